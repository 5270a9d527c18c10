"""Where each 128x1 column block of a grouped tensor lives, computed inside a kernel.

Rows ``[0, M)`` are split into G groups (experts) whose sizes sit in a device
tensor; each group is covered by ``ceil(m_g/128)`` blocks of 128 rows, the last
one partial. Block ``b`` (the columnwise scale row) is found from the sizes
alone, so launchers need no host copy of them. ``store_columnwise`` writes a
transposed block into the (expert-major) columnwise data. See ``layout.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import m_splits_tensor


@triton.jit
def group_extent(gi, sizes_ptr, num_groups, MAX_GROUPS: tl.constexpr):
    """Group ``gi``'s first row, row count and first column block."""
    g = tl.arange(0, MAX_GROUPS)
    sizes = tl.load(sizes_ptr + g, mask=g < num_groups, other=0)
    before = g < gi
    first_row = tl.sum(tl.where(before, sizes, 0), axis=0)
    first_block = tl.sum(tl.where(before, (sizes + 127) // 128, 0), axis=0)
    return first_row, tl.sum(tl.where(g == gi, sizes, 0), axis=0), first_block


@triton.jit
def column_block_rows(b, sizes_ptr, num_groups, M, GROUPED: tl.constexpr, MAX_GROUPS: tl.constexpr):
    """(first row, row count, group, the group's first row, the group's row count) of column block ``b``;
    the count is 0 for an unused block. Without groups: one group of M rows."""
    if GROUPED:
        g = tl.arange(0, MAX_GROUPS)
        sizes = tl.load(sizes_ptr + g, mask=g < num_groups, other=0)
        gi = tl.sum((tl.cumsum((sizes + 127) // 128, axis=0) <= b).to(tl.int32), axis=0)  # b's group
        first_row, size, first_block = group_extent(gi, sizes_ptr, num_groups, MAX_GROUPS)
        start = first_row + (b - first_block) * 128
        count = tl.maximum(tl.minimum(first_row + size - start, 128), 0)
    else:
        gi = b * 0
        first_row, size = gi, M
        start = b * 128
        count = tl.minimum(M - start, 128)
    return start, count, gi, first_row, size


@triton.jit
def store_columnwise(qt_ptr, out, col_ok, cols, r, count, first, size, local, K):
    """Store ``out [BLOCK_K, 128]`` (columns ``cols`` x ``count`` rows of a column block, transposed) into
    128x1 columnwise data: the ``[K, size]`` block at element ``first * K`` (a group's own block, expert-
    major; ``[K, M]`` without groups), from its column ``local``. The caller proves ``first``, ``size`` and
    ``count`` multiples of 16 where they are (``x // 16 * 16`` in a branch taken when they are): the stores
    are then 16-byte vectors (padded experts always are); ragged groups store bytes."""
    block = qt_ptr + first.to(tl.int64) * K + local
    tl.store(block + cols.to(tl.int64)[:, None] * size + r[None, :], out,
             mask=col_ok[:, None] & (r < count)[None, :])


def group_sizes_arg(m_splits, device):
    """(sizes tensor on ``device`` (int32), G, GROUPED, MAX_GROUPS) for ``column_block_rows``."""
    if m_splits is None:
        return torch.empty(1, dtype=torch.int32, device=device), 1, False, 1
    sizes = m_splits_tensor(m_splits, device, torch.int32)
    g = sizes.numel()
    return sizes, g, True, triton.next_power_of_2(g)

