"""Shared scaffold for the microbenchmarks: timing, the copy-bandwidth ceiling, saved-activation bytes,
result files, and the expert-parallel runs (one process per GPU, or gloo on CPU processes).

Every benchmark measures its baselines in the same run, reports bytes/FLOPs
over time against ceilings measured on the same device, and writes
``benchmarks/results/<name>.json`` and ``<name>.md`` (device, date, shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import socket
import statistics
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from transformer_engine_moe import Float8BlockwiseQTensor

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def time_ms(fn: Callable[[], object], warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median device time of ``fn`` in milliseconds (CUDA events via triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


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
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def markdown_table(rows: Sequence[dict], columns: Sequence[str], formats: Optional[dict] = None) -> str:
    """A GitHub markdown table of ``rows`` restricted to ``columns``: floats to 3 significant digits, or
    with ``formats[column]`` (a format spec, e.g. ``".4f"``)."""

    def fmt(v, c):
        return f"{v:{(formats or {}).get(c, '.3g')}}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, ""), c) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(name: str, title: str, env: dict, ceilings: dict, rows: Sequence, columns: Sequence[str],
                  notes: str = "", formats: Optional[dict] = None) -> pathlib.Path:
    """Write ``<name>.json`` and ``<name>.md`` under benchmarks/results (``formats``: ``markdown_table``'s);
    return the markdown path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    rows = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r) for r in rows]
    (RESULTS_DIR / f"{name}.json").write_text(
        json.dumps({"environment": env, "ceilings": ceilings, "results": rows}, indent=2) + "\n"
    )
    md = [f"# {title}", ""]
    md += [f"- {k}: {v}" for k, v in env.items()]
    md += [f"- {k}: {v:.3g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in ceilings.items()]
    md += ["", markdown_table(rows, columns, formats), ""]
    if notes:
        md += [notes.strip(), ""]
    path = RESULTS_DIR / f"{name}.md"
    path.write_text("\n".join(md))
    return path


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
