"""FP8 transposes: ``scaling_aware_transpose`` adds a 128x1 columnwise copy to a rowwise 1x128
Float8BlockwiseQTensor; ``transpose_grouped_weight`` transposes stacked 128x128 expert weights.

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
from .grouped_gemm import check_grouped_weight


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


def transpose_grouped_weight(weight: Float8BlockwiseQTensor, backend: str = "auto") -> Float8BlockwiseQTensor:
    """``[G, N, K]`` 128x128 FP8 -> ``[G, K, N]`` (each expert transposed; exact: the scales are
    transpose-invariant). The dgrad GEMM's K-major operand. ``backend``: ``"auto"`` (Triton byte
    transpose on CUDA, reference elsewhere), ``"triton"`` or ``"reference"``."""
    data, scale = check_grouped_weight(weight)
    g, n, k = weight.shape
    impl = implementation(backend, data, "transpose_grouped_weight")
    data_t, scale_t = impl.transpose_128x128(data, scale)
    return Float8BlockwiseQTensor._of_launch(
        shape=(g, k, n), dtype=weight.dtype, fp8_dtype=weight.fp8_dtype, is_2D_scaled=True,
        force_pow_2_scales=weight.force_pow_2_scales, rowwise_data=data_t.view(g * k, n),
        rowwise_scale_inv=scale_t.view(g * k // 128, n // 128),
    )
