"""dequantize_blockwise / t.dequantize: Triton kernel vs reference (bitwise, NaN/inf included), which launcher runs,
autograd, bad input."""

import dataclasses
import math

import pytest
import torch

from conftest import KERNEL_DEVICE, requires_cuda
from transformer_engine_moe import Float8BlockwiseQTensor, dequantize_blockwise, quantize_blockwise
from transformer_engine_moe.kernels import dequantize as kd


def _every_code_tensor(fp8, m, k, device=KERNEL_DEVICE):
    """All 256 FP8 codes (NaN, inf, subnormals, signed zeros) tiled over [m, k], random pow2 scales."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(m * k // 256 + 1)[: m * k]
    data = codes.view(m, k).view(fp8)
    scale = 2.0 ** torch.randint(-127, 100, (m, -(-k // 128))).float()
    return Float8BlockwiseQTensor(shape=(m, k), dtype=torch.bfloat16, fp8_dtype=fp8,
                                  rowwise_data=data.to(device), rowwise_scale_inv=scale.to(device),
                                  force_pow_2_scales=True)


def _same(a, b):
    """Equal values, infinities included, every NaN alike (+0 and -0 alike: the kernel under the interpreter
    writes the code -0 as +0)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0, math.inf, -math.inf),
                                                               b.nan_to_num(0.0, math.inf, -math.inf))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(0, 128), (3, 256), (33, 300)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_matches_reference_on_every_code(fp8, shape, dtype):
    t = _every_code_tensor(fp8, *shape)
    assert _same(dequantize_blockwise(t, dtype, backend="triton"),
                 dequantize_blockwise(t, dtype, backend="reference"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_finite_values_within_an_fp8_step_of_the_dtype_max_come_back_inf_as_in_transformer_engine(dtype):
    """The chosen behaviour (docs/inputs.md): each FP8 value times its block's scale_inv in float32, cast once to
    the output dtype, as TransformerEngine's dequantize does. A finite input whose FP8 code rounds up past the
    dtype's max comes back +-inf: fp16 65504 and 63488 quantize (power-of-two scale 2**-8) to 256 and dequantize
    to 65536; the dtype's max in bf16 and fp32 to 256 * 2**120 = 2**128. Kernel and reference agree bit for bit;
    half the max stays finite; non-finite inputs stay non-finite (NaN keeps its code, +-inf marks its block
    NaN), the other values of the NaN's block finite."""
    big = torch.finfo(dtype).max
    x = torch.zeros(2, 256, dtype=dtype, device=KERNEL_DEVICE)
    x[0, :4] = torch.tensor([big, -big, big / 2, 63488.0 if dtype == torch.float16 else 1.0], dtype=dtype)
    x[1, :2] = torch.tensor([float("nan"), 1.0], dtype=dtype)
    x[1, 128] = float("inf")
    q = quantize_blockwise(x, backend="reference")
    got, want = q.dequantize(dtype, backend="triton"), q.dequantize(dtype, backend="reference")
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert _same(got, want) and torch.equal(got.masked_fill(got.isnan(), 0).view(bits),
                                            want.masked_fill(want.isnan(), 0).view(bits))
    assert got[0, :2].tolist() == [float("inf"), -float("inf")] and got[0, 2].isfinite()
    assert got[0, 3].isinf() == (dtype == torch.float16)
    assert got[1, 0].isnan() and got[1, 1] == 1.0 and got[1, 128:].isnan().all()


def test_other_layouts_and_gradient():
    x = torch.randn(300, 256, device=KERNEL_DEVICE, requires_grad=True)
    q = quantize_blockwise(x, columnwise=True)
    col = dequantize_blockwise(q, usage="columnwise", backend="triton")  # reference layout path
    assert torch.equal(col, q.dequantize(usage="columnwise"))
    (dequantize_blockwise(q, torch.bfloat16, backend="triton").float() * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_bad_input():
    with pytest.raises(TypeError, match="must be a Float8BlockwiseQTensor"):
        dequantize_blockwise(torch.randn(2, 128))
    with pytest.raises(TypeError, match="floating dtype"):
        dequantize_blockwise(quantize_blockwise(torch.randn(2, 128)), torch.int32)


@requires_cuda
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_gpu_software_decode_equals_hardware(fp8):
    t = _every_code_tensor(fp8, 1024, 512, "cuda")
    hw = kd.dequantize_1x128(t.rowwise_data, t.rowwise_scale_inv, torch.float32, software_cast=False)
    sw = kd.dequantize_1x128(t.rowwise_data, t.rowwise_scale_inv, torch.float32, software_cast=True)
    assert _same(hw, sw)


def test_the_kernel_runs_where_it_can(monkeypatch):
    """``t.dequantize`` / ``dequantize_blockwise`` take the table's 1x128 launcher for a contiguous rowwise
    copy in bf16/fp16/fp32, and the reference for float64."""
    from transformer_engine_moe import backend

    calls = []
    kernel = backend.TRITON.dequantize_1x128
    monkeypatch.setattr(backend, "TRITON", dataclasses.replace(
        backend.TRITON, dequantize_1x128=lambda *a: calls.append(a[2]) or kernel(*a)))
    t = _every_code_tensor(torch.float8_e4m3fn, 4, 256)
    want, nan = dequantize_blockwise(t, torch.bfloat16, backend="reference"), t.dequantize(backend="reference").isnan()
    assert _same(t.dequantize(torch.bfloat16, backend="triton"), want)
    assert torch.equal(t.dequantize(torch.float64, backend="triton").isnan(), nan)
    assert calls == [torch.bfloat16]
    with pytest.raises(ValueError, match=r"dequantize: backend must be one of .*got 'cuda'"):
        t.dequantize(backend="cuda")
