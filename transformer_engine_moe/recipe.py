"""FP8-Flow recipe: which FP8 format and block shape each tensor role uses.

Mirrors TransformerEngine's ``Float8BlockScaling`` recipe (1x128 blocks for
activations and gradients, 128x128 blocks for weights, power-of-two scales),
as a small frozen dataclass passed explicitly, never read from global state.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

BLOCK_SIZE = 128
"""Edge length of every quantization block (1x128, 128x1, 128x128)."""

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HIGH_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _parse_member(enum_cls, value, name: str):
    """``value`` (a member of ``enum_cls`` or its string value) as a member; ValueError naming ``name`` otherwise.
    A lookup, not ``enum_cls(value)``: torch 2.11's Dynamo cannot trace an Enum's call, and this runs inside
    compiled ops."""
    if isinstance(value, enum_cls):
        return value
    member = enum_cls._value2member_map_.get(value) if isinstance(value, str) else None
    if member is None:
        raise ValueError(f"{name} must be a {enum_cls.__name__} or one of {[m.value for m in enum_cls]}, "
                         f"got {value!r}")
    return member


class BlockShape(str, enum.Enum):
    """The scaling block of a blockwise FP8 tensor (TransformerEngine's ``block_scaling_dim`` 1 or 2).

    A str enum: a member equals its string, so ``"1x128"`` and ``"128x128"`` keep working wherever a
    block shape is taken (``BlockShape.parse``) or compared.
    """

    ROW_1x128 = "1x128"  # activations and gradients: 1x128 along K (the columnwise copy: 128x1 along M)
    TILE_128x128 = "128x128"  # weights: 128x128, transpose-invariant

    def __str__(self) -> str:
        return self.value

    @property
    def is_2D(self) -> bool:
        """128x128 blocks (TE's ``is_2D_scaled``)."""
        return self is BlockShape.TILE_128x128

    @property
    def dim(self) -> int:
        """TE's ``block_scaling_dim``: 1 (1x128) or 2 (128x128)."""
        return 2 if self.is_2D else 1

    @classmethod
    def parse(cls, block, name: str = "block") -> "BlockShape":
        """``block`` (a member or its string) as a member; ValueError naming ``name`` otherwise."""
        return _parse_member(cls, block, name)


class Format(enum.Enum):
    """FP8 format of a recipe, named as in TransformerEngine.

    ``E4M3``: every tensor in E4M3. ``HYBRID``: E4M3 in the forward pass
    (activations, weights), E5M2 for gradients.
    """

    E4M3 = "E4M3"
    HYBRID = "HYBRID"


class Role(enum.Enum):
    """What a quantized tensor is, which fixes its FP8 dtype and block shape.

    Taken as a member or its string (``"input"``, ``"weight"``, ``"grad"``: ``Role.parse``) wherever a role is.
    """

    INPUT = "input"  # activations entering a GEMM: 1x128
    WEIGHT = "weight"  # expert weights: 128x128
    GRAD = "grad"  # output gradients entering dgrad/wgrad: 1x128

    @classmethod
    def parse(cls, role, name: str = "role") -> "Role":
        """``role`` (a member or its string) as a member; ValueError naming ``name`` otherwise."""
        return _parse_member(cls, role, name)


@dataclass(frozen=True, slots=True)
class FP8FlowRecipe:
    """Blockwise FP8 recipe for the FP8-Flow MoE path.

    Args:
        fp8_format: ``Format.E4M3`` or ``Format.HYBRID`` (E5M2 gradients).
        force_pow_2_scales: round every scale down to a power of two (required by
            the scaling-aware transpose, which shifts exponents); TE's quantizer's
            name (the old ``power_2_scales`` reads as an alias).
        amax_epsilon: floor applied to each block's amax before the scale is
            computed (TransformerEngine's ``amax_epsilon``).
    """

    fp8_format: Format = Format.E4M3
    force_pow_2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        if not isinstance(self.fp8_format, Format):
            raise TypeError(
                f"fp8_format must be a transformer_engine_moe.Format, got {self.fp8_format!r}"
            )
        check_bool(self.force_pow_2_scales, "force_pow_2_scales")
        check_amax_epsilon(self.amax_epsilon)

    def fp8_dtype(self, role: Role) -> torch.dtype:
        """The torch FP8 dtype for tensors of ``role`` (a ``Role`` or its string): E5M2 for gradients with
        ``Format.HYBRID`` (TransformerEngine's convention), else E4M3."""
        if Role.parse(role) is Role.GRAD and self.fp8_format is Format.HYBRID:
            return torch.float8_e5m2
        return torch.float8_e4m3fn

    @property
    def power_2_scales(self) -> bool:
        """Alias of ``force_pow_2_scales`` (the recipe's old name)."""
        return self.force_pow_2_scales

    @staticmethod
    def block(role: Role) -> BlockShape:
        """The block shape for tensors of ``role`` (a ``Role`` or its string): 128x128 for weights, else 1x128."""
        return BlockShape.TILE_128x128 if Role.parse(role) is Role.WEIGHT else BlockShape.ROW_1x128


def check_bool(value, name: str) -> None:
    """Raise TypeError naming ``name`` unless ``value`` is a bool: a truthy stand-in (``1``, ``"no"``, ``None``) once
    switched a setting on or off silently."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")


def check_amax_epsilon(amax_epsilon) -> None:
    """Raise ValueError unless ``amax_epsilon`` is a finite float >= 0."""
    if not isinstance(amax_epsilon, (int, float)) or isinstance(amax_epsilon, bool):
        raise TypeError(f"amax_epsilon must be a float, got {type(amax_epsilon).__name__}")
    if not math.isfinite(amax_epsilon) or amax_epsilon < 0:
        raise ValueError(f"amax_epsilon must be finite and >= 0, got {amax_epsilon}")


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 (E4M3), 57344 (E5M2)."""
    return float(torch.finfo(fp8_dtype).max)


def scale_value_for_inf(dtype: torch.dtype) -> float:
    """Scale used when ``fp8_max / amax`` overflows float32.

    TransformerEngine uses the largest finite value of the *input* dtype
    (``compute_scale_from_types``): bf16 max, fp16 max, or float32 max.
    """
    return float(torch.finfo(dtype).max)
