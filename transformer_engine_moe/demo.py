"""The main job, for now: quantize real-sized MoE activations, gradients and expert weights.

Prints, per tensor, the blockwise-FP8 reconstruction error next to per-tensor
FP8 scaling (one scale set by the largest value, which flushes small tokens and
channels to zero) and the bytes saved against BF16.
DeepSeek-V3-like sizes: hidden 7168, expert FFN 2048, 8192 routed tokens.
Runs the Triton kernels on a GPU, the plain-PyTorch reference on CPU.

    python -m transformer_engine_moe.demo [--tokens N]
"""

from __future__ import annotations

import argparse
import time

import torch

from transformer_engine_moe import FP8FlowRecipe, Float8BlockQuantizer, Format, Role
from transformer_engine_moe.recipe import fp8_max
from transformer_engine_moe.reference.quantize import cast_to_fp8


def activations(tokens: int, hidden: int, device) -> torch.Tensor:
    """Heavy-tailed token activations: per-channel log-normal magnitudes and a few outlier channels."""
    channel = torch.exp(torch.randn(hidden, device=device))
    channel[torch.randperm(hidden, device=device)[:8]] *= 100.0
    return (torch.randn(tokens, hidden, device=device) * channel).to(torch.bfloat16)


def per_tensor_fp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Dequantized per-tensor-scaled FP8 (one scale for the whole tensor), for comparison."""
    scale = fp8_max(fp8_dtype) / x.float().abs().max()
    return cast_to_fp8(x.float() * scale, fp8_dtype).float() / scale


def report(name: str, x: torch.Tensor, quantizer: Float8BlockQuantizer) -> None:
    if x.is_cuda:
        quantizer(x)  # compile the kernel outside the timing
        torch.cuda.synchronize()
    start = time.perf_counter()
    q = quantizer(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    ref = x.float()
    nonzero = ref != 0

    def errors(y):
        rel = ((y - ref).abs() / ref.abs())[nonzero]
        return rel.median().item(), 100 * (y[nonzero] == 0).float().mean().item()

    blk_med, blk_zero = errors(q.dequantize())
    pt_med, pt_zero = errors(per_tensor_fp8(x, q.fp8_dtype))
    fp8_bytes = q.rowwise_data.numel() + 4 * q.rowwise_scale_inv.numel()
    bf16_bytes = 2 * x.numel()
    print(
        f"{name:<30} {str(list(x.shape)):<13} {str(q.fp8_dtype)[6:]:<14} {q.block:<8} "
        f"{blk_med:>8.2e} {blk_zero:>7.3f}% {pt_med:>8.2e} {pt_zero:>7.3f}% "
        f"{bf16_bytes / 2**20:>8.1f} {fp8_bytes / 2**20:>7.1f} {100 * (1 - fp8_bytes / bf16_bytes):>6.1f}% "
        f"{ms:>8.1f}"
    )


def main():
    parser = argparse.ArgumentParser(description="Blockwise FP8 quantization of MoE tensors")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--ffn", type=int, default=2048)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    recipe = FP8FlowRecipe(fp8_format=Format.HYBRID)
    act = Float8BlockQuantizer.from_recipe(recipe, Role.INPUT)
    grad = Float8BlockQuantizer.from_recipe(recipe, Role.GRAD)
    weight = Float8BlockQuantizer.from_recipe(recipe, Role.WEIGHT)
    print(f"device: {device} ({'Triton kernels' if device == 'cuda' else 'PyTorch reference'}); "
          f"recipe: {recipe}")
    print(f"{'':<67}{'blockwise':^18} {'per-tensor':^18}")
    print(f"{'tensor':<30} {'shape':<13} {'fp8':<14} {'block':<8} {'med.rel':>8} {'zeroed':>8} "
          f"{'med.rel':>8} {'zeroed':>8} {'BF16 MiB':>8} {'FP8 MiB':>7} {'saved':>7} {'ms':>8}")
    x = activations(args.tokens, args.hidden, device)
    report("dispatched tokens (fc1 input)", x, act)
    h = activations(args.tokens, args.ffn, device)
    report("SwiGLU output (fc2 input)", h, act)
    token_scale = 10 ** (-6 * torch.rand(args.tokens, 1, device=device))  # router-weighted grads
    g = (torch.randn(args.tokens, args.hidden, device=device) * 1e-2 * token_scale).to(torch.bfloat16)
    report("fc2 output gradient", g, grad)
    w1 = (torch.randn(2 * args.ffn, args.hidden, device=device) * args.hidden**-0.5).to(torch.bfloat16)
    report("expert fc1 weight", w1, weight)
    w2 = (torch.randn(args.hidden, args.ffn, device=device) * args.ffn**-0.5).to(torch.bfloat16)
    report("expert fc2 weight", w2, weight)
    print("med.rel: median of |dequantize(q) - x| / |x| over nonzero x; zeroed: share of nonzero x "
          "that came back 0; FP8 bytes include the float32 scales.")


if __name__ == "__main__":
    main()
