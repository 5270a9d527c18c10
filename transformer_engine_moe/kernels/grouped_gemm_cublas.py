"""Grouped blockwise-FP8 GEMMs as one cuBLAS GEMM per non-empty expert (Hopper).

For splits already on the host (DeepEP returns them as a list): no sync, one
launch per expert (wgrad's spread over ``NUM_COMPUTE_STREAMS`` streams). Same
signatures as ``kernels/grouped_gemm.py``; layouts (checked on an H100/H200 with
torch 2.11, docs/grouped_gemm.md):

- fprop ``A_e [m, K] @ W_e^T`` through ``torch._scaled_mm``: ``scale_a`` = the 1x128
  scales as a column-major ``[m, K/128]``, ``b = W_e.t()``, ``scale_b = S_e.t()`` (128x128 scales).
- dgrad ``dY_e [m, N] @ W_e``: cuBLAS wants B column-major, so ``b`` is the
  transposed weight ``W_e^T [K, N]`` made by the caller (``weight_t``), ``.t()``.
- wgrad ``dY_e^T [N, m] @ X_e [m, K]`` through cuBLASLt itself (``kernels/cublaslt.py``: beta = 1
  adds into ``main_grad`` in the epilogue, which ``torch._scaled_mm`` cannot) from the
  expert-major columnwise copies: expert e's contiguous ``[N, m]`` and ``[K, m]`` blocks and
  their block-major 128x1 scales, as they lie. Needs each group's m a multiple of 128 (no
  partial 1x128 block along cuBLAS's reduction) and not both operands E5M2.

cuBLAS blockwise in torch 2.11 gives silently wrong results for 1x128 x 128x128
(fprop/dgrad) when the reduction has a number of 128-blocks that is not a multiple
of 4 (docs/grouped_gemm.md): ``supports`` says which calls are safe and the op falls
back to another backend otherwise. The 1x128 x 1x128 wgrad is correct for any
multiple of 128 (checked on an H200: relative error 1.3e-4 at groups of 128, 384,
640, 1152 rows).
"""

from __future__ import annotations

import contextlib

import torch

from . import cublaslt

# Per-expert wgrad GEMMs go round-robin over this many CUDA streams forked from and joined back into the
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


def supports(reduction: int, m_splits) -> bool:
    """Whether the cuBLAS path is correct for a reduction dim of ``reduction`` over groups ``m_splits``."""
    return isinstance(m_splits, (list, tuple)) and reduction % 512 == 0


def supports_wgrad(a_dtype: torch.dtype, b_dtype: torch.dtype, m_splits) -> bool:
    """Whether the cuBLAS wgrad can run (given ``cublaslt.available``): not both operands E5M2 (cuBLAS's FP8
    pairs), host splits, each a multiple of 128 (whole 1x128 blocks)."""
    return (not a_dtype == b_dtype == torch.float8_e5m2 and isinstance(m_splits, (list, tuple))
            and all(s % 128 == 0 for s in m_splits))


def _col_major(s: torch.Tensor) -> torch.Tensor:
    return s.t().contiguous().t()


def grouped_gemm(a, a_scale_inv, b, b_scale_inv, m_splits, out_dtype=torch.bfloat16, config=None):
    """As ``kernels.grouped_gemm.grouped_gemm`` (``b`` K-major ``[G, N, R]``), for host ``m_splits`` (a
    trailing weightless group's rows zeroed)."""
    m, n = a.shape[0], b.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    lo = 0
    for g, size in enumerate(m_splits[:b.shape[0]]):
        if size:
            torch._scaled_mm(a[lo:lo + size], b[g].t(), _col_major(a_scale_inv[lo:lo + size]), b_scale_inv[g].t(),
                             out_dtype=out_dtype, out=c[lo:lo + size])
        lo += size
    c[lo:].zero_()
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
