"""Scale layouts: this package's COMPACT layout and TransformerEngine's GEMM_READY.

COMPACT (what every op here produces and consumes), for a logical ``[M, K]``:

====================  ==============  ===============================
usage, block          data            scale_inv (float32)
====================  ==============  ===============================
rowwise, 1x128        ``[M, K]``      ``[M, ceil(K/128)]``
columnwise, 128x1     ``[K, M]``      ``[K, ceil(M/128)]``
rowwise, 128x128      ``[M, K]``      ``[ceil(M/128), ceil(K/128)]``
columnwise, 128x128   ``[K, M]``      ``[ceil(K/128), ceil(M/128)]``
====================  ==============  ===============================

Columnwise data is the transpose (the operand layout a wgrad GEMM reads), so a
columnwise copy is exactly the rowwise quantization of ``X^T``.

GEMM_READY (TransformerEngine's default for cuBLAS): same data; 1D scales are
transposed, and the last scale dimension is padded to a multiple of 4
(1x128 rowwise ``[ceil(K/128), pad4(M)]``, 128x1 columnwise
``[ceil(M/128), pad4(K)]``, 128x128 ``[blocks, pad4(blocks)]``).
"""

from __future__ import annotations

import torch

GEMM_READY_ALIGNMENT = 4


def _pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def compact_to_gemm_ready(scale_inv: torch.Tensor, is_2D_scaled: bool) -> torch.Tensor:
    """COMPACT scale_inv (either usage) -> TE GEMM_READY (new tensor, zero padding)."""
    s = scale_inv if is_2D_scaled else scale_inv.t()
    out = s.new_zeros(s.shape[0], _pad_to(s.shape[1], GEMM_READY_ALIGNMENT))
    out[:, : s.shape[1]] = s
    return out


def gemm_ready_to_compact(scale_inv: torch.Tensor, is_2D_scaled: bool, n: int) -> torch.Tensor:
    """TE GEMM_READY scale_inv -> COMPACT.

    ``n`` is the unpadded length of the padded dimension: the number of data
    rows the scales belong to for 1D scaling (M rowwise, K columnwise), the
    number of 128-blocks along the inner dimension for 2D scaling.
    """
    if scale_inv.dim() != 2 or scale_inv.shape[1] < n:
        raise ValueError(
            f"GEMM_READY scale_inv must be 2-D with at least {n} columns, "
            f"got shape {tuple(scale_inv.shape)}"
        )
    s = scale_inv[:, :n]
    return s.contiguous() if is_2D_scaled else s.t().contiguous()
