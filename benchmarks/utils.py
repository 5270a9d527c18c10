"""Shared scaffold for the microbenchmarks: timing (one call; interleaved rounds; host time), the MoE block step,
runs in fresh processes and their aggregation, the copy-bandwidth ceiling, saved-activation bytes, result files,
and the expert-parallel runs (one process per GPU, or gloo on CPU processes).

Every benchmark measures its baselines in the same run, reports bytes/FLOPs
over time against ceilings measured on the same device, and writes
``benchmarks/results/<name>.json`` and ``<name>.md`` (device, date, shapes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import itertools
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from transformer_engine_moe import Float8BlockwiseQTensor
from transformer_engine_moe.kernels import grouped_gemm_deepgemm

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def time_ms(fn: Callable[[], object], warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median device time of ``fn`` in milliseconds (CUDA events via triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def cuda_ms_per_call(fn: Callable[[], object], calls: int) -> float:
    """Device milliseconds per call of ``calls`` back-to-back calls of ``fn``, between two CUDA events recorded
    on the current stream, from an idle device (synchronized before)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def interleaved_ms(steps: dict[str, Callable[[], object]], rounds: int, calls: int,
                   clock: Callable[[Callable[[], object], int], float] = cuda_ms_per_call) -> dict[str, list[float]]:
    """``name -> [ms per call in each round]`` for warmed-up ``steps``, timed in ``rounds`` rounds that
    interleave them: each round times every step over ``calls`` calls (``clock``), and the order rotates by
    one step each round. Clock and thermal drift over the run then reach every step alike, and each step
    runs next to the others in one warm caching allocator."""
    names = list(steps)
    out = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(clock(steps[name], calls))
    return out


def host_and_wall_ms(step, steps: int, sync) -> tuple[float, float]:
    """Medians over ``steps`` of (ms until ``step()`` returns, ms until ``sync()`` returns), each from an idle
    device (``sync`` before): what the host spends issuing a step, and the step's whole time."""
    host, wall = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        sync()
        host.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(host), statistics.median(wall)


# is_first_microbatch of an MoE block's successive steps, by how its FP8 weights are treated
FP8_WEIGHTS = {
    "cached": lambda: itertools.chain([True], itertools.repeat(False)),  # a step's later micro-batches
    "requantized": lambda: itertools.repeat(True),  # a step's first micro-batch: quantized, cached anew
    "uncached": lambda: itertools.repeat(None),  # no cache (Megatron's --disable-parameter-transpose-cache)
}


def moe_step(block, x, ids, probs, dy, fp8_weights: str = "cached") -> Callable[[], None]:
    """One forward + backward of an MoE ``block`` (``forward_topk(x [T, H], ids [T, k], probs [T, k],
    is_first_microbatch)``, ``x`` a leaf with ``requires_grad``) with output gradient ``dy [T, H]``; the
    gradients are set to None first, as an optimizer's ``zero_grad`` does (else autograd adds each step's
    weight gradients into the last's: a pass over all parameters that no training step makes).
    ``fp8_weights`` (``FP8_WEIGHTS``): ``cached``, ``requantized`` or ``uncached``; BF16 blocks ignore it."""
    if fp8_weights not in FP8_WEIGHTS:
        raise ValueError(f"fp8_weights must be one of {sorted(FP8_WEIGHTS)}, got {fp8_weights!r}")
    flags = FP8_WEIGHTS[fp8_weights]()

    def step():
        block.zero_grad(set_to_none=True)
        x.grad = None
        block.forward_topk(x, ids, probs, is_first_microbatch=next(flags)).backward(dy)

    return step


def in_fresh_processes(argv: Sequence[str], processes: int, out_flag: str = "--worker-out") -> list:
    """Run ``python *argv <out_flag> PATH`` ``processes`` times, one after the other, each a fresh Python
    process (no JIT, allocator or autotuning state carried over; the on-disk kernel caches are), and return
    the JSON each wrote to its PATH. A process that fails raises ``CalledProcessError``."""
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive int, got {processes!r}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            path = pathlib.Path(tmp, f"process{i}.json")
            print(f"process {i + 1}/{processes}: {' '.join(argv)}", flush=True)
            subprocess.run([sys.executable, *argv, out_flag, str(path)], check=True)
            results.append(json.loads(path.read_text()))
    return results


def spread(values: Sequence[float]) -> float:
    """``(max - min) / median`` of ``values``: how far apart fresh processes measure one thing."""
    return (max(values) - min(values)) / statistics.median(values)


