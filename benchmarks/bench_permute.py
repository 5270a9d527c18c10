"""MoE permute+pad (FP8 rows, scales, probs) and unpermute+unpad (BF16 merge) on the GPU.

DeepSeek-V3-like: hidden 7168, top-8, 4096 tokens over 256 experts and 16384
tokens over 32 experts, align 128. Also the top-k to routing-map conversion
(``topk_to_routing_map``, the ``topk_routing`` kernel). Compares the fused ops (and their kernels
alone) with the copy bandwidth and with an unfused torch implementation
(index_select of data, of scales and of probs, then padding by index_copy into
a zeroed buffer; unpermute: index_select, multiply by probs, index_add in
float32), all in this run. Bytes counted are those required: the token rows
read once, the routed and padding rows written once (not the slack rows that
the worst-case sizing adds, though those are written too, as zeros).

Run on a GPU: ``python benchmarks/bench_permute.py [--sweep]``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from transformer_engine_moe import (moe_permute_and_pad_with_probs, moe_unpermute, quantize_blockwise,
                                    topk_to_routing_map)
from transformer_engine_moe.kernels import permute as kp
from transformer_engine_moe.reference import permute as reference_permute

import utils

HIDDEN, TOPK, ALIGN = 7168, 8, 128
CASES = [(4096, 256), (16384, 32)]


@dataclass(frozen=True)
class ExperimentResult:
    op: str
    tokens: int
    experts: int
    required_mb: float
    fused_us: float
    fused_host_us: float
    kernels_us: float
    pct_of_copy: float
    unfused_us: float
    speedup: float


def host_us(fn, n: int = 50) -> float:
    """Microseconds the host takes to issue one call (no sync inside the loop). An op whose host time
    exceeds its GPU time is launch-bound: its measured time is the host's."""
    fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - began
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def routing(tokens: int, experts: int):
    logits = torch.randn(tokens, experts, device="cuda")
    rm = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda")
    rm.scatter_(1, logits.topk(TOPK, dim=1).indices, True)
    return rm, torch.softmax(logits, -1)


def unfused_indices(rm: torch.Tensor):
    """Index vectors an unfused implementation works from (computed once, outside the timing)."""
    counts = rm.sum(0)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    token = rm.t().nonzero()[:, 1]  # expert-major, token order within an expert
    expert = rm.t().nonzero()[:, 0]
    rank = torch.arange(token.numel(), device="cuda") - (torch.cumsum(counts, 0) - counts)[expert]
    dest = (torch.cumsum(padded, 0) - padded)[expert] + rank
    return token, expert, dest, int(padded.sum())


def unfused_permute(q, probs, token, expert, dest, rows):
    data = q.rowwise_data.view(torch.uint8).index_select(0, token)
    scales = q.rowwise_scale_inv.index_select(0, token)
    pprobs = probs[token, expert]
    out = torch.zeros(rows, q.shape[1], dtype=torch.uint8, device="cuda").index_copy_(0, dest, data)
    out_s = torch.ones(rows, scales.shape[1], device="cuda").index_copy_(0, dest, scales)
    out_p = torch.zeros(rows, device="cuda").index_copy_(0, dest, pprobs)
    return out, out_s, out_p


def unfused_unpermute(y, probs, token, expert, dest):
    terms = y.index_select(0, dest).float() * probs[token, expert][:, None]
    out = torch.zeros(probs.shape[0], y.shape[1], device="cuda").index_add_(0, token, terms)
    return out.to(y.dtype)


