"""Grouped blockwise-FP8 GEMMs (fprop, dgrad, wgrad) and GroupedLinear forward+backward on the GPU.

DeepSeek-V3 expert shapes: fc1 7168 -> 2*2048 and fc2 2048 -> 7168 over 65536 routed tokens, 8 or 32
experts, equal splits. Backends: our Triton kernels (device-tensor splits: no host sync), cuBLAS blockwise
``torch._scaled_mm`` per expert (host splits), and BF16 ``torch._grouped_mm`` as the baseline; ceilings
are dense GEMMs of the same total size measured in this run. Each FP8 result is checked against the
float32 reference before timing.

Run on a GPU: ``python benchmarks/bench_grouped_gemm.py [--sweep]``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from transformer_engine_moe import quantize_blockwise, scaling_aware_transpose
from transformer_engine_moe.kernels import grouped_gemm as kg
from transformer_engine_moe.module import GroupedLinear
from transformer_engine_moe.ops.grouped_gemm import grouped_gemm, grouped_gemm_wgrad, transpose_grouped_weight

import utils

SHAPES = [(8, 65536, 4096, 7168), (8, 65536, 7168, 2048), (32, 65536, 4096, 7168)]  # (experts, M, N, K)


@dataclass(frozen=True)
class ExperimentResult:
    shape: str
    op: str
    triton_tflops: float
    cublas_tflops: float
    bf16_tflops: float
    cublas_over_triton: float
    best_fp8_over_bf16: float


def relerr(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ceilings(m, n, k):
    """Dense TFLOP/s of one M x N x K GEMM: BF16 and cuBLAS blockwise FP8 (1x128 x 128x128)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    aq, bq = quantize_blockwise(a), quantize_blockwise(b, "128x128")
    sa = aq.rowwise_scale_inv.t().contiguous().t()
    fp8 = lambda: torch._scaled_mm(aq.rowwise_data, bq.rowwise_data.t(), sa, bq.rowwise_scale_inv.t(),
                                   out_dtype=torch.bfloat16)
    flops = 2 * m * n * k
    return flops / utils.time_ms(lambda: a @ b.t()) / 1e9, flops / utils.time_ms(fp8) / 1e9


