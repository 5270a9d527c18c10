"""A Megatron pretrain run's output, parsed: what ``examples.demo`` and ``benchmarks/bench_megatron_pretrain.py``
read of it.

- ``iterations``: Megatron's ``training_log`` line per logged iteration (`` iteration N/ M | ... | elapsed time per
  iteration (ms): T | ... | global batch size: B | lm loss: L |``): N, T, B (None where the line has none), L;
- ``max_allocated_mib``: the most of Megatron's ``report_memory`` lines' ``max allocated: MiB``;
- ``allocator_reports``: ``examples.pretrain_gpt``'s line per rank after training, ``allocator (rank R): retries
  N, reserved peak P MiB``;
- ``experts_line``: ``examples.expert_path``'s ``experts: ...`` line, the first.
"""

from __future__ import annotations

import re
from typing import NamedTuple

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+) "
                       r"(?:.*global batch size:\s*(\d+) )?.*lm loss: ([\d.E+-]+)")
MAX_ALLOCATED = re.compile(r"max allocated: ([\d.]+)")
ALLOCATOR = re.compile(r"allocator \(rank (\d+)\): retries (\d+), reserved peak ([\d.]+) MiB")


class Iteration(NamedTuple):
    iteration: int
    ms: float  # elapsed time per iteration
    global_batch_size: int | None
    loss: float  # lm loss


class AllocatorReport(NamedTuple):
    rank: int
    retries: int
    reserved_peak_mib: float


def iterations(text: str) -> list[Iteration]:
    """Every iteration line of ``text``, in order."""
    return [Iteration(int(i), float(ms), int(gbs) if gbs else None, float(loss))
            for i, ms, gbs, loss in ITERATION.findall(text)]


def max_allocated_mib(text: str) -> float | None:
    """The largest ``max allocated`` (MiB) of ``text``'s memory reports; None without one."""
    return max(map(float, MAX_ALLOCATED.findall(text)), default=None)


def allocator_reports(text: str) -> list[AllocatorReport]:
    """Every allocator line of ``text``, in order."""
    return [AllocatorReport(int(rank), int(retries), float(mib)) for rank, retries, mib in ALLOCATOR.findall(text)]


def experts_line(text: str) -> str | None:
    """The first line of ``text`` that starts (after white space) with ``experts: ``, stripped; None without one."""
    return next((line.strip() for line in text.splitlines() if line.strip().startswith("experts: ")), None)