def run_case(tokens: int, experts: int, copy_tbps: float) -> list[ExperimentResult]:
    rm, probs = routing(tokens, experts)
    q = quantize_blockwise(torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16))
    token, expert, dest, rows = unfused_indices(rm)
    nkb = HIDDEN // 128
    cap = tokens * TOPK
    device_counts = rm.sum(0)  # on the device: the worst-case output of `cap` routed rows, no host sync

    # permute + pad, FP8
    fused = lambda: moe_permute_and_pad_with_probs(q, probs, rm, device_counts, ALIGN, cap)  # noqa: E731
    out, pprobs, rmap, pad, padded = fused()
    base = unfused_permute(q, probs, token, expert, dest, rows)
    assert torch.equal(out.rowwise_data.view(torch.uint8)[:rows], base[0])
    assert torch.equal(out.rowwise_scale_inv[:rows], base[1]) and torch.equal(pprobs[:rows], base[2])
    capacity = out.shape[0]

    def kernels():
        kp.permute(q.rowwise_data, rmap, capacity, pad, probs, q.rowwise_scale_inv)

    required = tokens * (HIDDEN + 4 * nkb) + rows * (HIDDEN + 4 * nkb + 4)
    t_fused, t_kernels = utils.time_ms(fused), utils.time_ms(kernels)
    t_unfused = utils.time_ms(lambda: unfused_permute(q, probs, token, expert, dest, rows))
    results = [ExperimentResult("permute+pad FP8", tokens, experts, required / 1e6, t_fused * 1e3, host_us(fused),
                                t_kernels * 1e3, 100 * required / t_kernels / 1e9 / copy_tbps,
                                t_unfused * 1e3, t_unfused / t_fused)]
    counts = rm.sum(0).tolist()  # the dispatcher's host counts: exact output size, no slack rows
    exact = lambda: moe_permute_and_pad_with_probs(q, probs, rm, counts, ALIGN)  # noqa: E731
    assert torch.equal(exact()[0].rowwise_data.view(torch.uint8), base[0])
    t_exact = utils.time_ms(exact)
    results.append(ExperimentResult("permute+pad FP8, host counts", tokens, experts, required / 1e6, t_exact * 1e3,
                                    host_us(exact), t_kernels * 1e3, 100 * required / t_kernels / 1e9 / copy_tbps,
                                    t_unfused * 1e3, t_unfused / t_exact))

    # DeepEP's top-k format -> routing map and probs (FP8FlowMoE's _permute, every step), checks included
    ids, weights = probs.topk(TOPK, dim=1)[::-1]
    convert = lambda: topk_to_routing_map(ids, weights, experts)  # noqa: E731
    got, want = convert(), reference_permute.topk_routing(ids, weights, experts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    required = tokens * TOPK * (8 + 4) + tokens * experts * (1 + 4)
    t_fused, t_kernels = utils.time_ms(convert), utils.time_ms(lambda: kp.topk_routing(ids, weights, experts))
    t_unfused = utils.time_ms(lambda: reference_permute.topk_routing(ids, weights, experts))
    results.append(ExperimentResult("top-k to routing map", tokens, experts, required / 1e6, t_fused * 1e3,
                                    host_us(convert), t_kernels * 1e3, 100 * required / t_kernels / 1e9 / copy_tbps,
                                    t_unfused * 1e3, t_unfused / t_fused))

    # unpermute + unpad, BF16 expert outputs merged with the probs
    y = torch.randn(capacity, HIDDEN, device="cuda", dtype=torch.bfloat16)
    merged = moe_unpermute(y, rmap, probs, pad_offsets=pad)
    ref_merged = unfused_unpermute(y, probs, token, expert, dest)
    torch.testing.assert_close(merged, ref_merged, rtol=1e-2, atol=1e-2)  # float32 sums, other order
    required = 2 * HIDDEN * (tokens * TOPK + tokens) + 4 * tokens * TOPK
    unpermute = lambda: moe_unpermute(y, rmap, probs, pad_offsets=pad)  # noqa: E731
    t_fused = utils.time_ms(unpermute)
    t_kernels = utils.time_ms(lambda: kp.unpermute(y, rmap, probs, pad))
    t_unfused = utils.time_ms(lambda: unfused_unpermute(y, probs, token, expert, dest))
    results.append(ExperimentResult("unpermute+unpad BF16", tokens, experts, required / 1e6, t_fused * 1e3,
                                    host_us(unpermute), t_kernels * 1e3, 100 * required / t_kernels / 1e9 / copy_tbps,
                                    t_unfused * 1e3, t_unfused / t_fused))
    return results


def sweep(copy_tbps: float) -> list[dict]:
    """Launch shapes (BLOCK_H, num_warps) of the permute and unpermute kernels, 16384 tokens, 32 experts."""
    tokens, experts = CASES[1]
    rm, probs = routing(tokens, experts)
    q = quantize_blockwise(torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16))
    rmap, _, pad, _ = kp.routing_layout(rm, ALIGN)
    cap = tokens * TOPK + experts * (ALIGN - 1)
    y = torch.randn(cap, HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows = []
    for block_h, warps in itertools.product((512, 1024, 2048, 4096), (2, 4, 8)):
        t = utils.time_ms(lambda: kp.permute(q.rowwise_data, rmap, cap, pad, probs, q.rowwise_scale_inv,
                                             config=(block_h, warps)), 25, 100)
        rows.append(dict(kernel="permute FP8", block_h=block_h, num_warps=warps, us=t * 1e3,
                         pct_of_copy=100 * tokens * TOPK * HIDDEN * 1.0 / t / 1e9 / copy_tbps))
        t = utils.time_ms(lambda: kp.unpermute(y, rmap, probs, pad, config=(block_h, warps)), 25, 100)
        rows.append(dict(kernel="unpermute BF16", block_h=block_h, num_warps=warps, us=t * 1e3,
                         pct_of_copy=100 * 2 * HIDDEN * tokens * (TOPK + 1) / t / 1e9 / copy_tbps))
    return rows


def main():
    args, env, ceilings, copy_tbps = utils.start(__doc__.splitlines()[0], "also sweep the kernels' launch shapes")
    if args.sweep:
        path = utils.write_results("bench_permute_sweep", "Permute / unpermute kernels: launch-shape sweep", env,
                                   ceilings, sweep(copy_tbps), ["kernel", "block_h", "num_warps", "us", "pct_of_copy"])
        print(path.read_text())
    results = [r for tokens, experts in CASES for r in run_case(tokens, experts, copy_tbps)]
    path = utils.write_results(
        "bench_permute", "MoE permute+pad (FP8) and unpermute+unpad (BF16)", env, ceilings, results,
        list(ExperimentResult.__dataclass_fields__),
        notes=(
            f"hidden {HIDDEN}, top-{TOPK}, align {ALIGN}; launch shapes (BLOCK_H, warps): permute "
            f"{kp.PERMUTE_CONFIG}, unpermute {kp.UNPERMUTE_CONFIG}. fused: the public op (row_id_map, "
            "counts, kernels, zero fill); fused_host_us: the host's time to issue one fused call (no sync; "
            "where it exceeds fused_us' GPU share the op is launch-bound); host counts: tokens_per_expert "
            "as the dispatcher's host list, exact output size; kernels: the data-moving kernel and the zero fill, given the "
            "row_id_map; pct_of_copy: required bytes over the kernels' time. unfused: torch index_select / "
            "index_copy / index_add from precomputed indices (their computation not timed); for the top-k "
            "conversion the reference's torch formulation (scatters, counts) without the op's checks. "
            "Target: >= 75% of the copy bandwidth."
        ),
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
