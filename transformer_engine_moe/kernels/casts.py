"""Exact float conversions for Triton kernels, with the software paths the CPU interpreter needs.

On the GPU these are the hardware conversions. Triton's interpreter gets them
wrong (checked with Triton 3.6): its float32 -> FP8 cast rounds ties away from
zero, drops exponent carries (0.488 -> 0.25) and does not saturate; its FP8 ->
float32 cast turns the E4M3 NaN into 480 and E5M2 infinities into finite
values; its float32 -> bf16 cast truncates; its bf16 -> float32 cast mangles
bf16 subnormals. Every launcher sets the constexpr ``SOFTWARE_CAST`` with
``use_software_cast(t)``: True for CPU tensors (only the interpreter runs
kernels on them), and the same results come from integer arithmetic on the
bits. GPU tests compare both paths bit for bit, so the interpreter-run CI
checks the arithmetic the GPU executes.
"""

from typing import Optional

import torch
import triton
import triton.language as tl


def use_software_cast(t: torch.Tensor, forced: Optional[bool] = None) -> bool:
    """The ``SOFTWARE_CAST`` flag of a launch on ``t``'s device: True for CPU tensors, which only Triton's
    interpreter runs kernels on (the software conversions, and ``while`` loops where the interpreter cannot
    ``range()`` over run-time values); ``forced`` overrides it (GPU tests run both paths bit for bit)."""
    return (not t.is_cuda) if forced is None else forced


@triton.jit
def _round_to_fp8_bits_software(c, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """|c| <= fp8_max, not NaN -> FP8 bit pattern (int32), RNE, by integer arithmetic.

    Normals round the float32 bits to MBITS mantissa bits (the carry may bump
    the exponent); values below the smallest FP8 normal become a multiple of
    the subnormal step, rounded to nearest even with the 2**23 magic number.
    """
    bits = c.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MBITS
    normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - (
        (127 - BIAS) << MBITS
    )
    subnormal_steps = tl.abs(c) * (2.0 ** (BIAS - 1 + MBITS))
    subnormal = ((subnormal_steps + 8388608.0) - 8388608.0).to(tl.int32)
    is_normal = mag >= ((128 - BIAS) << 23)
    return sign | tl.where(is_normal, normal, subnormal)


@triton.jit
def float_to_fp8_bits(v, FP8_MAX: tl.constexpr, E5M2: tl.constexpr, SOFTWARE_CAST: tl.constexpr):
    """Float32 -> FP8 bit pattern (uint8): RNE, finite saturation, every NaN -> 0x7F.

    On the GPU this is the hardware conversion (``cvt.rn.satfinite``), which
    already saturates +-inf and overflow to +-fp8_max and writes NaN as 0x7F;
    extra clamps here cost a quarter of the kernel's bandwidth. Under Triton's
    CPU interpreter, whose FP8 cast is not IEEE (ties away from zero, lost
    exponent carries, no saturation), launchers set ``SOFTWARE_CAST`` and the
    same result is computed with integer arithmetic. Both paths are compared
    bitwise on the GPU (tests/ops/test_quantize.py).
    """
    if SOFTWARE_CAST:
        c = tl.where(v > FP8_MAX, FP8_MAX, tl.where(v < -FP8_MAX, -FP8_MAX, v))
        if E5M2:
            bits = _round_to_fp8_bits_software(c, 2, 15)
        else:
            bits = _round_to_fp8_bits_software(c, 3, 7)
        return tl.where(v != v, 0x7F, bits).to(tl.uint8)
    elif E5M2:
        return v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def fp8_bits_to_float(code, E5M2: tl.constexpr, SOFTWARE_CAST: tl.constexpr):
    """FP8 codes (uint8) -> float32, exactly, NaN and inf included.

    ``SOFTWARE_CAST`` decodes the bit fields with integer arithmetic: Triton's CPU
    interpreter turns the E4M3 NaN code into 480 and E5M2 infinities into finite values.
    """
    if SOFTWARE_CAST:
        MBITS: tl.constexpr = 2 if E5M2 else 3
        BIAS: tl.constexpr = 15 if E5M2 else 7
        c = code.to(tl.int32)
        mag = c & 0x7F
        e = mag >> MBITS
        m = mag & ((1 << MBITS) - 1)
        normal = (((e + (127 - BIAS)) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
        v = tl.where(e > 0, normal, m.to(tl.float32) * (2.0 ** (1 - BIAS - MBITS)))
        if E5M2:
            v = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), v)
        else:
            v = tl.where(mag == 0x7F, float("nan"), v)
        return tl.where((c & 0x80) != 0, -v, v)
    elif E5M2:
        return code.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def to_float(x, SOFTWARE_CAST: tl.constexpr):
    """A kernel input (bf16, fp16, fp32) -> float32, exactly (bf16 subnormals included)."""
    if SOFTWARE_CAST and x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def float_to_bf16(v, SOFTWARE_CAST: tl.constexpr):
    """Float32 -> bf16, round-to-nearest-even (NaN stays NaN)."""
    if SOFTWARE_CAST:
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def cast_for_store(v, dtype: tl.constexpr, SOFTWARE_CAST: tl.constexpr):
    """Float32 ``v`` converted to a kernel output's element ``dtype`` (bf16 exact under the interpreter)."""
    if dtype == tl.bfloat16:
        return float_to_bf16(v, SOFTWARE_CAST)
    return v.to(dtype)
