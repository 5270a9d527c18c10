"""Grouped blockwise-FP8 GEMMs over experts: ``grouped_gemm`` (fprop, dgrad) and ``grouped_gemm_wgrad``.

Operands are ``Float8BlockwiseQTensor``s: activations and gradients 1x128
(rowwise COMPACT for fprop/dgrad, the grouped 128x1 columnwise copy for wgrad),
weights 128x128 stacked as ``[G, N, K]``. Four backends:

- ``"triton"``: one launch per GEMM over all experts; group sizes read on the
  device (``m_splits`` may be a device tensor: no host sync, CUDA-graph safe).
- ``"cublas"``: one ``torch._scaled_mm`` per non-empty expert; needs ``m_splits``
  on the host, reductions in multiples of 512 (and, for wgrad, groups of
  multiples of 512 rows), see ``kernels/grouped_gemm_cublas.py``.
- ``"reference"``: plain PyTorch in float32 (the oracle, and the CPU path).
- ``"auto"``: cuBLAS where it applies and experts average at least
  ``CUBLAS_MIN_MEAN_ROWS`` rows (measured 1.8x faster for fprop/dgrad and 1.4x for
  wgrad than our Triton kernels on an H200 at DeepSeek-V3 shapes, docs/grouped_gemm.md),
  else Triton on the GPU; the reference on CPU.

Alignment: K and N multiples of 128 (the weights' 128x128 blocks); groups may
have any size, 0 included.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layout import MSplits, check_m_splits
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from .backend import check_on_device, implementation, use_triton

GEMM_BACKENDS = ("auto", "triton", "cublas", "reference")
# "auto" takes cuBLAS only for experts this large on average: below it the per-expert launches cost more
# host time than their GPU time (128 experts of ~512 rows: 512 launches, 89 ms step for 65 ms of GPU work).
CUBLAS_MIN_MEAN_ROWS = 2048


def _impl(backend: str, tensor: torch.Tensor, m_splits, reduction: int, op: str, wgrad: bool = False):
    """The module running ``op``: kernels.grouped_gemm, kernels.grouped_gemm_cublas or reference.grouped_gemm."""
    from ..kernels import grouped_gemm_cublas as cublas  # plain torch; no Triton import

    if backend not in GEMM_BACKENDS:
        raise ValueError(f"{op}: backend must be one of {GEMM_BACKENDS}, got {backend!r}")
    ok = cublas.supports_wgrad(m_splits) if wgrad else cublas.supports(reduction, m_splits)
    if backend == "cublas":
        if not tensor.is_cuda or not ok:
            raise ValueError(
                f"{op}: backend='cublas' needs CUDA tensors, m_splits as a host list and "
                + ("every group a multiple of 512 rows" if wgrad else f"a reduction dim multiple of 512 "
                   f"(got {reduction})")
                + " (torch 2.11's cuBLAS blockwise GEMM is silently wrong otherwise); use 'triton'"
            )
        return cublas
    if backend == "auto" and tensor.is_cuda and ok and sum(m_splits) >= CUBLAS_MIN_MEAN_ROWS * len(m_splits):
        return cublas
    if use_triton(backend, tensor, op):
        from ..kernels import grouped_gemm as kernels

        return kernels
    from ..reference import grouped_gemm as reference

    return reference


def _check_act(t, name: str, usage: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(t, Float8BlockwiseQTensor):
        raise TypeError(f"{name} must be a Float8BlockwiseQTensor (1x128), got {type(t).__name__}")
    if t.is_2D_scaled or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D 1x128-scaled tensor [M, K], got shape {list(t.shape)}"
                         f"{' with 128x128 scales' if t.is_2D_scaled else ''}")
    data = t.rowwise_data if usage == "rowwise" else t.columnwise_data
    if data is None:
        raise ValueError(f"{name} has no {usage} data (usages: {t.usages})")
    if t.shape[1] % 128:
        raise ValueError(f"{name}: the reduction/feature dim must be a multiple of 128, got shape {list(t.shape)}")
    return data, t.rowwise_scale_inv if usage == "rowwise" else t.columnwise_scale_inv


def _check_splits(m_splits: MSplits, m: int, groups: Optional[int], device) -> tuple[MSplits, int]:
    """Validated ``(m_splits, number of groups)``; ``groups``: the count the weight expects (None: any)."""
    if m_splits is None:
        raise ValueError("m_splits is required: a host list or a device int tensor of per-expert row counts")
    m_splits = check_m_splits(m_splits, m)
    n = len(m_splits) if isinstance(m_splits, list) else m_splits.numel()
    if groups is not None and n != groups:
        raise ValueError(f"m_splits has {n} groups but the weight has {groups} experts")
    if isinstance(m_splits, torch.Tensor):
        if m_splits.device != device:
            raise ValueError(f"m_splits is on {m_splits.device}, the operands on {device}")
        check_on_device((m_splits >= 0).all() & (m_splits.sum() == m),
                        f"m_splits must be >= 0 and sum to M={m}")
    return m_splits, n


def check_grouped_weight(weight, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [G, N, K], scale_inv [G, N/128, K/128])`` of a stacked 128x128 FP8 weight."""
    if not isinstance(weight, Float8BlockwiseQTensor):
        raise TypeError(f"{name} must be a Float8BlockwiseQTensor [G, N, K] (128x128), got {type(weight).__name__}")
    if not weight.is_2D_scaled or weight.dim() != 3 or weight.rowwise_data is None:
        raise ValueError(f"{name} must be 128x128-scaled rowwise [G, N, K], got shape {list(weight.shape)}, "
                         f"is_2D_scaled={weight.is_2D_scaled}, usages {weight.usages}")
    g, n, k = weight.shape
    if n % 128 or k % 128:
        raise ValueError(f"{name}: N and K must be multiples of 128, got [G={g}, N={n}, K={k}]")
    return weight.rowwise_data.view(g, n, k), weight.rowwise_scale_inv.view(g, n // 128, k // 128)


def transpose_grouped_weight(weight: Float8BlockwiseQTensor, backend: str = "auto") -> Float8BlockwiseQTensor:
    """``[G, N, K]`` 128x128 FP8 -> ``[G, K, N]`` (each expert transposed; exact: the scales are
    transpose-invariant). The dgrad GEMM's K-major operand. ``backend``: ``"auto"`` (Triton byte
    transpose on CUDA, reference elsewhere), ``"triton"`` or ``"reference"``."""
    data, scale = check_grouped_weight(weight)
    g, n, k = weight.shape
    kernel = use_triton(backend, data, "transpose_grouped_weight")
    data_t, scale_t = implementation(kernel, "transpose").transpose_128x128(data, scale)
    return Float8BlockwiseQTensor(
        shape=(g, k, n), dtype=weight.dtype, fp8_dtype=weight.fp8_dtype, is_2D_scaled=True,
        pow2_scales=weight.pow2_scales, rowwise_data=data_t.view(g * k, n),
        rowwise_scale_inv=scale_t.view(g * k // 128, n // 128),
    )


def grouped_gemm(inp: Float8BlockwiseQTensor, weight: Float8BlockwiseQTensor, m_splits: MSplits, *,
                 out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> torch.Tensor:
    """``out[rows of g] = inp[rows of g] @ weight[g]^T``: ``inp [M, K]`` 1x128 rowwise, ``weight
    [G, N, K]`` 128x128 -> ``[M, N]`` in ``out_dtype``. fprop passes the weights, dgrad their
    ``transpose_grouped_weight`` and the output gradient as ``inp``. Not differentiable (see
    ``module.GroupedLinear``)."""
    a, a_scale = _check_act(inp, "inp", "rowwise")
    b, b_scale = check_grouped_weight(weight)
    if inp.shape[1] != weight.shape[2]:
        raise ValueError(f"inp has {inp.shape[1]} features but weight expects K={weight.shape[2]} "
                         f"(weight shape {list(weight.shape)})")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype must be bf16/fp16/fp32, got {out_dtype}")
    m_splits, _ = _check_splits(m_splits, inp.shape[0], weight.shape[0], a.device)
    impl = _impl(backend, a, m_splits, inp.shape[1], "grouped_gemm")
    return impl.grouped_gemm(a, a_scale, b, b_scale, m_splits, out_dtype)


def grouped_gemm_wgrad(grad_output: Float8BlockwiseQTensor, inp: Float8BlockwiseQTensor, m_splits: MSplits, *,
                       out: Optional[torch.Tensor] = None, accumulate: bool = False,
                       out_dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """``dW[g] = grad_output[rows of g]^T @ inp[rows of g]`` -> ``[G, N, K]`` float32, from the grouped
    128x1 columnwise copies of ``grad_output [M, N]`` and ``inp [M, K]`` (scaling-aware transpose with
    these ``m_splits``). ``out``: a float32 ``[G, N, K]`` buffer written, or added to when ``accumulate``
    (Megatron's ``main_grad`` fusion); without ``out``, a new tensor in ``out_dtype`` (FP32 accumulation,
    one rounding at the end)."""
    a, a_scale = _check_act(grad_output, "grad_output", "columnwise")
    b, b_scale = _check_act(inp, "inp", "columnwise")
    if grad_output.shape[0] != inp.shape[0]:
        raise ValueError(f"grad_output has {grad_output.shape[0]} rows, inp {inp.shape[0]}")
    m_splits, groups = _check_splits(m_splits, inp.shape[0], None, a.device)
    for name, t in (("grad_output", grad_output), ("inp", inp)):
        own = t.columnwise_m_splits
        if (own is not m_splits) and not (isinstance(own, list) and own == m_splits):
            raise ValueError(f"{name}'s columnwise copy is grouped by {own if isinstance(own, list) else 'another tensor'}"
                             f", not by these m_splits; transpose it with the same m_splits")
    shape = (groups, grad_output.shape[1], inp.shape[1])
    if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != shape or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {list(shape)}, got {out.dtype} "
                         f"{list(out.shape)}")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out (the main_grad buffer)")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")
    impl = _impl(backend, a, m_splits, 0, "grouped_gemm_wgrad", wgrad=True)
    return impl.grouped_gemm_wgrad(a, a_scale, b, b_scale, m_splits, out, accumulate, out_dtype)
