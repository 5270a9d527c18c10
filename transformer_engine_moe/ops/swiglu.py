"""``weighted_swiglu_quant``: the activation between the expert GEMMs, fused with fc2's input quantization.

``x [M, 2F]`` (fc1's output, BF16) -> ``silu(x[:, :F]) * x[:, F:] * probs[:, None]``
quantized 1x128 (COMPACT, power-of-two scales per the recipe) in one pass; the
backward is one pass too, producing ``dx`` in BF16 or already quantized 1x128
for fc1's dgrad GEMM, and the probs' gradient. Arithmetic: ``reference/swiglu.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backend import Implementation, implementation
from ..recipe import BLOCK_SIZE, HIGH_PRECISION_DTYPES, FP8FlowRecipe, Role, check_bool
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor


class _WeightedSwiGLUQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, recipe: FP8FlowRecipe, quantize_grad: bool, impl: Implementation):
        fp8_dtype = recipe.fp8_dtype(Role.INPUT)
        q, s = impl.weighted_swiglu_quant(x, probs, fp8_dtype, recipe.force_pow_2_scales)
        ctx.save_for_backward(x, probs)
        ctx.recipe, ctx.quantize_grad, ctx.impl = recipe, quantize_grad, impl
        return Float8BlockwiseQTensor._of_launch(
            shape=q.shape, dtype=x.dtype, fp8_dtype=fp8_dtype, force_pow_2_scales=recipe.force_pow_2_scales,
            rowwise_data=q, rowwise_scale_inv=s,
        )

    @staticmethod
    def backward(ctx, dy):
        x, probs = ctx.saved_tensors
        recipe = ctx.recipe
        grad_fp8 = recipe.fp8_dtype(Role.GRAD) if ctx.quantize_grad else None
        dy = dy.contiguous()
        dx, dx_scale, dprobs = ctx.impl.weighted_swiglu_backward(dy, x, probs, grad_fp8, recipe.force_pow_2_scales)
        if grad_fp8 is not None:
            dx = Float8BlockwiseQTensor._of_launch(
                shape=x.shape, dtype=x.dtype, fp8_dtype=grad_fp8, force_pow_2_scales=recipe.force_pow_2_scales,
                rowwise_data=dx, rowwise_scale_inv=dx_scale,
            )
        return dx, (dprobs.to(probs.dtype) if dprobs is not None else None), None, None, None


def weighted_swiglu_quant(
    x: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    recipe: Optional[FP8FlowRecipe] = None,
    *,
    quantize_grad: bool = False,
    backend: str = "auto",
) -> Float8BlockwiseQTensor:
    """``y = silu(x[:, :F]) * x[:, F:] * probs[:, None]`` as a rowwise 1x128 Float8BlockwiseQTensor ``[M, F]``.

    Args:
        x: ``[M, 2F]`` bf16/fp16/fp32, F a multiple of 128, M any (0 included).
        probs: ``[M]`` router probs of the rows (``permuted_probs``), or None (plain SwiGLU).
        recipe: FP8FlowRecipe (default ``FP8FlowRecipe()``): y in its INPUT dtype, the
            gradient (if quantized) in its GRAD dtype, power-of-two scales or not.
        quantize_grad: return ``dx`` as a rowwise 1x128 Float8BlockwiseQTensor (for fc1's
            dgrad GEMM) instead of ``x``'s dtype: bitwise ``quantize_blockwise`` (amax_epsilon 0) of
            the dx it returns otherwise, without writing and reading that dx.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Non-finite values propagate: NaN stays NaN, +-inf becomes a non-finite FP8 code (never
    +-fp8_max). Zero rows (padding from permute+pad, whose probs are 0) give zeros and zero
    gradients. Differentiable in ``x`` and ``probs`` (the FP8 output's gradient is taken as
    the gradient of y).
    """
    if isinstance(x, Float8BlockwiseQTensor):
        raise TypeError("x is a Float8BlockwiseQTensor; weighted_swiglu_quant takes fc1's high-precision output")
    if not isinstance(x, torch.Tensor) or x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"x must be a bf16/fp16/fp32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2 or x.shape[1] % (2 * BLOCK_SIZE):
        raise ValueError(
            f"x must be [M, 2F] with F a multiple of {BLOCK_SIZE} (the 1x128 blocks of y), got shape {list(x.shape)}"
        )
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
            raise TypeError(f"probs must be a floating-point tensor, got {getattr(probs, 'dtype', type(probs))}")
        if tuple(probs.shape) != (x.shape[0],):
            raise ValueError(f"probs must have shape [M={x.shape[0]}], got {list(probs.shape)}")
        if probs.device != x.device:
            raise ValueError(f"probs is on {probs.device}, x on {x.device}")
        probs = probs.contiguous()
    recipe = FP8FlowRecipe() if recipe is None else recipe
    if not isinstance(recipe, FP8FlowRecipe):
        raise TypeError(f"recipe must be an FP8FlowRecipe, got {type(recipe).__name__}")
    check_bool(quantize_grad, "quantize_grad")
    impl = implementation(backend, x, "weighted_swiglu_quant")
    return _WeightedSwiGLUQuant.apply(x.contiguous(), probs, recipe, quantize_grad, impl)
