"""The FP8-Flow MoE expert block vs BF16 blocks and blockwise FP8 with casts, EP=1, per rank, on the GPU.

DeepSeek-V3 experts (hidden 7168, ffn 2048, top-8, 16384 tokens = 131072 routed rows) over 8, 32, 64 and
128 local experts: what one rank holds at EP = 32, 8, 4, 2 with 256 experts. Step: forward + backward of
the block, router outside, FP8 weights quantized once per step (a step's first micro-batch) and reused by
the moe_expert rerun, gradients set to None before each step as an optimizer's ``zero_grad`` does (else
autograd adds every step's weight gradients into the last: a BF16 pass over all parameters, 4.2 ms per
step at 64 experts on an H200, in every block). Blocks, all with the same parameters and routing:

- ``bf16_grouped_mm``: the strongest BF16 block (``baselines.BF16GroupedMMBlock``: stacked weights,
  ``torch._grouped_mm``, no padding); every speedup is over it, measured in the same run;
- ``bf16_loop``: BF16 per-expert cuBLAS GEMMs (``baselines.BF16LoopMoE``);
- ``blockwise_casts``: blockwise FP8 with BF16 between ops (TransformerEngine's Float8BlockScaling,
  ``baselines.BlockwiseCastsMoE``);
- ``fp8_flow`` and ``fp8_flow+moe_expert``: FP8-Flow, ``gemm_backend="auto"``;
- ``fp8_flow_triton``: FP8-Flow on the Triton GEMMs alone (host splits, eager);
- ``fp8_flow_graph``: FP8-Flow with ``device_splits=True`` and the Triton GEMMs, forward + backward
  captured in one CUDA graph, timed as replays (no host sync anywhere in the step);
  ``fp8_flow_graph_auto``: the same with ``gemm_backend="auto"`` (DeepGEMM fprop/dgrad, Triton wgrad).
  Their memory columns are of the same step run eagerly.

Reports step time (``fp8_flow`` and ``fp8_flow+moe_expert`` also without the FP8 weight cache, as
Megatron's ``--disable-parameter-transpose-cache``), peak memory above the inputs, activation bytes kept
for backward, and (``--profile``) where the GPU time of the ``fp8_flow`` step and of the
``fp8_flow_graph_auto`` replay goes at the given expert counts: GEMMs vs the rest, by kernel. Writes a PNG.

Run on a GPU: ``python benchmarks/bench_moe_layer.py [--experts 8 32 64 128] [--profile 64 128] [--suffix _h200]``
(``--experts`` with no count: the profile alone).
"""

from __future__ import annotations

import argparse
import collections

import torch

from transformer_engine_moe.module import FP8FlowMoE, GroupedLinear

import utils
from baselines import BF16GroupedMMBlock, BF16LoopMoE, BlockwiseCastsMoE

TOKENS, HIDDEN, FFN, TOPK = 16384, 7168, 2048, 8
# name -> (the block over the FP8-Flow block's parameters, recompute)
BLOCKS = {"bf16_loop": (BF16LoopMoE.from_block, None), "blockwise_casts": (BlockwiseCastsMoE.from_block, None),
          "fp8_flow": (lambda block: block, None), "fp8_flow+moe_expert": (lambda block: block, "moe_expert")}
# FP8-Flow blocks of their own constructor arguments: the eager block on the Triton GEMMs alone, and the
# block with device splits captured in one CUDA graph (Triton GEMMs; auto: DeepGEMM fprop/dgrad + Triton wgrad).
UNCACHED = ("fp8_flow", "fp8_flow+moe_expert")  # also timed with is_first_microbatch=None
OTHER_BLOCKS = {"fp8_flow_triton": dict(gemm_backend="triton"),
                "fp8_flow_graph": dict(gemm_backend="triton", device_splits=True),
                "fp8_flow_graph_auto": dict(device_splits=True)}
# Kernel name fragments -> category, for the profile (first match wins).
CATEGORIES = (("gemm", ("gemm", "sm90_xmma", "cutlass", "wgrad", "deep_gemm", "nvjet")),
              ("weight quantization + W^T", ("grouped_weight", "byte_transpose")),
              ("activation quantization", ("quantize",)), ("scaling-aware transpose", ("transpose", "shift")),
              ("permute / unpermute", ("permute", "scan", "routing", "row_id")), ("swiglu", ("swiglu",)))


