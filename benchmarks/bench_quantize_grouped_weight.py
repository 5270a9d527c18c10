"""Per-step expert weight preparation: ``quantize_grouped_weight`` (W and W^T) vs two launches vs stacking first.

``quantize_grouped_weight`` quantizes the G BF16 weights in place (no stack) and writes W and W^T from one
launch. ``two_launches``: the same kernel writing W alone, then the Triton byte transpose of W (what it did
before). ``stack_first``: ``torch.stack`` of the G weights, 128x128 quantization of the stack, byte transpose.
Bytes counted for the product: BF16 read 2 per element, W and W^T written 1 each, plus the scales (two
launches: W also read once more, 5 per element); % of the copy bandwidth measured in this run. All outputs
are checked bitwise against the stack-first path first. DeepSeek-V3 expert shapes (fc1 [4096, 7168], fc2
[7168, 2048]) at 8 to 128 local experts.

Run on a GPU: ``python benchmarks/bench_quantize_grouped_weight.py [--sweep]`` (``--sweep``: launch shapes of
the one-launch kernel at 64 experts, fc1: num_warps, and rows per slice where it writes W and W^T).
"""

from __future__ import annotations

import torch

from transformer_engine_moe import quantize_blockwise, quantize_grouped_weight, transpose_grouped_weight

import utils
from transformer_engine_moe.kernels import quantize as kq

SHAPES = {"fc1": (4096, 7168), "fc2": (7168, 2048)}


def stack_first(weights):
    n, k = weights[0].shape
    w = quantize_blockwise(torch.stack(weights).view(-1, k), "128x128").view(len(weights), n, k)
    return w, transpose_grouped_weight(w)


def run(experts, gemm, copy_tbps) -> dict:
    n, k = SHAPES[gemm]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(experts)]
    ours, ref = quantize_grouped_weight(weights), stack_first(weights)
    two = kq.quantize_grouped_weight(weights, torch.float8_e4m3fn, fused=False)
    for a, b in zip(ours, ref):
        assert torch.equal(a.rowwise_data.view(torch.uint8), b.rowwise_data.view(torch.uint8))
        assert torch.equal(a.rowwise_scale_inv, b.rowwise_scale_inv)
    assert torch.equal(two[2].view(torch.uint8), ref[1].rowwise_data.view(torch.uint8).view(two[2].shape))
    t = utils.time_ms(lambda: quantize_grouped_weight(weights))
    t_two = utils.time_ms(lambda: kq.quantize_grouped_weight(weights, torch.float8_e4m3fn, fused=False))
    t_stack = utils.time_ms(lambda: stack_first(weights))
    scales = 3 * experts * (n // 128) * (k // 128) * 4
    return dict(experts=experts, gemm=gemm, ms=t, two_launches_ms=t_two, stack_first_ms=t_stack,
                speedup_over_two_launches=t_two / t, speedup=t_stack / t,
                pct_of_copy=100 * (experts * n * k * 4 + scales) / t / 1e9 / copy_tbps,
                two_launches_pct_of_copy=100 * (experts * n * k * 5 + scales) / t_two / 1e9 / copy_tbps)


def sweep(copy_tbps) -> list[dict]:
    """Launch shapes (rows per slice, num_warps) of the quantizing kernel writing W alone (3 bytes per element,
    whole tiles) and W and W^T (4) at 64 experts, fc1, BF16."""
    n, k = SHAPES["fc1"]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(64)]
    rows = []
    for transpose, nbytes, slices in ((False, 3, (128,)), (True, 4, (128, 64, 32))):
        for slice_rows in slices:
            for warps in (2, 4, 8, 16):
                t = utils.time_ms(lambda: kq.quantize_grouped_weight(weights, torch.float8_e4m3fn, transpose=transpose,
                                                                     config=(slice_rows, warps)))
                rows.append(dict(writes="W and W^T" if transpose else "W", slice_rows=slice_rows, num_warps=warps,
                                 ms=t, pct_of_copy=100 * 64 * n * k * nbytes / t / 1e9 / copy_tbps))
    return rows


def main():
    args, env, ceil, copy_tbps = utils.start(__doc__.splitlines()[0], "also sweep the kernel's launch shapes")
    if args.sweep:
        path = utils.write_results("bench_quantize_grouped_weight_sweep", "quantize_grouped_weight launch shapes",
                                   env, ceil, sweep(copy_tbps),
                                   ["writes", "slice_rows", "num_warps", "ms", "pct_of_copy"],
                                   notes=f"64 experts x [4096, 7168] BF16; default: whole tiles on "
                                         f"{kq.GROUPED_WEIGHT_WARPS} warps (W), (rows per slice, num_warps) "
                                         f"{kq.FUSED_WEIGHT_CONFIG} (W and W^T).")
        print(path.read_text())
    rows = [run(e, g, copy_tbps) for e in (8, 32, 64, 128) for g in SHAPES]
    path = utils.write_results("bench_quantize_grouped_weight", "Expert weights -> W and W^T, 128x128 FP8", env,
                               ceil, rows, ["experts", "gemm", "ms", "two_launches_ms", "stack_first_ms",
                                            "speedup_over_two_launches", "speedup", "pct_of_copy",
                                            "two_launches_pct_of_copy"],
                               notes="ms: quantize_grouped_weight (W and W^T from one launch); two_launches: W, then "
                                     "the byte transpose; stack_first: torch.stack + quantize_blockwise 128x128 + "
                                     "transpose_grouped_weight. Bitwise equal outputs (checked).")
    print(path.read_text())


if __name__ == "__main__":
    main()
