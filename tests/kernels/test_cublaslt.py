"""kernels/cublaslt.py, cuBLASLt's blockwise-FP8 wgrad called directly. GPU: written, it is bitwise
``torch._scaled_mm``'s result (the same cuBLASLt kernel), per expert of ragged groups addressed by offsets;
added into float32 (beta = 1), it is ``out + written`` within float32 rounding, with NaN/inf in ``out``
kept; HYBRID's E5M2 gradients; Megatron-sized experts through the op; no host sync; non-contiguous operands
refused. CPU: not available, and the op's cuBLAS wgrad refuses by name."""

import pytest
import torch

from conftest import CUDA, assert_no_host_sync, relerr, requires_cuda
from transformer_engine_moe import quantize_blockwise, scaling_aware_transpose
from transformer_engine_moe.kernels import cublaslt
from transformer_engine_moe.ops.grouped_gemm import grouped_gemm_wgrad

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def expert_blocks(m, n, k, dy_fp8=E4M3):
    """One expert's grouped columnwise copies: ``dY^T [N, m]``, its scales ``[m/128, N]``, ``X^T [K, m]``,
    ``[m/128, K]``."""
    dyt = scaling_aware_transpose(quantize_blockwise(torch.randn(m, n, device="cuda"), fp8_dtype=dy_fp8), [m])
    xt = scaling_aware_transpose(quantize_blockwise(torch.randn(m, k, device="cuda")), [m])
    return dyt.columnwise_data.view(n, m), dyt.columnwise_scale_inv, xt.columnwise_data.view(k, m), \
        xt.columnwise_scale_inv


def one_expert(a, sa, b, sb, out, accumulate):
    cublaslt.grouped_wgrad(a, sa, b, sb, [a.shape[1]], [out], accumulate, [torch.cuda.current_stream()])


def test_not_available_off_the_gpu():
    assert not cublaslt.available(torch.device("cpu"))


def test_cpu_wgrad_refuses_cublas_by_name():
    dy = x = scaling_aware_transpose(quantize_blockwise(torch.randn(128, 128)), [128])
    with pytest.raises(ValueError, match="backend='cublas' cannot run this call: it needs CUDA"):
        grouped_gemm_wgrad(dy, x, [128], backend="cublas")


@requires_cuda
def test_gpu_available_on_hopper():
    assert cublaslt.available(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] == 9)


gpu_lt = pytest.mark.skipif(not (CUDA and cublaslt.available(torch.device("cuda"))),
                            reason="needs a Hopper GPU and cuBLASLt >= 12.9")


@gpu_lt
@pytest.mark.parametrize("m", [128, 384, 1024])
@pytest.mark.parametrize("dy_fp8", [E4M3, E5M2], ids=["e4m3", "hybrid_e5m2"])
def test_gpu_written_is_scaled_mm_and_added_is_out_plus_written(m, dy_fp8):
    n, k = 256, 384
    a, sa, b, sb = expert_blocks(m, n, k, dy_fp8)
    for dtype in (torch.bfloat16, torch.float32):
        want = torch._scaled_mm(a, b.t(), sa.t(), sb, out_dtype=dtype)
        out = torch.full((n, k), float("nan"), device="cuda", dtype=dtype)  # written over
        one_expert(a, sa, b, sb, out, accumulate=False)
        assert torch.equal(out, want), dtype
    start = torch.randn(n, k, device="cuda")
    start[0, 0], start[1, 1] = float("nan"), float("inf")
    out = start.clone()
    one_expert(a, sa, b, sb, out, accumulate=True)
    finite = torch.ones_like(out, dtype=torch.bool)
    finite[0, 0] = finite[1, 1] = False
    assert relerr(out[finite], (start + want)[finite]) < 1e-6  # want: the float32 one
    assert out[0, 0].isnan() and out[1, 1] == float("inf")
    assert_no_host_sync(lambda: one_expert(a, sa, b, sb, out, accumulate=True))


@gpu_lt
def test_gpu_megatron_sized_experts_added_into_main_grads():
    """DeepSeek-V3's fc2 wgrad (7168 x 2048) over ragged 128-multiple experts, one empty, added through the op
    into separate main_grads lying in reverse order (Megatron's DDP layout), on the op's side streams."""
    splits, n, k = [1024, 0, 384, 2048, 128], 7168, 2048
    m = sum(splits)
    dyt = scaling_aware_transpose(quantize_blockwise(torch.randn(m, n, device="cuda")), splits)
    xt = scaling_aware_transpose(quantize_blockwise(torch.randn(m, k, device="cuda")), splits)
    ref = grouped_gemm_wgrad(dyt, xt, splits, backend="reference")
    start = torch.randn(len(splits), n, k, device="cuda")
    outs = list(start.flip(0).contiguous().unbind(0))[::-1]
    grouped_gemm_wgrad(dyt, xt, splits, out=outs, accumulate=True, backend="cublas")
    assert relerr(torch.stack(outs) - start, ref) < 2e-3
    assert torch.equal(outs[1], start[1])


@gpu_lt
def test_gpu_ragged_groups_are_each_experts_scaled_mm():
    """Through the op on its side streams into one [G, N, K]: each expert bitwise its own ``torch._scaled_mm``
    (the offsets into the grouped operands and their scales are right), the empty one zeros."""
    splits, n, k = [256, 0, 128, 640, 128], 256, 384
    dyt = scaling_aware_transpose(quantize_blockwise(torch.randn(sum(splits), n, device="cuda")), splits)
    xt = scaling_aware_transpose(quantize_blockwise(torch.randn(sum(splits), k, device="cuda")), splits)
    got = grouped_gemm_wgrad(dyt, xt, splits, out_dtype=torch.bfloat16, backend="cublas")
    lo = 0
    for g, m in enumerate(splits):
        a, b = dyt.columnwise_data[n * lo:n * (lo + m)].view(n, m), xt.columnwise_data[k * lo:k * (lo + m)].view(k, m)
        sa, sb = dyt.columnwise_scale_inv[lo // 128:(lo + m) // 128], xt.columnwise_scale_inv[lo // 128:(lo + m) // 128]
        want = torch._scaled_mm(a, b.t(), sa.t(), sb, out_dtype=torch.bfloat16) if m else torch.zeros_like(got[g])
        assert torch.equal(got[g], want), g
        lo += m


@gpu_lt
def test_gpu_non_contiguous_operand_refused_by_name():
    a, sa, b, sb = expert_blocks(256, 256, 256)
    out = torch.empty(256, 256, device="cuda")
    with pytest.raises(ValueError, match="a_scale_inv must be contiguous"):
        one_expert(a, sa.t().contiguous().t(), b, sb, out, accumulate=False)
