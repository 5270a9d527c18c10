"""Blockwise FP8 dequantization (1x128, E4M3 -> bf16) on the GPU.

Compares the Triton kernel with the device-to-device copy bandwidth and with
the plain-PyTorch reference (eager and ``torch.compile``d), all in this run.
Bytes counted: read 1/elt plus 4 per 128-block scale, write 2/elt.

Run on a GPU: ``python benchmarks/bench_dequantize.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transformer_engine_moe import quantize_blockwise
from transformer_engine_moe.kernels import dequantize as kd
from transformer_engine_moe.reference import dequantize as ref

import utils

SHAPES = [(65536, 7168), (32768, 4096)]


@dataclass(frozen=True)
class ExperimentResult:
    shape: str
    triton_us: float
    triton_tbps: float
    pct_of_copy: float
    compiled_ref_us: float
    eager_ref_us: float
    speedup_vs_compiled: float


_compiled_reference = torch.compile(ref.dequantize_1x128, dynamic=False)


def run_experiment(m: int, k: int, copy_tbps: float) -> ExperimentResult:
    q = quantize_blockwise(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    data, scale = q.rowwise_data, q.rowwise_scale_inv
    assert torch.equal(kd.dequantize_1x128(data, scale, torch.bfloat16),
                       ref.dequantize_1x128(data, scale, torch.bfloat16))
    t = utils.time_ms(lambda: kd.dequantize_1x128(data, scale, torch.bfloat16))
    t_compiled = utils.time_ms(lambda: _compiled_reference(data, scale, torch.bfloat16))
    t_eager = utils.time_ms(lambda: ref.dequantize_1x128(data, scale, torch.bfloat16))
    tbps = (3 * m * k + 4 * m * -(-k // 128)) / t / 1e9
    return ExperimentResult(f"{m}x{k}", t * 1e3, tbps, 100 * tbps / copy_tbps, t_compiled * 1e3,
                            t_eager * 1e3, t_compiled / t)


def main():
    _, env, ceilings, copy_tbps = utils.start(__doc__.splitlines()[0])
    results = [run_experiment(m, k, copy_tbps) for m, k in SHAPES]
    path = utils.write_results(
        "bench_dequantize", "Blockwise FP8 dequantization (E4M3 1x128 -> bf16)", env, ceilings, results,
        list(ExperimentResult.__dataclass_fields__),
        notes=f"Launch shape (BLOCK_M, num_warps) {kd.DEQUANTIZE_CONFIG} on the flat [M*K/128, 128] view; "
              "output checked bitwise against the reference before timing.",
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
