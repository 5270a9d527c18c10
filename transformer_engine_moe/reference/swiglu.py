"""Plain-PyTorch weighted SwiGLU (+ quantization): the oracle and the CPU path.

For ``x [M, 2F]`` with ``a = x[:, :F]``, ``b = x[:, F:]`` and router probs ``p [M]``
(or none), in float32, in this order (the kernels use the same order, without
FMA contraction, and the same ``exp2f``):

    e = exp2(-a * LOG2E);  silu = a / (1 + e);  y = (silu * b) * p

``exp2`` of the float32 product, not ``exp``: CUDA's ``exp2f`` is a few
instructions where ``expf`` is many, which took the forward kernel from 75% to
81% of the copy bandwidth, and torch computes the same function bit for bit.
One IEEE division: ``a * (1 / (1 + e))`` would round twice. Backward, for
``dy [M, F]``:

    s = 1 / (1 + e);  silu = a * s;  g = dy * p;  dsilu = s * (1 + a * (1 - s))
    da = (g * b) * dsilu;  db = g * silu;  dp = sum_f (dy * silu) * b

Quantization of ``y`` is ``quantize_1x128``: an overflow is never silently
clipped to +-fp8_max (a 1x128 block holding +-inf gets a NaN scale_inv, so it
dequantizes to NaN; marking the block costs one select per block where an
element-wise inf code cost five operations per element). NaN stays NaN (the
NaN byte).
"""

from __future__ import annotations

from typing import Optional

import torch

from .quantize import quantize_1x128

LOG2E = 1.4426950408889634  # used as float32, in the kernels too


def _halves(x: torch.Tensor):
    f = x.shape[1] // 2
    return x[:, :f].float(), x[:, f:].float()


def weighted_swiglu(x: torch.Tensor, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y [M, F]`` float32 (see the module doc for the arithmetic)."""
    a, b = _halves(x)
    y = (a / (1.0 + torch.exp2(-a * LOG2E))) * b
    return y * probs.float()[:, None] if probs is not None else y


def weighted_swiglu_grad(dy: torch.Tensor, x: torch.Tensor, probs: Optional[torch.Tensor] = None):
    """``(dx [M, 2F] float32, dprobs [M] float32 or None)`` (see the module doc for the arithmetic)."""
    a, b = _halves(x)
    s = 1.0 / (1.0 + torch.exp2(-a * LOG2E))
    silu = a * s
    dsilu = s * (1.0 + a * (1.0 - s))
    g = dy.float()
    dprobs = None
    if probs is not None:
        dprobs = ((g * silu) * b).sum(1)
        g = g * probs.float()[:, None]
    return torch.cat([(g * b) * dsilu, g * silu], dim=1), dprobs


def weighted_swiglu_quant(x: torch.Tensor, probs: Optional[torch.Tensor], fp8_dtype: torch.dtype,
                          force_pow_2_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As the kernel: ``x [M, 2F]``, ``probs [M]`` or None -> ``(q [M, F] FP8, scale_inv [M, F/128])``,
    ``quantize_1x128`` of ``weighted_swiglu``."""
    return quantize_1x128(weighted_swiglu(x, probs), fp8_dtype, force_pow_2_scales)


def weighted_swiglu_backward(dy: torch.Tensor, x: torch.Tensor, probs: Optional[torch.Tensor],
                             grad_fp8_dtype: Optional[torch.dtype] = None, force_pow_2_scales: bool = True):
    """As the kernel: ``dy [M, F]``, ``x [M, 2F]``, ``probs [M]`` or None -> ``(dx, dx_scale_inv, dprobs)``:
    ``dx [M, 2F]`` in ``x``'s dtype (``dx_scale_inv`` None), or FP8 1x128 in ``grad_fp8_dtype`` with
    ``[M, 2F/128]`` scales (``quantize_1x128`` of that dx in ``x``'s dtype: bitwise what quantizing the
    unquantized backward's output gives); dprobs float32 ``[M]`` or None."""
    dx, dprobs = weighted_swiglu_grad(dy, x, probs)
    if grad_fp8_dtype is None:
        return dx.to(x.dtype), None, dprobs
    return (*quantize_1x128(dx.to(x.dtype), grad_fp8_dtype, force_pow_2_scales), dprobs)
