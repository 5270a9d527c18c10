"""Plain-PyTorch grouped blockwise-FP8 GEMMs: the oracle for ``kernels/grouped_gemm.py`` and the CPU path.

Each operand is dequantized to float32 (its scales are powers of two, so this
is exact) and multiplied per group in float32; the kernels sum the same
products in another order (per 128-wide block on the tensor cores), so the two
agree within float32 rounding of the sum, not bit for bit. Same signatures as
the kernels. Group ranges come from ``m_splits`` (a device tensor is read back
to the host here: the reference is not the hot path).
"""

from __future__ import annotations

import torch

from .dequantize import dequantize_1x128, dequantize_128x1, dequantize_128x128


def _ranges(m_splits, m: int) -> list[tuple[int, int]]:
    sizes = [m] if m_splits is None else [int(s) for s in (m_splits.tolist() if isinstance(
        m_splits, torch.Tensor) else m_splits)]
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()
    return [(e - s, e) for s, e in zip(sizes, ends)]


def grouped_gemm(a, a_scale_inv, b, b_scale_inv, m_splits, out_dtype=torch.bfloat16, config=None):
    """``C[rows of g] = A[rows of g] @ B_g^T`` (``b [G, N, R]``) in float32, cast to ``out_dtype``."""
    a32 = dequantize_1x128(a, a_scale_inv, torch.float32)
    n = b.shape[1]
    c = torch.zeros((a.shape[0], n), dtype=torch.float32, device=a.device)
    for g, (lo, hi) in enumerate(_ranges(m_splits, a.shape[0])[:b.shape[0]]):  # a weightless group: zeros
        if hi > lo:
            w = dequantize_128x128(b[g], b_scale_inv[g], torch.float32)
            c[lo:hi] = a32[lo:hi] @ w.t()
    return c.to(out_dtype)


def grouped_gemm_wgrad(a_t, a_t_scale_inv, b_t, b_t_scale_inv, m_splits, out=None, accumulate=False,
                       out_dtype=torch.float32, config=None):
    """``C_g [N, K] = A_g^T B_g`` over group g's rows of the logical ``A [M, N]``, ``B [M, K]`` given as their
    expert-major columnwise copies (float32 math, then ``out_dtype``), or into ``out``: a ``[G, N, K]``
    tensor or a list of G ``[N, K]``, float32, written or added (``accumulate``) after rounding to ``out_dtype``.
    ``m_splits`` may cover only the leading rows (the rest, a weightless group, is not read)."""
    n, k = a_t_scale_inv.shape[1], b_t_scale_inv.shape[1]
    ranges = _ranges(m_splits, a_t.numel() // n)
    splits = [hi - lo for lo, hi in ranges]
    rows = sum(splits)
    a32 = dequantize_128x1(a_t.reshape(-1)[:rows * n], a_t_scale_inv, torch.float32, splits)
    b32 = dequantize_128x1(b_t.reshape(-1)[:rows * k], b_t_scale_inv, torch.float32, splits)
    c = torch.stack([a32[lo:hi].t() @ b32[lo:hi] for lo, hi in ranges]) if ranges else a32.new_zeros(
        (0, a32.shape[1], b32.shape[1]))
    if out is None:
        return c.to(out_dtype)
    c = c.to(out_dtype).float()
    for out_g, c_g in zip(out, c) if isinstance(out, list) else ((out, c),):
        if accumulate:
            out_g += c_g
        else:
            out_g.copy_(c_g)
    return out
