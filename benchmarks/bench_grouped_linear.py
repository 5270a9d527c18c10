"""GroupedLinear forward+backward (FP8) vs BF16 ``torch._grouped_mm`` autograd, on the GPU.

DeepSeek-V3 expert shapes, fc1 7168 -> 2*2048 and fc2 2048 -> 7168, over 65536 routed rows and 8 or 64
experts, equal splits. FP8 paths: BF16 input with host splits (``backend="auto"``), with device-tensor
splits (Triton, no host sync), and an FP8 input (as inside FP8-Flow). Each step quantizes the weights
(W and W^T, one kernel) as a step's first micro-batch does, quantizes dY, and makes both scaling-aware
transposes.

Run on a GPU: ``python benchmarks/bench_grouped_linear.py``.
"""

from __future__ import annotations

import torch

from transformer_engine_moe import quantize_blockwise
from transformer_engine_moe.module import GroupedLinear

import utils

SHAPES = [(8, 65536, 4096, 7168), (8, 65536, 7168, 2048), (64, 65536, 4096, 7168)]  # (experts, M, N, K)


def step(e, m, n, k) -> list[dict]:
    splits = [m // e] * e
    st = torch.tensor(splits, device="cuda")
    offs = st.cumsum(0).to(torch.int32)
    gl = GroupedLinear(e, k, n, device="cuda")
    wb = torch.stack([w.detach() for w in gl.weights]).requires_grad_()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    xq = quantize_blockwise(x.detach())

    def fp8(s, inp):
        return lambda: gl(inp, s, is_first_microbatch=True).backward(dy)

    bf16 = lambda: torch._grouped_mm(x, wb.transpose(1, 2), offs=offs).backward(dy)
    times = {}
    for name, f in (("fp8_host_splits", fp8(splits, x)), ("fp8_device_splits", fp8(st, x)),
                    ("fp8_input_host_splits", fp8(splits, xq)), ("bf16_grouped_mm", bf16)):
        f()
        torch.cuda.synchronize()
        times[name] = utils.time_ms(f)
    return [dict(shape=f"E={e} {m}x{n}x{k}", path=name, ms=t, tflops=3 * 2 * m * n * k / t / 1e9,
                 speedup_over_bf16=times["bf16_grouped_mm"] / t) for name, t in times.items()]


def main():
    _, env, ceil, _ = utils.start(__doc__.splitlines()[0])
    rows = [r for shape in SHAPES for r in step(*shape)]
    path = utils.write_results("bench_grouped_linear", "GroupedLinear forward+backward", env, ceil, rows,
                               ["shape", "path", "ms", "tflops", "speedup_over_bf16"],
                               notes="tflops counts 3 GEMMs (fprop, dgrad, wgrad). FP8 includes quantizing "
                                     "dY and X (if BF16), both scaling-aware transposes, and quantizing the "
                                     "weights 128x128 (W and W^T) every step.")
    print(path.read_text())


if __name__ == "__main__":
    main()
