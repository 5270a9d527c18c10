"""``quantize_blockwise``: high-precision tensor -> Float8BlockwiseQTensor (COMPACT).

Argument checks, the autograd rule (straight-through: the gradient of the
quantized tensor is passed to the input unchanged) and the choice between the
Triton kernel and the reference live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..backend import BACKENDS, Implementation, implementation
from ..layout import MSplits, check_m_splits
from ..recipe import FP8_DTYPES, HIGH_PRECISION_DTYPES, BlockShape, check_amax_epsilon, check_bool
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor


@dataclass(frozen=True, slots=True)
class QuantizeArgs:
    """Everything but the input that fixes a blockwise quantization (``block``: a ``BlockShape`` or its
    string, stored as the member)."""

    block: BlockShape = BlockShape.ROW_1x128
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    force_pow_2_scales: bool = True
    amax_epsilon: float = 0.0
    rowwise: bool = True
    columnwise: bool = False
    backend: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "block", BlockShape.parse(self.block))
        if self.fp8_dtype not in FP8_DTYPES:
            raise TypeError(f"fp8_dtype must be one of {FP8_DTYPES}, got {self.fp8_dtype}")
        for name in ("force_pow_2_scales", "rowwise", "columnwise"):
            check_bool(getattr(self, name), name)
        if not (self.rowwise or self.columnwise):
            raise ValueError("at least one of rowwise and columnwise must be True")
        check_amax_epsilon(self.amax_epsilon)
        if self.backend not in BACKENDS:  # here, not at the first call: a quantizer's settings are refused when made
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def pow2_scales(self) -> bool:
        """Alias of ``force_pow_2_scales``."""
        return self.force_pow_2_scales


def check_quantize_input(x, name: str = "x") -> torch.Tensor:
    """Validate a quantization input ``[..., K]`` (unit stride along K, any row stride); return its ``[M, K]``
    view (no copy)."""
    if isinstance(x, Float8BlockwiseQTensor):
        raise TypeError(f"{name} is already a Float8BlockwiseQTensor; dequantize() it first")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{name} must have dtype in {HIGH_PRECISION_DTYPES}, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name} must be at least 2-D [..., K], got shape {list(x.shape)}")
    if x.shape[-1] == 0:
        raise ValueError(f"{name} has an empty last dimension K: shape {list(x.shape)}")
    if x.stride(-1) != 1 and x.numel() > 1:
        raise ValueError(
            f"{name} must have unit stride in its last dimension, got strides {x.stride()} "
            f"for shape {list(x.shape)}; call .contiguous() first"
        )
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {list(x.shape)} and strides {x.stride()} cannot be viewed as "
            "[M, K] without a copy; call .contiguous() first"
        ) from None


def quantize_2d(x2d: torch.Tensor, args: QuantizeArgs, m_splits: MSplits, impl: Implementation) -> dict:
    """Quantize a checked ``[M, K]`` tensor with ``impl``; return the Float8BlockwiseQTensor components."""
    common = (args.fp8_dtype, args.force_pow_2_scales, args.amax_epsilon)
    out = {}
    if args.block.is_2D:
        q, s = impl.quantize_128x128(x2d, *common)
        if args.rowwise:
            out.update(rowwise_data=q, rowwise_scale_inv=s)
        if args.columnwise:  # 128x128 scales are transpose-invariant
            out.update(columnwise_data=q.t().contiguous(), columnwise_scale_inv=s.t().contiguous())
        return out
    if args.rowwise:
        q, s = impl.quantize_1x128(x2d, *common)
        out.update(rowwise_data=q, rowwise_scale_inv=s)
    if args.columnwise:
        qt, st = impl.quantize_128x1(x2d, *common, m_splits=m_splits)
        out.update(columnwise_data=qt, columnwise_scale_inv=st, columnwise_m_splits=m_splits)
    return out


def _quantized(x: torch.Tensor, args: QuantizeArgs, m_splits: MSplits, impl: Implementation) -> Float8BlockwiseQTensor:
    """The Float8BlockwiseQTensor of a checked ``x``, no autograd."""
    return Float8BlockwiseQTensor._of_launch(
        shape=x.shape,
        dtype=x.dtype,
        fp8_dtype=args.fp8_dtype,
        is_2D_scaled=args.block.is_2D,
        force_pow_2_scales=args.force_pow_2_scales,
        **quantize_2d(x.view(-1, x.shape[-1]), args, m_splits, impl),
    )


class _Quantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, args: QuantizeArgs, m_splits, impl: Implementation):
        return _quantized(x, args, m_splits, impl)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def quantize_blockwise(
    x: torch.Tensor,
    block: BlockShape = BlockShape.ROW_1x128,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    m_splits: MSplits = None,
    backend: str = "auto",
    pow2_scales: Optional[bool] = None,
) -> Float8BlockwiseQTensor:
    """Quantize ``x [..., K]`` (bf16/fp16/fp32) to blockwise FP8 with COMPACT scales.

    Args:
        x: input; leading dims flatten into M; unit stride along K. Any row
            stride (sliced, or rows expanded from one) is read in place, bitwise
            as its contiguous copy; a transposed input, one expanded along K, or
            leading dims that do not flatten without a copy are refused (ValueError
            naming the strides: call ``.contiguous()``). K need not
            be a multiple of 128 (the last block is scaled over its valid
            elements, as TransformerEngine does); M may be 0.
        block: ``BlockShape.ROW_1x128`` (activations, gradients) or ``BlockShape.TILE_128x128``
            (weights), or their strings ``"1x128"`` / ``"128x128"``.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        force_pow_2_scales: round scales down to powers of two (TE's quantizer's name; ``pow2_scales``
            is an alias, taking precedence when passed).
        amax_epsilon: floor on each block's amax.
        rowwise: produce the rowwise copy: data ``[M, K]``, scale_inv
            ``[M, ceil(K/128)]`` (128x128: ``[ceil(M/128), ceil(K/128)]``).
        columnwise: produce the columnwise copy: data ``[K, M]`` (with ``m_splits``:
            expert-major ``[M*K]``, each group's ``[K, m_g]`` after the previous one),
            block-major scale_inv ``[num_column_blocks, K]`` from 128x1 blocks along M
            (128x128: the transposed blocks, same scales).
        m_splits: groups of rows (experts) the 128x1 blocks restart at: a host
            list or a device int tensor (see ``layout.py``); 1x128 columnwise only.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see ``backend.py``).

    Returns a Float8BlockwiseQTensor of ``x``'s shape and nominal dtype; the
    gradient flows straight through to ``x``.
    """
    force_pow_2_scales = force_pow_2_scales if pow2_scales is None else pow2_scales
    args = QuantizeArgs(block, fp8_dtype, force_pow_2_scales, amax_epsilon, rowwise, columnwise, backend)
    return quantize_with_args(x, args, m_splits)


def quantize_with_args(x: torch.Tensor, args: QuantizeArgs, m_splits: MSplits = None) -> Float8BlockwiseQTensor:
    """``quantize_blockwise`` with its settings bundled in ``args``."""
    x2d = check_quantize_input(x)
    if m_splits is not None:
        if args.block.is_2D or not args.columnwise:
            raise ValueError("m_splits groups the 128x1 columnwise blocks: needs block='1x128', columnwise=True")
        m_splits = check_m_splits(m_splits, x2d.shape[0], device=x2d.device)
    return _Quantize.apply(x, args, m_splits, implementation(args.backend, x2d, "quantize_blockwise"))


def quantize_in_function(x: torch.Tensor, args: QuantizeArgs) -> Float8BlockwiseQTensor:
    """Quantize a contiguous bf16/fp16/fp32 ``x [..., K]`` inside another autograd Function's forward or
    backward (``GroupedLinear``'s input and output gradient): no autograd node and no input checks, which
    would stop ``torch.compile`` tracing that Function (it cannot trace a nested autograd Function, nor read
    the strides of a gradient in a backward)."""
    return _quantized(x, args, None, implementation(args.backend, x, "quantize_blockwise"))


def quantize_grouped_weight(
    weights, fp8_dtype: torch.dtype = torch.float8_e4m3fn, force_pow_2_scales: bool = True, amax_epsilon: float = 0.0,
    *, transpose: bool = True, backend: str = "auto", pow2_scales: Optional[bool] = None,
) -> tuple[Float8BlockwiseQTensor, Optional[Float8BlockwiseQTensor]]:
    """G expert weights -> ``(W, W^T)``: 128x128 FP8 ``[G, N, K]`` and its per-expert transpose
    ``[G, K, N]`` (the dgrad GEMM's K-major operand; None unless ``transpose``), one quantization.

    Args:
        weights: a sequence of G contiguous ``[N, K]`` tensors (bf16/fp16/fp32, one shape, dtype and
            device; N and K multiples of 128), e.g. ``GroupedLinear``'s ``weight0..``. The kernel
            reads them in place: no stacked copy.
        fp8_dtype, force_pow_2_scales, amax_epsilon, pow2_scales: as ``quantize_blockwise``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Bitwise equal to ``quantize_blockwise(torch.stack(weights).view(-1, K), "128x128", ...)`` and a
    byte transpose of each expert. Not differentiable (weights are quantized under no_grad).
    """
    force_pow_2_scales = force_pow_2_scales if pow2_scales is None else pow2_scales
    args = QuantizeArgs(BlockShape.TILE_128x128, fp8_dtype, force_pow_2_scales, amax_epsilon, backend=backend)
    check_bool(transpose, "transpose")
    if not isinstance(weights, (list, tuple)) or not weights:
        raise TypeError(f"weights must be a non-empty list of [N, K] tensors, got {type(weights).__name__}")
    w0 = weights[0]
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or isinstance(w, Float8BlockwiseQTensor):
            raise TypeError(f"weights[{i}] must be a high-precision torch.Tensor, got {type(w).__name__}")
        if w.dim() != 2 or w.shape != w0.shape or w.dtype != w0.dtype or w.device != w0.device:
            raise ValueError(f"weights[{i}] is {w.dtype} {list(w.shape)} on {w.device}; every weight must be "
                             f"2-D like weights[0] ({w0.dtype} {list(w0.shape)} on {w0.device})")
        if not w.is_contiguous():
            raise ValueError(f"weights[{i}] must be contiguous, got strides {w.stride()}")
    if w0.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"weights must have dtype in {HIGH_PRECISION_DTYPES}, got {w0.dtype}")
    n, k = w0.shape
    if n % 128 or k % 128 or n == 0 or k == 0:
        raise ValueError(f"weights must be [N, K] with N and K positive multiples of 128, got {list(w0.shape)}")
    impl = implementation(backend, w0, "quantize_grouped_weight")
    q, s, qt, st = impl.quantize_grouped_weight([w.detach() for w in weights], fp8_dtype, force_pow_2_scales,
                                                 amax_epsilon, transpose)
    g = len(weights)
    common = dict(dtype=w0.dtype, fp8_dtype=fp8_dtype, is_2D_scaled=True, force_pow_2_scales=args.force_pow_2_scales)
    w = Float8BlockwiseQTensor(shape=(g, n, k), rowwise_data=q.view(g * n, k),
                               rowwise_scale_inv=s.view(g * n // 128, k // 128), **common)
    if not transpose:
        return w, None
    return w, Float8BlockwiseQTensor(shape=(g, k, n), rowwise_data=qt.view(g * k, n),
                                     rowwise_scale_inv=st.view(g * k // 128, n // 128), **common)
