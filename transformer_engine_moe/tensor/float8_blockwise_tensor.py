"""Float8BlockwiseQTensor: blockwise-scaled FP8 data that presents as a high-precision tensor.

Shaped after TransformerEngine's ``Float8BlockwiseQTensor`` and usable without
it. The tensor reports the logical shape ``[..., K]`` and the nominal dtype
(e.g. bf16); it holds a rowwise copy (1x128 or 128x128 blocks) and/or a
columnwise copy (128x1 or 128x128 blocks) in the COMPACT layout described in
:mod:`transformer_engine_moe.layout`. Leading dimensions flatten into M:
rowwise data is always stored ``[M, K]``, so ``split(m_splits)`` along M is a
zero-copy view of data and scales.

Ops that do not know the type see its dequantized value (``__torch_dispatch__``
fallback); in-place writes into it are refused. ``dequantize()``, ``view``,
``reshape`` and ``split`` (``views.py``) are autograd functions with
straight-through gradients, so a loss on a dequantized output reaches whatever
produced the FP8 tensor. This module imports no ``ops/``: its launchers come
from ``backend.py``'s table.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from ..backend import REFERENCE, Implementation, implementation
from ..layout import (MSplits, OwnedSplits, check_m_splits, columnwise_data_shape, compact_to_gemm_ready,
                      num_column_blocks, own_m_splits)
from ..recipe import BLOCK_SIZE, FP8_DTYPES, HIGH_PRECISION_DTYPES, BlockShape, check_bool
from .views import Reshape, Split, reshaped, shape_arg

aten = torch.ops.aten

USAGES = ("rowwise", "columnwise")


def scale_inv_shape(
    m: int, k: int, is_2D_scaled: bool, columnwise: bool, m_splits: MSplits = None
) -> tuple[int, int]:
    """COMPACT scale_inv shape for a logical ``[M, K]`` tensor (columnwise 128x1: grouped by ``m_splits``)."""
    nmb, nkb = -(-m // BLOCK_SIZE), -(-k // BLOCK_SIZE)
    if is_2D_scaled:
        return (nkb, nmb) if columnwise else (nmb, nkb)
    return (num_column_blocks(m, m_splits), k) if columnwise else (m, nkb)


def _shape(shape) -> torch.Size:
    """``shape`` as a ``torch.Size`` of non-negative ints (TypeError/ValueError naming it otherwise; symbolic sizes,
    as ``torch.compile`` passes them to ``__tensor_unflatten__``, are taken as they are)."""
    if isinstance(shape, torch.Tensor) or not isinstance(shape, (tuple, list, torch.Size)) \
            or not all(isinstance(n, (int, torch.SymInt)) and not isinstance(n, bool) for n in shape):
        raise TypeError(f"shape must be a sequence of ints (the logical [..., K]), got {shape!r}")
    if any(type(n) is int and n < 0 for n in shape):
        raise ValueError(f"shape must hold sizes >= 0, got {list(shape)}")
    return torch.Size(shape)


def _check_meta(shape: torch.Size, dtype: torch.dtype, fp8_dtype: torch.dtype) -> None:
    if len(shape) < 1:
        raise ValueError("Float8BlockwiseQTensor needs at least one dimension")
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"dtype must be one of {HIGH_PRECISION_DTYPES}, got {dtype}")
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype}")


def _check_component(name, data, scale_inv, data_shape, scale_shape, fp8_dtype, device):
    if (data is None) != (scale_inv is None):
        raise ValueError(f"{name}_data and {name}_scale_inv must be given together")
    if data is None:
        return
    if data.dtype != fp8_dtype:
        raise TypeError(f"{name}_data must have dtype {fp8_dtype}, got {data.dtype}")
    if tuple(data.shape) != data_shape:
        raise ValueError(f"{name}_data must have shape {list(data_shape)}, got {list(data.shape)}")
    if name == "columnwise" and data.shape[-1] > 1 and data.stride(-1) != 1 and data.numel() > 0:
        raise ValueError(f"columnwise_data must be unit-stride in its last dimension, got strides {data.stride()} "
                         f"for shape {list(data.shape)}: make it contiguous")
    if scale_inv.dtype != torch.float32:
        raise TypeError(f"{name}_scale_inv must be float32, got {scale_inv.dtype}")
    if tuple(scale_inv.shape) != scale_shape:
        raise ValueError(
            f"{name}_scale_inv must have COMPACT shape {list(scale_shape)}, got {list(scale_inv.shape)}"
        )
    if data.device != device or scale_inv.device != device:
        raise ValueError(f"{name} data and scales must be on {device}")


class Float8BlockwiseQTensor(torch.Tensor):
    """Blockwise FP8 tensor with COMPACT scales.

    Args (keyword only):
        shape: logical shape ``[..., K]``; M is the product of leading dims.
        dtype: nominal high-precision dtype (bf16, fp16 or fp32).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        rowwise_data: FP8 ``[M, K]``; rowwise_scale_inv: float32 ``[M, ceil(K/128)]``
            (1x128) or ``[ceil(M/128), ceil(K/128)]`` (128x128). Stored contiguous: a strided
            (sliced, transposed, expanded) one is copied, as every kernel reading a rowwise copy
            (dequantize, transpose, GEMMs, permute) reads it densely.
        columnwise_data: FP8 ``[K, M]``, or with ``columnwise_m_splits`` the expert-major
            ``[M*K]`` (each group's ``[K, m_g]`` transpose after the previous one, ``layout.py``);
            columnwise_scale_inv: float32 ``[num_column_blocks, K]`` (128x1) or
            ``[ceil(K/128), ceil(M/128)]`` (128x128). Kept as given, strided views included (data
            unit-stride along its last dim): ``split`` makes column slices of ``[K, M]``; the wgrad
            GEMM, the one kernel reading this copy, makes a strided one contiguous.
        columnwise_m_splits: groups of rows (list or device tensor) whose 128x1
            columnwise blocks restart at each group boundary; None: one group. The tensor
            keeps its own copy (a list copy, a device tensor's clone: ``layout.own_m_splits``),
            so later writes into the caller's splits do not reach it.
        is_2D_scaled: 128x128 blocks (weights) instead of 1x128 / 128x1.
        force_pow_2_scales: every scale is a power of two (what the scaling-aware
            transpose needs); set by the quantizer (TE's quantizer's name; ``pow2_scales``
            is an alias, taking precedence when passed).
        requires_grad: as for any tensor.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        *,
        shape: Sequence[int],
        dtype: torch.dtype,
        fp8_dtype: torch.dtype,
        rowwise_data: Optional[torch.Tensor] = None,
        rowwise_scale_inv: Optional[torch.Tensor] = None,
        columnwise_data: Optional[torch.Tensor] = None,
        columnwise_scale_inv: Optional[torch.Tensor] = None,
        columnwise_m_splits: MSplits = None,
        is_2D_scaled: bool = False,
        force_pow_2_scales: bool = False,
        requires_grad: bool = False,
        pow2_scales: Optional[bool] = None,
    ):
        shape = _shape(shape)
        _check_meta(shape, dtype, fp8_dtype)
        for name, flag in (("is_2D_scaled", is_2D_scaled), ("force_pow_2_scales", force_pow_2_scales),
                           ("pow2_scales", pow2_scales)):
            if flag is not None:  # "false" once read as True: a tensor claiming power-of-two scales it lacks
                check_bool(flag, name)
        if rowwise_data is None and columnwise_data is None:
            raise ValueError("Float8BlockwiseQTensor needs rowwise or columnwise data")
        for name, t in (("rowwise_data", rowwise_data), ("rowwise_scale_inv", rowwise_scale_inv),
                        ("columnwise_data", columnwise_data), ("columnwise_scale_inv", columnwise_scale_inv)):
            if t is not None and (not isinstance(t, torch.Tensor) or isinstance(t, Float8BlockwiseQTensor)):
                raise TypeError(f"{name} must be a plain torch.Tensor, got {type(t).__name__}")
        device = (rowwise_data if rowwise_data is not None else columnwise_data).device
        k = shape[-1]
        m = math.prod(shape[:-1])
        if columnwise_m_splits is not None and (is_2D_scaled or columnwise_data is None):
            raise ValueError("columnwise_m_splits needs 1x128-scaled columnwise data")
        splits = own_m_splits(columnwise_m_splits, m, "columnwise_m_splits", device)
        groups = None if splits is None else splits.values
        _check_component(
            "rowwise", rowwise_data, rowwise_scale_inv, (m, k),
            scale_inv_shape(m, k, is_2D_scaled, False), fp8_dtype, device,
        )
        _check_component(
            "columnwise", columnwise_data, columnwise_scale_inv, columnwise_data_shape(m, k, groups),
            scale_inv_shape(m, k, is_2D_scaled, True, groups), fp8_dtype, device,
        )
        if rowwise_data is not None:  # the kernels read rowwise copies densely: a view is copied
            rowwise_data, rowwise_scale_inv = rowwise_data.contiguous(), rowwise_scale_inv.contiguous()
        return cls._assemble(shape, dtype, fp8_dtype, device, requires_grad, rowwise_data, rowwise_scale_inv,
                             columnwise_data, columnwise_scale_inv, splits, bool(is_2D_scaled),
                             bool(force_pow_2_scales if pow2_scales is None else pow2_scales))

    @classmethod
    def _assemble(cls, shape, dtype, fp8_dtype, device, requires_grad, rowwise_data, rowwise_scale_inv,
                  columnwise_data, columnwise_scale_inv, splits: Optional[OwnedSplits], is_2D_scaled: bool,
                  force_pow_2_scales: bool) -> "Float8BlockwiseQTensor":
        """The tensor over components already checked (the constructor's) or given by a launcher (``_of_launch``)."""
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        self._rowwise_data, self._rowwise_scale_inv = rowwise_data, rowwise_scale_inv
        self._columnwise_data, self._columnwise_scale_inv = columnwise_data, columnwise_scale_inv
        self._set_columnwise_m_splits(splits)
        self._fp8_dtype, self._is_2D_scaled, self._force_pow_2_scales = fp8_dtype, is_2D_scaled, force_pow_2_scales
        return self

    @classmethod
    def _of_launch(cls, *, shape, dtype: torch.dtype, fp8_dtype: torch.dtype, rowwise_data=None,
                   rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None,
                   columnwise_m_splits: MSplits = None, is_2D_scaled: bool = False,
                   force_pow_2_scales: bool = False) -> "Float8BlockwiseQTensor":
        """The constructor without its argument checks, for the package's ops on what a launcher of theirs has
        just returned: contiguous components of the shapes, dtypes and device the launchers' contracts give (which
        ``tests/tensor`` holds them to by running the ops through the checked constructor). Those checks cost
        about 15 us of host time a tensor, a dozen tensors a step, on the path the GPU waits for at small experts
        (docs/megatron.md). The splits are kept as the constructor keeps them (``own_m_splits``). Under
        ``torch.compile`` the checked constructor, which Dynamo traces as one (checks run at trace time)."""
        if torch.compiler.is_compiling():
            return cls(shape=shape, dtype=dtype, fp8_dtype=fp8_dtype, rowwise_data=rowwise_data,
                       rowwise_scale_inv=rowwise_scale_inv, columnwise_data=columnwise_data,
                       columnwise_scale_inv=columnwise_scale_inv, columnwise_m_splits=columnwise_m_splits,
                       is_2D_scaled=is_2D_scaled, force_pow_2_scales=force_pow_2_scales)
        device = (rowwise_data if rowwise_data is not None else columnwise_data).device
        splits = own_m_splits(columnwise_m_splits, math.prod(shape[:-1]), "columnwise_m_splits", device)
        return cls._assemble(shape, dtype, fp8_dtype, device, False, rowwise_data, rowwise_scale_inv,
                             columnwise_data, columnwise_scale_inv, splits, is_2D_scaled, force_pow_2_scales)

    # ------------------------------------------------------------------ metadata
    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._fp8_dtype

    @property
    def is_2D_scaled(self) -> bool:
        return self._is_2D_scaled

    @property
    def force_pow_2_scales(self) -> bool:
        """Whether every scale is a power of two."""
        return self._force_pow_2_scales

    @property
    def pow2_scales(self) -> bool:
        """Alias of ``force_pow_2_scales``."""
        return self._force_pow_2_scales

    @property
    def block(self) -> BlockShape:
        """``BlockShape.TILE_128x128`` or ``BlockShape.ROW_1x128`` (rowwise; the columnwise copy is 128x1);
        equal to the strings ``"128x128"`` / ``"1x128"``."""
        return BlockShape.TILE_128x128 if self._is_2D_scaled else BlockShape.ROW_1x128

    @property
    def rowwise_data(self) -> Optional[torch.Tensor]:
        """FP8 ``[M, K]``, or None."""
        return self._rowwise_data

    @property
    def rowwise_scale_inv(self) -> Optional[torch.Tensor]:
        """Float32 COMPACT ``[M, ceil(K/128)]`` (128x128: ``[ceil(M/128), ceil(K/128)]``), or None."""
        return self._rowwise_scale_inv

    @property
    def columnwise_data(self) -> Optional[torch.Tensor]:
        """FP8 ``[K, M]`` (transposed; grouped: expert-major ``[M*K]``, ``layout.py``), or None."""
        return self._columnwise_data

    @property
    def columnwise_scale_inv(self) -> Optional[torch.Tensor]:
        """Float32 COMPACT ``[num_column_blocks, K]`` (128x128: ``[ceil(K/128), ceil(M/128)]``), or None."""
        return self._columnwise_scale_inv

    @property
    def columnwise_m_splits(self) -> MSplits:
        """Row groups the 128x1 columnwise blocks restart at, or None: a new list of the host sizes, or the
        device tensor the copy was made with, for ``grouped_gemm_wgrad``'s check that it gets the same splits
        (``layout.OwnedSplits.as_given``; the tensor itself reads its clone of it)."""
        return None if self._columnwise_m_splits is None else self._owned_splits().as_given()

    def _owned_splits(self) -> Optional[OwnedSplits]:
        """The columnwise groups as owned (shared as they are by tensors made from this one's storage)."""
        if self._columnwise_m_splits is None:
            return None
        return OwnedSplits(self._columnwise_m_splits, self._columnwise_m_splits_given)

    def _set_columnwise_m_splits(self, splits: Optional[OwnedSplits]) -> None:
        """Keep ``splits`` as two attributes: ``_columnwise_m_splits``, the values every method here reads (a
        list, or a device tensor that ``__tensor_flatten__`` names), and the caller's tensor they came from."""
        self._columnwise_m_splits = None if splits is None else splits.values
        self._columnwise_m_splits_given = None if splits is None else splits.given

    @property
    def usages(self) -> tuple[str, ...]:
        """The copies held: a subset of ``("rowwise", "columnwise")``."""
        held = (self._rowwise_data is not None, self._columnwise_data is not None)
        return tuple(u for u, h in zip(USAGES, held) if h)

    def _components(self) -> dict:
        """The storage: data, scales and the columnwise grouping."""
        return dict(
            rowwise_data=self._rowwise_data,
            rowwise_scale_inv=self._rowwise_scale_inv,
            columnwise_data=self._columnwise_data,
            columnwise_scale_inv=self._columnwise_scale_inv,
            columnwise_m_splits=self._owned_splits(),
        )

    def _make_like(self, *, shape=None, requires_grad=False, **components) -> "Float8BlockwiseQTensor":
        """New tensor sharing this one's storage, with some fields replaced."""
        merged = {**self._components(), **components}
        return Float8BlockwiseQTensor(
            shape=self.shape if shape is None else shape,
            dtype=self.dtype,
            fp8_dtype=self._fp8_dtype,
            is_2D_scaled=self._is_2D_scaled,
            force_pow_2_scales=self._force_pow_2_scales,
            requires_grad=requires_grad,
            **merged,
        )

    def __tensor_flatten__(self):
        """The inner tensors (attribute names) and the metadata: ``torch.compile`` traces the tensor through
        them (Dynamo reads an attribute of an in-graph tensor only if it is named here). Device splits are two
        inner tensors: ``columnwise_m_splits`` (the caller's tensor, what the property returns) and
        ``_columnwise_m_splits`` (the owned clone); host ones are metadata."""
        inner = [k for k, v in self._components().items() if isinstance(v, torch.Tensor)]
        splits = self._columnwise_m_splits
        if isinstance(splits, torch.Tensor):
            inner += ["columnwise_m_splits", "_columnwise_m_splits"]
        splits = splits if isinstance(splits, list) else None
        return inner, (self.dtype, self._fp8_dtype, self._is_2D_scaled, self._force_pow_2_scales, splits)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size, outer_stride) -> "Float8BlockwiseQTensor":
        dtype, fp8_dtype, is_2D_scaled, force_pow_2_scales, splits = meta
        inner = dict(inner)
        if "_columnwise_m_splits" in inner:
            splits = OwnedSplits(inner.pop("_columnwise_m_splits"), inner.pop("columnwise_m_splits"))
        if splits is not None:
            inner["columnwise_m_splits"] = splits
        return Float8BlockwiseQTensor(shape=outer_size, dtype=dtype, fp8_dtype=fp8_dtype, is_2D_scaled=is_2D_scaled,
                                      force_pow_2_scales=force_pow_2_scales, **inner)

    def __repr__(self, *, tensor_contents=None):
        return (
            f"Float8BlockwiseQTensor(shape={list(self.shape)}, dtype={self.dtype}, "
            f"fp8_dtype={self._fp8_dtype}, block={self.block}, usages={self.usages}, "
            f"device={self.device}, requires_grad={self.requires_grad})"
        )

    def __reduce_ex__(self, protocol):
        # FP8 data travels as uint8 views: plain pickle cannot serialise float8 storages (torch 2.11-2.13);
        # the groups as the owned values (a copy is unpickled: no identity to keep)
        components = {k: (v.view(torch.uint8) if k.endswith("_data") and v is not None else v)
                      for k, v in self._components().items()}
        components["columnwise_m_splits"] = self._columnwise_m_splits
        return (
            _rebuild,
            (tuple(self.shape), self.dtype, self._fp8_dtype, self._is_2D_scaled, self._force_pow_2_scales, components),
        )

    # ------------------------------------------------------------------ dequantize
    def _check_usage(self, usage: Optional[str]) -> str:
        if usage is None:
            return self.usages[0]
        if usage not in USAGES:
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        if usage not in self.usages:
            raise ValueError(f"this Float8BlockwiseQTensor holds no {usage} data (usages={self.usages})")
        return usage

    def _dequantize_no_grad(self, dtype: torch.dtype, usage: Optional[str] = None,
                            impl: Implementation = REFERENCE) -> torch.Tensor:
        """The ``usage`` copy dequantized by ``impl``'s launchers (``backend.py``), no autograd."""
        if self._check_usage(usage) == "rowwise":
            dq = impl.dequantize_128x128 if self._is_2D_scaled else impl.dequantize_1x128
            out = dq(self._rowwise_data, self._rowwise_scale_inv, dtype)
        elif self._is_2D_scaled:
            out = impl.dequantize_128x128(self._columnwise_data, self._columnwise_scale_inv, dtype).t()
        else:
            out = impl.dequantize_128x1(
                self._columnwise_data, self._columnwise_scale_inv, dtype, self._columnwise_m_splits
            )
        return out.reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32, usage: Optional[str] = None, *,
                   backend: str = "auto") -> torch.Tensor:
        """The logical ``[..., K]`` tensor in ``dtype`` from the ``usage`` copy.

        ``usage`` defaults to rowwise when held, else columnwise. Differentiable:
        the gradient passes straight through (cast to the nominal dtype). A rowwise
        1x128 copy runs the Triton kernel on the GPU (``backend``: ``"auto"``,
        ``"triton"`` or ``"reference"``, ``backend.py``); other layouts, float64
        outputs and the CPU run ``reference/dequantize.py``. Both compute each FP8 value times its
        block's scale_inv in float32 and cast the product once to ``dtype``, as TransformerEngine
        does: a finite value within one FP8 rounding step of ``dtype``'s max can come out +-inf
        (``reference/dequantize.py``).
        """
        if dtype not in HIGH_PRECISION_DTYPES + (torch.float64,):
            raise TypeError(f"dequantize dtype must be a floating dtype, got {dtype}")
        usage = self._check_usage(usage)
        impl = implementation(backend, self, "dequantize")
        if dtype == torch.float64:
            impl = REFERENCE  # the 1x128 kernel writes bf16/fp16/fp32
        return _Dequantize.apply(self, dtype, usage, impl)

    def scale_inv_gemm_ready(self, usage: str = "rowwise") -> torch.Tensor:
        """The ``usage`` scales converted to TransformerEngine's GEMM_READY layout (a copy)."""
        usage = self._check_usage(usage)
        if usage == "columnwise" and self._columnwise_m_splits is not None:
            raise ValueError("TE's GEMM_READY layout has no grouped 128x1 columnwise scales")
        s = self._rowwise_scale_inv if usage == "rowwise" else self._columnwise_scale_inv
        return compact_to_gemm_ready(s, self._is_2D_scaled, usage == "columnwise")

    # ------------------------------------------------------------------ usages
    def update_usage(
        self,
        rowwise_usage: Optional[bool] = None,
        columnwise_usage: Optional[bool] = None,
        m_splits: MSplits = None,
    ) -> None:
        """Drop a copy, or derive a missing one in place.

        128x128: the other copy is the transpose (scales are transpose-invariant).
        1x128: the 128x1 columnwise copy comes from the scaling-aware transpose
        of the rowwise copy (power-of-two scales only), its blocks restarting at
        each group of ``m_splits``; a rowwise copy cannot be recovered.
        """
        for name, flag in (("rowwise_usage", rowwise_usage), ("columnwise_usage", columnwise_usage)):
            if flag is not None:
                check_bool(flag, name)
        want_row = rowwise_usage if rowwise_usage is not None else self._rowwise_data is not None
        want_col = columnwise_usage if columnwise_usage is not None else self._columnwise_data is not None
        if not (want_row or want_col):
            raise ValueError("update_usage must keep rowwise or columnwise data")
        if want_col and self._columnwise_data is None:
            if self._is_2D_scaled:
                self._columnwise_data = self._rowwise_data.t().contiguous()
                self._columnwise_scale_inv = self._rowwise_scale_inv.t().contiguous()
            else:
                self._check_transposable()
                splits = own_m_splits(m_splits, self._rowwise_data.shape[0], device=self.device)
                col = scaling_aware_columnwise(self, None if splits is None else splits.values,
                                               implementation("auto", self, "update_usage"))
                self._columnwise_data = col["columnwise_data"]
                self._columnwise_scale_inv = col["columnwise_scale_inv"]
                self._set_columnwise_m_splits(splits)
        if want_row and self._rowwise_data is None:
            if not self._is_2D_scaled:
                raise ValueError("a columnwise-only 1x128 tensor cannot recover rowwise data")
            self._rowwise_data = self._columnwise_data.t().contiguous()
            self._rowwise_scale_inv = self._columnwise_scale_inv.t().contiguous()
        if not want_row:
            self._rowwise_data = self._rowwise_scale_inv = None
        if not want_col:
            self._columnwise_data = self._columnwise_scale_inv = None
            self._set_columnwise_m_splits(None)

    def _check_transposable(self) -> None:
        """Raise unless the scaling-aware transpose can make this tensor's 128x1 copy: rowwise 1x128 data
        with power-of-two scales."""
        if self._is_2D_scaled:
            raise ValueError("t is 128x128-scaled: its columnwise copy is a plain transpose (update_usage)")
        if self._rowwise_data is None:
            raise ValueError("t has no rowwise data to transpose")
        if not self._force_pow_2_scales:
            raise ValueError(
                "t's scales are not powers of two (quantized with force_pow_2_scales=False); the scaling-aware "
                "transpose shifts exponents and would need a real requantization"
            )

    # ------------------------------------------------------------------ shape ops
    def view(self, *shape) -> "Float8BlockwiseQTensor":
        """Reshape between ``[..., K]`` shapes with the same last dim K (zero copy)."""
        return Reshape.apply(self, shape_arg(shape))

    def reshape(self, *shape) -> "Float8BlockwiseQTensor":
        """Same as :meth:`view`: FP8 storage is ``[M, K]`` whatever the leading dims."""
        return Reshape.apply(self, shape_arg(shape))

    def split(self, m_splits, dim: int = 0) -> tuple["Float8BlockwiseQTensor", ...]:
        """Split the flattened ``[M, K]`` rows by the host list ``m_splits`` (zero copy).

        Each piece is ``[m_i, K]``. Rowwise 1x128 data and scales split at any
        row. A 128x1 columnwise copy splits where its blocks end (a multiple of
        128 rows into a group, or a group boundary), each piece keeping the
        groups it holds; 128x128 scales split at multiples of 128.
        """
        if dim != 0:
            raise ValueError(f"Float8BlockwiseQTensor.split splits rows (dim=0), got dim={dim}")
        if not isinstance(m_splits, (list, tuple)):
            raise TypeError("m_splits must be a list of Python ints (a device tensor would need a host sync); "
                            f"got {type(m_splits).__name__}")
        m = math.prod(self.shape[:-1])
        if m_splits or m:  # an empty list splits no rows into no pieces
            m_splits = check_m_splits(m_splits, m)
        return Split.apply(self, tuple(m_splits))

    def __setitem__(self, key, value):
        raise TypeError("Float8BlockwiseQTensor does not support item assignment: its FP8 data is immutable "
                        "here; dequantize() it, or quantize a new tensor")

    @property
    def data(self):
        return self.detach()

    @data.setter
    def data(self, value):
        raise TypeError("Float8BlockwiseQTensor.data cannot be assigned: its FP8 data is immutable here; "
                        "quantize a new tensor")

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._make_like()
        if func is aten.clone.default:
            src = args[0]  # data and scales copied; columnwise_m_splits (owned metadata) shared
            return src._make_like(**{k: (v.clone() if v is not None and k != "columnwise_m_splits" else v)
                                     for k, v in src._components().items()})
        if func in (aten.view.default, aten._unsafe_view.default) and isinstance(args[0], cls):
            return reshaped(args[0], args[1])  # torch.reshape, flatten, ...: row-preserving views stay FP8
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                val = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(val, cls):
                    raise TypeError(
                        f"{func} would write into a Float8BlockwiseQTensor; its FP8 data is "
                        "immutable here: dequantize() it, or quantize a new tensor"
                    )
        if isinstance(args[0], cls) and any(r.alias_info is not None and not r.alias_info.is_write
                                            for r in func._schema.returns):
            raise TypeError(
                f"{func} would return a view of a Float8BlockwiseQTensor (indexing, slicing, transposing); "
                "it has no FP8 form, and writes through a dequantized copy would be lost: dequantize() "
                "first, or use view/reshape (same last dim) or split"
            )
        args, kwargs = pytree.tree_map_only(
            cls, lambda t: t._dequantize_no_grad(t.dtype), (args, kwargs)
        )
        return func(*args, **kwargs)


