"""``dequantize_blockwise``: Float8BlockwiseQTensor -> high-precision tensor, the functional form of
``t.dequantize()`` (``tensor/float8_blockwise_tensor.py``, which owns the autograd rule: straight-through).

Rowwise 1x128 copies use the Triton kernel (``kernels/dequantize.py``) on the GPU; other layouts, float64
outputs and the CPU use the reference (``reference/dequantize.py``). Both cast the float32 product once, as
TransformerEngine does: a finite value within one FP8 rounding step of the output dtype's max can come back
+-inf (``reference/dequantize.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor


def dequantize_blockwise(
    t: Float8BlockwiseQTensor,
    dtype: torch.dtype = torch.float32,
    usage: Optional[str] = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """The logical ``[..., K]`` value of ``t`` in ``dtype`` (bf16/fp16/fp32/fp64), from its ``usage`` copy
    (default: rowwise when held). ``backend``: ``"auto"``, ``"triton"`` or ``"reference"``.
    Differentiable (straight-through to ``t``)."""
    if not isinstance(t, Float8BlockwiseQTensor):
        raise TypeError(f"t must be a Float8BlockwiseQTensor, got {type(t).__name__}")
    return t.dequantize(dtype, usage, backend=backend)