def step_fn(model, x, ids, probs, dy, is_first_microbatch=True):
    def fwd_bwd():  # one micro-batch per step: the FP8 weights are quantized once per step
        model.zero_grad(set_to_none=True)  # as a training step's zero_grad: no add into last step's gradients
        x.grad = None
        model.forward_topk(x, ids, probs, is_first_microbatch=is_first_microbatch).backward(dy)
    return fwd_bwd


def memory(model, x, ids, probs, dy, is_first_microbatch) -> tuple[float, int]:
    """(peak bytes allocated above the inputs and parameters during one forward+backward, saved activation
    bytes), from no gradients and no cached FP8 weights: what the step allocates counts, the cache included."""
    for m in model.modules():
        if isinstance(m, GroupedLinear):
            m.reset_fp8_weight_cache()
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    saved, y = utils.saved_activation_bytes(lambda: model.forward_topk(x, ids, probs, is_first_microbatch))
    y.backward(dy)
    del y
    peak = torch.cuda.max_memory_allocated() - base
    model.zero_grad(set_to_none=True)
    x.grad = None
    return peak, saved


def measure(model, x, ids, probs, dy, graph: bool = False, uncached: bool = False) -> dict:
    """Step time (``graph``: of the step captured in a CUDA graph and replayed; ``uncached``: also of the
    eager step with ``is_first_microbatch=None``) and memory (always of the step run eagerly)."""
    fwd_bwd = step_fn(model, x, ids, probs, dy)
    fwd_bwd()  # compile / JIT outside the timing
    torch.cuda.synchronize()
    captured = utils.cuda_graph(fwd_bwd) if graph else None
    res = dict(ms=utils.time_ms(captured.replay if graph else fwd_bwd, 100, 1000))
    del captured
    if uncached:
        res["ms_uncached"] = utils.time_ms(step_fn(model, x, ids, probs, dy, None), 100, 1000)
    peak, saved = memory(model, x, ids, probs, dy, True)
    peak_uncached, _ = memory(model, x, ids, probs, dy, None)
    return dict(res, saved_gib=saved / 2**30, peak_gib=peak / 2**30, peak_uncached_gib=peak_uncached / 2**30)


def inputs(experts):
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs, ids = torch.softmax(torch.randn(TOKENS, experts, device="cuda"), -1).topk(TOPK)
    dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return x, ids, probs, dy


