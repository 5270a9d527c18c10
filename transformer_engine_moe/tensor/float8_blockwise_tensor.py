"""Float8BlockwiseQTensor: blockwise-scaled FP8 data that presents as a high-precision tensor.

Shaped after TransformerEngine's ``Float8BlockwiseQTensor`` and usable without
it. The tensor reports the logical shape ``[..., K]`` and the nominal dtype
(e.g. bf16); it holds a rowwise copy (1x128 or 128x128 blocks) and/or a
columnwise copy (128x1 or 128x128 blocks) in the COMPACT layout described in
:mod:`transformer_engine_moe.tensor.layout`. Leading dimensions flatten into M:
rowwise data is always stored ``[M, K]``, so ``split(m_splits)`` along M is a
zero-copy view of data and scales.

Ops that do not know the type see its dequantized value (``__torch_dispatch__``
fallback); in-place writes into it are refused. ``dequantize()``, ``view``,
``reshape`` and ``split`` are autograd functions with straight-through
gradients, so a loss on a dequantized output reaches whatever produced the FP8
tensor.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from ..recipe import BLOCK_SIZE, FP8_DTYPES, HIGH_PRECISION_DTYPES
from ..reference.quantize import dequantize_1x128, dequantize_128x128
from .layout import compact_to_gemm_ready

aten = torch.ops.aten

USAGES = ("rowwise", "columnwise")


def scale_inv_shape(m: int, k: int, is_2D_scaled: bool, columnwise: bool) -> tuple[int, int]:
    """COMPACT scale_inv shape for a logical ``[M, K]`` tensor."""
    nmb, nkb = -(-m // BLOCK_SIZE), -(-k // BLOCK_SIZE)
    if is_2D_scaled:
        return (nkb, nmb) if columnwise else (nmb, nkb)
    return (k, nmb) if columnwise else (m, nkb)


def _check_component(name, data, scale_inv, data_shape, scale_shape, fp8_dtype, device):
    if (data is None) != (scale_inv is None):
        raise ValueError(f"{name}_data and {name}_scale_inv must be given together")
    if data is None:
        return
    if data.dtype != fp8_dtype:
        raise TypeError(f"{name}_data must have dtype {fp8_dtype}, got {data.dtype}")
    if tuple(data.shape) != data_shape:
        raise ValueError(f"{name}_data must have shape {list(data_shape)}, got {list(data.shape)}")
    if data.stride(-1) != 1 and data.numel() > 0:
        raise ValueError(f"{name}_data must be unit-stride in its last dimension, strides {data.stride()}")
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
            (1x128) or ``[ceil(M/128), ceil(K/128)]`` (128x128).
        columnwise_data: FP8 ``[K, M]``; columnwise_scale_inv: float32
            ``[K, ceil(M/128)]`` (128x1) or ``[ceil(K/128), ceil(M/128)]`` (128x128).
        is_2D_scaled: 128x128 blocks (weights) instead of 1x128 / 128x1.
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
        is_2D_scaled: bool = False,
        requires_grad: bool = False,
    ):
        shape = torch.Size(shape)
        if len(shape) < 1:
            raise ValueError("Float8BlockwiseQTensor needs at least one dimension")
        if dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"dtype must be one of {HIGH_PRECISION_DTYPES}, got {dtype}")
        if fp8_dtype not in FP8_DTYPES:
            raise TypeError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype}")
        if rowwise_data is None and columnwise_data is None:
            raise ValueError("Float8BlockwiseQTensor needs rowwise or columnwise data")
        device = (rowwise_data if rowwise_data is not None else columnwise_data).device
        k = shape[-1]
        m = math.prod(shape[:-1])
        _check_component(
            "rowwise", rowwise_data, rowwise_scale_inv, (m, k),
            scale_inv_shape(m, k, is_2D_scaled, False), fp8_dtype, device,
        )
        _check_component(
            "columnwise", columnwise_data, columnwise_scale_inv, (k, m),
            scale_inv_shape(m, k, is_2D_scaled, True), fp8_dtype, device,
        )
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=requires_grad
        )
        self._rowwise_data = rowwise_data
        self._rowwise_scale_inv = rowwise_scale_inv
        self._columnwise_data = columnwise_data
        self._columnwise_scale_inv = columnwise_scale_inv
        self._fp8_dtype = fp8_dtype
        self._is_2D_scaled = bool(is_2D_scaled)
        return self

    # ------------------------------------------------------------------ metadata
    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._fp8_dtype

    @property
    def is_2D_scaled(self) -> bool:
        return self._is_2D_scaled

    @property
    def block(self) -> str:
        """``"128x128"`` or ``"1x128"`` (rowwise; the columnwise copy is 128x1)."""
        return "128x128" if self._is_2D_scaled else "1x128"

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
        """FP8 ``[K, M]`` (transposed), or None."""
        return self._columnwise_data

    @property
    def columnwise_scale_inv(self) -> Optional[torch.Tensor]:
        """Float32 COMPACT ``[K, ceil(M/128)]`` (128x128: ``[ceil(K/128), ceil(M/128)]``), or None."""
        return self._columnwise_scale_inv

    @property
    def usages(self) -> tuple[str, ...]:
        """The copies held: a subset of ``("rowwise", "columnwise")``."""
        held = (self._rowwise_data is not None, self._columnwise_data is not None)
        return tuple(u for u, h in zip(USAGES, held) if h)

    def _components(self) -> dict:
        return dict(
            rowwise_data=self._rowwise_data,
            rowwise_scale_inv=self._rowwise_scale_inv,
            columnwise_data=self._columnwise_data,
            columnwise_scale_inv=self._columnwise_scale_inv,
        )

    def _make_like(self, *, shape=None, requires_grad=False, **components) -> "Float8BlockwiseQTensor":
        """New tensor sharing this one's storage, with some fields replaced."""
        merged = {**self._components(), **components}
        return Float8BlockwiseQTensor(
            shape=self.shape if shape is None else shape,
            dtype=self.dtype,
            fp8_dtype=self._fp8_dtype,
            is_2D_scaled=self._is_2D_scaled,
            requires_grad=requires_grad,
            **merged,
        )

    def __repr__(self, *, tensor_contents=None):
        return (
            f"Float8BlockwiseQTensor(shape={list(self.shape)}, dtype={self.dtype}, "
            f"fp8_dtype={self._fp8_dtype}, block={self.block}, usages={self.usages}, "
            f"device={self.device}, requires_grad={self.requires_grad})"
        )

    def __reduce_ex__(self, protocol):
        return (
            _rebuild,
            (tuple(self.shape), self.dtype, self._fp8_dtype, self._is_2D_scaled, self._components()),
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

    def _dequantize_no_grad(self, dtype: torch.dtype, usage: Optional[str] = None) -> torch.Tensor:
        dq = dequantize_128x128 if self._is_2D_scaled else dequantize_1x128
        if self._check_usage(usage) == "rowwise":
            out = dq(self._rowwise_data, self._rowwise_scale_inv, dtype)
        else:
            out = dq(self._columnwise_data, self._columnwise_scale_inv, dtype).t()
        return out.reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32, usage: Optional[str] = None) -> torch.Tensor:
        """The logical ``[..., K]`` tensor in ``dtype`` from the ``usage`` copy.

        ``usage`` defaults to rowwise when held, else columnwise. Differentiable:
        the gradient passes straight through (cast to the nominal dtype).
        """
        if dtype not in HIGH_PRECISION_DTYPES + (torch.float64,):
            raise TypeError(f"dequantize dtype must be a floating dtype, got {dtype}")
        self._check_usage(usage)
        return _Dequantize.apply(self, dtype, usage)

    def scale_inv_gemm_ready(self, usage: str = "rowwise") -> torch.Tensor:
        """The ``usage`` scales converted to TransformerEngine's GEMM_READY layout (a copy)."""
        usage = self._check_usage(usage)
        s = self._rowwise_scale_inv if usage == "rowwise" else self._columnwise_scale_inv
        return compact_to_gemm_ready(s, self._is_2D_scaled)

    # ------------------------------------------------------------------ usages
    def update_usage(
        self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None
    ) -> None:
        """Drop a copy, or (128x128 only) derive the columnwise copy by transposing.

        A 1x128 tensor cannot gain a columnwise copy here: its 128x1 scales differ
        (use ``scaling_aware_transpose``).
        """
        want_row = rowwise_usage if rowwise_usage is not None else self._rowwise_data is not None
        want_col = columnwise_usage if columnwise_usage is not None else self._columnwise_data is not None
        if not (want_row or want_col):
            raise ValueError("update_usage must keep rowwise or columnwise data")
        if want_col and self._columnwise_data is None:
            if not self._is_2D_scaled:
                raise ValueError(
                    "a 1x128 Float8BlockwiseQTensor cannot derive 128x1 columnwise data from rowwise "
                    "data by transposing; requantize or use the scaling-aware transpose"
                )
            self._columnwise_data = self._rowwise_data.t().contiguous()
            self._columnwise_scale_inv = self._rowwise_scale_inv.t().contiguous()
        if want_row and self._rowwise_data is None:
            if not self._is_2D_scaled:
                raise ValueError("a columnwise-only 1x128 tensor cannot recover rowwise data")
            self._rowwise_data = self._columnwise_data.t().contiguous()
            self._rowwise_scale_inv = self._columnwise_scale_inv.t().contiguous()
        if not want_row:
            self._rowwise_data = self._rowwise_scale_inv = None
        if not want_col:
            self._columnwise_data = self._columnwise_scale_inv = None

    # ------------------------------------------------------------------ shape ops
    def view(self, *shape) -> "Float8BlockwiseQTensor":
        """Reshape between ``[..., K]`` shapes with the same last dim K (zero copy)."""
        return _Reshape.apply(self, _shape_arg(shape))

    def reshape(self, *shape) -> "Float8BlockwiseQTensor":
        """Same as :meth:`view`: FP8 storage is ``[M, K]`` whatever the leading dims."""
        return _Reshape.apply(self, _shape_arg(shape))

    def split(self, m_splits, dim: int = 0) -> tuple["Float8BlockwiseQTensor", ...]:
        """Split the flattened ``[M, K]`` rows by the host list ``m_splits`` (zero copy).

        Each piece is ``[m_i, K]``. Rowwise 1x128 data and scales split at any
        row; a columnwise copy or 128x128 scales only at multiples of 128
        (blocks must not straddle a boundary).
        """
        if dim != 0:
            raise ValueError(f"Float8BlockwiseQTensor.split splits rows (dim=0), got dim={dim}")
        if not isinstance(m_splits, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in m_splits
        ):
            raise TypeError(
                "m_splits must be a list of Python ints (a device tensor would need a host sync); "
                f"got {type(m_splits).__name__}"
            )
        m = math.prod(self.shape[:-1])
        if any(s < 0 for s in m_splits) or sum(m_splits) != m:
            raise ValueError(f"m_splits must be >= 0 and sum to M={m}, got {list(m_splits)}")
        if (self._is_2D_scaled or self._columnwise_data is not None) and any(
            s % BLOCK_SIZE for s in m_splits[:-1]
        ):
            raise ValueError(
                f"m_splits {list(m_splits)} cut through 128-row scaling blocks of the "
                f"{'128x128' if self._is_2D_scaled else 'columnwise'} copy; "
                "drop it with update_usage(columnwise_usage=False) first"
            )
        return _Split.apply(self, tuple(m_splits))

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._make_like()
        if func is aten.clone.default:
            src = args[0]
            return src._make_like(
                **{k: (v.clone() if v is not None else None) for k, v in src._components().items()}
            )
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                val = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(val, cls):
                    raise TypeError(
                        f"{func} would write into a Float8BlockwiseQTensor; its FP8 data is "
                        "immutable here: dequantize() it, or quantize a new tensor"
                    )
        args, kwargs = pytree.tree_map_only(
            cls, lambda t: t._dequantize_no_grad(t.dtype), (args, kwargs)
        )
        return func(*args, **kwargs)


