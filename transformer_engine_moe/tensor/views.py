"""Row-preserving views and row splits of a Float8BlockwiseQTensor: zero-copy, FP8 kept.

The FP8 storage is ``[M, K]`` whatever the leading dims, so a view between ``[..., K]`` shapes with the
same K (``view``, ``reshape``, ``torch.reshape``, ``flatten`` through ``aten.view``) only relabels the
shape, and ``split`` along the rows slices data and scales (COMPACT layouts: ``layout.py``). Both are
autograd functions with straight-through gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..recipe import BLOCK_SIZE

if TYPE_CHECKING:
    from .float8_blockwise_tensor import Float8BlockwiseQTensor


def shape_arg(shape) -> tuple:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return tuple(shape[0])
    return tuple(shape)


def reshaped(t: Float8BlockwiseQTensor, shape) -> Float8BlockwiseQTensor:
    """``t`` with another ``[..., K]`` shape of the same last dim K (the FP8 storage is ``[M, K]``)."""
    try:  # torch's own rules (one -1, sizes that hold the elements), on a meta tensor: no data touched
        new_shape = torch.empty(t.shape, device="meta").reshape(shape).shape
    except RuntimeError as error:  # e.g. two -1, or () for many elements: named, not torch's RuntimeError
        raise ValueError(f"Float8BlockwiseQTensor of shape {list(t.shape)} cannot be viewed as {list(shape)}: "
                         f"{error}") from None
    if len(new_shape) < 1 or new_shape[-1] != t.shape[-1]:
        raise ValueError(
            f"Float8BlockwiseQTensor can only reshape between [..., K] shapes with K={t.shape[-1]}, "
            f"got {list(new_shape)} from {list(t.shape)}"
        )
    return t._make_like(shape=new_shape)


class Reshape(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, shape):
        ctx.shape = t.shape
        return reshaped(t, shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape), None


def _column_pieces(t: Float8BlockwiseQTensor, m_splits) -> list[dict]:
    """Per split piece: its 128x1 columnwise data, scale rows and groups. A piece of an ungrouped copy
    ``[K, M]`` is a column slice ending at block boundaries; of an expert-major copy, either whole groups
    (a flat slice, grouped as they were) or a block-aligned part of one group (a strided ``[K, m]`` view
    of that group's block, ungrouped)."""
    grouped = t._columnwise_m_splits is not None
    groups = t._columnwise_m_splits if grouped else [sum(m_splits)]
    if isinstance(groups, torch.Tensor):
        raise ValueError(
            "cannot split a columnwise copy grouped by a device tensor (its block boundaries are "
            "on the device); drop it with update_usage(columnwise_usage=False) first"
        )
    k = t.shape[-1]
    firsts = [sum(groups[:i]) for i in range(len(groups) + 1)]
    bounds, blk = {0: 0}, 0  # every block boundary: row -> scale row
    for first, g in zip(firsts, groups):
        for start in range(0, g, BLOCK_SIZE):
            bounds[first + start] = blk
            blk += 1
        bounds[first + g] = blk
    cut = ValueError(f"m_splits {list(m_splits)} cut through 128-row blocks{' or across groups' if grouped else ''}"
                     f" of the columnwise copy (groups {list(groups)}); drop it with "
                     "update_usage(columnwise_usage=False) first")
    pieces, lo = [], 0
    for size in m_splits:
        hi = lo + size
        if lo not in bounds or hi not in bounds:
            raise cut
        piece = dict(columnwise_scale_inv=t._columnwise_scale_inv[bounds[lo]:bounds[hi]], columnwise_m_splits=None)
        if not grouped:
            piece["columnwise_data"] = t._columnwise_data[:, lo:hi]
        elif size == 0:
            piece["columnwise_data"] = t._columnwise_data.new_empty((k, 0))
        elif lo in firsts and hi in firsts:  # whole groups (and the empty ones at lo)
            piece.update(columnwise_data=t._columnwise_data[k * lo:k * hi],
                         columnwise_m_splits=groups[firsts.index(lo):firsts.index(hi)])
        else:  # inside one group
            g = max(i for i, f in enumerate(firsts[:-1]) if f <= lo)
            if hi > firsts[g + 1]:
                raise cut
            block = t._columnwise_data[k * firsts[g]:k * firsts[g + 1]].view(k, groups[g])
            piece["columnwise_data"] = block[:, lo - firsts[g]:hi - firsts[g]]
        pieces.append(piece)
        lo = hi
    return pieces


class Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, m_splits):
        k = t.shape[-1]
        ctx.meta = (t.shape, t.dtype, t.device)
        ctx.m_splits = m_splits
        pieces = [dict.fromkeys(t._components()) for _ in m_splits]
        if t._rowwise_data is not None:
            blocks = m_splits
            if t._is_2D_scaled:
                if any(s % BLOCK_SIZE for s in m_splits[:-1]):
                    raise ValueError(f"m_splits {list(m_splits)} cut through 128x128 blocks")
                blocks = [-(-s // BLOCK_SIZE) for s in m_splits]
            for p, d, s in zip(pieces, t._rowwise_data.split(m_splits), t._rowwise_scale_inv.split(blocks)):
                p.update(rowwise_data=d, rowwise_scale_inv=s)
        if t._columnwise_data is not None:
            if t._is_2D_scaled:
                if any(s % BLOCK_SIZE for s in m_splits[:-1]):
                    raise ValueError(f"m_splits {list(m_splits)} cut through 128x128 blocks")
                blocks = [-(-s // BLOCK_SIZE) for s in m_splits]
                cols = zip(t._columnwise_data.split(m_splits, dim=1),
                           t._columnwise_scale_inv.split(blocks, dim=1))
                for p, (d, s) in zip(pieces, cols):
                    p.update(columnwise_data=d, columnwise_scale_inv=s)
            else:
                for p, c in zip(pieces, _column_pieces(t, m_splits)):
                    p.update(c)
        return tuple(t._make_like(shape=(s, k), **p) for s, p in zip(m_splits, pieces))

    @staticmethod
    def backward(ctx, *grads):
        shape, dtype, device = ctx.meta
        parts = [
            g if g is not None else torch.zeros((m, shape[-1]), dtype=dtype, device=device)
            for g, m in zip(grads, ctx.m_splits)
        ]
        return torch.cat(parts).reshape(shape), None
