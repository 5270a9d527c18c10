"""An independent, deliberately naive oracle for blockwise FP8 quantization.

FP8 values are decoded from their bit fields by formula and rounding is a
nearest-value search with ties to the even code, so nothing here relies on
torch's FP8 cast or on the package's reference. Scales follow
TransformerEngine's rule with numpy float32 arithmetic and ``math.frexp``.
Python loops over blocks: use small shapes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# (exponent bits, mantissa bits, bias, max finite)
FORMATS = {
    torch.float8_e4m3fn: (4, 3, 7, 448.0),
    torch.float8_e5m2: (5, 2, 15, 57344.0),
}


def decode(code: int, fp8_dtype: torch.dtype) -> float:
    """Value of an FP8 code by formula (NaN/inf codes -> nan)."""
    ebits, mbits, bias, _ = FORMATS[fp8_dtype]
    sign = -1.0 if code & 0x80 else 1.0
    e = (code >> mbits) & ((1 << ebits) - 1)
    f = code & ((1 << mbits) - 1)
    if fp8_dtype == torch.float8_e4m3fn and e == 15 and f == 7:
        return math.nan
    if fp8_dtype == torch.float8_e5m2 and e == 31:
        return math.nan
    if e == 0:
        return sign * 2.0 ** (1 - bias) * f / 2**mbits
    return sign * 2.0 ** (e - bias) * (1 + f / 2**mbits)


def _positive_table(fp8_dtype):
    codes = [c for c in range(0x80) if not math.isnan(decode(c, fp8_dtype))]
    return np.array(codes), np.array([decode(c, fp8_dtype) for c in codes])


def round_to_fp8(v: np.ndarray, fp8_dtype: torch.dtype) -> np.ndarray:
    """float64 values -> uint8 FP8 codes: nearest, ties to even code, saturating, NaN -> 0x7F."""
    codes, vals = _positive_table(fp8_dtype)
    v = np.asarray(v, dtype=np.float64)
    a = np.minimum(np.abs(v), vals[-1])
    hi = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo = hi - 1
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    out = np.where(pick_hi, codes[hi], codes[lo]) | np.where(np.signbit(v), 0x80, 0)
    return np.where(np.isnan(v), 0x7F, out).astype(np.uint8)


def block_scale(amax: float, fp8_dtype, input_dtype, pow2: bool, eps: float) -> tuple[float, float]:
    """(scale, scale_inv) for one block, TE's rule in numpy float32."""
    fmax = FORMATS[fp8_dtype][3]
    amax = np.float32(max(amax, np.float32(eps)))
    if amax == 0 or np.isinf(amax):
        scale = np.float32(1.0)
    else:
        with np.errstate(over="ignore"):
            scale = np.float32(fmax) / amax
        if np.isinf(scale):
            scale = np.float32(torch.finfo(input_dtype).max)
    if pow2:
        mant, exp = math.frexp(float(scale))
        scale = np.float32(2.0 ** (exp - 1))
    return float(scale), float(np.float32(1.0) / scale)


def quantize(x: torch.Tensor, fp8_dtype, block_rows: int, block_cols: int, pow2=True, eps=0.0):
    """Quantize 2-D x with blocks of block_rows x block_cols. Returns (codes uint8 [M, K], scale_inv)."""
    xf = x.float().numpy().astype(np.float32)
    m, k = xf.shape
    nbr, nbc = -(-m // block_rows), -(-k // block_cols)
    codes = np.zeros((m, k), dtype=np.uint8)
    sinv = np.zeros((nbr, nbc), dtype=np.float32)
    for i in range(nbr):
        for j in range(nbc):
            blk = xf[i * block_rows:(i + 1) * block_rows, j * block_cols:(j + 1) * block_cols]
            a = np.abs(blk)
            amax = float(np.max(np.where(np.isnan(a), 0, a))) if blk.size else 0.0
            scale, sinv[i, j] = block_scale(amax, fp8_dtype, x.dtype, pow2, eps)
            if np.isinf(amax):  # this package, unlike TE: a block holding +-inf gets scale_inv NaN
                sinv[i, j] = np.nan
            prod = (blk * np.float32(scale)).astype(np.float32)  # float32 product, as TE
            codes[i * block_rows:(i + 1) * block_rows, j * block_cols:(j + 1) * block_cols] = (
                round_to_fp8(prod.astype(np.float64), fp8_dtype)
            )
    return torch.from_numpy(codes), torch.from_numpy(sinv)