def _rebuild(shape, dtype, fp8_dtype, is_2D_scaled, components):
    return Float8BlockwiseQTensor(
        shape=shape, dtype=dtype, fp8_dtype=fp8_dtype, is_2D_scaled=is_2D_scaled, **components
    )


def _shape_arg(shape) -> tuple:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return tuple(shape[0])
    return tuple(shape)


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, dtype, usage):
        ctx.nominal_dtype = t.dtype
        return t._dequantize_no_grad(dtype, usage)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.nominal_dtype), None, None


class _Reshape(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, shape):
        new_shape = torch.empty(t.shape, device="meta").reshape(shape).shape
        if len(new_shape) < 1 or new_shape[-1] != t.shape[-1]:
            raise ValueError(
                f"Float8BlockwiseQTensor can only reshape between [..., K] shapes with K={t.shape[-1]}, "
                f"got {list(new_shape)} from {list(t.shape)}"
            )
        ctx.shape = t.shape
        return t._make_like(shape=new_shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape), None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, m_splits):
        k = t.shape[-1]
        ctx.meta = (t.shape, t.dtype, t.device)
        ctx.m_splits = m_splits
        pieces = {}
        if t._rowwise_data is not None:
            pieces["rowwise_data"] = t._rowwise_data.split(m_splits)
            blocks = [-(-s // BLOCK_SIZE) for s in m_splits] if t._is_2D_scaled else m_splits
            pieces["rowwise_scale_inv"] = t._rowwise_scale_inv.split(blocks)
        if t._columnwise_data is not None:
            pieces["columnwise_data"] = t._columnwise_data.split(m_splits, dim=1)
            blocks = [-(-s // BLOCK_SIZE) for s in m_splits]
            pieces["columnwise_scale_inv"] = t._columnwise_scale_inv.split(blocks, dim=1)
        return tuple(
            t._make_like(
                shape=(s, k),
                **{**dict.fromkeys(t._components()), **{name: p[i] for name, p in pieces.items()}},
            )
            for i, s in enumerate(m_splits)
        )

    @staticmethod
    def backward(ctx, *grads):
        shape, dtype, device = ctx.meta
        parts = [
            g if g is not None else torch.zeros((m, shape[-1]), dtype=dtype, device=device)
            for g, m in zip(grads, ctx.m_splits)
        ]
        return torch.cat(parts).reshape(shape), None