def across_processes(per_process: Sequence[dict[str, float]], baseline: str) -> dict[str, dict]:
    """``name -> aggregate`` over processes, from each process's ``{name: ms}``. The speedup over ``baseline``
    is taken in each process (its own baseline, same clocks and allocator) and then aggregated:
    ``ms``/``speedup`` the medians over the processes that measured the name, ``ms_per_process``/
    ``speedup_per_process`` each process's value, ``ms_spread``/``speedup_spread`` their ``spread``,
    ``processes`` how many measured it. Every process must measure ``baseline``."""
    if not per_process or any(baseline not in p for p in per_process):
        raise ValueError(f"every process must measure the baseline {baseline!r}, got {list(per_process)}")
    out = {}
    for name in dict.fromkeys(n for p in per_process for n in p):
        ms = [p[name] for p in per_process if name in p]
        speedups = [p[baseline] / p[name] for p in per_process if name in p]
        out[name] = dict(ms=statistics.median(ms), speedup=statistics.median(speedups), ms_per_process=ms,
                         speedup_per_process=speedups, ms_spread=spread(ms), speedup_spread=spread(speedups),
                         processes=len(ms))
    return out


def gpu_state() -> dict:
    """The GPU's SM clock (MHz), temperature (C), power draw (W) and the processes computing on it (this one
    included) now, as nvidia-smi reports them (through pynvml; empty without it): recorded around timed runs,
    as a clock that throttled or a process sharing the GPU explains a slow one (a warning names the sharing:
    on 2026-11-27 a loss study landed on a benchmark's GPU and slowed every block 3.6x)."""
    try:
        import pynvml

        state = dict(sm_clock_mhz=torch.cuda.clock_rate(), temperature_c=torch.cuda.temperature(),
                     power_w=torch.cuda.power_draw() / 1e3)  # (NVML initialised by these)
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(None))
        state["processes"] = len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except Exception as e:  # noqa: BLE001 (no pynvml, NVML refusing: the run goes on without these)
        return dict(unavailable=f"{type(e).__name__}: {e}")
    if state["processes"] > 1:
        print(f"warning: {state['processes']} processes compute on this GPU: timings are shared-GPU timings",
              file=sys.stderr, flush=True)
    return state


@contextlib.contextmanager
def clock_while(period_s: float = 0.1):
    """Within: the GPU's SM clock (MHz) and power draw (W) sampled every ``period_s`` by a thread (NVML, as
    ``gpu_state``); yields a dict that holds their medians on exit (``sm_clock_mhz``, ``power_w``; empty without
    pynvml). Recorded with each timed kernel: an H200 running FP8 GEMMs back to back sits at its 700 W cap and
    clocks down (1680 MHz against its 1980 MHz boost, 2026-12-02), by more on one machine than another, so a
    kernel's TFLOP/s compares across runs only at the clock it ran at."""
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            try:
                samples.append((torch.cuda.clock_rate(), torch.cuda.power_draw() / 1e3))
            except Exception:  # noqa: BLE001 (no pynvml, NVML refusing: no samples)
                return
            stop.wait(period_s)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    medians: dict = {}
    try:
        yield medians
    finally:
        stop.set()
        thread.join()
        if samples:
            medians.update(sm_clock_mhz=statistics.median(c for c, _ in samples),
                           power_w=round(statistics.median(w for _, w in samples)))


def host_load() -> dict:
    """The host's 1-minute load average, the CPUs this process may run on and the host's CPUs: recorded around
    timed runs of blocks whose step waits on the host, which other work on the same host slows (2026-11-28, H200s:
    the qwen3_moe_like block 1.45-1.58x over three processes beside another GPU's tests and sweep, 1.48-1.54x
    alone)."""
    return dict(load_1min=round(os.getloadavg()[0], 2), cpus=len(os.sched_getaffinity(0)), host_cpus=os.cpu_count())


