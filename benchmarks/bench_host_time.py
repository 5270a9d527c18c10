"""Host time against GPU time of one MoE layer step: FP8-Flow vs the BF16 grouped block, on the GPU.

Configurations (``--config``, ``CONFIGS``; the MoE layers of ``bench_megatron_pretrain.py``'s models):

- ``deepseek_small``: 64 experts, hidden 2048, ffn 1024, top-8, 4096 tokens (about 512 rows per expert), where
  the FP8-Flow iteration was bound by its host (docs/megatron.md);
- ``qwen3_moe_like``: Qwen3-30B-A3B's MoE layer, 128 experts, hidden 2048, ffn 768, top-8, at 16384 and 4096
  tokens per step (Megatron micro-batches of 4 and 1 sequences of 4096);
- ``dsv3_ep8_rank``: one EP=8 rank of DeepSeek-V3's experts, 32 local experts, hidden 7168, ffn 2048, top-8, 16384
  tokens (the 4096 rows per expert such a rank receives).

Step: forward + backward with the local dispatcher, the FP8 weights cached as on a step's later micro-batches
(``is_first_microbatch=True`` once, then ``False``), gradients set to None first (``utils.moe_step``). Blocks,
same parameters and routing:

- ``bf16_grouped_mm``: the strongest BF16 block (``baselines.BF16GroupedMMBlock``);
- ``fp8_flow_single_weight``: FP8-Flow with one ``[E, N, K]`` weight per GEMM;
- ``fp8_flow``: FP8-Flow with one weight per expert (TE's layout; autograd and hooks per parameter);
- ``fp8_flow_single_weight_moe_expert``: single weight with ``recompute="moe_expert"`` (Megatron's
  ``--recompute-modules moe_expert``): backward reruns permute, fc1 and SwiGLU, so more host work per step.

Per block: ``host_ms`` (median over steps of the time until ``backward()`` returns, the GPU idle at the
start: what the CPU spends issuing the step), ``wall_ms`` (until the GPU is done), ``gpu_ms`` (kernel time
per step, torch profiler) and ``launches`` per step. ``host_ms`` above ``gpu_ms`` means the step waits on
its host (issue 37's target: ``host_over_gpu`` <= 1 at ``qwen3_moe_like``); the host figures move with the
machine's CPU. ``--profile-host``: also where the host time goes, cProfile's largest functions per step
(``bench_host_time_profile``). ``--gpu-idle``: also where the GPU idles between a step's kernels, from a
CUDA-only profiler trace that leaves the host's speed as it is (``bench_host_time_idle``: the kernels the GPU
waits longest before, i.e. where the step waits for its host). Results keep the stored rows of other
configurations.

Run on a GPU: ``python benchmarks/bench_host_time.py --config qwen3_moe_like [--profile-host]``.

``--cpu-faked`` (a machine without a GPU): the package's own host path, with every launch of the package's ops
replaced by its fake (outputs of the right shapes, nothing computed; ``faked_launches``) but the routing's (its
counts size the permute), whose time is taken off. Per FP8-Flow block: ``host_us`` per step and ``experts_us`` from
``routed_experts``' entry (after the dispatch's host wait) to unpermute's launch, the median and the least over
``--steps``: a proxy of the Python and dispatch work on the host's path, for comparing two versions of the code
on one machine (interleave them); it leaves out what only a GPU has (launch latency, DeepGEMM's and Triton's own
host work). ``bench_host_time_cpu``. Run: ``python benchmarks/bench_host_time.py --cpu-faked --config
qwen3_moe_like --tokens 256 --steps 100``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pathlib
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from transformer_engine_moe import FP8FlowMoE, backend, custom_ops
from transformer_engine_moe.module import moe

import utils
from baselines import BF16GroupedMMBlock

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cuLaunchKernel")
# name -> the layer's shapes: experts, hidden, ffn, top-k, and tokens per step (one row set per token count)
CONFIGS = {"deepseek_small": dict(experts=64, hidden=2048, ffn=1024, topk=8, tokens=(4096,)),
           "qwen3_moe_like": dict(experts=128, hidden=2048, ffn=768, topk=8, tokens=(16384, 4096)),
           "dsv3_ep8_rank": dict(experts=32, hidden=7168, ffn=2048, topk=8, tokens=(16384,))}


def make_blocks(experts: int, hidden: int, ffn: int, topk: int, device) -> dict:
    """name -> block, the two FP8-Flow layouts (single weight also with ``moe_expert``) and the BF16 block over the
    same expert weights."""
    blocks = {}
    for name, kw in (("fp8_flow_single_weight", dict(single_grouped_weight=True)), ("fp8_flow", {}),
                     ("fp8_flow_single_weight_moe_expert", dict(single_grouped_weight=True, recompute="moe_expert"))):
        torch.manual_seed(0)
        blocks[name] = FP8FlowMoE(experts, hidden, ffn, topk, device=device, **kw)
    return {"bf16_grouped_mm": BF16GroupedMMBlock.from_block(blocks["fp8_flow_single_weight"]), **blocks}


def make_inputs(tokens: int, hidden: int, experts: int, topk: int, device):
    """``(x [T, H] bf16 leaf with requires_grad, topk_ids [T, k] distinct experts, topk_probs [T, k], output
    gradient [T, H])``."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.rand(tokens, experts, generator=gen).argsort(1)[:, :topk].to(device)
    probs = torch.rand(tokens, topk, generator=gen).softmax(-1).to(device)
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    return x, ids, probs, dy


