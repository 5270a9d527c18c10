"""Fused weighted SwiGLU + 1x128 FP8 quantization, forward and backward, on the GPU.

Shapes: fc1 outputs ``[65536, 2*2048]``, ``[32768, 2*1536]`` and Qwen3-30B-A3B's ``[131072, 2*768]``
(128 experts x 1024 rows; bf16) with a router prob per row. Compares the fused kernels with the copy
bandwidth and with the unfused path measured in this run: torch's bf16 ``silu(a) * b * probs`` then
our quantize kernel (forward); torch autograd of that bf16 expression (backward, bf16 dx), and that
autograd then our quantize kernel (``backward_fp8``: dx quantized 1x128, what ``FP8FlowMoE`` runs).
Bytes: forward reads x (4F/row) and probs, writes FP8 y (F/row) and scales; backward reads dy (2F),
x (4F), probs, writes dx (4F bf16, or 2F FP8 and scales) and dprobs.

Run on a GPU: ``python benchmarks/bench_swiglu.py [--sweep]`` (the sweep: both passes the block runs, at the
first and the last shape).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from transformer_engine_moe.kernels import quantize as kq
from transformer_engine_moe.kernels import swiglu as ks
from transformer_engine_moe.reference import quantize as ref_quantize
from transformer_engine_moe.reference import swiglu as ref

import utils

FP8 = torch.float8_e4m3fn
SHAPES = [(65536, 2048), (32768, 1536), (131072, 768)]


@dataclass(frozen=True)
class ExperimentResult:
    shape: str
    pass_: str
    fused_us: float
    fused_tbps: float
    pct_of_copy: float
    unfused_us: float
    speedup: float


def forward_bytes(m, f):
    return m * (4 * f + 4) + m * (f + 4 * f // 128)


def backward_bytes(m, f, fp8=False):
    written = 2 * f + 4 * 2 * f // 128 if fp8 else 4 * f
    return m * (2 * f + 4 * f + 4) + m * (written + 4)


def unfused_forward(x, probs):
    f = x.shape[1] // 2
    y = torch.nn.functional.silu(x[:, :f]) * x[:, f:] * probs[:, None].to(x.dtype)
    return kq.quantize_1x128(y, FP8, True, 0.0)


def run(m: int, f: int, copy_tbps: float) -> list[ExperimentResult]:
    x = (torch.randn(m, 2 * f, device="cuda") * 3).to(torch.bfloat16)
    probs = torch.rand(m, device="cuda")
    dy = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    q, s = ks.weighted_swiglu_quant(x, probs, FP8, True)
    rq, rs = ref_quantize.quantize_1x128(ref.weighted_swiglu(x, probs), FP8)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    t_fwd = utils.time_ms(lambda: ks.weighted_swiglu_quant(x, probs, FP8, True))
    t_fwd_unfused = utils.time_ms(lambda: unfused_forward(x, probs))
    t_bwd = utils.time_ms(lambda: ks.weighted_swiglu_backward(dy, x, probs))
    t_bwd_fp8 = utils.time_ms(lambda: ks.weighted_swiglu_backward(dy, x, probs, FP8))
    xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y = torch.nn.functional.silu(xg[:, :f]) * xg[:, f:] * pg[:, None].to(x.dtype)
    t_bwd_unfused = utils.time_ms(lambda: torch.autograd.grad(y, (xg, pg), dy, retain_graph=True))
    t_bwd_fp8_unfused = utils.time_ms(
        lambda: kq.quantize_1x128(torch.autograd.grad(y, (xg, pg), dy, retain_graph=True)[0], FP8, True, 0.0))
    rows = []
    for name, t, tu, nbytes in (("forward", t_fwd, t_fwd_unfused, forward_bytes(m, f)),
                                ("backward", t_bwd, t_bwd_unfused, backward_bytes(m, f)),
                                ("backward_fp8", t_bwd_fp8, t_bwd_fp8_unfused, backward_bytes(m, f, True))):
        tbps = nbytes / t / 1e9
        rows.append(ExperimentResult(f"{m}x{2 * f}", name, t * 1e3, tbps, 100 * tbps / copy_tbps, tu * 1e3, tu / t))
    return rows


def sweep(copy_tbps: float) -> list[dict]:
    """Forward and the quantizing backward (the passes the block runs) at the first and the last shape. The
    backward's K_BLOCKS are cut to divide F/128 (the launcher's rule): at F = 768, 4 runs as 2."""
    rows = []
    for m, f in (SHAPES[0], SHAPES[-1]):
        x = (torch.randn(m, 2 * f, device="cuda") * 3).to(torch.bfloat16)
        probs = torch.rand(m, device="cuda")
        dy = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
        for cfg in itertools.product((2, 4, 8, 16), (1, 2, 4), (2, 4, 8)):
            if cfg[0] * cfg[1] > 64:
                continue
            t = utils.time_ms(lambda: ks.weighted_swiglu_quant(x, probs, FP8, True, config=cfg), 25, 100)
            rows.append(dict(shape=f"{m}x{2 * f}", pass_="forward", config=str(cfg), us=t * 1e3,
                             pct_of_copy=100 * forward_bytes(m, f) / t / 1e9 / copy_tbps))
            t = utils.time_ms(lambda: ks.weighted_swiglu_backward(dy, x, probs, FP8, config=cfg), 25, 100)
            rows.append(dict(shape=f"{m}x{2 * f}", pass_="backward_fp8", config=str(cfg), us=t * 1e3,
                             pct_of_copy=100 * backward_bytes(m, f, True) / t / 1e9 / copy_tbps))
    return rows


def main():
    args, env, ceilings, copy_tbps = utils.start(__doc__.splitlines()[0], "also sweep the kernels' launch shapes")
    if args.sweep:
        path = utils.write_results("bench_swiglu_sweep", "Weighted SwiGLU + quantization: launch-shape sweep", env,
                                   ceilings, sweep(copy_tbps), ["shape", "pass_", "config", "us", "pct_of_copy"],
                                   notes="config: (BLOCK_M, K_BLOCKS, num_warps).")
        print(path.read_text())
    results = [r for m, f in SHAPES for r in run(m, f, copy_tbps)]
    path = utils.write_results(
        "bench_swiglu", "Fused weighted SwiGLU + 1x128 FP8 quantization (E4M3)", env, ceilings, results,
        list(ExperimentResult.__dataclass_fields__),
        notes=(f"Launch shapes (BLOCK_M, K_BLOCKS, num_warps): forward {ks.FORWARD_CONFIG}, backward "
               f"{ks.BACKWARD_CONFIG}. Forward output checked bitwise against quantize(reference y) before "
               "timing. Targets: >= 80% of the copy bandwidth; paper's speedups 1.7-2.2x forward, 2.6-4.0x "
               "backward."),
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
