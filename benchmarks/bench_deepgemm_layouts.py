"""Which kernel layout DeepGEMM's JIT picks for a grouped fprop/dgrad, per total rows M: the data behind
``kernels/grouped_gemm_deepgemm.MIN_ROWS``.

DeepGEMM (SM90) chooses a layout (block_n, cluster, stages) for each ``m_grouped_fp8_gemm_nt_contiguous`` call
from its shape, M included, and compiles each layout it meets first (seconds of NVCC). This sweeps M (every
multiple of 128 up to 65536, then steps of 1.25x up to ``--max-rows``) for each (N, K, groups) of the Megatron
configurations' experts (fc1, fc2 and their dgrads), calling DeepGEMM directly (not through the package, which
pads small calls) with every row in a weightless group (``m_indices`` -1: MMAs skipped, the choice is made on the
host), and reads the choice from ``DG_PRINT_CONFIGS``. One process per shape, run in parallel (NVCC is CPU work).

Output ``benchmarks/results/bench_deepgemm_layouts.{json,md}``: per shape, each layout with the M range it was picked
for, and ``settled_from``: the smallest swept M from which every larger one gets the largest M's layout.

    python benchmarks/bench_deepgemm_layouts.py [--max-rows 524288] [--jobs 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile

import utils
from megatron_configs import CONFIGS

LINE = re.compile(r"^GemmDesc\(gemm_type=1, .*?m=(\d+), n=(\d+), k=(\d+), num_groups=(\d+).*?\): (GemmConfig\(.*?)"
                  r", LayoutInfo\(")


def expert_shapes(groups=(32,)) -> list:
    """``(N, K, G)`` of every grouped fprop/dgrad of the configurations' experts: fc1 ``[2F, H]``, fc2 ``[H, F]``,
    and their transposes (dgrad)."""
    shapes = set()
    for config in CONFIGS.values():
        h, f = config.hidden, config.ffn
        for g in groups:
            shapes |= {(2 * f, h, g), (h, f, g), (h, 2 * f, g), (f, h, g)}
    return sorted(shapes)


def sweep_rows(max_rows: int) -> list:
    rows = list(range(128, 65536 + 1, 128))
    while rows[-1] < max_rows:
        rows.append(min(max_rows, -(-int(rows[-1] * 1.25) // 128) * 128))
    return rows


def one(n: int, k: int, groups: int, max_rows: int) -> None:
    """In a child process: call DeepGEMM at every swept M for one shape; DG_PRINT_CONFIGS goes to stdout."""
    import deep_gemm
    import torch

    rows = sweep_rows(max_rows)
    m = rows[-1]
    a = torch.zeros(m, k, dtype=torch.float8_e4m3fn, device="cuda")
    sa = torch.ones(m, k // 128, device="cuda")
    b = torch.zeros(groups, n, k, dtype=torch.float8_e4m3fn, device="cuda")
    sb = torch.ones(groups, n // 128, k // 128, device="cuda")
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    idx = torch.full((m,), -1, dtype=torch.int32, device="cuda")
    for r in rows:
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a[:r], sa[:r]), (b, sb), d[:r], idx[:r])
    torch.cuda.synchronize()


def run_shape(shape: tuple, max_rows: int) -> dict:
    n, k, g = shape
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.run([sys.executable, __file__, "--one", str(n), str(k), str(g), "--max-rows", str(max_rows)],
                              stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, DG_PRINT_CONFIGS="1"))
        log.seek(0)
        text = log.read()
    picked = {int(mm.group(1)): mm.group(5) for mm in map(LINE.match, text.splitlines()) if mm}
    row = {"n": n, "k": k, "groups": g, "rc": proc.returncode}
    if proc.returncode or not picked:
        return dict(row, error=text[-2000:])
    ms = sorted(picked)
    last = picked[ms[-1]]
    settled = next(m for i, m in enumerate(ms) if all(picked[x] == last for x in ms[i:]))
    layouts = {}
    for m in ms:
        layouts.setdefault(picked[m], []).append(m)
    return dict(row, swept=len(ms), max_rows=ms[-1], settled_from=settled,
                layouts=[{"config": c, "rows_min": min(v), "rows_max": max(v), "calls": len(v)}
                         for c, v in sorted(layouts.items(), key=lambda kv: -max(kv[1]))])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rows", type=int, default=524288)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--one", nargs=3, type=int, metavar=("N", "K", "G"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return one(*args.one, args.max_rows)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda s: run_shape(s, args.max_rows), expert_shapes()))
    env = utils.environment()
    for r in rows:
        r["layouts_md"] = "<br>".join(f"{x['rows_min']}-{x['rows_max']}: {layout(x['config'])}"
                                      for x in r.get("layouts", ()))
    path = utils.write_results(
        "bench_deepgemm_layouts", "DeepGEMM's layout per total rows M (grouped fprop/dgrad)", env, {}, rows,
        ["n", "k", "groups", "settled_from", "layouts_md", "rc"],
        notes="`settled_from`: the smallest swept M (rows) from which every larger M gets the largest M's layout. "
              "Every row weightless (`m_indices` -1); M every 128 rows to 65536, then steps of 1.25x.")
    print(path.read_text())


def layout(config: str) -> str:
    """The layout and pipeline fields of a printed GemmConfig (block sizes, cluster, stages)."""
    fields = re.findall(r"\b(block_n|cluster_m|cluster_n|swap_ab|num_stages|stages)=(\d+)", config)
    return " ".join(f"{k}={v}" for k, v in fields) or config[:120]

if __name__ == "__main__":
    main()
