"""quantize_grouped_weight: W and W^T from G separate weights, bitwise equal to stacking,
quantizing 128x128 and byte-transposing (the reference path); special values; bad input."""

import pytest
import torch

from conftest import KERNEL_DEVICE, assert_no_host_sync, requires_cuda, same_bits
from test_quantize import FP8, FP8_IDS, _input, assert_same_fp8
from transformer_engine_moe import quantize_blockwise, quantize_grouped_weight, transpose_grouped_weight
from transformer_engine_moe.kernels import quantize as kq


def _weights(g, n, k, dtype, device=KERNEL_DEVICE):
    """G weights with rows spanning 12 decades, special values in the first, a zero weight in the second."""
    ws = [_input(n, k, dtype, device) for _ in range(g)]
    if g > 1:
        ws[1].zero_()
    return ws


def _two_step(weights, fp8, backend):
    n, k = weights[0].shape
    w = quantize_blockwise(torch.stack(weights).view(-1, k), "128x128", fp8, backend=backend)
    w = w.view(len(weights), n, k)
    return w, transpose_grouped_weight(w, backend)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_matches_stack_quantize_transpose(fp8, dtype, backend):
    """16-bit weights: W^T from the quantizing launch; float32: W, then the byte transpose."""
    weights = _weights(3, 256, 384, dtype)
    w, wt = quantize_grouped_weight(weights, fp8, backend=backend)
    ref_w, ref_wt = _two_step(weights, fp8, "reference")
    assert w.shape == (3, 256, 384) and wt.shape == (3, 384, 256) and w.dtype == dtype
    assert w.is_2D_scaled and wt.is_2D_scaled and w.force_pow_2_scales
    assert_same_fp8(w, ref_w)
    assert_same_fp8(wt, ref_wt)


@pytest.mark.parametrize("config", [(128, 4), (64, 8), (32, 4), (16, 2)], ids=str)
def test_every_launch_shape_gives_the_same_bytes(config):
    """The kernel's launch shapes (rows per slice, warps; benchmark sweeps): a tile read in slices, twice, quantizes
    as a tile read at once, special values included (NaN, infinities, zeros, values spanning 12 decades)."""
    weights = _weights(2, 256, 384, torch.bfloat16)
    q, s, qt, st = kq.quantize_grouped_weight(weights, torch.float8_e4m3fn, config=config)
    ref_w, ref_wt = _two_step(weights, torch.float8_e4m3fn, "reference")
    assert torch.equal(q.view(torch.uint8), ref_w.rowwise_data.view(torch.uint8).view(q.shape))
    assert torch.equal(qt.view(torch.uint8), ref_wt.rowwise_data.view(torch.uint8).view(qt.shape))
    assert same_bits(s, ref_w.rowwise_scale_inv.view(s.shape))
    assert same_bits(st, ref_wt.rowwise_scale_inv.view(st.shape))
    with pytest.raises(ValueError, match="rows per slice must be 16, 32, 64 or 128, got 48"):
        kq.quantize_grouped_weight(weights, torch.float8_e4m3fn, config=(48, 4))


def test_one_expert_and_without_transpose():
    weights = _weights(1, 128, 128, torch.bfloat16)
    w, wt = quantize_grouped_weight(weights, backend="triton")
    ref_w, ref_wt = _two_step(weights, torch.float8_e4m3fn, "reference")
    assert_same_fp8(w, ref_w)
    assert_same_fp8(wt, ref_wt)
    w2, none = quantize_grouped_weight(weights, transpose=False, backend="triton")
    assert none is None
    assert_same_fp8(w2, w)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "2-byte-offset"])
def test_weights_read_in_place_not_copied(offset):
    """Views into one buffer (as Megatron may hand them over) are read where they are, also at addresses
    that are not 16-byte aligned (the kernel then drops its alignment hint)."""
    flat = torch.randn(offset + 4 * 128 * 256, device=KERNEL_DEVICE).to(torch.bfloat16)
    buf = flat[offset:].view(4 * 128, 256)
    views = list(buf.view(4, 128, 256).unbind(0))
    w, _ = quantize_grouped_weight(views, backend="triton")
    assert_same_fp8(w, quantize_blockwise(buf.clone(), "128x128").view(4, 128, 256))


@pytest.mark.parametrize("bad, err, match", [
    ([], TypeError, "non-empty list"),
    (torch.randn(2, 128, 128), TypeError, "non-empty list"),
    ([torch.randn(128, 128), "w"], TypeError, r"weights\[1\]"),
    ([torch.randn(128, 128), torch.randn(128, 256)], ValueError, r"weights\[1\].*\[128, 256\]"),
    ([torch.randn(128, 128), torch.randn(128, 128, dtype=torch.bfloat16)], ValueError, r"weights\[1\] is torch.bfloat16"),
    ([torch.randn(256, 128).t()], ValueError, "contiguous"),
    ([torch.randn(128, 100)], ValueError, "multiples of 128"),
    ([torch.randint(0, 4, (128, 128))], TypeError, "dtype"),
    ([torch.randn(128, 128, 1)], ValueError, "2-D"),
], ids=["empty", "tensor", "not-tensor", "shape", "dtype-mix", "strided", "ragged", "int", "3d"])
def test_bad_input(bad, err, match):
    with pytest.raises(err, match=match):
        quantize_grouped_weight(bad)


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        quantize_grouped_weight([torch.randn(128, 128)], backend="cublas")
    with pytest.raises(TypeError, match="transpose must be a bool .*, got 'no'"):  # once read as True
        quantize_grouped_weight([torch.randn(128, 128)], transpose="no")
    with pytest.raises(ValueError, match="quantize_grouped_weight: got a tensor on the meta device"):
        quantize_grouped_weight([torch.randn(128, 128, device="meta")])


@requires_cuda
def test_gpu_fp8_bitwise_deepseek_shape_and_no_sync():
    weights = [torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    w, wt = quantize_grouped_weight(weights)
    ref_w, ref_wt = _two_step(weights, torch.float8_e4m3fn, "reference")
    assert_same_fp8(w, ref_w)
    assert_same_fp8(wt, ref_wt)
    assert_no_host_sync(lambda: quantize_grouped_weight(weights))