def run(e, m, n, k) -> list[ExperimentResult]:
    splits = [m // e] * e
    st = torch.tensor(splits, device="cuda", dtype=torch.int32)
    offs = st.cumsum(0).to(torch.int32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    xq, dyq = quantize_blockwise(x), quantize_blockwise(dy)
    w = quantize_blockwise(wb.view(-1, k), "128x128").view(e, n, k)
    wt = transpose_grouped_weight(w)
    xt_l, dyt_l = scaling_aware_transpose(xq, splits), scaling_aware_transpose(dyq, splits)
    xt_t, dyt_t = scaling_aware_transpose(xq, st), scaling_aware_transpose(dyq, st)
    ops = {
        "fprop": (lambda: grouped_gemm(xq, w, st, backend="triton"),
                  lambda: grouped_gemm(xq, w, splits, backend="cublas"),
                  lambda: torch._grouped_mm(x, wb.transpose(1, 2), offs=offs),
                  lambda: grouped_gemm(xq, w, splits, out_dtype=torch.float32, backend="reference")),
        "dgrad": (lambda: grouped_gemm(dyq, wt, st, backend="triton"),
                  lambda: grouped_gemm(dyq, wt, splits, backend="cublas"),
                  lambda: torch._grouped_mm(dy, wb, offs=offs),
                  lambda: grouped_gemm(dyq, wt, splits, out_dtype=torch.float32, backend="reference")),
        "wgrad": (lambda: grouped_gemm_wgrad(dyt_t, xt_t, st, backend="triton"),
                  lambda: grouped_gemm_wgrad(dyt_l, xt_l, splits, backend="cublas"),
                  lambda: torch._grouped_mm(dy.t(), x, offs=offs),
                  lambda: grouped_gemm_wgrad(dyt_l, xt_l, splits, backend="reference")),
    }
    flops = 2 * m * n * k
    rows = []
    for op, (tri, cub, bf16, ref) in ops.items():
        r = ref()
        assert relerr(tri(), r) < 2e-3 and relerr(cub(), r) < 2e-3, op
        t_tri, t_cub, t_bf = (utils.time_ms(f) for f in (tri, cub, bf16))
        rows.append(ExperimentResult(f"E={e} {m}x{n}x{k}", op, flops / t_tri / 1e9, flops / t_cub / 1e9,
                                     flops / t_bf / 1e9, t_tri / t_cub, t_bf / min(t_tri, t_cub)))
    return rows


def module_step(e, m, n, k) -> list[dict]:
    """GroupedLinear forward+backward (FP8: host splits -> cuBLAS, device splits -> Triton) vs BF16 grouped_mm."""
    splits = [m // e] * e
    st = torch.tensor(splits, device="cuda")
    offs = st.cumsum(0).to(torch.int32)
    gl = GroupedLinear(e, k, n, device="cuda")
    wb = torch.stack([w.detach() for w in gl.weights]).requires_grad_()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    xq = quantize_blockwise(x.detach())

    def fp8(s, inp):
        return lambda: gl(inp, s).backward(dy)

    bf16 = lambda: torch._grouped_mm(x, wb.transpose(1, 2), offs=offs).backward(dy)
    times = {name: utils.time_ms(f) for name, f in (
        ("fp8_host_splits", fp8(splits, x)), ("fp8_device_splits", fp8(st, x)),
        ("fp8_input_host_splits", fp8(splits, xq)), ("bf16_grouped_mm", bf16))}
    return [dict(shape=f"E={e} {m}x{n}x{k}", path=name, ms=t, tflops=3 * 2 * m * n * k / t / 1e9,
                 speedup_over_bf16=times["bf16_grouped_mm"] / t) for name, t in times.items()]


def sweep() -> list[dict]:
    e, m, n, k = SHAPES[0]
    st = torch.tensor([m // e] * e, device="cuda")
    xq = quantize_blockwise(torch.randn(m, k, device="cuda"))
    w = quantize_blockwise(torch.randn(e * n, k, device="cuda"), "128x128").view(e, n, k)
    rows = []
    for cfg in itertools.product((64, 128), (4, 8, 16), (4, 8), (3, 4)):
        try:
            t = utils.time_ms(lambda: kg.grouped_gemm(xq.rowwise_data, xq.rowwise_scale_inv, w.rowwise_data.view(
                e, n, k), w.rowwise_scale_inv.view(e, n // 128, k // 128), st, config=cfg), 20, 100)
            rows.append(dict(config=str(cfg), tflops=2 * m * n * k / t / 1e9))
        except Exception as exc:  # out of shared memory for the larger tiles
            rows.append(dict(config=str(cfg), tflops=type(exc).__name__))
    return rows


def main():
    args, env, ceil, _ = utils.start(__doc__.splitlines()[0], "also sweep the fprop kernel's launch shapes")
    bf16_tf, fp8_tf = ceilings(16384, 4096, 7168)
    ceil.update({"dense bf16 16384x4096x7168 TFLOP/s": bf16_tf, "dense cuBLAS blockwise FP8 same TFLOP/s": fp8_tf})
    if args.sweep:
        path = utils.write_results("bench_grouped_gemm_sweep", "Triton grouped FP8 fprop: launch-shape sweep", env,
                                   ceil, sweep(), ["config", "tflops"],
                                   notes="config: (BLOCK_N, GROUP_M, num_warps, num_stages), E=8 65536x4096x7168.")
        print(path.read_text())
    results = [r for shape in SHAPES for r in run(*shape)]
    path = utils.write_results(
        "bench_grouped_gemm", "Grouped blockwise FP8 GEMMs (TFLOP/s)", env, ceil, results,
        list(ExperimentResult.__dataclass_fields__),
        notes=(f"Triton launch shapes: fprop/dgrad {kg.GEMM_CONFIG} (BLOCK_N, GROUP_M, warps, stages), wgrad "
               f"{kg.WGRAD_CONFIG} (BLOCK_N, BLOCK_K, warps, stages). cuBLAS: one torch._scaled_mm per expert. "
               "BF16: torch._grouped_mm. Every FP8 output checked against the float32 reference first."),
    )
    print(path.read_text())
    rows = [r for shape in SHAPES[:2] for r in module_step(*shape)]
    path = utils.write_results("bench_grouped_linear", "GroupedLinear forward+backward", env, ceil, rows,
                               ["shape", "path", "ms", "tflops", "speedup_over_bf16"],
                               notes="tflops counts 3 GEMMs (fprop, dgrad, wgrad). FP8 includes quantizing "
                                     "dY and X (if BF16), both scaling-aware transposes, and quantizing the "
                                     "weights 128x128 (and W^T) every call, as with one micro-batch per step.")
    print(path.read_text())


if __name__ == "__main__":
    main()
