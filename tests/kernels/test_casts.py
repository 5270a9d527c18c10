"""kernels/casts.py: the software conversions (interpreter path) against torch's IEEE casts, and,
on the GPU, against the hardware conversions."""

import pytest
import torch
import triton
import triton.language as tl

from conftest import KERNEL_DEVICE, requires_cuda
from transformer_engine_moe.kernels.casts import float_to_bf16, float_to_fp8_bits, fp8_bits_to_float, to_float
from transformer_engine_moe.reference.quantize import cast_to_fp8


@triton.jit
def _to_bf16_kernel(x_ptr, y_ptr, N, SOFTWARE_CAST: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + o, float_to_bf16(tl.load(x_ptr + o, mask=o < N), SOFTWARE_CAST), mask=o < N)


@triton.jit
def _to_float_kernel(x_ptr, y_ptr, N, SOFTWARE_CAST: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + o, to_float(tl.load(x_ptr + o, mask=o < N), SOFTWARE_CAST), mask=o < N)


@triton.jit
def _to_fp8_kernel(x_ptr, y_ptr, N, FP8_MAX: tl.constexpr, E5M2: tl.constexpr,
                   SOFTWARE_CAST: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + o, mask=o < N)
    tl.store(y_ptr + o, float_to_fp8_bits(v, FP8_MAX, E5M2, SOFTWARE_CAST), mask=o < N)


@triton.jit
def _from_fp8_kernel(c_ptr, y_ptr, N, E5M2: tl.constexpr, SOFTWARE_CAST: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + o, fp8_bits_to_float(tl.load(c_ptr + o, mask=o < N), E5M2, SOFTWARE_CAST), mask=o < N)


def _random_floats(n, device):
    """Random float32 bit patterns (every binade, subnormals, inf, NaN) plus hand-picked ties."""
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int64).to(torch.int32)
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 2.0**-130, 1.5 * 2.0**-133, 1.0625, 1.1875,
                         0.46875 + 2**-6, 2.0**-10, 3 * 2.0**-10, 464.0, 480.0, 61440.0, -0.0])
    return torch.cat([bits.view(torch.float32), ties]).to(device)


def _launch(kernel, x, out_dtype, software, **kw):
    y = torch.empty(x.numel(), dtype=out_dtype, device=x.device)
    kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), SOFTWARE_CAST=software, BLOCK=1024, **kw)
    return y


def _same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_bf16_rounding_matches_torch():
    x = _random_floats(1 << 15, KERNEL_DEVICE)
    y = _launch(_to_bf16_kernel, x, torch.bfloat16, not x.is_cuda)
    assert _same(y.float(), x.to(torch.bfloat16).float())


def test_every_bf16_loads_exactly():
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x.to(KERNEL_DEVICE)
    assert _same(_launch(_to_float_kernel, x, torch.float32, not x.is_cuda), x.float())


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_rounding_and_decoding_match_torch(fp8):
    x = _random_floats(1 << 15, KERNEL_DEVICE)
    kw = dict(FP8_MAX=float(torch.finfo(fp8).max), E5M2=fp8 == torch.float8_e5m2)
    codes = _launch(_to_fp8_kernel, x, torch.uint8, not x.is_cuda, **kw)
    assert torch.equal(codes.cpu(), cast_to_fp8(x.cpu(), fp8).view(torch.uint8))
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(KERNEL_DEVICE)
    back = _launch(_from_fp8_kernel, every, torch.float32, not x.is_cuda, E5M2=kw["E5M2"])
    assert _same(back.cpu(), every.cpu().view(fp8).float())


@requires_cuda
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_gpu_software_paths_equal_hardware(fp8):
    x = _random_floats(1 << 20, "cuda")
    kw = dict(FP8_MAX=float(torch.finfo(fp8).max), E5M2=fp8 == torch.float8_e5m2)
    assert torch.equal(_launch(_to_fp8_kernel, x, torch.uint8, True, **kw),
                       _launch(_to_fp8_kernel, x, torch.uint8, False, **kw))
    assert _same(_launch(_to_bf16_kernel, x, torch.bfloat16, True).float(),
                 _launch(_to_bf16_kernel, x, torch.bfloat16, False).float())
    b = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
    assert _same(_launch(_to_float_kernel, b, torch.float32, True), _launch(_to_float_kernel, b, torch.float32, False))
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).cuda()
    assert _same(_launch(_from_fp8_kernel, every, torch.float32, True, E5M2=kw["E5M2"]),
                 _launch(_from_fp8_kernel, every, torch.float32, False, E5M2=kw["E5M2"]))
