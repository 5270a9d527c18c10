"""MoE expert blocks that benchmarks (and tests) measure FP8-Flow against: benchmark code, not product.

``BF16LoopMoE`` and ``BlockwiseCastsMoE`` are ``FP8FlowMoE`` with its ``quantize`` and ``experts``
phases overridden (same parameters, dispatcher, routing and padding): BF16 tokens throughout, and either
BF16 per-expert GEMMs (the reference block of the tests) or today's blockwise FP8 with casts
(TransformerEngine's Float8BlockScaling with Megatron: each GEMM quantizes its BF16 input and returns
BF16, an unfused BF16 SwiGLU in between), the baseline FP8-Flow removes.

``grouped_swiglu`` is their expert computation (also the experts of ``megatron_grouped_mm.GroupedMMExperts``,
the stand-in for TransformerEngine's ``TEGroupedMLP`` in Megatron runs).
``BF16GroupedMMBlock`` is the strongest BF16 block a user would pick instead of FP8-Flow, written as
torchtitan writes its experts: weights stacked ``[E, 2F, H]`` (gate rows, then up) and ``[E, H, F]``,
a stable argsort of the routed expert ids as the permute, ``torch._grouped_mm`` over the ragged groups
(no padding), BF16 SwiGLU with the router prob applied to its output, and ``index_add_`` back to the
tokens. Autograd differentiates it; nothing syncs with the host.
``TEGroupedLinearBlock`` has the same permute with TransformerEngine's ``GroupedLinear`` as the experts, in
BF16 or under a TE recipe (``Float8BlockScaling``: TE's blockwise FP8 with its casts), as Megatron's
``TEGroupedMLP`` runs them; ``transformer_engine()`` says whether TE imports, and why not.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from transformer_engine_moe import FP8FlowMoE, moe_unpermute
from transformer_engine_moe.reference.swiglu import weighted_swiglu


class _BF16TokensMoE(FP8FlowMoE):
    """``FP8FlowMoE`` whose tokens stay BF16: no ``quantize`` phase, BF16 dispatch and permute+pad; the
    expert MLP between permute and unpermute is ``mlp``."""

    @classmethod
    def from_block(cls, block: FP8FlowMoE) -> "_BF16TokensMoE":
        """This baseline over ``block``'s submodules, parameters, dispatcher and settings (shared, not copied:
        no second copy of the weights in a benchmark), without recompute (``moe_expert`` is FP8-Flow's)."""
        twin = cls.__new__(cls)
        twin.__dict__.update(vars(block))
        twin.recompute = None
        return twin

    def routed_experts(self, hidden, topk_ids, topk_probs, tokens_per_expert, is_first_microbatch=None, *,
                       routing=None):
        if self.recompute is not None:
            raise ValueError(f"{type(self).__name__} runs without recompute; moe_expert is FP8-Flow's "
                             f"(got recompute={self.recompute!r})")
        return super().routed_experts(hidden, topk_ids, topk_probs, tokens_per_expert, is_first_microbatch,
                                      routing=routing)

    def quantize(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def experts(self, hidden, topk_ids, topk_probs, tokens_per_expert: list[int],
                is_first_microbatch: Optional[bool] = None, *, routing=None) -> torch.Tensor:
        """BF16 ``hidden [R, H]``, local ``topk_ids``/``topk_probs [R, k]``, host ``tokens_per_expert`` ->
        ``[R, H]`` BF16, with ``FP8FlowMoE.experts``'s permute+pad (``routing``: the dispatch's) and unpermute."""
        x, probs, row_id_map, pad_offsets, padded = self._permute(hidden, topk_ids, topk_probs, tokens_per_expert,
                                                                  routing)
        return moe_unpermute(self.mlp(x, probs, padded, is_first_microbatch), row_id_map, pad_offsets=pad_offsets)

    def mlp(self, x: torch.Tensor, probs: torch.Tensor, padded: list[int], is_first_microbatch) -> torch.Tensor:
        """Permuted BF16 rows ``x [P, H]``, their probs ``[P]``, rows per expert -> ``[P, H]`` BF16."""
        raise NotImplementedError


class BF16LoopMoE(_BF16TokensMoE):
    """The BF16 block: one ``F.linear`` per expert, the reference SwiGLU in float32 rounded to BF16."""

    def prefetch_fp8_weights(self, is_first_microbatch=None, transpose=None) -> None:
        """BF16 weights: nothing to quantize ahead."""

    def mlp(self, x, probs, padded, is_first_microbatch):
        h = _per_expert_linear(x, self.linear_fc1.weights, padded)
        return _per_expert_linear(weighted_swiglu(h, probs).to(h.dtype), self.linear_fc2.weights, padded)


class BlockwiseCastsMoE(_BF16TokensMoE):
    """Blockwise FP8 with casts: ``GroupedLinear`` quantizes each BF16 input and returns BF16; the SwiGLU
    between them is unfused BF16."""

    def mlp(self, x, probs, padded, is_first_microbatch):
        h = self.linear_fc1(x, padded, is_first_microbatch)
        return self.linear_fc2(weighted_swiglu(h, probs).to(h.dtype), padded, is_first_microbatch)


def _per_expert_linear(x: torch.Tensor, weights, m_splits: list[int]) -> torch.Tensor:
    """BF16 ``x[rows of g] @ weights[g]^T``."""
    return torch.cat([F.linear(xi, w) for xi, w in zip(x.split(m_splits), weights)])


def grouped_swiglu(x: torch.Tensor, probs: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                   offs: torch.Tensor) -> torch.Tensor:
    """The experts' SwiGLU MLPs on rows grouped by expert, two ``torch._grouped_mm``: ``x [M, H]`` (expert g's
    rows end at ``offs[g]``, int32 ``[G]`` cumulative), ``probs [M]`` (each row's router prob, applied to the
    SwiGLU output as Megatron's experts apply it), ``fc1 [G, 2F, H]`` (gate rows, then up), ``fc2 [G, H, F]``
    -> ``[M, H]`` in ``x``'s dtype."""
    h = torch._grouped_mm(x, fc1.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up * probs[:, None].to(h.dtype)
    return torch._grouped_mm(act, fc2.transpose(-2, -1), offs=offs)


class _SortedRoutingBlock(nn.Module):
    """``forward_topk(hidden [T, H] BF16, topk_ids [T, k] int64, topk_probs [T, k] float32) -> [T, H]`` over
    ``num_experts`` local experts: a stable argsort of the routed expert ids as the permute, the experts'
    ``mlp`` on the rows grouped by expert, ``index_add_`` back to the tokens."""

    num_experts: int

    def forward_topk(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_probs: torch.Tensor,
                     is_first_microbatch=None, num_routed=None) -> torch.Tensor:
        """``topk_ids`` local expert ids, -1 for a slot routed elsewhere (after an EP dispatch).
        ``num_routed``: the number of slots routed here as a host int (a dispatcher's
        ``sum(tokens_per_expert)``): only those rows are gathered and computed (``torch._grouped_mm``
        leaves rows past the last offset undefined, gradients included). None: every slot is routed
        here (asserted on the device, no host sync)."""
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        if num_routed is None:
            torch._assert_async((flat >= 0).all(), "topk_ids has slots routed elsewhere (-1): pass num_routed")
        flat = torch.where(flat < 0, self.num_experts, flat)  # unused slots sort last, past offs[-1]
        order = torch.argsort(flat, stable=True)[:flat.numel() if num_routed is None else num_routed]
        counts = torch.zeros(self.num_experts + 1, dtype=torch.int32, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount syncs; this does not
        token = order // k
        y = self.mlp(hidden[token], topk_probs.reshape(-1)[order], counts[:self.num_experts], is_first_microbatch)
        return torch.zeros_like(hidden).index_add_(0, token, y)

    def mlp(self, x: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor, is_first_microbatch) -> torch.Tensor:
        """Rows grouped by expert ``x [M, H]``, their router probs ``[M]``, ``counts [E]`` int32 on the device
        (rows per expert) -> ``[M, H]``."""
        raise NotImplementedError


class BF16GroupedMMBlock(_SortedRoutingBlock):
    """The sorted-routing block with ``E`` local experts of ``fc1 [E, 2F, H]`` and ``fc2 [E, H, F]`` BF16
    parameters and ``grouped_swiglu`` (``torch._grouped_mm``, no padding) as the experts; nothing syncs with
    the host."""

    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor):
        super().__init__()
        self.fc1 = nn.Parameter(fc1.detach().clone())
        self.fc2 = nn.Parameter(fc2.detach().clone())
        self.num_experts = fc1.shape[0]

    @classmethod
    def from_block(cls, block) -> "BF16GroupedMMBlock":
        """The same experts as an ``FP8FlowMoE`` (its ``linear_fc1/2.weight{i}`` stacked)."""
        return cls(torch.stack(block.linear_fc1.weights), torch.stack(block.linear_fc2.weights))

    def mlp(self, x, probs, counts, is_first_microbatch):
        return grouped_swiglu(x, probs, self.fc1, self.fc2, counts.cumsum(0, dtype=torch.int32))


def transformer_engine():
    """``(transformer_engine.pytorch, "")`` when it imports, else ``(None, why not)``."""
    try:
        return importlib.import_module("transformer_engine.pytorch"), ""
    except ModuleNotFoundError as e:
        if e.name in ("transformer_engine", "transformer_engine.pytorch"):
            return None, "TransformerEngine is not installed (no module transformer_engine.pytorch)"
        return None, f"transformer_engine.pytorch does not import: {type(e).__name__}: {e}"
    except (ImportError, OSError, RuntimeError) as e:  # a missing shared library, a version check
        return None, f"transformer_engine.pytorch does not import: {type(e).__name__}: {e}"


def float8_block_scaling():
    """TE's ``Float8BlockScaling()`` recipe (1x128 activations and gradients, 128x128 weights, power-of-two
    scales: the paper's "blockwise" baseline); ``ImportError`` with the reason without TE."""
    te, why = transformer_engine()
    if te is None:
        raise ImportError(why)
    from transformer_engine.common.recipe import Float8BlockScaling

    return Float8BlockScaling()


class TEGroupedLinearBlock(_SortedRoutingBlock):
    """The sorted-routing block with TransformerEngine's ``GroupedLinear`` as the experts, computed as
    Megatron's ``TEGroupedMLP`` computes them: ``linear_fc1`` (``E`` GEMMs ``H -> 2F``, gate rows then up),
    SwiGLU with the router prob applied to its output, ``linear_fc2`` (``F -> H``), no bias.

    ``recipe`` None: BF16 GEMMs. A TE recipe (``transformer_engine.common.recipe.Float8BlockScaling()``: the
    blockwise FP8 baseline "with casts"): forward under TE's ``autocast`` with it, each GEMM quantizing its
    BF16 input and returning BF16, each expert's rows padded by TE's ``Fp8Padding`` (the probs too) and
    unpadded after fc2, as ``TEGroupedMLP`` does. TE takes the rows per expert as a host list: one
    device-to-host copy of the counts per step (Megatron's dispatchers hand ``TEGroupedMLP`` host counts).
    Needs TransformerEngine: ``ImportError`` with the reason without it."""

    def __init__(self, fc1: Sequence[torch.Tensor], fc2: Sequence[torch.Tensor], recipe=None):
        """``fc1``: ``E`` weights ``[2F, H]``; ``fc2``: ``E`` weights ``[H, F]`` (copied into TE's
        ``weight{i}`` parameters, same dtype and device)."""
        super().__init__()
        te, why = transformer_engine()
        if te is None:
            raise ImportError(why)
        self.te, self.recipe, self.num_experts = te, recipe, len(fc1)
        if len(fc2) != self.num_experts:
            raise ValueError(f"fc1 and fc2 must hold one weight per expert, got {len(fc1)} and {len(fc2)}")
        for name, weights in (("linear_fc1", fc1), ("linear_fc2", fc2)):
            out_features, in_features = weights[0].shape
            linear = te.GroupedLinear(self.num_experts, in_features, out_features, bias=False,
                                      params_dtype=weights[0].dtype, device=weights[0].device)
            with torch.no_grad():
                for i, w in enumerate(weights):
                    getattr(linear, f"weight{i}").copy_(w)
            setattr(self, name, linear)
        self.padding = te.Fp8Padding(self.num_experts) if recipe is not None else None
        self.unpadding = te.Fp8Unpadding(self.num_experts) if recipe is not None else None

    @classmethod
    def from_block(cls, block, recipe=None) -> "TEGroupedLinearBlock":
        """The same experts as an ``FP8FlowMoE`` (its ``linear_fc1/2.weight{i}``)."""
        return cls(block.linear_fc1.weights, block.linear_fc2.weights, recipe)

    def _autocast(self):
        """TE's ``autocast(recipe=...)`` (TE >= 2.9), else its ``fp8_autocast(fp8_recipe=...)``; nothing in BF16."""
        if self.recipe is None:
            return contextlib.nullcontext()
        if hasattr(self.te, "autocast"):
            return self.te.autocast(enabled=True, recipe=self.recipe)
        return self.te.fp8_autocast(enabled=True, fp8_recipe=self.recipe)

    def mlp(self, x, probs, counts, is_first_microbatch):
        splits = counts.tolist()  # TE's split path takes host splits
        probs = probs.unsqueeze(-1)
        with self._autocast():
            padded = splits
            if self.padding is not None:
                x, padded = self.padding(x, splits)
                probs, _ = self.padding(probs, splits)
            h = self.linear_fc1(x, padded, is_first_microbatch=is_first_microbatch)
            gate, up = h.chunk(2, dim=-1)
            y = self.linear_fc2(F.silu(gate) * up * probs.to(h.dtype), padded, is_first_microbatch=is_first_microbatch)
            return y if self.unpadding is None else self.unpadding(y, splits)


class BF16GroupedMMEP(nn.Module):
    """``BF16GroupedMMBlock`` behind an FP8-Flow block's token dispatcher with a BF16 payload: what a
    BF16 user runs at EP > 1 (dispatch, grouped_mm experts, combine)."""

    def __init__(self, block):
        super().__init__()
        self.dispatcher = block.dispatcher
        self.experts = BF16GroupedMMBlock.from_block(block)

    def forward_topk(self, hidden, topk_ids, topk_probs, is_first_microbatch=None):
        res = self.dispatcher.dispatch(hidden, topk_ids, topk_probs.float())
        y = self.experts.forward_topk(res.hidden, res.topk_ids, res.topk_probs, num_routed=sum(res.tokens_per_expert))
        return self.dispatcher.combine(y, res.handle)
