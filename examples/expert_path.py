"""What runs the routed experts of a model, in one line for logs and summaries, so a speed is read for what
it is: Megatron's experts, or the FP8-Flow block with the device and backends its ops take.

``GroupedLinear(backend="auto")`` resolves per call (``transformer_engine_moe.ops.grouped_gemm``): on a CPU
every op is the plain-PyTorch reference; on a GPU the Triton kernels, and for each grouped GEMM the first of
``AUTO_ORDER`` that can run it (DeepGEMM where it imports on a Hopper GPU, cuBLAS for experts averaging at
least ``CUBLAS_MIN_MEAN_ROWS`` rows and that many rows of a ``CUBLAS_MIN_WEIGHT`` weight's multiply-adds,
where cuBLASLt >= 12.9 runs on a Hopper GPU, the Gluon kernels on a Hopper GPU under Triton 3.6, else Triton).
"""

from __future__ import annotations

import torch

_NAMES = {"deepgemm": "DeepGEMM", "cublas": "cuBLAS", "gluon": "Gluon (N a multiple of 256)", "triton": "Triton"}
CPU_PATH = ("the plain-PyTorch reference ops (quantize, permute, SwiGLU, grouped GEMMs in float32): the CPU "
            "path that checks correctness, not the GPU kernels")


def gemm_backends(device: torch.device, backend: str = "auto") -> str:
    """How the FP8-Flow block's ops run on ``device`` with ``GroupedLinear.backend``."""
    if device.type != "cuda":
        return CPU_PATH if backend in ("auto", "reference") else f"grouped GEMMs {backend!r} on {device}"
    if backend != "auto":
        return f"Triton kernels; grouped GEMMs {backend!r}"
    from transformer_engine_moe.kernels import cublaslt, grouped_gemm_deepgemm
    from transformer_engine_moe.ops.grouped_gemm import (AUTO_ORDER, CUBLAS_MIN_MEAN_ROWS, CUBLAS_MIN_WEIGHT,
                                                         DEEPGEMM_WRITTEN_MIN_MEAN_ROWS, gluon_available)

    deepgemm, lt = grouped_gemm_deepgemm.available(device), cublaslt.available(device)
    gluon = gluon_available(device)
    kinds = []
    for kind, label in (("fprop", "fprop/dgrad"), ("wgrad", "wgrad"), ("wgrad_accumulate", "wgrad into main_grad")):
        order = [n for n in AUTO_ORDER[kind] if (n != "deepgemm" or deepgemm) and (n != "cublas" or lt)
                 and (n != "gluon" or gluon)]
        names = {"fprop": _NAMES, "wgrad": dict(_NAMES, deepgemm=f"DeepGEMM (experts of >= "
                                                                 f"{DEEPGEMM_WRITTEN_MIN_MEAN_ROWS} rows)",
                                                gluon="Gluon (groups of multiples of 16)"),
                 "wgrad_accumulate": dict(_NAMES, deepgemm="DeepGEMM (main_grad as one [G, N, K])")}[kind]
        kinds.append(f"{label} " + " > ".join(
            _cublas(CUBLAS_MIN_MEAN_ROWS[kind], CUBLAS_MIN_WEIGHT) if n == "cublas" else names[n] for n in order))
    return ("Triton kernels; grouped GEMMs 'auto', per call the first that can run it: " + "; ".join(kinds)
            + ("" if deepgemm else " (DeepGEMM not importable here or not a Hopper GPU)")
            + ("" if lt else " (cuBLAS needs cuBLASLt >= 12.9 on a Hopper GPU)"))


def _cublas(rows: int, weight: int) -> str:
    return f"cuBLAS (experts of >= {rows} rows and >= {rows} x {weight / 1e6:.1f}M multiply-adds)"


def expert_path(model: torch.nn.Module) -> str:
    """``experts: ...``: the FP8-Flow block's device and backends, or the class of Megatron's experts."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from transformer_engine_moe import FP8FlowMoE

    blocks = [m for m in model.modules() if isinstance(m, FP8FlowMoE)]
    if blocks:
        fc1 = blocks[0].linear_fc1
        device = fc1.weight_params[0].device
        graphs = ("; device splits for CUDA graphs (--moe-fp8-flow-cuda-graph): only backends taking per-expert "
                  "counts on the GPU run (no cuBLAS)" if blocks[0].device_splits else "")
        return f"experts: FP8-Flow on {device}: {gemm_backends(device, fc1.backend)}{graphs}"
    classes = {type(m.experts) for m in model.modules() if isinstance(m, MoELayer)}
    names = ", ".join(sorted(c.__name__ for c in classes)) or "none"
    device = next(model.parameters()).device
    te = any(c.__module__.startswith("megatron.core.extensions.transformer_engine") or c.__name__.startswith("TE")
             for c in classes)
    return f"experts: Megatron's {names} on {device} " + (
        "(TransformerEngine's GroupedLinear)" if te else "(plain torch matmuls)")
