"""A torch SDPA core attention for Megatron runs without TransformerEngine (benchmark only).

Without TE, Megatron's local layer spec computes attention with ``DotProductAttention``: ``baddbmm`` into a
``[b * heads, s, s]`` buffer, a softmax and a ``bmm``, unfused, which at sequence 4096 swamps whatever the
experts save, and it cannot run multi-latent attention at all (MLA builds its core attention with
``k_channels`` / ``v_channels``, which only TE's ``TEDotProductAttention`` accepts). ``SDPACoreAttention`` is
that module's forward contract on ``torch.nn.functional.scaled_dot_product_attention`` (causal, flash or cuDNN where
they run), and ``sdpa_layer_spec`` puts it into every self-attention of a Megatron layer spec. The benchmarks
swap it into every variant, baseline included, so the attention is the same in all of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F


class SDPACoreAttention(torch.nn.Module):
    """Megatron's core-attention interface on torch SDPA.

    Built as Megatron builds ``DotProductAttention`` (``config, layer_number, attn_mask_type, attention_type,
    attention_dropout, softmax_scale, cp_comm_type, pg_collection``) plus MLA's ``k_channels`` (query/key head
    dim) and ``v_channels`` (value head dim); default head dim ``config.kv_channels``, default scale
    ``1 / sqrt(k_channels)``. ``forward(query [sq, b, heads, dk], key [sk, b, groups, dk], value [sk, b, groups,
    dv], attention_mask=None, attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> [sq, b, heads
    * dv]`` in the input dtype: causal attention (Megatron's ``AttnMaskType.causal`` with no mask, as GPT
    pretraining passes it), grouped-query heads through SDPA's ``enable_gqa`` (no repeated K/V kept for
    backward), attention dropout under Megatron's CUDA RNG tracker as ``DotProductAttention`` does.

    On CUDA it asks for one fused kernel at a time (``_kernels``): flash where Q, K and V share a head dim; for
    MLA's value (128 against 192) cuDNN's attention, then flash on V zero-padded to the query's head dim with the
    output sliced back. A kernel that refuses the inputs is not asked again; if all refuse, SDPA chooses and
    ``backend`` says why. ``backend`` names what ran (``None`` before the first call); on the CPU it is torch's
    math path.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        refused = {"context_parallel_size": (config.context_parallel_size, 1),
                   "tensor_model_parallel_size": (config.tensor_model_parallel_size, 1),
                   "attn_mask_type": (attn_mask_type, AttnMaskType.causal),
                   "window_size": (getattr(config, "window_size", None), None),
                   "softmax_type": (getattr(config, "softmax_type", "vanilla"), "vanilla")}
        for name, (got, expected) in refused.items():
            if got != expected:
                raise ValueError(f"SDPACoreAttention supports {name}={expected!r} only, got {got!r}")
        self.config = config
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.backend: Optional[str] = None
        self._refused: dict = {}  # SDPA kernel -> why it refused these inputs

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, attn_mask_type=None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        given = {"attention_mask": attention_mask, "attention_bias": attention_bias,
                 "packed_seq_params": packed_seq_params}
        for name, got in given.items():
            if got is not None:
                raise ValueError(f"SDPACoreAttention computes causal attention without {name}; got one")
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise ValueError(f"SDPACoreAttention: attn_mask_type must be causal, got {attn_mask_type}")
        dv = value.shape[-1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._attend(q, k, v, dropout)
        else:
            out = self._attend(q, k, v, dropout)
        out = out[..., :dv].permute(2, 0, 1, 3)  # [sq, b, heads, dv]
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _attend(self, q, k, v, dropout: float) -> torch.Tensor:
        """SDPA of ``[b, h, s, d]`` tensors on CUDA by the first kernel of ``_kernels`` that takes them (named in
        ``backend``; one that refuses is not asked again), else SDPA's choice (also on the CPU)."""
        kwargs = dict(dropout_p=dropout, is_causal=True, scale=self.softmax_scale,
                      enable_gqa=q.shape[1] != k.shape[1])
        for name, pad in self._kernels(q, v):
            v_in = F.pad(v, (0, q.shape[-1] - v.shape[-1])) if pad else v
            try:
                with _only(name):
                    out = F.scaled_dot_product_attention(q, k, v_in, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as error:  # this kernel refused these inputs: said, and not asked again
                self._refused[name] = str(error).splitlines()[0]
                continue
            self.backend = f"{name} (V padded {v.shape[-1]} -> {q.shape[-1]})" if pad else name
            return out
        refused = "; ".join(f"{n} refused: {why}" for n, why in self._refused.items())
        self.backend = f"SDPA's choice ({refused or 'on the CPU'})"
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def _kernels(self, q, v) -> list:
        """``(SDPA kernel, pad V to the Q/K head dim)`` to try in order: flash when Q, K and V share a head dim;
        with MLA's value dim (128 against 192) cuDNN's attention, which takes it as is (H100, 128 heads, sequence
        4096, forward + backward: 5.8 ms, against 12.1 ms for flash on V zero-padded to 192, whose padded columns
        give zero output columns, sliced off), then padded flash."""
        if not q.is_cuda:
            return []
        order = [("flash", False)] if v.shape[-1] == q.shape[-1] else [("cudnn", False), ("flash", True)]
        return [(name, pad) for name, pad in order if name not in self._refused]


def _only(name: str):
    """``sdpa_kernel`` limited to one kernel: ``flash`` or ``cudnn``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name])


def sdpa_layer_spec(spec):
    """A copy of a Megatron layer spec (a ``ModuleSpec`` of a transformer layer, or a block's submodules with
    ``layer_specs``) whose self-attentions compute with ``SDPACoreAttention``: every ``core_attention`` that is
    Megatron's local ``DotProductAttention`` is replaced. ValueError when none is."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def swap(layer):
        attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
        inner = getattr(attention, "submodules", None)
        if getattr(inner, "core_attention", None) is not DotProductAttention:
            return layer, False
        inner = dataclasses.replace(inner, core_attention=SDPACoreAttention)
        attention = dataclasses.replace(attention, submodules=inner)
        submodules = dataclasses.replace(layer.submodules, self_attention=attention)
        return dataclasses.replace(layer, submodules=submodules), True

    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    swapped = [swap(layer) for layer in layers]
    if not any(done for _, done in swapped):
        raise ValueError("no self-attention of the spec uses Megatron's local DotProductAttention "
                         "(--transformer-impl local); TE's attention is left as it is")
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[layer for layer, _ in swapped])
    return swapped[0][0]
