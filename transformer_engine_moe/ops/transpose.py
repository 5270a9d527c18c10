"""``scaling_aware_transpose``: add a 128x1 columnwise copy to a rowwise 1x128 Float8BlockwiseQTensor.

The wgrad GEMMs need X and dY quantized along tokens (128x1 blocks per
expert). This makes that copy from the rowwise FP8 by exponent shifts: one read
and one write of FP8, no BF16 intermediate, no second rounding where nothing
underflows (rule in ``reference/transpose.py``).
"""

from __future__ import annotations

import torch

from ..backend import Implementation, implementation
from ..layout import MSplits, check_m_splits
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor, scaling_aware_columnwise


def scaling_aware_transpose(
    t: Float8BlockwiseQTensor, m_splits: MSplits = None, *, backend: str = "auto"
) -> Float8BlockwiseQTensor:
    """A Float8BlockwiseQTensor sharing ``t``'s rowwise copy, with a 128x1 columnwise copy made by
    exponent shifts.

    Args:
        t: rowwise 1x128 FP8 with power-of-two scales (COMPACT).
        m_splits: row counts of the groups (experts) whose blocks must not mix: a
            host list, or a device int tensor (no host sync; the scale buffer then
            has the worst-case ``M // 128 + G`` rows, unused ones holding 1). None:
            one group.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Returns the same logical tensor with columnwise data ``[K, M]`` (with ``m_splits``: expert-major
    ``[M*K]``, each group's ``[K, m_g]`` transpose after the previous one, ``layout.py``) and scale_inv
    ``[num_column_blocks, K]``. The kernel never syncs with the host; a tensor
    mislabelled as power-of-two gets NaN scales in the blocks it spoils (the
    reference raises ``ValueError``).
    """
    if not isinstance(t, Float8BlockwiseQTensor):
        raise TypeError(f"t must be a Float8BlockwiseQTensor, got {type(t).__name__}")
    t._check_transposable()
    m, k = t.rowwise_data.shape
    m_splits = check_m_splits(m_splits, m, device=t.device)
    return _Transpose.apply(t, m_splits, implementation(backend, t.rowwise_data, "scaling_aware_transpose"))


class _Transpose(torch.autograd.Function):
    """Adds a copy of the same values: the gradient passes straight through."""

    @staticmethod
    def forward(ctx, t, m_splits, impl: Implementation):
        return t._make_like(**scaling_aware_columnwise(t, m_splits, impl))

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None