def scaling_aware_columnwise(t: Float8BlockwiseQTensor, m_splits: MSplits, impl: Implementation) -> dict:
    """The 128x1 columnwise components of ``t`` made from its rowwise copy by exponent shifts (``impl``'s
    launcher; rule in ``reference/transpose.py``), blocks restarting at each group of the checked
    ``m_splits``: data ``[K, M]`` (grouped: expert-major ``[M*K]``), scale_inv ``[num_column_blocks, K]``.
    A function, not a method: ``torch.compile`` traces a method of the tensor type as a tensor op."""
    data_t, scale_t = impl.scaling_aware_transpose(t.rowwise_data, t.rowwise_scale_inv, m_splits)
    return dict(columnwise_data=data_t, columnwise_scale_inv=scale_t, columnwise_m_splits=m_splits)


def _rebuild(shape, dtype, fp8_dtype, is_2D_scaled, force_pow_2_scales, components):
    components = {k: (v.view(fp8_dtype) if k.endswith("_data") and v is not None else v)
                  for k, v in components.items()}
    return Float8BlockwiseQTensor(
        shape=shape, dtype=dtype, fp8_dtype=fp8_dtype, is_2D_scaled=is_2D_scaled,
        force_pow_2_scales=force_pow_2_scales, **components,
    )


# torch.load's default (weights_only=True, torch >= 2.6) refused a saved tensor with an UnpicklingError; _rebuild only
# calls the checked constructor on tensors, dtypes and lists, so it is a safe global as torch's own rebuilders are
torch.serialization.add_safe_globals([_rebuild])


class _Dequantize(torch.autograd.Function):
    """``Float8BlockwiseQTensor.dequantize``: straight-through gradient, cast to the nominal dtype."""

    @staticmethod
    def forward(ctx, t, dtype, usage, impl: Implementation):
        ctx.nominal_dtype = t.dtype
        return t._dequantize_no_grad(dtype, usage, impl)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.nominal_dtype), None, None, None
