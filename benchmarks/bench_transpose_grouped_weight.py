"""Grouped 128x128 FP8 weight transpose ``[G, N, K] -> [G, K, N]`` (dgrad's operand) on the GPU.

The Triton byte transpose against ``torch``'s ``transpose(1, 2).contiguous()`` (the reference path,
which the module used before) and the device-to-device copy bandwidth, all in this run, at the
DeepSeek-V3 expert shapes (fc1 ``[G, 4096, 7168]``, fc2 ``[G, 7168, 2048]``). Bytes counted: the FP8
data read and written. Also sweeps the kernel's launch shapes at the first shape.

Run on a GPU: ``python benchmarks/bench_transpose_grouped_weight.py``.
"""

from __future__ import annotations

import itertools

import torch

from transformer_engine_moe.kernels import transpose as kt
from transformer_engine_moe.reference import transpose as ref

import utils

SHAPES = [(32, 4096, 7168), (32, 7168, 2048), (8, 4096, 7168)]


def weights(g: int, n: int, k: int):
    data = torch.randint(0, 256, (g, n, k), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    return data, torch.rand(g, n // 128, k // 128, device="cuda")


def main():
    _, env, ceilings, copy_tbps = utils.start(__doc__.splitlines()[0])
    rows = []
    for g, n, k in SHAPES:
        data, scale = weights(g, n, k)
        out, _ = kt.transpose_128x128(data, scale)
        assert torch.equal(out.view(torch.uint8), ref.transpose_128x128(data, scale)[0].view(torch.uint8))
        t_kernel = utils.time_ms(lambda: kt.transpose_128x128(data, scale))
        t_torch = utils.time_ms(lambda: ref.transpose_128x128(data, scale))
        tbps = 2 * g * n * k / t_kernel / 1e9
        rows.append(dict(shape=f"{g}x{n}x{k}", triton_us=t_kernel * 1e3, tbps=tbps, pct_of_copy=100 * tbps / copy_tbps,
                         torch_us=t_torch * 1e3, speedup_over_torch=t_torch / t_kernel))
        del data, scale, out
    g, n, k = SHAPES[0]
    data, scale = weights(g, n, k)
    sweep = []
    for block, warps in itertools.product((32, 64, 128), (2, 4, 8)):
        t = utils.time_ms(lambda: kt.transpose_128x128(data, scale, config=(block, warps)), 25, 100)
        sweep.append(dict(config=f"BLOCK={block} warps={warps}", us=t * 1e3,
                          pct_of_copy=100 * 2 * g * n * k / t / 1e9 / copy_tbps))
    notes = (f"Launch shape: {kt.BYTE_TRANSPOSE_CONFIG} (BLOCK, warps). Random bytes (every FP8 code). Sweep at "
             f"{g}x{n}x{k}:\n\n" + utils.markdown_table(sweep, ["config", "us", "pct_of_copy"]))
    path = utils.write_results("bench_transpose_grouped_weight", "Grouped 128x128 FP8 weight transpose", env,
                               ceilings, rows, list(rows[0]), notes=notes)
    print(path.read_text())


if __name__ == "__main__":
    main()
