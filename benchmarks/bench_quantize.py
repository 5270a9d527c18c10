"""Blockwise FP8 quantization (1x128, bf16 -> E4M3) on the GPU.

Compares the Triton kernels with the device-to-device copy bandwidth and with
the plain-PyTorch reference (eager and ``torch.compile``d), all measured in
this run. Bytes counted: read 2/elt, write 1/elt plus 4 bytes per 128-block
scale (per copy; the columnwise copy reads the input again: 2 more bytes per
element). ``--sweep`` also times every launch shape of the rowwise kernel and
writes ``bench_quantize_sweep``.

Run on a GPU: ``python benchmarks/bench_quantize.py [--sweep]``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from transformer_engine_moe.kernels import quantize as kq
from transformer_engine_moe.reference import quantize as ref

import utils

FP8 = torch.float8_e4m3fn
SHAPES = [(65536, 7168), (32768, 4096)]


@dataclass(frozen=True)
class ExperimentConfig:
    m: int
    k: int
    columnwise: bool  # also produce the 128x1 columnwise copy


@dataclass(frozen=True)
class ExperimentResult:
    shape: str
    usages: str
    mbytes: float
    triton_us: float
    triton_tbps: float
    pct_of_copy: float
    compiled_ref_us: float
    eager_ref_us: float
    speedup_vs_compiled: float


def get_configs() -> list[ExperimentConfig]:
    return [ExperimentConfig(m, k, c) for (m, k), c in itertools.product(SHAPES, (False, True))]


def bytes_moved(m: int, k: int, columnwise: bool) -> int:
    nkb, nmb = -(-k // 128), -(-m // 128)
    total = 2 * m * k + m * k + 4 * m * nkb
    if columnwise:  # a second kernel: reads x again
        total += 3 * m * k + 4 * k * nmb
    return total


def _reference(x, columnwise):
    out = ref.quantize_1x128(x, FP8)
    return (out, ref.quantize_128x1(x, FP8)) if columnwise else out


def _kernels(x, columnwise):
    out = kq.quantize_1x128(x, FP8, True, 0.0)
    return (out, kq.quantize_128x1(x, FP8, True, 0.0)) if columnwise else out


_compiled_reference = torch.compile(_reference, dynamic=False)


def check_bitwise(x: torch.Tensor, columnwise: bool) -> None:
    got, want = _kernels(x, columnwise), _reference(x, columnwise)
    for (q, s), (rq, rs) in zip(got, want) if columnwise else [(got, want)]:
        assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def run_experiment(cfg: ExperimentConfig, copy_tbps: float) -> ExperimentResult:
    x = torch.randn(cfg.m, cfg.k, device="cuda", dtype=torch.bfloat16)
    check_bitwise(x, cfg.columnwise)
    nbytes = bytes_moved(cfg.m, cfg.k, cfg.columnwise)
    t_triton = utils.time_ms(lambda: _kernels(x, cfg.columnwise))
    try:
        t_compiled = utils.time_ms(lambda: _compiled_reference(x, cfg.columnwise))
    except Exception as e:  # report the baseline as missing rather than lose the run
        print(f"torch.compile'd reference failed at {cfg}: {type(e).__name__}: {e}")
        t_compiled = float("nan")
    t_eager = utils.time_ms(lambda: _reference(x, cfg.columnwise))
    tbps = nbytes / t_triton / 1e9
    return ExperimentResult(
        shape=f"{cfg.m}x{cfg.k}",
        usages="rowwise+columnwise" if cfg.columnwise else "rowwise",
        mbytes=nbytes / 1e6,
        triton_us=t_triton * 1e3,
        triton_tbps=tbps,
        pct_of_copy=100 * tbps / copy_tbps,
        compiled_ref_us=t_compiled * 1e3,
        eager_ref_us=t_eager * 1e3,
        speedup_vs_compiled=t_compiled / t_triton,
    )


def sweep(copy_tbps: float) -> list[dict]:
    """Time every rowwise launch shape (BLOCK_M, K_BLOCKS, num_warps) at each benchmark shape:
    "flat" on a contiguous input (the launcher's [M*K/128, 128] view), "2d" on rows 128
    elements longer than K (the 2-D tiling that ragged K and strided rows use)."""
    rows = []
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        strided = torch.randn(m, k + 128, device="cuda", dtype=torch.bfloat16)[:, :k]
        nbytes = bytes_moved(m, k, False)
        for view, cfg in itertools.product(("2d", "flat"), itertools.product((8, 16, 32, 64), (1, 2, 4), (2, 4, 8))):
            if cfg[0] * cfg[1] > 128 or (view == "flat" and cfg[1] > 1):
                continue
            xv = strided if view == "2d" else x
            t = utils.time_ms(lambda: kq.quantize_1x128(xv, FP8, True, 0.0, config=cfg), 25, 100)
            tbps = nbytes / t / 1e9
            rows.append(dict(shape=f"{m}x{k}", view=view, block_m=cfg[0], k_blocks=cfg[1],
                             num_warps=cfg[2], us=t * 1e3, tbps=tbps, pct_of_copy=100 * tbps / copy_tbps))
    return rows


def main():
    args, env, ceilings, copy_tbps = utils.start(__doc__.splitlines()[0], "also sweep the rowwise launch shapes")
    if args.sweep:
        rows = sweep(copy_tbps)
        best = {}
        for r in rows:
            if r["shape"] not in best or r["us"] < best[r["shape"]]["us"]:
                best[r["shape"]] = r
        path = utils.write_results(
            "bench_quantize_sweep", "Rowwise 1x128 quantization: launch-shape sweep", env, ceilings,
            rows, ["shape", "view", "block_m", "k_blocks", "num_warps", "us", "tbps", "pct_of_copy"],
            notes="Best per shape: " + "; ".join(
                f"{s}: {r['view']} {r['block_m']}x{r['k_blocks']} blocks, {r['num_warps']} warps, {r['us']:.1f} us"
                for s, r in best.items()),
        )
        print(path.read_text())
    results = [run_experiment(cfg, copy_tbps) for cfg in get_configs()]
    path = utils.write_results(
        "bench_quantize",
        "Blockwise FP8 quantization (bf16 -> E4M3, pow2 scales)",
        env,
        ceilings,
        results,
        [f.name for f in ExperimentResult.__dataclass_fields__.values()],
        notes=(
            f"Launch shapes: rowwise {kq.FLAT_CONFIG} (BLOCK_M, K_BLOCKS, num_warps) on the flat "
            f"[M*K/128, 128] view; the columnwise copy is a second kernel, 128x1 blocks, "
            f"{kq.COLWISE_CONFIG} (BLOCK_K, num_warps). Kernel output checked bitwise against the "
            "reference before timing. Target (rowwise): >= 90% of the copy bandwidth."
        ),
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
