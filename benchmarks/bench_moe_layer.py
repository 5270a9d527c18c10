"""The FP8-Flow MoE expert block vs BF16 blocks and blockwise FP8 with casts, EP=1, per rank, on the GPU.

Shapes (``--shape``, ``SHAPES``): ``deepseek_v3``, DeepSeek-V3's experts (hidden 7168, ffn 2048, top-8, 16384
tokens = 131072 routed rows) over 8, 32, 64 and 128 local experts, what one rank holds at EP = 32, 8, 4, 2
with 256 experts; ``qwen3_moe_like``, Qwen3-30B-A3B's (hidden 2048, ffn 768, top-8, 16384 tokens, 128 experts:
1024 rows each). Step: forward + backward of the block, router outside, gradients set to None before each
step (``utils.moe_step``). All blocks of a run have the same parameters and routing.

**Rows over fresh processes** (``--processes N``, default 3 at ``qwen3_moe_like``): each of N fresh Python
processes, one after the other, builds every block and measures them all; a row is the median over the
processes, with the speedup over ``bf16_grouped_mm`` taken in each process (its own baseline) and then
aggregated, its spread ``(max - min) / median`` and each process's value (``utils.across_processes``). Before
them ``--priming-processes`` (default 1) run the same and are left out of the rows (their speedups are kept in
the environment, ``priming_speedups``): on a fresh machine the first process fills the on-disk Triton and
DeepGEMM caches, and after its warm-up it still ran slower than the later ones (H200, 2026-11-28: 1.46x against
1.55 / 1.56 for ``fp8_flow``, 1.19x against 1.27 / 1.25 with ``moe_expert``), a start that a training run pays
once, not per step.
Blocks (``VARIANTS``):

- ``bf16_grouped_mm``: the strongest BF16 block (``baselines.BF16GroupedMMBlock``: stacked weights,
  argsort permute, ``torch._grouped_mm``, no padding, index_add unpermute); every speedup is over it;
- ``fp8_flow``: FP8-Flow (``gemm_backend="auto"``, one ``[E, N, K]`` weight per GEMM: ``single_grouped_weight``,
  Megatron's ``--moe-fp8-flow-single-grouped-weight``) with its FP8 weights cached as in the middle of a step
  (``is_first_microbatch=True`` on the first call, ``False`` on every later one); ``fp8_flow_requant`` and
  ``fp8_flow+moe_expert`` share that layout;
- ``fp8_flow_per_expert``: ``fp8_flow`` with one weight parameter per expert (the default layout: 256 weight
  gradients for autograd to deliver per step at 128 experts, host time the GPU waits for);
- ``fp8_flow_requant``: the weights requantized every step (``True`` each call: a step's first micro-batch);
- ``fp8_flow+moe_expert``: ``recompute="moe_expert"``, weights cached as ``fp8_flow``;
- ``te_bf16`` / ``te_blockwise``: TransformerEngine's ``GroupedLinear`` as the experts behind the same
  permute, in BF16 / under ``Float8BlockScaling`` (TE's blockwise FP8 with its casts, weights cached as
  ``fp8_flow``; ``baselines.TEGroupedLinearBlock``); rows with the reason where TE does not import.

How each process times them, against the causes of the 1.06x-1.45x spread issue 37 measured for one block
over five processes: (1) JIT and first-call work (Triton compilation, DeepGEMM's JIT, cuBLASLt heuristics,
TE's setup, the FP8 weight cache's first fill) is done before any timing: every block runs
``--warmup`` steps in its timed mode, then one untimed round of all of them; nothing times a call count
estimated from a first call (``do_bench`` does, so a slow first call shortens its run). (2) Clock and thermal
drift: the blocks are timed in ``--rounds`` interleaved rounds, the order rotating each round, each round
``--calls`` back-to-back steps between CUDA events; a block's figure is the median over rounds, so all
blocks see the same clocks; the GPU's SM clock, temperature and power are recorded at each process's start
and end (clocks are left as the machine sets them). (3) Allocator: all blocks step in one process, one warm
caching allocator, no ``empty_cache`` between them. (4) What remains between processes (the host CPU's
speed, which a step that syncs once for its counts feels, or the GPU's state) shows as the rows' spread;
``host_ms`` (host time of a step from an idle GPU, median over the processes) says how host-bound a block is.

**One-process sweep** (``--processes 0``, default at ``deepseek_v3``): every block of ``BLOCKS`` and
``OTHER_BLOCKS`` in turn (``do_bench``), also ``bf16_loop``, ``blockwise_casts``, ``fp8_flow_triton``,
``fp8_flow_graph`` / ``fp8_flow_graph_auto`` (forward + backward captured in one CUDA graph, replays timed),
``fp8_flow_no_deepgemm`` / ``fp8_flow_graph_no_deepgemm`` (the ``auto`` block, eager / captured, as where
DeepGEMM is not installed: ``utils.without_deepgemm``);
the FP8 weights requantized every step (``fp8_flow``, ``fp8_flow+moe_expert`` also without the cache, as
Megatron's ``--disable-parameter-transpose-cache``); peak memory above the inputs and activation bytes
kept for backward.

``--profile``: where the GPU time of one step goes, by kernel category, then the largest kernels with the op
that launched each (torch.profiler): the sweep's ``fp8_flow`` and ``fp8_flow_graph_auto`` at ``deepseek_v3``,
every block of the rows at ``qwen3_moe_like``.

Results: ``bench_moe_layer{suffix}`` .json/.md (one table per shape; a run replaces the rows of its shape and
keeps the others), ``bench_moe_layer{suffix}.png`` (sweep) or ``bench_moe_layer_<shape>{suffix}.png``, and
``bench_moe_layer[_<shape>]_profile{suffix}``. Run on a GPU:

    python benchmarks/bench_moe_layer.py --shape qwen3_moe_like            # rows, 3 fresh processes
    python benchmarks/bench_moe_layer.py --shape qwen3_moe_like --experts --profile   # the profile alone
    python benchmarks/bench_moe_layer.py [--experts 8 32 64 128] [--profile 64 128] [--suffix _h200]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from transformer_engine_moe.module import FP8FlowMoE, GroupedLinear

import kernel_profile
import utils
from baselines import BF16GroupedMMBlock, BF16LoopMoE, BlockwiseCastsMoE, TEGroupedLinearBlock, float8_block_scaling


@dataclasses.dataclass(frozen=True)
class Shape:
    """An MoE layer's expert shapes at EP=1: ``tokens`` per step, ``hidden``, each expert's ``ffn``, ``topk``,
    and the local expert counts measured by default (``experts``); ``processes``: the default of
    ``--processes`` (0: the one-process sweep)."""

    tokens: int
    hidden: int
    ffn: int
    topk: int
    experts: tuple[int, ...]
    processes: int

    def rows_per_expert(self, experts: int) -> int:
        return self.tokens * self.topk // experts


SHAPES = {"deepseek_v3": Shape(16384, 7168, 2048, 8, (8, 32, 64, 128), processes=0),
          "qwen3_moe_like": Shape(16384, 2048, 768, 8, (128,), processes=3)}
BASELINE = "bf16_grouped_mm"


def _fp8_twin(block: FP8FlowMoE, **kw) -> FP8FlowMoE:
    """A second FP8-Flow block with ``block``'s shapes, weight layout and parameters (its own FP8 weight cache),
    built with ``kw`` (which may set another layout: the state dict's per-expert keys load into either)."""
    kw.setdefault("single_grouped_weight", block.linear_fc1.single_grouped_weight)
    twin = FP8FlowMoE(block.num_experts, block.linear_fc1.in_features, block.linear_fc2.in_features, block.topk,
                      device=block.linear_fc1.weight_params[0].device, **kw)
    twin.load_state_dict(block.state_dict())
    return twin


def _te_block(block: FP8FlowMoE, blockwise: bool = False) -> TEGroupedLinearBlock:
    """TE's ``GroupedLinear`` block over ``block``'s experts, in BF16 or under TE's blockwise FP8 recipe; refused
    (ValueError) for a block off the GPU before TE is touched: TE's kernels take GPU memory only (trying them on CPU
    tensors in a GPU test process was followed by an illegal memory access there)."""
    device = block.linear_fc1.weight_params[0].device
    if device.type != "cuda":
        raise ValueError(f"the te_* blocks need CUDA weights (TransformerEngine runs on the GPU), got {device}")
    return TEGroupedLinearBlock.from_block(block, float8_block_scaling() if blockwise else None)


# Rows over fresh processes: name -> (its FP8 weights step to step, utils.FP8_WEIGHTS; the block, made from the
# fp8_flow block). BF16 blocks ignore the first; te_* rows are skipped with the reason where TE does not run.
VARIANTS = {BASELINE: ("uncached", BF16GroupedMMBlock.from_block),
            "fp8_flow": ("cached", lambda block: block),
            "fp8_flow_requant": ("requantized", _fp8_twin),
            "fp8_flow+moe_expert": ("cached", lambda block: _fp8_twin(block, recompute="moe_expert")),
            "fp8_flow_per_expert": ("cached", lambda block: _fp8_twin(block, single_grouped_weight=False)),
            "te_bf16": ("uncached", _te_block),
            "te_blockwise": ("cached", lambda block: _te_block(block, blockwise=True))}
OPTIONAL = ("te_bf16", "te_blockwise")
# The one-process sweep: name -> (the block over the FP8-Flow block's parameters, recompute)
BLOCKS = {"bf16_loop": (BF16LoopMoE.from_block, None), "blockwise_casts": (BlockwiseCastsMoE.from_block, None),
          "fp8_flow": (lambda block: block, None), "fp8_flow+moe_expert": (lambda block: block, "moe_expert")}
# FP8-Flow blocks of their own constructor arguments: the eager block on the Triton GEMMs alone, and the
# block with device splits captured in one CUDA graph (Triton GEMMs; auto: DeepGEMM fprop/dgrad + Triton wgrad).
UNCACHED = ("fp8_flow", "fp8_flow+moe_expert")  # also timed with is_first_microbatch=None
OTHER_BLOCKS = {"fp8_flow_triton": dict(gemm_backend="triton"),
                "fp8_flow_graph": dict(gemm_backend="triton", device_splits=True),
                "fp8_flow_graph_auto": dict(device_splits=True)}
# the auto block as on a machine without DeepGEMM (issue 39): eager, and captured with device splits
NO_DEEPGEMM = {"fp8_flow_no_deepgemm": {}, "fp8_flow_graph_no_deepgemm": dict(device_splits=True)}


def inputs(shape: Shape, experts: int):
    """``(x [T, H] BF16 leaf with requires_grad, topk_ids [T, k], topk_probs [T, k], dy [T, H])``, seeded."""
    torch.manual_seed(0)
    x = torch.randn(shape.tokens, shape.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs, ids = torch.softmax(torch.randn(shape.tokens, experts, device="cuda"), -1).topk(shape.topk)
    dy = torch.randn(shape.tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
    return x, ids, probs, dy


def fp8_flow_block(shape: Shape, experts: int, **kw) -> FP8FlowMoE:
    torch.manual_seed(0)
    return FP8FlowMoE(experts, shape.hidden, shape.ffn, shape.topk, device="cuda", **kw)


def build_variants(names, block: FP8FlowMoE, data, warmup: int, sync=torch.cuda.synchronize) -> tuple[dict, dict]:
    """``({name: its warmed-up step}, {name: why it was skipped})`` for ``VARIANTS``' ``names`` over ``block``
    and ``data`` (``inputs``): each built and stepped ``warmup`` times in its timed mode (kernels compiled,
    caches filled), then ``sync()``. A block of ``OPTIONAL`` that fails to build or step is skipped with the
    error; any other failure raises."""
    steps, skipped = {}, {}
    for name in names:
        fp8_weights, make = VARIANTS[name]
        try:
            step = utils.moe_step(make(block), *data, fp8_weights=fp8_weights)
            for _ in range(warmup):
                step()
            sync()
        except Exception as e:  # noqa: BLE001 (TE: not installed, or its recipe unsupported here)
            if name not in OPTIONAL:
                raise
            skipped[name] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.empty_cache()
            continue
        steps[name] = step
    return steps, skipped


def one_process(shape: Shape, experts_list, names, warmup: int, rounds: int, calls: int) -> dict:
    """One process's measurements (``--worker-out``): per expert count, each block's median ms per step over
    the interleaved rounds, its rounds, its host ms per step, and the blocks skipped; the GPU state at start
    and end, and the host's load (``utils.host_load``)."""
    out = {"gpu_state": [utils.gpu_state()], "host_load": [utils.host_load()], "experts": {}}
    for experts in experts_list:
        data = inputs(shape, experts)
        steps, skipped = build_variants(names, fp8_flow_block(shape, experts, single_grouped_weight=True), data, warmup)
        utils.interleaved_ms(steps, 1, calls)  # untimed: the allocator sees every block's pattern, interleaved
        rounds_ms = utils.interleaved_ms(steps, rounds, calls)
        host = {n: utils.host_and_wall_ms(s, 3, torch.cuda.synchronize)[0] for n, s in steps.items()}
        out["experts"][str(experts)] = dict(ms={n: statistics.median(r) for n, r in rounds_ms.items()},
                                            rounds_ms=rounds_ms, host_ms=host, skipped=skipped)
        del steps, data
        torch.cuda.empty_cache()
    out["gpu_state"].append(utils.gpu_state())
    out["host_load"].append(utils.host_load())
    return out


def process_rows(shape_name: str, per_process: list[dict], names) -> list[dict]:
    """The rows of the processes' results (``one_process``'s, in order): one per expert count and block,
    aggregated by ``utils.across_processes`` (speedup over ``bf16_grouped_mm`` per process, then the median),
    with ``within_process_spread`` (the median over processes of the spread of a process's rounds); a block
    no process ran gives a row with ``skipped`` (the first process's reason)."""
    shape, rows = SHAPES[shape_name], []
    for key in per_process[0]["experts"]:
        runs = [p["experts"][key] for p in per_process]
        agg = utils.across_processes([r["ms"] for r in runs], BASELINE)
        skipped = {}
        for r in runs:
            for name, why in r["skipped"].items():
                skipped.setdefault(name, why)
        for name in [n for n in names if n in agg or n in skipped]:
            row = dict(shape=shape_name, experts=int(key), rows_per_expert=shape.rows_per_expert(int(key)),
                       block=name, fp8_weights="" if name in (BASELINE, "te_bf16") else VARIANTS[name][0])
            if name not in agg:
                rows.append(dict(row, skipped=skipped[name]))
                continue
            a = agg[name]
            rows.append(dict(row, ms=a["ms"], speedup_over_bf16_grouped_mm=a["speedup"],
                             speedup_spread=a["speedup_spread"], speedup_per_process=a["speedup_per_process"],
                             ms_per_process=a["ms_per_process"], ms_spread=a["ms_spread"],
                             within_process_spread=statistics.median(
                                 utils.spread(r["rounds_ms"][name]) for r in runs if name in r["rounds_ms"]),
                             host_ms=statistics.median(r["host_ms"][name] for r in runs if name in r["host_ms"]),
                             processes=a["processes"]))
    return rows


def priming_speedups(shape_name: str, priming: list[dict]) -> dict:
    """``{experts: {block: [speedup over bf16_grouped_mm in each priming process]}}`` (``--priming-processes``:
    measured as the others, left out of the rows)."""
    out = {}
    for row in process_rows(shape_name, priming, list(VARIANTS)) if priming else []:
        if "speedup_per_process" in row:
            out.setdefault(str(row["experts"]), {})[row["block"]] = row["speedup_per_process"]
    return out


# ---------------------------------------------------------------------------------------------- one-process sweep
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
    fwd_bwd = utils.moe_step(model, x, ids, probs, dy, "requantized")
    fwd_bwd()  # compile / JIT outside the timing
    torch.cuda.synchronize()
    captured = utils.cuda_graph(fwd_bwd) if graph else None
    res = dict(ms=utils.time_ms(captured.replay if graph else fwd_bwd, 100, 1000))
    del captured
    if uncached:
        res["ms_uncached"] = utils.time_ms(utils.moe_step(model, x, ids, probs, dy, "uncached"), 100, 1000)
    peak, saved = memory(model, x, ids, probs, dy, True)
    peak_uncached, _ = memory(model, x, ids, probs, dy, None)
    return dict(res, saved_gib=saved / 2**30, peak_gib=peak / 2**30, peak_uncached_gib=peak_uncached / 2**30)


def sweep_point(shape_name: str, experts: int) -> list[dict]:
    shape = SHAPES[shape_name]
    x, ids, probs, dy = inputs(shape, experts)
    block = fp8_flow_block(shape, experts)
    baseline = BF16GroupedMMBlock.from_block(block)
    res = {BASELINE: measure(baseline, x, ids, probs, dy)}
    del baseline
    torch.cuda.empty_cache()
    for name, (make, recompute) in BLOCKS.items():
        model = make(block)
        model.recompute = recompute
        res[name] = measure(model, x, ids, probs, dy, uncached=name in UNCACHED)
    del block, model

    def measure_blocks(blocks: dict) -> None:  # each its own block; device splits: captured and replayed
        for name, kw in blocks.items():
            torch.cuda.empty_cache()
            res[name] = measure(fp8_flow_block(shape, experts, **kw), x, ids, probs, dy,
                                graph=kw.get("device_splits", False))

    measure_blocks(OTHER_BLOCKS)
    with utils.without_deepgemm():
        measure_blocks(NO_DEEPGEMM)
    base = res[BASELINE]
    for r in res.values():
        r["speedup_over_bf16_grouped_mm"] = base["ms"] / r["ms"]
        r["peak_vs_bf16_grouped_mm"] = r["peak_gib"] / base["peak_gib"]
        if "ms_uncached" in r:
            r["speedup_uncached"] = base["ms"] / r["ms_uncached"]
            r["peak_uncached_vs_bf16"] = r["peak_uncached_gib"] / base["peak_gib"]
    return [dict(shape=shape_name, experts=experts, rows_per_expert=shape.rows_per_expert(experts), block=name, **r)
            for name, r in res.items()]


# ------------------------------------------------------------------------------------------------------ profile
def profile(shape_name: str, experts: int) -> list[dict]:
    """GPU time per kernel category and per kernel of one step (``kernel_profile.kernel_times``): at ``deepseek_v3`` the
    sweep's eager ``fp8_flow`` step and the ``fp8_flow_graph_auto`` replay; otherwise every block of
    ``VARIANTS`` that runs, each warmed up in its timed mode."""
    shape = SHAPES[shape_name]
    data = inputs(shape, experts)
    rows = []
    if shape_name != "deepseek_v3":
        steps, skipped = build_variants(VARIANTS, fp8_flow_block(shape, experts, single_grouped_weight=True), data, warmup=3)
        for name, step in steps.items():
            rows += [dict(shape=shape_name, experts=experts, block=name, **r)
                     for r in kernel_profile.kernel_times(step)]
        return rows + [dict(shape=shape_name, experts=experts, block=n, what=f"skipped: {why}")
                       for n, why in skipped.items()]
    for name, kw in (("fp8_flow", {}), ("fp8_flow_graph_auto", OTHER_BLOCKS["fp8_flow_graph_auto"])):
        torch.cuda.empty_cache()
        block = fp8_flow_block(shape, experts, **kw)
        fwd_bwd = utils.moe_step(block, *data, fp8_weights="requantized")
        fwd_bwd()
        torch.cuda.synchronize()
        graph = utils.cuda_graph(fwd_bwd) if kw else None
        rows += [dict(shape=shape_name, experts=experts, block=name, **r)
                 for r in kernel_profile.kernel_times(graph.replay if graph else fwd_bwd)]
        del block, graph
    return rows


# --------------------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="deepseek_v3")
    parser.add_argument("--experts", type=int, nargs="*", default=None,
                        help="local expert counts (default: the shape's; with no count: no rows, the profile alone)")
    parser.add_argument("--processes", type=int, default=None,
                        help="fresh processes for the interleaved rows (default: the shape's: 3 at qwen3_moe_like, "
                             "0 at deepseek_v3 = the one-process sweep of every block)")
    parser.add_argument("--priming-processes", type=int, default=1,
                        help="fresh processes run before the timed ones, left out of the rows (the JIT caches' "
                             "first fill on a fresh machine)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps of each block before the rounds")
    parser.add_argument("--rounds", type=int, default=12, help="interleaved timing rounds per process")
    parser.add_argument("--calls", type=int, default=5, help="back-to-back steps per block and round")
    parser.add_argument("--suffix", default="",
                        help="appended to the results' name (e.g. _h200: bench_moe_layer_h200 for a second GPU)")
    parser.add_argument("--profile", type=int, nargs="*", default=None, metavar="EXPERTS",
                        help="also profile a step at these local expert counts (with no count: the shape's)")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # one process of the rows: its JSON here
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    args.experts = list(shape.experts) if args.experts is None else args.experts
    args.profile = list(shape.experts) if args.profile == [] else args.profile or []
    args.processes = shape.processes if args.processes is None else args.processes
    for e in args.experts + args.profile:
        if e < shape.topk:
            parser.error(f"expert counts must be >= the shape's top-{shape.topk}, got {e}")
    for flag in ("processes", "priming_processes"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    for flag in ("warmup", "rounds", "calls"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    return args


def main():
    args = parse_args()
    shape = SHAPES[args.shape]
    if args.worker_out:
        res = one_process(shape, args.experts, list(VARIANTS), args.warmup, args.rounds, args.calls)
        with open(args.worker_out, "w") as f:
            json.dump(res, f)
        return
    per_process, priming = [], []
    if args.processes and args.experts:
        argv = [__file__, "--shape", args.shape, "--experts", *map(str, args.experts), "--warmup",
                str(args.warmup), "--rounds", str(args.rounds), "--calls", str(args.calls)]
        per_process = utils.in_fresh_processes(argv, args.priming_processes + args.processes)
        priming, per_process = per_process[:args.priming_processes], per_process[args.priming_processes:]
    env = utils.environment()
    ceilings = {"copy_bandwidth_tbps (1 GiB, read+write)": utils.copy_bandwidth_tbps()}
    if per_process:
        env = dict(env, processes=args.processes, warmup=args.warmup, rounds=args.rounds, calls=args.calls,
                   gpu_state_per_process=[p["gpu_state"] for p in per_process],
                   host_load_per_process=[p["host_load"] for p in per_process],
                   priming_processes=args.priming_processes, priming_speedups=priming_speedups(args.shape, priming))
        write_rows(args.shape, args.suffix, env, ceilings, process_rows(args.shape, per_process, list(VARIANTS)))
    elif args.experts:
        rows = [r for e in args.experts for r in sweep_point(args.shape, e)]
        write_rows(args.shape, args.suffix, env, ceilings, rows)
    if args.profile:
        prof = [r for e in args.profile for r in profile(args.shape, e)]
        shape_part = "" if args.shape == "deepseek_v3" else f"_{args.shape}"
        path = utils.write_results(
            f"bench_moe_layer{shape_part}_profile{args.suffix}", f"MoE block step at {args.shape}: GPU time by kernel",
            env, ceilings, prof, ["shape", "experts", "block", "what", "launched_by", "ms", "share", "launches"],
            notes=f"torch.profiler CUDA kernel time per step ({kernel_profile.PROFILE_STEPS} steps averaged): the "
                  "categories first, then the largest kernels; launched_by: the op the profiler tied the kernel to, "
                  "< the nearest enclosing op outside aten (a custom op, an autograd Function's backward); launches: "
                  "per step. "
                  "deepseek_v3: the eager fp8_flow step (weights requantized each step) and the "
                  "fp8_flow_graph_auto replay; other shapes: every block of the rows, each in its timed mode.")
        print(path.read_text())


# the markdown columns of each kind of row (one table per shape, with the columns its rows have)
COLUMNS = ["shape", "experts", "rows_per_expert", "block", "fp8_weights", "ms", "speedup_over_bf16_grouped_mm",
           "speedup_spread", "speedup_per_process", "ms_per_process", "ms_spread", "within_process_spread",
           "host_ms", "processes", "skipped", "peak_gib", "peak_vs_bf16_grouped_mm", "ms_uncached", "speedup_uncached",
           "peak_uncached_gib", "peak_uncached_vs_bf16", "saved_gib"]
NOTES = {
    "processes": "Rows over fresh processes (speedup_spread etc.): ms and speedup_over_bf16_grouped_mm are medians "
                 "over `processes` fresh processes; each process's speedup is over its own bf16_grouped_mm; *_spread "
                 "= (max - min) / median over the processes; *_per_process in process order; "
                 "within_process_spread: the same over one process's interleaved rounds (median over processes); "
                 "host_ms: host time of one step from an idle GPU (median). fp8_weights: cached = "
                 "is_first_microbatch True once, then False (the middle of a step); requantized = True every step. "
                 "Method: the module docstring; environment: gpu_state_per_process = SM clock, temperature, power at "
                 "each process's start and end; host_load_per_process = the host's 1-minute load average and the "
                 "CPUs the process may use, at its start and end (other work on the host slows these blocks).",
    "sweep": "One-process sweep (peak_gib etc.): FP8 blocks pad each expert's rows to the block's align_size; "
             "bf16_grouped_mm does not pad. saved_gib: distinct storages autograd keeps for backward "
             "(saved_tensors_hooks), parameters excluded. peak_gib: peak allocation above the inputs and parameters "
             "during one forward+backward as timed (is_first_microbatch=True), from no gradients and no cached FP8 "
             "weights: the FP8 weight cache (one byte per parameter) and the gradients count. peak_uncached_gib: the "
             "same with is_first_microbatch=None (no cache, as Megatron's --disable-parameter-transpose-cache); "
             "ms_uncached, speedup_uncached: that step's time (fp8_flow blocks; BF16 blocks have no cache). "
             "fp8_flow_graph*: ms of CUDA-graph replays, memory of the same step run eagerly.",
}


def write_rows(shape_name: str, suffix: str, env: dict, ceilings: dict, rows: list[dict]):
    """``bench_moe_layer{suffix}`` .json/.md with ``rows`` in place of the stored rows of ``shape_name`` (the
    stored rows of other shapes kept; rows from before shapes were recorded are ``deepseek_v3``'s), and a PNG."""
    merged, env = utils.merge_stored(f"bench_moe_layer{suffix}", "shape", rows, env, default="deepseek_v3")
    shapes = [(n, SHAPES[n]) for n in dict.fromkeys(r["shape"] for r in merged)]
    notes = ("; ".join(f"{n}: {s.tokens} tokens, hidden {s.hidden}, ffn {s.ffn}, top-{s.topk}" for n, s in shapes)
             + "; uniform random router. `runs` in the environment: the device and date of each shape's rows.\n\n"
             + "\n\n".join(NOTES.values()))
    path = utils.write_results(f"bench_moe_layer{suffix}", "MoE expert block forward+backward, EP=1, per rank", env,
                               ceilings, merged, COLUMNS, notes=notes, group_by="shape")
    print(path.read_text())
    if "peak_gib" in rows[0]:
        plot_sweep(shape_name, rows, path.with_suffix(".png"))
    else:
        plot_processes(shape_name, rows, path.with_name(f"bench_moe_layer_{shape_name}{suffix}.png"))


def plot_sweep(shape_name, rows, path):
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
    s = SHAPES[shape_name]
    fig.suptitle(f"MoE expert block per rank, {s.tokens} tokens, hidden {s.hidden}, ffn {s.ffn}, top-{s.topk}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_processes(shape_name, rows, path):
    """Per expert count, each block's median speedup over the BF16 block (bar) and each process's (dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    experts = list(dict.fromkeys(r["experts"] for r in rows))
    fig, axes = plt.subplots(1, len(experts), figsize=(5 * len(experts), 3.8), squeeze=False)
    for ax, e in zip(axes[0], experts):
        timed = [r for r in rows if r["experts"] == e and "ms" in r]
        for i, r in enumerate(timed):
            ax.bar(i, r["speedup_over_bf16_grouped_mm"], 0.6)
            ax.plot([i] * len(r["speedup_per_process"]), r["speedup_per_process"], "k.")
        ax.set_xticks(range(len(timed)), [r["block"] for r in timed], rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{e} experts: speedup over bf16_grouped_mm (dots: processes)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    s = SHAPES[shape_name]
    fig.suptitle(f"{shape_name}: {s.tokens} tokens, hidden {s.hidden}, ffn {s.ffn}, top-{s.topk}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