def gpu_ms_and_launches(step, steps: int) -> tuple[float, float]:
    """(kernel time, kernel launches) per step, from the torch profiler over ``steps`` steps."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return gpu_us / steps / 1e3, sum(e.count for e in events if e.key in LAUNCHES) / steps


STEP_MARKER = "FillFunctor<short>"  # the kernel of ``marker.fill_(i)`` on an int16 tensor: where each step starts


def gpu_idle(kernels, top: int = 8) -> dict:
    """Where the GPU idles, from ``kernels``: ``(start_us, end_us, name)`` of every kernel and copy of a run of
    back-to-back steps, each step opened by a ``STEP_MARKER`` kernel. Per step (between markers, the first and
    last step dropped): wall from marker to marker, kernel time, idle (time no kernel ran); medians, and the
    ``top`` kernels with the most idle before them (by position in the step, median over steps)."""
    kernels = sorted(kernels)
    marks = [i for i, k in enumerate(kernels) if STEP_MARKER in k[2]]
    steps, before = [], {}
    for a, b in zip(marks[1:-2], marks[2:-1]):
        seg, end, busy, idle = kernels[a:b + 1], kernels[a][1], 0.0, 0.0
        for j, (start, stop, name) in enumerate(seg[1:-1], 1):
            gap = max(0.0, start - end)
            idle += gap
            busy += stop - start
            before.setdefault((j, name), []).append(gap)
            end = max(end, stop)
        idle += max(0.0, seg[-1][0] - end)
        steps.append((seg[-1][0] - seg[0][0], busy, idle, len(seg) - 2))
    if not steps:
        raise ValueError(f"gpu_idle needs 4 or more {STEP_MARKER!r} marker kernels (one opening each step, one after "
                         f"the last), got {len(marks)}")
    wall, busy, idle, count = (statistics.median(v) for v in zip(*steps))
    worst = sorted(((statistics.median(g), j, n) for (j, n), g in before.items()), key=lambda w: (-w[0], w[1]))[:top]
    return dict(step_us=wall, kernel_us=busy, idle_us=idle, kernels=count, steps=len(steps),
                idle_before=[dict(position=j, kernel=n[:80], idle_us=g) for g, j, n in worst])


def idle_trace(step, steps: int) -> dict:
    """``gpu_idle`` of ``steps`` back-to-back ``step`` calls under the torch profiler with CUDA activity only (no
    CPU-op recording: the host runs at its own speed, so its waits show as they are)."""
    marker = torch.zeros(1, dtype=torch.int16, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            marker.fill_(i)
            step()
        marker.fill_(steps)
        torch.cuda.synchronize()
    return gpu_idle([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA])


def host_profile(step, steps: int, sync, top: int = 25) -> list[dict]:
    """cProfile of ``steps`` calls of ``step``, each from an idle device (``sync`` before, outside the profile):
    the ``top`` functions by own time, with calls, own and cumulative ms per step."""
    prof = cProfile.Profile()
    for _ in range(steps):
        sync()
        prof.enable()
        step()
        prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, own s, cumulative s, _)
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [dict(function=f"{'/'.join(pathlib.Path(f).parts[-2:])}:{line}({fn})", calls=nc / steps,
                 own_ms=tt * 1e3 / steps, cumulative_ms=ct * 1e3 / steps)
            for (f, line, fn), (_, nc, tt, ct, _) in ranked]


# launchers --cpu-faked keeps real: their values (the routing map and its counts) size what follows
KEPT_REAL = ("topk_routing", "routing_layout")


@contextlib.contextmanager
def faked_launches():
    """Within: ``backend.REFERENCE``'s launchers (the CPU's) replaced by their fakes (``custom_ops``' shape
    functions: outputs of the right shapes, dtypes and devices, nothing computed; an ``out`` argument returned as
    given), except ``KEPT_REAL``. Yields ``{"kept_s": seconds inside the real ones, "experts_s": seconds from
    FP8FlowMoE.routed_experts' entry to the first unpermute launch after it}``, accumulated; reset them per step.
    Everything is put back on exit."""
    clock = {"kept_s": 0.0, "experts_s": 0.0, "entered": None}
    originals = {}

    def fake_of(name, spec, real):
        names = custom_ops._arguments(spec.schema)

        def launch(*args, **kwargs):
            if name == "unpermute" and clock["entered"] is not None:
                clock["experts_s"] += time.perf_counter() - clock["entered"]
                clock["entered"] = None
            if name in KEPT_REAL:
                t0 = time.perf_counter()
                out = real(*args, **kwargs)
                clock["kept_s"] += time.perf_counter() - t0
                return out
            values = list(args) + [kwargs.get(n) for n in names[len(args):]]
            for arg, default in (("accumulate", False), ("out_dtype", torch.bfloat16)):
                if arg in names and values[names.index(arg)] is None:
                    values[names.index(arg)] = default
            out = spec.fake(*values[:len(names)])
            return values[names.index("out")] if "out" in names and values[names.index("out")] is not None else out

        return launch

    for name, spec in custom_ops._SPECS.items():
        if hasattr(backend.REFERENCE, name):
            originals[name] = getattr(backend.REFERENCE, name)
            object.__setattr__(backend.REFERENCE, name, fake_of(name, spec, originals[name]))
    routed = moe.FP8FlowMoE.routed_experts

    def timed_routed(self, *args, **kwargs):
        clock["entered"] = time.perf_counter()
        return routed(self, *args, **kwargs)

    moe.FP8FlowMoE.routed_experts = timed_routed
    try:
        yield clock
    finally:
        moe.FP8FlowMoE.routed_experts = routed
        for name, real in originals.items():
            object.__setattr__(backend.REFERENCE, name, real)


def cpu_faked_rows(shape: dict, steps: int) -> list[dict]:
    """``--cpu-faked``: per FP8-Flow block of ``make_blocks`` at ``shape`` (on the CPU), ``host_us`` (a step's host
    time less the real routing's) and ``experts_us`` (``faked_launches``), medians and least over ``steps``."""
    inputs = make_inputs(shape["tokens"], shape["hidden"], shape["experts"], shape["topk"], "cpu")
    blocks = make_blocks(shape["experts"], shape["hidden"], shape["ffn"], shape["topk"], "cpu")
    rows = []
    with faked_launches() as clock:
        for name, block in blocks.items():
            if not name.startswith("fp8_flow"):  # torch's own ops (the BF16 block) have no fakes here
                continue
            step = utils.moe_step(block, *inputs, fp8_weights="cached")
            host, experts = [], []
            for i in range(steps + 3):
                clock.update(kept_s=0.0, experts_s=0.0, entered=None)
                t0 = time.perf_counter()
                step()
                if i >= 3:  # three warm-up steps
                    host.append((time.perf_counter() - t0 - clock["kept_s"]) * 1e6)
                    experts.append(clock["experts_s"] * 1e6)
            rows.append(dict(shape, block=name, host_us=statistics.median(host), host_us_min=min(host),
                             experts_us=statistics.median(experts), experts_us_min=min(experts)))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", choices=list(CONFIGS), default=["deepseek_small"])
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="tokens per step instead of each configuration's (e.g. 8192)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block (medians)")
    parser.add_argument("--profile-host", action="store_true",
                        help="also cProfile each block's steps: bench_host_time_profile .json/.md")
    parser.add_argument("--gpu-idle", action="store_true",
                        help="also where the GPU idles between kernels (CUDA-only trace): bench_host_time_idle")
    parser.add_argument("--cpu-faked", action="store_true",
                        help="no GPU: the package's host path with its launches faked (bench_host_time_cpu)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    for t in args.tokens or ():
        if t < 1:
            parser.error(f"--tokens must be positive, got {t}")
    if args.cpu_faked and (args.profile_host or args.gpu_idle):
        parser.error("--cpu-faked measures the CPU alone: without --profile-host and --gpu-idle")
    return args


def main():
    args = parse_args()
    if args.cpu_faked:
        return main_cpu_faked(args)
    env = utils.environment()
    rows, host_rows, idle_rows = [], [], []
    for config in args.config:
        c = CONFIGS[config]
        for tokens in args.tokens or c["tokens"]:
            shape = dict(config=config, experts=c["experts"], hidden=c["hidden"], ffn=c["ffn"], topk=c["topk"],
                         tokens=tokens)
            inputs = make_inputs(tokens, c["hidden"], c["experts"], c["topk"], "cuda")
            for name, block in make_blocks(c["experts"], c["hidden"], c["ffn"], c["topk"], "cuda").items():
                step = utils.moe_step(block, *inputs, fp8_weights="cached")
                for _ in range(3):
                    step()
                host, wall = utils.host_and_wall_ms(step, args.steps, torch.cuda.synchronize)
                gpu, launches = gpu_ms_and_launches(step, 5)
                rows.append(dict(shape, block=name, host_ms=host, wall_ms=wall, gpu_ms=gpu, launches=launches,
                                 host_over_gpu=host / gpu))
                if args.profile_host:
                    host_rows += [dict(shape, block=name, **r) for r in host_profile(step, 10, torch.cuda.synchronize)]
                if args.gpu_idle:
                    idle = idle_trace(step, 12)
                    idle_rows += [dict(shape, block=name, **{k: v for k, v in idle.items() if k != "idle_before"})]
                    idle_rows += [dict(shape, block=name, **r) for r in idle["idle_before"]]
            del inputs, block, step
            torch.cuda.empty_cache()
    shapes = ["config", "experts", "hidden", "ffn", "topk", "tokens", "block"]
    merged, env = utils.merge_stored("bench_host_time", "config", rows, env, default="deepseek_small")
    path = utils.write_results(
        "bench_host_time", "Host time vs GPU time of one MoE layer step", env, {}, merged,
        shapes + ["host_ms", "wall_ms", "gpu_ms", "launches", "host_over_gpu"],
        notes="host_ms: until backward() returns, from an idle GPU; wall_ms: until the GPU is done; gpu_ms: "
              "kernel time per step (torch profiler); medians over --steps steps. Local dispatcher, FP8 weights "
              "cached (a step's later micro-batches), gradients set to None before each step. `runs` in the "
              "environment: the device and date of each configuration's rows (rows of configurations this run "
              "did not measure are kept from earlier runs).")
    print(path.read_text())
    if idle_rows:
        path = utils.write_results(
            "bench_host_time_idle", "Where the GPU idles in back-to-back MoE layer steps", env, {}, idle_rows,
            shapes + ["step_us", "kernel_us", "idle_us", "kernels", "steps", "position", "kernel"],
            notes="torch profiler with CUDA activity only (the host not slowed by CPU-op recording), 12 back-to-back "
                  "steps, each opened by a marker kernel, the first and last dropped. Per block one row of medians "
                  "(step wall, kernel time, idle: no kernel running; kernels per step), then its kernels with the "
                  "most idle before them (position in the step, median idle_us over the steps): where the step "
                  "waits for its host to issue the next kernel.")
        print(path.read_text())
    if host_rows:
        path = utils.write_results(
            "bench_host_time_profile", "Where one MoE layer step's host time goes (cProfile)", env, {}, host_rows,
            shapes + ["function", "calls", "own_ms", "cumulative_ms"],
            notes="cProfile over 10 steps per block, each from an idle GPU (the sync outside the profile); per "
                  "step: calls, own time (ms) and cumulative time (ms) of the 25 functions with the most own "
                  "time. cProfile slows Python down: compare functions within a row set, not with host_ms.")
        print(path.read_text())


def main_cpu_faked(args: argparse.Namespace) -> None:
    env = utils.environment({"device": "CPU, launches faked", "cpus": len(os.sched_getaffinity(0))})
    rows = []
    for config in args.config:
        c = CONFIGS[config]
        for tokens in args.tokens or c["tokens"]:
            shape = dict(config=config, experts=c["experts"], hidden=c["hidden"], ffn=c["ffn"], topk=c["topk"],
                         tokens=tokens)
            rows += cpu_faked_rows(shape, args.steps)
    path = utils.write_results(
        "bench_host_time_cpu", "The package's host path per MoE layer step, launches faked (CPU)", env, {}, rows,
        ["config", "experts", "hidden", "ffn", "topk", "tokens", "block", "host_us", "host_us_min", "experts_us",
         "experts_us_min"],
        notes="--cpu-faked: the package's launches replaced by their fakes (nothing computed), the routing real and "
              "its time taken off; host_us per step, experts_us from routed_experts' entry to unpermute's launch; "
              "median and least over --steps after three warm-up steps. A proxy of the host path's Python and "
              "dispatch work for comparing versions on one machine, not of a GPU step's host time.")
    print(path.read_text())


if __name__ == "__main__":
    main()
