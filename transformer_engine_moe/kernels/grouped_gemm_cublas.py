"""Grouped blockwise-FP8 GEMMs as one cuBLAS GEMM per non-empty expert (Hopper), through cuBLASLt itself.

For splits already on the host (DeepEP returns them as a list): no sync, one launch per expert, spread
over ``NUM_COMPUTE_STREAMS`` streams. Same signatures as ``kernels/grouped_gemm.py``; the launches and
cuBLAS's layouts are ``kernels/cublaslt.py``'s:

- fprop ``A_e [m, R] @ W_e^T`` and dgrad ``dY_e [m, N] @ W_e`` (through the transposed weight ``W_e^T
  [K, N]`` made by the caller, K-major as Hopper's FP8 kernels want): the 1x128 scales are first laid out
  expert-major (``kernels/grouped_gemm.expert_major_scales``, one Triton launch: cuBLAS reads each expert's
  as its own ``[R/128, m]`` block, rows contiguous) and the 128x128 scales' rows padded to a multiple of 4
  blocks when R/128 is not one (cuBLAS's leading dimension; torch 2.11's ``_scaled_mm`` passed them unpadded
  and was silently wrong there). Any R that is a multiple of 128; groups of multiples of 16 rows
  (``ROW_ALIGNMENT``); BF16 or float32 out.
- wgrad ``dY_e^T [N, m] @ X_e [m, K]`` from the expert-major columnwise copies: expert e's contiguous
  ``[N, m]`` and ``[K, m]`` blocks and their block-major 128x1 scales, as they lie; beta = 1 adds into
  ``main_grad`` in the epilogue. Needs each group's m a multiple of 128 (no partial 1x128 block along
  cuBLAS's reduction).

Neither runs both operands E5M2 (cuBLAS's FP8 pairs); ``supports`` and ``supports_wgrad`` say which calls
can run, and ``ops/grouped_gemm.py`` sends the others to another backend.
"""

from __future__ import annotations

import contextlib

import torch

from . import cublaslt
from ..layout import all_multiples_of

# Rows per group of the fprop/dgrad: 16-byte aligned scale blocks (TransformerEngine asks 8 rows of a 1x128-scaled
# cuBLAS operand; its MoE pads experts' rows to 16 for FP8, FP8FlowMoE to 128).
ROW_ALIGNMENT = 16
# Per-expert GEMMs go round-robin over this many CUDA streams forked from and joined back into the
# caller's (as TransformerEngine's NVTE_NUM_COMPUTE_STREAMS for its grouped GEMMs): one expert's GEMM fills
# the launch gap and the last partial wave of another. 1: everything on the current stream.
NUM_COMPUTE_STREAMS = 2
_STREAMS: dict[tuple, list] = {}


@contextlib.contextmanager
def _side_streams(device: torch.device, jobs: int):
    """Yields the streams for ``jobs`` launches: up to ``NUM_COMPUTE_STREAMS`` side streams that wait for the
    current stream on entry, which waits for them on exit (no host sync; capturable); the current stream alone
    for one launch or one stream. Launches name their stream and allocate nothing on it (cuBLASLt's workspace
    per stream is made once and kept): what they read or write was allocated on the current stream, whose
    later work (reuse of freed memory included) is ordered after the join."""
    n = min(NUM_COMPUTE_STREAMS, jobs)
    main = torch.cuda.current_stream(device)
    if n <= 1:
        yield [main]
        return
    key = (device, n)
    if key not in _STREAMS:
        _STREAMS[key] = [torch.cuda.Stream(device) for _ in range(n)]
    streams = _STREAMS[key]
    for s in streams:
        s.wait_stream(main)
    try:
        yield streams
    finally:
        for s in streams:
            main.wait_stream(s)


def supports(a_dtype: torch.dtype, b_dtype: torch.dtype, m_splits, out_dtype: torch.dtype) -> bool:
    """Whether the cuBLAS fprop/dgrad can run (given ``cublaslt.available``): not both operands E5M2, host splits,
    each a multiple of ``ROW_ALIGNMENT``, BF16 or float32 out."""
    return (not a_dtype == b_dtype == torch.float8_e5m2 and isinstance(m_splits, (list, tuple))
            and all_multiples_of(m_splits, ROW_ALIGNMENT) and out_dtype in (torch.bfloat16, torch.float32))


def supports_wgrad(a_dtype: torch.dtype, b_dtype: torch.dtype, m_splits) -> bool:
    """Whether the cuBLAS wgrad can run (given ``cublaslt.available``): not both operands E5M2 (cuBLAS's FP8
    pairs), host splits, each a multiple of 128 (whole 1x128 blocks)."""
    return (not a_dtype == b_dtype == torch.float8_e5m2 and isinstance(m_splits, (list, tuple))
            and all_multiples_of(m_splits, 128))


def _padded_blocks(b_scale_inv: torch.Tensor) -> torch.Tensor:
    """128x128 scales ``[G, N/128, R/128]`` as cuBLAS reads them: rows padded to a multiple of 4 blocks (a copy
    only where R/128 is not one; the padding is never read)."""
    pad = -b_scale_inv.shape[-1] % 4
    return torch.nn.functional.pad(b_scale_inv, (0, pad)) if pad else b_scale_inv.contiguous()


def grouped_gemm(a, a_scale_inv, b, b_scale_inv, m_splits, out_dtype=torch.bfloat16, config=None):
    """As ``kernels.grouped_gemm.grouped_gemm`` (``b`` K-major ``[G, N, R]``), for host ``m_splits`` (a
    trailing weightless group's rows zeroed)."""
    m, n = a.shape[0], b.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    splits = list(m_splits[:b.shape[0]])
    rows = sum(splits)
    if rows:
        from .grouped_gemm import expert_major_scales  # Triton: present wherever cuBLAS runs

        # made here, before the side streams wait for the current stream: made inside, the padding raced the
        # launches reading it (relative error 0.68 at R = 2176 on an H200, 2026-11-27)
        scales, blocks = expert_major_scales(a_scale_inv, splits), _padded_blocks(b_scale_inv)
        with _side_streams(a.device, sum(1 for size in splits if size)) as streams:
            cublaslt.grouped_gemm(a, scales, b, blocks, splits, c, streams)
    if rows < m:
        c[rows:].zero_()
    return c


def grouped_gemm_wgrad(a_t, a_t_scale_inv, b_t, b_t_scale_inv, m_splits, out=None, accumulate=False,
                       out_dtype=torch.float32, config=None):
    """As ``kernels.grouped_gemm.grouped_gemm_wgrad`` (expert-major operands; host list of groups of
    128-multiple sizes, of the leading rows; ``out`` a ``[G, N, K]`` tensor or a list of G ``[N, K]``)."""
    n, k = a_t_scale_inv.shape[1], b_t_scale_inv.shape[1]
    if out is None:
        out = torch.empty((len(m_splits), n, k), dtype=out_dtype, device=a_t.device)
    if not accumulate:
        for g in (g for g, size in enumerate(m_splits) if not size):
            out[g].zero_()
    with _side_streams(a_t.device, sum(1 for size in m_splits if size)) as streams:
        cublaslt.grouped_wgrad(a_t, a_t_scale_inv, b_t, b_t_scale_inv, m_splits, out, accumulate, streams)
    return out