def sweep_point(experts) -> list[dict]:
    x, ids, probs, dy = inputs(experts)
    block = FP8FlowMoE(experts, HIDDEN, FFN, TOPK, device="cuda")
    baseline = BF16GroupedMMBlock.from_block(block)
    res = {"bf16_grouped_mm": measure(baseline, x, ids, probs, dy)}
    del baseline
    torch.cuda.empty_cache()
    for name, (make, recompute) in BLOCKS.items():
        model = make(block)
        model.recompute = recompute
        res[name] = measure(model, x, ids, probs, dy, uncached=name in UNCACHED)
    del block, model
    for name, kw in OTHER_BLOCKS.items():
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        other = FP8FlowMoE(experts, HIDDEN, FFN, TOPK, device="cuda", **kw)
        res[name] = measure(other, x, ids, probs, dy, graph=kw.get("device_splits", False))
        del other
    base = res["bf16_grouped_mm"]
    for r in res.values():
        r["speedup_over_bf16_grouped_mm"] = base["ms"] / r["ms"]
        r["peak_vs_bf16_grouped_mm"] = r["peak_gib"] / base["peak_gib"]
        if "ms_uncached" in r:
            r["speedup_uncached"] = base["ms"] / r["ms_uncached"]
            r["peak_uncached_vs_bf16"] = r["peak_uncached_gib"] / base["peak_gib"]
    return [dict(experts=experts, rows_per_expert=TOKENS * TOPK // experts, block=name, **r)
            for name, r in res.items()]


def profile(experts: int) -> list[dict]:
    """GPU time per kernel category of one eager FP8-Flow step and of one replay of the step captured with
    device splits (``fp8_flow_graph_auto``), torch.profiler, 5 steps averaged."""
    x, ids, probs, dy = inputs(experts)
    rows = []
    for name, kw in (("fp8_flow", {}), ("fp8_flow_graph_auto", OTHER_BLOCKS["fp8_flow_graph_auto"])):
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        block = FP8FlowMoE(experts, HIDDEN, FFN, TOPK, device="cuda", **kw)
        fwd_bwd = step_fn(block, x, ids, probs, dy)
        fwd_bwd()
        torch.cuda.synchronize()
        graph = utils.cuda_graph(fwd_bwd) if kw else None
        rows += [dict(experts=experts, block=name, **r) for r in kernel_times(graph.replay if graph else fwd_bwd)]
        del block, graph
    return rows


def kernel_times(step) -> list[dict]:
    """``step``'s GPU time by category (``CATEGORIES``), then its 25 largest kernels (5 steps averaged)."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    per_kernel = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time / 5 / 1e3
    total = sum(per_kernel.values())
    cats = collections.Counter()
    for name, ms in per_kernel.items():
        low = name.lower()
        cats[next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")] += ms
    rows = [dict(what=f"category: {c}", ms=ms, share=ms / total) for c, ms in cats.most_common()]
    return rows + [dict(what=name[:90], ms=ms, share=ms / total) for name, ms in per_kernel.most_common(25)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="*", default=[8, 32, 64, 128])
    parser.add_argument("--suffix", default="",
                        help="appended to the results' name (e.g. _h200: bench_moe_layer_h200 for a second GPU)")
    parser.add_argument("--profile", type=int, nargs="*", default=[], metavar="EXPERTS",
                        help="also profile the FP8-Flow step and its CUDA-graph replay at these local expert "
                             "counts (e.g. 64 128)")
    args = parser.parse_args()
    env = utils.environment()
    ceilings = {"copy_bandwidth_tbps (1 GiB, read+write)": utils.copy_bandwidth_tbps()}
    rows = [r for e in args.experts for r in sweep_point(e)]
    if rows:
        write_sweep(args.suffix, env, ceilings, rows)
    if args.profile:
        prof = [r for e in args.profile for r in profile(e)]
        path = utils.write_results("bench_moe_layer_profile", "FP8-Flow block step: GPU time by kernel", env,
                                   ceilings, prof, ["experts", "block", "what", "ms", "share"],
                                   notes="torch.profiler CUDA kernel time per step (5 steps averaged): the eager "
                                         "fp8_flow step and the fp8_flow_graph_auto replay; the categories "
                                         "first, then the 25 largest kernels.")
        print(path.read_text())


def write_sweep(suffix, env, ceilings, rows):
    """``bench_moe_layer{suffix}``'s JSON, markdown and PNG from the sweep's rows."""
    path = utils.write_results(
        f"bench_moe_layer{suffix}", "MoE expert block forward+backward, EP=1, per rank", env, ceilings, rows,
        ["experts", "rows_per_expert", "block", "ms", "speedup_over_bf16_grouped_mm", "peak_gib",
         "peak_vs_bf16_grouped_mm", "ms_uncached", "speedup_uncached", "peak_uncached_gib", "peak_uncached_vs_bf16",
         "saved_gib"],
        notes=(f"{TOKENS} tokens, hidden {HIDDEN}, ffn {FFN}, top-{TOPK}, uniform random router. FP8 blocks pad "
               "each expert's rows to the block's align_size; bf16_grouped_mm does not pad. saved_gib: distinct "
               "storages autograd keeps for backward (saved_tensors_hooks), parameters excluded. peak_gib: peak "
               "allocation above the inputs and parameters during one forward+backward as timed "
               "(is_first_microbatch=True), from no gradients and no cached FP8 weights: the FP8 weight cache "
               "(one byte per parameter) and the gradients count. peak_uncached_gib: the same with "
               "is_first_microbatch=None (no cache, as Megatron's --disable-parameter-transpose-cache); "
               "ms_uncached, speedup_uncached: that step's time (fp8_flow blocks; BF16 blocks have no cache). "
               "fp8_flow_graph*: ms of CUDA-graph replays, memory of the same step run eagerly."))
    print(path.read_text())
    plot(rows, path.with_suffix(".png"))


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = list(dict.fromkeys(r["block"] for r in rows))
    experts = list(dict.fromkeys(r["experts"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(blocks)
    for i, b in enumerate(blocks):
        for ax, key in zip(axes, ("speedup_over_bf16_grouped_mm", "peak_gib")):
            vals = [next(r[key] for r in rows if r["block"] == b and r["experts"] == e) for e in experts]
            ax.bar([j + i * width for j in range(len(experts))], vals, width, label=b)
    for ax, title in zip(axes, ("speedup over the BF16 grouped_mm block", "peak memory (GiB)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(experts))], [f"{e} experts" for e in experts])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"MoE expert block per rank, {TOKENS} tokens, hidden {HIDDEN}, ffn {FFN}, top-{TOPK}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