def cuda_graph(step: Callable[[], object], warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """``step`` captured in one CUDA graph, after ``warmup`` eager runs on a side stream (as torch.cuda.graphs
    requires: kernels compiled, caches filled); replay it with ``.replay()`` and keep it alive meanwhile."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def copy_bandwidth_tbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e9


def saved_activation_bytes(step: Callable[[], object]) -> tuple[int, object]:
    """``(bytes, step())``: the bytes of the distinct storages autograd saves for backward while
    ``step()`` runs forward (parameters excluded; a Float8BlockwiseQTensor counts its data and scales),
    the activation memory a block keeps until its backward, and what ``step`` returned."""
    seen: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, nn.Parameter):
            for s in _storages(t):
                seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    return sum(seen.values()), out


def _storages(t: torch.Tensor) -> list:
    if isinstance(t, Float8BlockwiseQTensor):  # its data and scales, not the wrapper
        parts = (t.rowwise_data, t.rowwise_scale_inv, t.columnwise_data, t.columnwise_scale_inv)
        return [p.untyped_storage() for p in parts if p is not None]
    return [t.untyped_storage()]


def start(description: str, sweep_help: str | None = None):
    """Parse the command line and measure the ceilings: ``(args, env, ceilings, copy_tbps)``.

    ``sweep_help``: offer ``--sweep`` (launch-shape sweep) with this help text.
    """
    parser = argparse.ArgumentParser(description=description)
    if sweep_help:
        parser.add_argument("--sweep", action="store_true", help=sweep_help)
    return (parser.parse_args(), *measure_machine())


def measure_machine():
    """``(env, ceilings, copy_tbps)``: the environment and the copy-bandwidth ceiling (printed)."""
    env = environment()
    copy_tbps = copy_bandwidth_tbps()
    ceilings = {"copy_bandwidth_tbps (1 GiB, read+write)": copy_tbps}
    print(env, ceilings)
    return env, ceilings, copy_tbps


def environment(device: Optional[dict] = None) -> dict:
    """Device and software facts recorded with every result. ``device``: the device's facts when the caller
    has them without torch's CUDA (a process that launches GPU runs holds no CUDA context beside them)."""
    if device is None:
        props = torch.cuda.get_device_properties(0)
        device = {"device": props.name, "sms": props.multi_processor_count}
    import triton

    return {
        **device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "transformer_engine": transformer_engine_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def transformer_engine_version() -> str:
    """TransformerEngine's installed version, without importing it ("not installed" when absent)."""
    try:
        return importlib.metadata.version("transformer_engine")
    except importlib.metadata.PackageNotFoundError:
        return "importable, no package metadata" if importlib.util.find_spec("transformer_engine") else "not installed"


def markdown_table(rows: Sequence[dict], columns: Sequence[str], formats: Optional[dict] = None) -> str:
    """A GitHub markdown table of ``rows`` restricted to ``columns``: floats to 3 significant digits, or
    with ``formats[column]`` (a format spec, e.g. ``".4f"``); a list's items so, joined by " / "."""

    def fmt(v, c):
        if isinstance(v, (list, tuple)):
            return " / ".join(fmt(x, c) for x in v)
        return f"{v:{(formats or {}).get(c, '.3g')}}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, ""), c) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(name: str, title: str, env: dict, ceilings: dict, rows: Sequence, columns: Sequence[str],
                  notes: str = "", formats: Optional[dict] = None, group_by: Optional[str] = None) -> pathlib.Path:
    """Write ``<name>.json`` and ``<name>.md`` under benchmarks/results (``formats``: ``markdown_table``'s);
    return the markdown path. ``group_by``: the markdown has one table per value of that key, each with the
    ``columns`` its rows have."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    rows = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r) for r in rows]
    (RESULTS_DIR / f"{name}.json").write_text(
        json.dumps({"environment": env, "ceilings": ceilings, "results": rows}, indent=2) + "\n"
    )
    md = [f"# {title}", ""]
    md += [f"- {k}: {v}" for k, v in env.items()]
    md += [f"- {k}: {v:.3g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in ceilings.items()]
    if group_by is None:
        md += ["", markdown_table(rows, columns, formats), ""]
    for value in dict.fromkeys(r.get(group_by) for r in rows) if group_by else ():
        group = [r for r in rows if r.get(group_by) == value]
        present = [c for c in columns if any(c in r for r in group)]
        md += ["", f"## {group_by}: {value}", "", markdown_table(group, present, formats), ""]
    if notes:
        md += [notes.strip(), ""]
    path = RESULTS_DIR / f"{name}.md"
    path.write_text("\n".join(md))
    return path


def merge_stored(name: str, key: str, rows: Sequence[dict], env: dict, default: str) -> tuple[list[dict], dict]:
    """``(rows kept, env)`` for a run that measured ``rows`` at some values of ``key`` (a shape, a config):
    the rows of the stored ``<name>.json`` at other values of ``key`` (a stored row without ``key`` is at
    ``default``: written before ``key`` was recorded), then ``rows``; ``env`` with ``runs``, the device and date
    of the rows at each value, and ``run_settings``: for a kept value, what its run's environment said that this
    one does not (a rows run's processes and GPU states, which ``env`` no longer describes)."""
    stored, kept, runs, settings = RESULTS_DIR / f"{name}.json", [], {}, {}
    values = {r[key] for r in rows}
    if stored.exists():
        old = json.loads(stored.read_text())
        kept = [r for r in (dict(r, **{key: r.get(key, default)}) for r in old["results"]) if r[key] not in values]
        old_env = old["environment"]
        own = f"{old_env['device']}, {old_env['date']}"
        for v in dict.fromkeys(r[key] for r in kept):
            runs[v] = old_env.get("runs", {}).get(v, own)
            said = (old_env.get("run_settings", {}).get(v) if runs[v] != own else
                    {k: x for k, x in old_env.items()
                     if k not in ("runs", "run_settings", "device", "date") and env.get(k) != x})
            if said:
                settings[v] = said
    runs.update({v: f"{env['device']}, {env['date']}" for v in dict.fromkeys(r[key] for r in rows)})
    return kept + list(rows), dict(env, runs=runs, **({"run_settings": settings} if settings else {}))


# ---------------------------------------------------------------- expert parallelism (bench_dispatch, bench_ep_scaling)
def ep_parser(description: str) -> argparse.ArgumentParser:
    """``--cpu`` (gloo on CPU processes, toy sizes) and ``--world N`` (its EP size)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU processes (toy sizes)")
    parser.add_argument("--world", type=int, default=4, help="with --cpu: the EP size")
    return parser


def free_port() -> int:
    """A TCP port free now on 127.0.0.1, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ep_run(worker: Callable, args, *worker_args):
    """Run ``worker(rank, world, cpu, *worker_args)`` on every EP rank, one process each: every visible GPU
    (NCCL), or ``args.world`` CPU processes (gloo) with ``args.cpu``. Returns ``(what rank 0's worker
    returned, env, ceilings, world, file suffix)``."""
    if args.cpu:
        env, ceilings, world = {"device": "CPU (gloo)", "torch": torch.__version__}, {}, args.world
    else:
        env, ceilings, _ = measure_machine()  # the script parsed its own command line
        world = torch.cuda.device_count()
    env["ep_size"] = world
    port = free_port()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_ep_process, args=(world, port, queue, worker, args.cpu, worker_args), nprocs=world, join=True)
    return queue.get(), env, ceilings, world, "_cpu" if args.cpu else ""


def _ep_process(rank, world, port, queue, worker, cpu, worker_args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cpu:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    out = worker(rank, world, cpu, *worker_args)
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def ep_device(rank: int, cpu: bool) -> torch.device:
    return torch.device("cpu") if cpu else torch.device("cuda", rank)


def ep_timed(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` barrier-aligned calls (wall clock, synchronized)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def routing(tokens: int, experts: int, topk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random router: ``(topk_ids [T, k] int64, topk_probs [T, k] float32 summing to 1)``."""
    probs, ids = torch.softmax(torch.randn(tokens, experts, device=device), -1).topk(topk)
    return ids, probs / probs.sum(1, keepdim=True)


def ddp_main_grad_hooks(module: nn.Module) -> list:
    """Megatron DDP's gradient contract on ``module``'s parameters, without DDP: each gets a float32 ``main_grad``
    of zeros and ``grad_added_to_main_grad = False``, and a hook after autograd's accumulation that adds ``.grad``
    into ``main_grad`` unless ``grad_added_to_main_grad`` is set (a fused wgrad wrote there), then drops ``.grad``,
    as DDP's backward hook does. Returns the list each firing appends its parameter's name to (the name, not the
    parameter: a hook holding its own parameter is a cycle through autograd that Python's gc cannot free, and
    kept every benchmarked block's weights alive to the process's end)."""
    fired = []

    def hook_for(name):
        def hook(p):
            fired.append(name)
            if not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad)
            p.grad = None
        return hook

    for name, p in module.named_parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False
        p.register_post_accumulate_grad_hook(hook_for(name))
    return fired


@contextlib.contextmanager
def without_deepgemm():
    """Within: the package finds no DeepGEMM module, as where it is not installed, so ``auto`` runs fprop/dgrad
    and wgrad on cuBLAS where it pays, else Gluon or Triton (``ops.grouped_gemm.AUTO_ORDER``; issue 39's user
    without DeepGEMM)."""
    found = grouped_gemm_deepgemm._module
    grouped_gemm_deepgemm._module = lambda: None
    try:
        yield
    finally:
        grouped_gemm_deepgemm._module = found


def busy_host_ms(fn: Callable[[], object], reps: int = 3) -> float:
    """Host milliseconds of one ``fn()`` issued while the GPU is busy behind a queued sleep, so that no launch
    waits for the GPU: what the call costs the CPU (a step whose host time exceeds its GPU time waits on it)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock cycles
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - began
    torch.cuda.synchronize()
    return elapsed / reps * 1e3
