"""Float8BlockQuantizer: a reusable quantization configuration, named after TransformerEngine's."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .ops.quantize import QuantizeArgs, quantize_with_args
from .recipe import BlockShape, FP8FlowRecipe, Role
from .tensor.float8_blockwise_tensor import Float8BlockwiseQTensor


class Float8BlockQuantizer:
    """Builds Float8BlockwiseQTensors with fixed settings.

    Args mirror TransformerEngine's ``Float8BlockQuantizer`` (``fp8_dtype`` is a
    torch FP8 dtype here): ``rowwise``/``columnwise`` usages,
    ``amax_epsilon``, ``force_pow_2_scales`` and ``block_scaling_dim`` (1 for
    1x128 / 128x1 blocks, 2 for 128x128). ``backend`` as in ``quantize_blockwise``.
    """

    def __init__(
        self,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        rowwise: bool = True,
        columnwise: bool = False,
        amax_epsilon: float = 0.0,
        force_pow_2_scales: bool = True,
        block_scaling_dim: int = 1,
        backend: str = "auto",
    ):
        if type(block_scaling_dim) is not int or block_scaling_dim not in (1, 2):  # not True, not 1.0
            raise ValueError(f"block_scaling_dim must be 1 or 2, got {block_scaling_dim!r}")
        self._args = QuantizeArgs(
            BlockShape.TILE_128x128 if block_scaling_dim == 2 else BlockShape.ROW_1x128,
            fp8_dtype, force_pow_2_scales, amax_epsilon, rowwise, columnwise, backend,
        )

    @classmethod
    def from_recipe(
        cls, recipe: FP8FlowRecipe, role: Role, *, rowwise: bool = True, columnwise: bool = False,
        backend: str = "auto",
    ) -> "Float8BlockQuantizer":
        """The quantizer ``recipe`` prescribes for tensors of ``role`` (a ``Role`` or its string, ``"input"``,
        ``"weight"`` or ``"grad"``; another is refused by name): E5M2 gradients with ``Format.HYBRID``."""
        if not isinstance(recipe, FP8FlowRecipe):
            raise TypeError(f"recipe must be an FP8FlowRecipe, got {type(recipe).__name__}")
        role = Role.parse(role)
        return cls(
            recipe.fp8_dtype(role),
            rowwise=rowwise,
            columnwise=columnwise,
            amax_epsilon=recipe.amax_epsilon,
            force_pow_2_scales=recipe.force_pow_2_scales,
            block_scaling_dim=recipe.block(role).dim,
            backend=backend,
        )

    @property
    def args(self) -> QuantizeArgs:
        """The settings, as ``quantize_with_args`` takes them."""
        return self._args

    @property
    def dtype(self) -> torch.dtype:
        """The FP8 dtype produced (TE's quantizer calls this ``dtype`` too)."""
        return self._args.fp8_dtype

    @property
    def block_scaling_dim(self) -> int:
        return self._args.block.dim

    @property
    def force_pow_2_scales(self) -> bool:
        return self._args.force_pow_2_scales

    @property
    def amax_epsilon(self) -> float:
        return self._args.amax_epsilon

    @property
    def rowwise_usage(self) -> bool:
        return self._args.rowwise

    @property
    def columnwise_usage(self) -> bool:
        return self._args.columnwise

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        """Change which copies ``quantize`` produces."""
        self._args = dataclasses.replace(
            self._args,
            rowwise=self._args.rowwise if rowwise is None else rowwise,
            columnwise=self._args.columnwise if columnwise is None else columnwise,
        )

    def quantize(self, x: torch.Tensor, *, m_splits=None) -> Float8BlockwiseQTensor:
        """Quantize ``x [..., K]``; differentiable (straight-through). ``m_splits`` groups
        the 128x1 columnwise blocks, as in ``quantize_blockwise``."""
        return quantize_with_args(x, self._args, m_splits)

    __call__ = quantize

    def __repr__(self):
        a = self._args
        return (
            f"Float8BlockQuantizer(fp8_dtype={a.fp8_dtype}, block={a.block}, rowwise={a.rowwise}, "
            f"columnwise={a.columnwise}, force_pow_2_scales={a.force_pow_2_scales}, "
            f"amax_epsilon={a.amax_epsilon}, backend={a.backend!r})"
        )
