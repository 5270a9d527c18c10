"""The Megatron benchmarks' model configurations and the memory model that sets how many layers fit a GPU.

``CONFIGS``: ``qwen3_moe_like`` (Qwen3-30B-A3B's layer) and ``dsv3_ep8_rank`` (what one rank of DeepSeek-V3 at
EP=8 holds); ``Config.flags`` gives their Megatron flags, ``layer_params`` / ``attention_params`` their
parameters per GPU; ``memory_needed`` and ``layers_that_fit`` the layer count (docs/megatron.md states the
model).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

SEQ = 4096


@dataclasses.dataclass(frozen=True)
class Config:
    """A benchmark model's shapes. ``experts``: routed experts on one GPU; the model has ``experts`` in all
    (split over the GPUs by expert parallelism) or, with ``experts_per_gpu``, ``experts`` per GPU. Attention:
    grouped-query (``query_groups`` groups of ``kv_channels``) or, with ``mla`` = ``(q_lora, kv_lora, qk, rope,
    v)``, multi-latent."""

    hidden: int
    heads: int
    experts: int
    ffn: int
    micro_batch_size: int
    min_layers: int
    query_groups: int = 0
    kv_channels: int = 0
    mla: Optional[tuple] = None
    shared_ffn: int = 0
    experts_per_gpu: bool = False
    vocab: int = 32768
    topk: int = 8

    def num_experts(self, gpus: int) -> int:
        return self.experts * gpus if self.experts_per_gpu else self.experts

    def flags(self, gpus: int) -> list[str]:
        flags = [f"--hidden-size {self.hidden} --num-attention-heads {self.heads} --num-experts "
                 f"{self.num_experts(gpus)} --moe-ffn-hidden-size {self.ffn}"]
        if self.mla:
            q_lora, kv_lora, qk, rope, v = self.mla
            flags.append(f"--multi-latent-attention --q-lora-rank {q_lora} --kv-lora-rank {kv_lora} --qk-head-dim "
                         f"{qk} --qk-pos-emb-head-dim {rope} --v-head-dim {v}")
        else:
            flags.append(f"--group-query-attention --num-query-groups {self.query_groups} --kv-channels "
                         f"{self.kv_channels}")
        if self.shared_ffn:
            flags.append(f"--moe-shared-expert-intermediate-size {self.shared_ffn}")
        return " ".join(flags).split()

    def attention_params(self) -> int:
        h, n = self.hidden, self.heads
        if self.mla:
            q_lora, kv_lora, qk, rope, v = self.mla
            return (h * q_lora + q_lora * n * (qk + rope) + h * (kv_lora + rope) + kv_lora * n * (qk + v)
                    + n * v * h + q_lora + kv_lora)
        d, g = self.kv_channels, self.query_groups
        return h * (n + 2 * g) * d + n * d * h + 2 * d

    def layer_params(self, gpus: int) -> int:
        """Parameters of one layer on one GPU: attention, norms, router, local routed and shared experts."""
        local = self.num_experts(gpus) // gpus
        return (self.attention_params() + 2 * self.hidden + self.hidden * self.num_experts(gpus)
                + 3 * self.hidden * (local * self.ffn + self.shared_ffn))

    def activation_bytes_per_token(self) -> int:
        """A rough estimate of what one layer keeps per token for backward in the BF16 stand-in (no recompute):
        the norms' and residual's ``[H]`` rows, the attention's projections, roped Q/K and context (MLA: with
        V padded to the Q/K head dim), each routed copy's ``[H]`` input, fc1 ``[2F]`` and SwiGLU ``[F]`` outputs
        and ``[H]`` output, the shared expert's, and the router's FP32 ``[E]`` rows. It only sets the layer count."""
        h, n = self.hidden, self.heads
        if self.mla:
            q_lora, kv_lora, qk, rope, v = self.mla
            attention = q_lora + n * (qk + rope) + kv_lora + rope + n * (qk + v) + 3 * n * (qk + rope) + n * v
        else:
            d, g = self.kv_channels, self.query_groups
            attention = (n + 2 * g) * d + (n + g) * d + n * d
        shared = h + 3 * self.shared_ffn if self.shared_ffn else 0
        return 2 * (3 * h + attention + self.topk * (2 * h + 3 * self.ffn) + shared) + 12 * self.experts


CONFIGS = {
    "qwen3_moe_like": Config(hidden=2048, heads=32, query_groups=4, kv_channels=128, experts=128, ffn=768,
                             micro_batch_size=4, min_layers=4),
    "dsv3_ep8_rank": Config(hidden=7168, heads=128, mla=(1536, 512, 128, 64, 128), shared_ffn=2048, experts=32,
                            experts_per_gpu=True, ffn=2048, micro_batch_size=1, min_layers=1),
}
# Memory per parameter (bytes), Megatron's mixed precision without a distributed optimizer: BF16 parameter 2,
# FP32 main_grad 4, FP32 master copy 4, Adam's two FP32 moments 8; plus during forward/backward 1 for FP8
# weight copies (FP8-Flow's cached expert weights, TE's FP8 weights), and at the optimizer step 4 for torch
# AdamW's foreach temporary (Megatron's optimizer without TE or Apex; TE's FusedAdam has none).
PARAM_BYTES, FP8_WEIGHT_BYTES, STEP_TEMP_BYTES = 18, 1, 4
LOGIT_BYTES = 10  # per token and vocabulary entry: BF16 logits and the FP32 cross-entropy's saved tensors
MEMORY_FRACTION = 0.9  # of the GPU's memory, the rest for the CUDA context, NCCL and the allocator's slack


def memory_needed(config: Config, layers: int, gpus: int, micro_batch_size: int) -> tuple[float, float]:
    """``(forward/backward peak, optimizer-step peak)`` in bytes by the model above: parameters with their
    state, one micro-batch's activations (``activation_bytes_per_token``) and logits, and the BF16 gradient of
    the largest layer before DDP's hooks add it into main_grad."""
    params = config.vocab * config.hidden + config.hidden + layers * config.layer_params(gpus)
    tokens = micro_batch_size * SEQ
    activations = tokens * (layers * config.activation_bytes_per_token() + LOGIT_BYTES * config.vocab)
    forward_backward = (PARAM_BYTES + FP8_WEIGHT_BYTES) * params + activations + 2 * config.layer_params(gpus)
    return forward_backward, (PARAM_BYTES + STEP_TEMP_BYTES) * params


def layers_that_fit(config: Config, gpu_bytes: float, gpus: int, micro_batch_size: int) -> int:
    """The most layers whose ``memory_needed`` stays within ``MEMORY_FRACTION`` of ``gpu_bytes``, at least the
    config's ``min_layers``."""
    layers = config.min_layers
    while max(memory_needed(config, layers + 1, gpus, micro_batch_size)) <= MEMORY_FRACTION * gpu_bytes:
        layers += 1
    return layers
