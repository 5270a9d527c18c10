"""The plain-PyTorch quantization reference against the independent oracle (tests/fp8_oracle.py)."""

import pytest
import torch

import fp8_oracle
from conftest import same_bits
from transformer_engine_moe.reference import dequantize as ref_dequantize
from transformer_engine_moe.reference import quantize as ref

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 448.0, -448.0, 500.0, 1e-40, -3e-39,
           2.0**-9, 2.0**-10, 57344.0, 1e5]


def _input(m, k, dtype):
    x = torch.randn(m, k) * torch.logspace(-6, 6, max(m, 1))[:m, None]
    x = x.to(dtype)
    if m > 2 and k > 20:
        x[0, : len(SPECIAL)] = torch.tensor(SPECIAL).to(dtype)
        x[1] = 0.0  # all-zero blocks
        x[2, 5] = float("nan")  # NaN never wins the amax
    return x


def _codes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(0, 256), (1, 128), (5, 300), (131, 257)], ids=str)
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32scale"])
def test_1x128_matches_oracle(fp8, dtype, shape, pow2):
    x = _input(*shape, dtype)
    data, sinv = ref.quantize_1x128(x, fp8, pow2)
    codes, sinv_o = fp8_oracle.quantize(x, fp8, 1, 128, pow2)
    assert data.dtype == fp8 and data.shape == x.shape
    assert sinv.shape == (shape[0], -(-shape[1] // 128))
    assert same_bits(sinv, sinv_o)
    assert torch.equal(_codes(data), codes)


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(1, 1), (130, 300), (256, 128)], ids=str)
def test_128x128_and_128x1_match_oracle(fp8, shape):
    x = _input(*shape, torch.bfloat16)
    data, sinv = ref.quantize_128x128(x, fp8)
    codes, sinv_o = fp8_oracle.quantize(x, fp8, 128, 128)
    assert same_bits(sinv, sinv_o) and torch.equal(_codes(data), codes)
    data_t, sinv_t = ref.quantize_128x1(x, fp8)
    codes_t, sinv_t_o = fp8_oracle.quantize(x, fp8, 128, 1)  # blocks along M
    assert data_t.shape == (shape[1], shape[0]) and data_t.is_contiguous()
    assert sinv_t.shape == (-(-shape[0] // 128), shape[1])  # block-major [ceil(M/128), K]
    assert same_bits(sinv_t, sinv_t_o) and torch.equal(_codes(data_t), codes_t.t())


def test_amax_epsilon_floors_small_blocks():
    x = torch.full((2, 128), 1e-3)
    x[1] = 10.0
    _, sinv = ref.quantize_1x128(x, torch.float8_e4m3fn, True, amax_epsilon=1.0)
    _, sinv_o = fp8_oracle.quantize(x, torch.float8_e4m3fn, 1, 128, True, 1.0)
    assert torch.equal(sinv, sinv_o)
    assert sinv[0, 0] == 2.0**-8  # amax floored to 1.0: scale 448 -> 256


def test_special_scale_cases():
    """amax 0 -> scale 1; a block holding inf -> scale_inv NaN (TE: 1), its inf saturated as TE's cast does;
    tiny amax -> scale from the input dtype's max (pow2: 2**127)."""
    x = torch.zeros(3, 128)
    x[1, 7] = float("inf")
    x[2, 0] = 1e-40  # 448 / 1e-40 overflows float32
    data, sinv = ref.quantize_1x128(x, torch.float8_e4m3fn, True)
    assert sinv[0, 0] == 1.0 and torch.isnan(sinv[1, 0]) and sinv[2, 0] == 2.0**-127
    assert data[1, 7].float() == 448.0  # the code saturates (SATFINITE); the NaN scale keeps it non-finite
    assert torch.isnan(ref_dequantize.dequantize_1x128(data, sinv, torch.float32)[1]).all()
    _, sinv_np = ref.quantize_1x128(x, torch.float8_e4m3fn, False)
    assert sinv_np[2, 0] == 1.0 / torch.finfo(torch.float32).max


def test_nan_is_canonical_and_dequantize_round_trip():
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    x[0, 3] = -float("nan")
    data, sinv = ref.quantize_1x128(x, torch.float8_e4m3fn)
    assert data.view(torch.uint8)[0, 3] == 0x7F
    y = ref_dequantize.dequantize_1x128(data, sinv, torch.float32)
    ok = ~torch.isnan(x)
    # RNE error is at most half a unit in the last place: |x| * 2**-4 for E4M3 normals.
    assert ((y - x.float()).abs()[ok] <= x.float().abs()[ok] * 2.0**-4 + 1e-30).all()


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_grouped_128x1_is_expert_major(as_tensor):
    """Grouped 128x1: group g's slice of the flat data is the oracle's 128x1 quantization of the group alone,
    transposed (``[K, m_g]`` row-major); its scales are the next rows of the block-major scales (a device
    tensor's unused trailing rows hold 1)."""
    groups = [0, 1, 130, 0, 127]
    x = _input(sum(groups), 200, torch.bfloat16)
    splits = torch.tensor(groups) if as_tensor else groups
    data_t, sinv_t = ref.quantize_128x1(x, torch.float8_e4m3fn, m_splits=splits)
    assert data_t.shape == (sum(groups) * 200,)
    first = blk = 0
    for size in groups:
        codes_t, sinv_o = fp8_oracle.quantize(x[first:first + size], torch.float8_e4m3fn, 128, 1)
        assert torch.equal(_codes(data_t[200 * first:200 * (first + size)]), codes_t.t().reshape(-1))
        assert same_bits(sinv_t[blk:blk + sinv_o.shape[0]], sinv_o)
        first, blk = first + size, blk + sinv_o.shape[0]
    assert (sinv_t[blk:] == 1.0).all() and sinv_t.shape[0] == (sum(groups) // 128 + 5 if as_tensor else blk)
