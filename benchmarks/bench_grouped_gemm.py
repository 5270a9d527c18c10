"""Grouped blockwise-FP8 GEMMs (fprop, dgrad, wgrad) per backend vs BF16 ``torch._grouped_mm``, on the GPU.

Expert shapes (``--shape``): ``deepseek_v3`` (default), fc1 7168 -> 2*2048 and fc2 2048 -> 7168; or
``qwen3_moe_like`` (Qwen3-30B-A3B), fc1 2048 -> 2*768 and fc2 768 -> 2048 (fc2's reduction dim 768 is not a
multiple of 512: cuBLAS runs it through cuBLASLt with its own scale layouts). Swept over rows per expert
512 ... 16384 at 131072 routed rows (16384 tokens, top-8), i.e. 128 ... 8 experts (at most 128: 512
rows/expert runs 128 experts, 65536 rows). Equal splits, each a multiple of 512 so that every backend can run.
Besides the GPU time, ``host_ms``: the host time of one call while the GPU is kept busy (a queued sleep), what
its launches cost the CPU (cuBLAS: one cuBLASLt call per expert); a step whose host time exceeds its GPU time
waits on the host. Ops:

- ``fprop`` ``Y = X W_g^T`` and ``dgrad`` ``dX = dY W_g``: BF16 out;
- ``wgrad`` ``dW_g = dY_g^T X_g``: written in BF16 (GroupedLinear without ``main_grad`` fusion);
- ``wgrad_fp32``: written into a float32 ``[G, N, K]`` buffer (Megatron-FSDP's ``overwrite_main_grad``);
  BF16's row is ``main_grad.copy_(grouped_mm(...))``;
- ``wgrad_main_grad``: accumulated into a float32 ``[G, N, K]`` buffer (Megatron's ``main_grad``);
  BF16's row is ``main_grad += grouped_mm(...)``;
- ``wgrad_main_grad_reversed``: accumulated into G float32 ``[N, K]`` lying in reverse order in one
  buffer (Megatron's DDP layout of per-expert weights' ``main_grad``s: no ``[G, N, K]`` view, so no
  DeepGEMM); BF16's row adds ``grouped_mm``'s output per expert.
- ``wgrad_main_grad_rounded``: rounded to BF16, then added into the float32 ``[G, N, K]`` (``out_dtype=bfloat16``:
  DDP's hook's sums without gradient-accumulation fusion, ``GroupedLinear.add_wgrad_into_main_grad``); BF16's row is
  ``main_grad += grouped_mm(...)``, as for ``wgrad_main_grad``.

Backends: ``deepgemm`` (when installed; its wgrads also on device-tensor splits where the release takes them,
``splits`` = device: the CUDA-graph path's), ``cublas`` (one cuBLAS GEMM per expert, cuBLASLt itself), ``triton``
(device-tensor splits, no host sync), ``gluon`` (the Gluon kernels, device-tensor splits; Hopper under Triton 3.6:
fprop, dgrad and the written wgrads, ``GLUON_OPS``; its other wgrads are Triton's, so no rows) and ``bf16``
(``torch._grouped_mm``). Every FP8 output
is checked against the float32 reference before it is timed. ``auto`` marks the backend ``ops.grouped_gemm`` picks.

Run on a GPU: ``python benchmarks/bench_grouped_gemm.py [--shape qwen3_moe_like] [--rows 512 1024 ...] [--ops ...]
[--backends deepgemm cublas gluon triton bf16] [--sweep] [--suffix _h200]``
(results ``bench_grouped_gemm{_<shape>}{suffix}``;
DeepGEMM compiles each new shape's kernels on first use, tens of seconds).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from transformer_engine_moe import quantize_blockwise, quantize_grouped_weight, scaling_aware_transpose
from transformer_engine_moe.kernels import grouped_gemm as kg
from transformer_engine_moe.ops.grouped_gemm import GemmCall, _impl, grouped_gemm, grouped_gemm_wgrad

import utils

TOTAL_ROWS, MAX_EXPERTS = 131072, 128
SHAPES = {"deepseek_v3": {"fc1": (4096, 7168), "fc2": (7168, 2048)},  # (N, K) of each expert GEMM
          "qwen3_moe_like": {"fc1": (1536, 2048), "fc2": (2048, 768)}}
FP8_BACKENDS = ("deepgemm", "cublas", "gluon", "triton")
GLUON_OPS = ("fprop", "dgrad", "wgrad", "wgrad_fp32")  # what its kernels run (the rest: Triton's wgrad)


def relerr(a, b):
    """||a - b|| / ||b||, one leading slice at a time (the [G, N, K] wgrads are tens of GB in float32)."""
    num = den = 0.0
    for x, y in zip(a.view(-1, a.shape[-1]).split(4096), b.view(-1, b.shape[-1]).split(4096)):
        num += (x.float() - y.float()).square().sum().item()
        den += y.float().square().sum().item()
    return (num / den) ** 0.5


def operands(e, m, n, k, device="cuda"):
    """FP8 operands of the three GEMMs for ``e`` equal groups of ``m // e`` rows, and their BF16 twins."""
    splits = [m // e] * e
    st = torch.tensor(splits, device=device, dtype=torch.int32)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    wb = torch.randn(e, n, k, device=device, dtype=torch.bfloat16) * 0.02
    xq, dyq = quantize_blockwise(x), quantize_blockwise(dy)
    w, wt = quantize_grouped_weight(list(wb.unbind(0)))
    acc = torch.zeros(wb.shape, device=device)
    return dict(splits=splits, st=st, x=x, dy=dy, wb=wb, xq=xq, dyq=dyq, w=w, wt=wt,
                xt=scaling_aware_transpose(xq, splits), dyt=scaling_aware_transpose(dyq, splits),
                xt_st=scaling_aware_transpose(xq, st), dyt_st=scaling_aware_transpose(dyq, st),
                acc=acc, acc_reversed=list(acc.unbind(0))[::-1])  # same memory, expert g in slot G-1-g


def calls(o, backend, device_splits):
    """The GEMMs on ``backend``, on the host splits or the device tensor."""
    s, t = (o["st"], "_st") if device_splits else (o["splits"], "")
    dyt, xt = o["dyt" + t], o["xt" + t]
    return {
        "fprop": lambda: grouped_gemm(o["xq"], o["w"], s, backend=backend),
        "dgrad": lambda: grouped_gemm(o["dyq"], o["wt"], s, backend=backend),
        "wgrad": lambda: grouped_gemm_wgrad(dyt, xt, s, out_dtype=torch.bfloat16, backend=backend),
        "wgrad_fp32": lambda: grouped_gemm_wgrad(dyt, xt, s, out=o["acc"], backend=backend),
        "wgrad_main_grad": lambda: grouped_gemm_wgrad(dyt, xt, s, out=o["acc"], accumulate=True, backend=backend),
        "wgrad_main_grad_reversed": lambda: grouped_gemm_wgrad(dyt, xt, s, out=o["acc_reversed"], accumulate=True,
                                                               backend=backend),
        "wgrad_main_grad_rounded": lambda: grouped_gemm_wgrad(dyt, xt, s, out=o["acc"], accumulate=True,
                                                              out_dtype=torch.bfloat16, backend=backend),
    }


def bf16_calls(o):
    offs = o["st"].cumsum(0, dtype=torch.int32)
    acc = o["acc"]
    wgrad = lambda: torch._grouped_mm(o["dy"].t(), o["x"], offs=offs)
    return {"fprop": lambda: torch._grouped_mm(o["x"], o["wb"].transpose(1, 2), offs=offs),
            "dgrad": lambda: torch._grouped_mm(o["dy"], o["wb"], offs=offs),
            "wgrad": wgrad, "wgrad_fp32": lambda: acc.copy_(wgrad()), "wgrad_main_grad": lambda: acc.add_(wgrad()),
            "wgrad_main_grad_reversed": lambda: torch._foreach_add_(o["acc_reversed"], list(wgrad().unbind(0))),
            "wgrad_main_grad_rounded": lambda: acc.add_(wgrad())}


def references(o, ops):
    """The float32 reference of each op in ``ops`` (wgrad rounded to BF16: the [G, N, K] float32 is large)."""
    fns = calls(o, "reference", False)
    fns["wgrad"] = lambda: grouped_gemm_wgrad(o["dyt"], o["xt"], o["splits"], out_dtype=torch.bfloat16,
                                              backend="reference")
    refs = {op: fns[op]() for op in ("fprop", "dgrad", "wgrad") if op in ops or op == "wgrad" and "wgrad_fp32" in ops}
    if "wgrad_fp32" in ops:
        refs["wgrad_fp32"] = refs["wgrad"]  # the float32 write is checked against the same BF16-rounded reference
    return refs


def auto_backend(o, op, n, k, device_splits) -> str:
    """The backend ``backend="auto"`` picks for ``op`` on these operands and splits."""
    wgrad = op.startswith("wgrad")
    a = o["dyt"].columnwise_data if wgrad else (o["xq"] if op == "fprop" else o["dyq"]).rowwise_data
    out = torch.bfloat16 if op in ("fprop", "dgrad", "wgrad", "wgrad_main_grad_rounded") else torch.float32
    kind = ("wgrad_rounded" if op == "wgrad_main_grad_rounded" else "wgrad_accumulate"
            if op.startswith("wgrad_main_grad") else "wgrad") if wgrad else "fprop"
    call = GemmCall.of(kind, a, torch.float8_e4m3fn, o["st"] if device_splits else o["splits"], out,
                       weight_elements=n * k, out_list=op == "wgrad_main_grad_reversed", n=n if op == "fprop" else k,
                       rows=o["xq"].shape[0])
    return _impl("auto", call, a, op).name


def splits_per_backend(backends) -> list[tuple[str, bool]]:
    """(backend, on device splits) pairs to time: Triton and Gluon on the device tensor (what they run either way),
    cuBLAS and BF16 on host splits, DeepGEMM on both where its wgrad takes device splits
    (``grouped_gemm_deepgemm.device_splits_wgrad``: the CUDA-graph path's wgrad)."""
    from transformer_engine_moe.kernels import grouped_gemm_deepgemm as dg

    pairs = []
    for backend in backends:
        pairs.append((backend, backend in ("triton", "gluon")))
        if backend == "deepgemm" and dg.device_splits_wgrad():
            pairs.append((backend, True))
    return pairs


def run(rows_per_expert, gemm, ops, shape="deepseek_v3", backends=FP8_BACKENDS + ("bf16",)) -> list[dict]:
    n, k = SHAPES[shape][gemm]
    e = min(MAX_EXPERTS, TOTAL_ROWS // rows_per_expert)
    m = e * rows_per_expert
    o = operands(e, m, n, k)
    refs = references(o, ops)
    flops = 2 * m * n * k
    out = []
    for backend, device_splits in splits_per_backend(backends):
        fns = bf16_calls(o) if backend == "bf16" else calls(o, backend, device_splits)
        for op, fn in fns.items():
            if op not in ops or backend == "gluon" and op not in GLUON_OPS:  # its other wgrads are Triton's
                continue
            if backend == "deepgemm" and device_splits and not op.startswith("wgrad"):
                continue  # its fprop/dgrad on device splits: the same kernel, rows under host splits
            row = dict(shape=shape, rows_per_expert=rows_per_expert, experts=e, gemm=gemm, op=op, backend=backend,
                       splits="device" if device_splits else "host")
            try:
                if backend != "bf16" and not op.startswith("wgrad_main_grad"):  # a wrong FP8 result is never timed
                    err = relerr(fn(), refs[op])
                    assert err < 1e-2, (backend, op, err)  # wrong results are ~1; tests check 2e-3
                fn()
                torch.cuda.synchronize()
                with utils.clock_while() as clock:
                    ms = utils.time_ms(fn)
            except (ImportError, ValueError) as exc:  # backend absent, or not applicable to this call
                out.append(dict(row, ms=float("nan"), tflops=float("nan"), host_ms=float("nan"),
                                auto=f"n/a: {str(exc)[:70]}"))
                continue
            picked = backend != "bf16" and auto_backend(o, op, n, k, device_splits) == backend
            out.append(dict(row, ms=ms, tflops=flops / ms / 1e9, host_ms=utils.busy_host_ms(fn),
                            auto="yes" if picked else "", **clock))
    return out


def sweep() -> list[dict]:
    """Launch shapes of the Triton fprop kernel at 8 experts x 8192 rows (fc1)."""
    o = operands(8, 65536, 4096, 7168)
    w = o["w"]
    rows = []
    for cfg in itertools.product((64, 128), (4, 8, 16), (4, 8), (3, 4)):
        try:
            t = utils.time_ms(lambda: kg.grouped_gemm(o["xq"].rowwise_data, o["xq"].rowwise_scale_inv,
                                                      w.rowwise_data.view(8, 4096, 7168),
                                                      w.rowwise_scale_inv.view(8, 32, 56), o["st"], config=cfg),
                              20, 100)
            rows.append(dict(config=str(cfg), tflops=2 * 65536 * 4096 * 7168 / t / 1e9))
        except Exception as exc:  # out of shared memory for the larger tiles
            rows.append(dict(config=str(cfg), tflops=type(exc).__name__))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--ops", nargs="+", default=["fprop", "dgrad", "wgrad", "wgrad_fp32", "wgrad_main_grad",
                                                     "wgrad_main_grad_reversed", "wgrad_main_grad_rounded"])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="deepseek_v3", help="the experts' GEMM shapes")
    parser.add_argument("--backends", nargs="+", choices=FP8_BACKENDS + ("bf16",), default=FP8_BACKENDS + ("bf16",))
    parser.add_argument("--sweep", action="store_true", help="also sweep the Triton fprop kernel's launch shapes")
    parser.add_argument("--suffix", default="",
                        help="appended to the results' name (e.g. _h200: bench_grouped_gemm_h200 for a second GPU)")
    args = parser.parse_args()
    env = utils.environment()
    ceil = {"copy_bandwidth_tbps (1 GiB, read+write)": utils.copy_bandwidth_tbps()}
    if args.sweep:
        path = utils.write_results("bench_grouped_gemm_sweep", "Triton grouped FP8 fprop: launch-shape sweep", env,
                                   ceil, sweep(), ["config", "tflops"],
                                   notes="config: (BLOCK_N, GROUP_M, num_warps, num_stages), E=8 65536x4096x7168.")
        print(path.read_text())
    results = []
    gemms = SHAPES[args.shape]
    shape = "" if args.shape == "deepseek_v3" else f"_{args.shape}"
    for rows in args.rows:  # written after each size: a run cut short keeps what it measured
        results += [r for gemm in gemms for r in run(rows, gemm, args.ops, args.shape, args.backends)]
        path = utils.write_results(
            f"bench_grouped_gemm{shape}{args.suffix}", "Grouped blockwise FP8 GEMMs per backend vs BF16 grouped_mm "
            "(TFLOP/s)", env, ceil, results,
            ["shape", "rows_per_expert", "experts", "gemm", "op", "backend", "splits", "tflops", "ms", "host_ms",
             "auto", "sm_clock_mhz", "power_w"],
            notes=(f"{args.shape}: " + "; ".join(f"{g}: N={n}, K={k}" for g, (n, k) in gemms.items()) + ". "
                   f"{TOTAL_ROWS} rows (at most {MAX_EXPERTS} experts). host_ms: one call's host time with the GPU "
                   "busy behind a queued sleep (3 calls). sm_clock_mhz, power_w: NVML's medians while the row was "
                   "timed (an H200 at its 700 W cap clocks down under dense FP8 work). "
                   f"Triton launch shapes: fprop/dgrad {kg.GEMM_CONFIG} (BLOCK_N, GROUP_M, warps, stages), wgrad "
                   f"{kg.WGRAD_CONFIG} (BLOCK_N, BLOCK_K, warps, stages). auto=yes: the backend ops.grouped_gemm "
                   "picks with backend='auto' for this call on these splits (host list or device tensor). Every "
                   "FP8 output checked against the float32 reference first (the wgrad_main_grad ops share "
                   "wgrad's check)."))
    print(path.read_text())


if __name__ == "__main__":
    main()
