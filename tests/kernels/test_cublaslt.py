"""kernels/cublaslt.py, cuBLASLt's blockwise-FP8 GEMMs called directly.

wgrad (GPU): written, it is bitwise ``torch._scaled_mm``'s result (the same cuBLASLt kernel), per expert of ragged
groups addressed by offsets; added into float32 (beta = 1), it is ``out + written`` within float32 rounding, with
NaN/inf in ``out`` kept; HYBRID's E5M2 gradients; Megatron-sized experts through the op; no host sync.
fprop/dgrad (GPU): bitwise ``torch._scaled_mm`` per expert where torch 2.11 is right (reduction dims multiples of
512; E4M3 and E5M2 activations, BF16 and float32 out); within the GEMM tolerance of the dequantized reference at
reduction dims 768 (Qwen3-30B-A3B's fc2) and 2176 (where ``torch._scaled_mm`` was silently wrong), ragged groups
with empty experts and a trailing weightless group; no host sync. CPU: not available; the expert-major 1x128
scales cuBLAS reads (Triton, in the interpreter) are ``layout.to_columnwise`` bit for bit; non-contiguous operands
and unpadded 128x128 scales are refused by name; the op's cuBLAS backend refuses by name."""

import ctypes
import threading

import pytest
import torch

from conftest import CUDA, KERNEL_DEVICE, assert_no_host_sync, relerr, requires_cuda, same_bits
from transformer_engine_moe import quantize_blockwise, quantize_grouped_weight, scaling_aware_transpose
from transformer_engine_moe.kernels import cublaslt
from transformer_engine_moe.kernels.grouped_gemm import expert_major_scales
from transformer_engine_moe.layout import to_columnwise
from transformer_engine_moe.ops.grouped_gemm import grouped_gemm, grouped_gemm_wgrad
from transformer_engine_moe.ops.transpose import transpose_grouped_weight

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


# ---------------------------------------------------------------- fprop / dgrad
TOL = 2e-3  # as tests/ops/test_grouped_gemm.py on the GPU (FP8 tensor cores' reduced-precision block sums)
RAGGED = [256, 0, 144, 640, 16, 0]  # multiples of 16 rows (cuBLAS's fprop/dgrad), empty experts among them


def fprop_operands(splits, n, r, fp8=E4M3, device="cuda"):
    """``x [M, r]`` 1x128 (``fp8``: E5M2 as HYBRID's dY) and weights ``[G, n, r]`` 128x128, G = len(splits)."""
    w, _ = quantize_grouped_weight([torch.randn(n, r, device=device) * 0.05 for _ in splits])
    return quantize_blockwise(torch.randn(sum(splits), r, device=device), fp8_dtype=fp8), w


@pytest.mark.parametrize("splits", [[0, 130, 0, 70], [256, 0, 16, 48], [64]], ids=str)
@pytest.mark.parametrize("s", [6, 17], ids=["6-blocks", "17-blocks"])
def test_expert_major_scales_are_to_columnwise(splits, s):
    """Each group's 1x128 scales transposed into its own ``[S, m_g]`` block, one after another (cuBLAS's VEC128
    layout per expert): bitwise ``layout.to_columnwise`` of the scales, NaN and inf included; rows after the
    groups (a weightless group) left out."""
    rows = sum(splits)
    scales = torch.randn(rows + 32, s, device=KERNEL_DEVICE).exp2()
    scales[0, 0], scales[-33, -1] = float("nan"), float("inf")
    got = expert_major_scales(scales, splits)
    assert same_bits(got, to_columnwise(scales[:rows], splits))


def test_fprop_refuses_non_contiguous_operands_and_unpadded_weight_scales_by_name():
    """Checked before any CUDA call (so on the CPU too): the launches address experts by offsets."""
    x, w = fprop_operands([128, 128], 256, 768, device="cpu")
    a, sa = x.rowwise_data, to_columnwise(x.rowwise_scale_inv, [128, 128])
    b, sb = w.rowwise_data.view(2, 256, 768), w.rowwise_scale_inv.view(2, 2, 6)
    padded = torch.nn.functional.pad(sb, (0, 2))
    out = torch.empty(256, 256, dtype=torch.bfloat16)
    stream = [None]
    with pytest.raises(ValueError, match=r"a must be contiguous, got strides \(1, 256\)"):
        cublaslt.grouped_gemm(a.t().contiguous().t(), sa, b, padded, [128, 128], out, stream)
    with pytest.raises(ValueError, match="b must be contiguous"):
        cublaslt.grouped_gemm(a, sa, b.transpose(1, 2).contiguous().transpose(1, 2), padded, [128, 128], out, stream)
    with pytest.raises(ValueError, match="out must be contiguous"):
        cublaslt.grouped_gemm(a, sa, b, padded, [128, 128], out.t(), stream)
    with pytest.raises(ValueError, match=r"b_scale must be \[G, N/128, pad4\(R/128\)=8\] .* got \[2, 2, 6\]"):
        cublaslt.grouped_gemm(a, sa, b, sb, [128, 128], out, stream)


class _ModelOfCublasLt:
    """cuBLASLt's blockwise "TN" matmul as its documentation and CUDA 13.0's cublasLt.h describe it, in float32 on
    host memory, standing in for ``cublaslt._Context`` on the CPU: ``D [mm, nn] = op_T(A) @ B (+ D)``, A stored
    ``[kk, mm]`` and B ``[kk, nn]`` column-major (leading dimension kk), D ``[mm, nn]`` column-major; scales
    ``VEC128`` ``[ceil(kk/128), outer]`` (outer contiguous) and ``BLK128x128`` ``[ceil(outer/128), pad4(ceil(kk/128))]``
    (the reduction's blocks contiguous). It checks the plumbing (each expert's addresses, shapes, scale modes and
    layouts), not cuBLAS itself (the GPU tests do)."""

    one, zero = 1.0, 0.0

    def __init__(self):
        self.lock, self.modes = threading.Lock(), set()

    def launches(self, streams):
        return [None] * len(streams)

    def plan(self, *key):
        """The key less the scale addresses, which must point somewhere: cuBLASLt's heuristic refused every
        block-scaled shape while they were null (cublasStatus_t 7 on an H100 and an H200)."""
        *key, a_scale, b_scale = key
        if not (a_scale and b_scale):
            raise cublaslt.NoKernel(f"null scale pointer for {key}")
        return tuple(key)

    @staticmethod
    def _at(address, dtype, numel):
        raw = (ctypes.c_uint8 * (numel * dtype.itemsize)).from_address(address)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)

    def _operand(self, address, scale, mode, dtype, kk, outer):
        """The dequantized ``[outer, kk]`` (row r: column r of the column-major operand)."""
        x = self._at(address, dtype, kk * outer).view(outer, kk).float()
        kb, ob = -(-kk // 128), -(-outer // 128)
        if mode == cublaslt.VEC128:
            s = self._at(scale, torch.float32, kb * outer).view(kb, outer).t()  # [outer, kb]
            return x * s.repeat_interleave(128, 1)[:, :kk]
        s = self._at(scale, torch.float32, ob * -(-kb // 4) * 4).view(ob, -1)[:, :kb]
        return x * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:outer, :kk]

    def matmul(self, plan, a, a_scale, b, b_scale, d, beta, launch):
        modes, kk, mm, nn, a_dtype, b_dtype, d_dtype = plan
        self.modes.add(modes)
        out = self._at(d, d_dtype, mm * nn).view(nn, mm)  # column-major [mm, nn]
        prod = self._operand(b, b_scale, modes[1], b_dtype, kk, nn) @ self._operand(a, a_scale, modes[0], a_dtype,
                                                                                      kk, mm).t()
        out.copy_(prod + out.float() if beta else prod)  # beta = 0: C is not read (it may hold NaN)


@pytest.fixture
def model_of_cublaslt(monkeypatch):
    """The cuBLAS backend's launches on CPU tensors through ``_ModelOfCublasLt``, on two (named) streams (on a
    GPU machine the expert-major scales by their reference: no interpreter runs Triton on CPU tensors there)."""
    from contextlib import contextmanager

    from transformer_engine_moe.kernels import grouped_gemm as kernels, grouped_gemm_cublas

    model = _ModelOfCublasLt()
    monkeypatch.setattr(cublaslt, "_context", lambda device: model)
    monkeypatch.setattr(grouped_gemm_cublas, "_side_streams", contextmanager(lambda device, jobs: (yield [0, 1])))
    if CUDA:
        monkeypatch.setattr(kernels, "expert_major_scales", lambda s, splits: to_columnwise(s[:sum(splits)], splits))
    return model, grouped_gemm_cublas


@pytest.mark.parametrize("r", [768, 2176], ids=["r768", "r2176-padded-scales"])
def test_what_the_launches_read_is_made_before_the_side_streams_wait(monkeypatch, model_of_cublaslt, r):
    """The side streams wait for the current stream once, on entry: work queued on the current stream after that
    (the 128x128 scales' padding to pad4(R/128), once made inside) races the launches reading it; on an H200 the
    padded case came out with relative error 0.68. So nothing is computed between entry and the launches."""
    from contextlib import contextmanager

    model, backend = model_of_cublaslt
    inside = []

    @contextmanager
    def side_streams(device, jobs):
        inside.append(True)
        yield [0, 1]
        inside.pop()

    made_inside = []

    def recorded(real):
        def made(*args):
            if inside:
                made_inside.append(real.__name__)
            return real(*args)
        return made

    monkeypatch.setattr(backend, "_padded_blocks", recorded(backend._padded_blocks))
    monkeypatch.setattr(backend, "_side_streams", side_streams)
    x, w = fprop_operands([256, 256], 256, r, device="cpu")
    got = backend.grouped_gemm(x.rowwise_data, x.rowwise_scale_inv, w.rowwise_data.view(2, 256, r),
                               w.rowwise_scale_inv.view(2, 2, r // 128), [256, 256], out_dtype=torch.float32)
    assert not made_inside
    assert relerr(got, grouped_gemm(x, w, [256, 256], out_dtype=torch.float32, backend="reference")) < 1e-6


@pytest.mark.parametrize("r", [768, 2176], ids=["r768", "r2176"])
def test_each_experts_addresses_and_layouts_through_a_model_of_cublaslt(model_of_cublaslt, r):
    """fprop (E4M3), dgrad (E5M2 dY against byte-transposed weights) and wgrad (written, added) of ragged experts with
    empty ones and a trailing weightless group, launched expert by expert as on the GPU but into the float32 model
    of cuBLASLt: within float32 rounding of the reference (the same products, another order), the weightless
    group's rows zero. A wrong offset, scale layout or shape reads another expert's bytes or scales: far off."""
    model, backend = model_of_cublaslt
    splits, slack, n = [128, 0, 144, 256, 16, 0], 32, 256
    m = sum(splits)
    x, w = fprop_operands(splits, n, r, device="cpu")
    _, w2 = fprop_operands(splits, r, n, device="cpu")
    dy = quantize_blockwise(torch.randn(m + slack, r), fp8_dtype=E5M2)
    for a, b, s in ((x, w, splits), (dy, transpose_grouped_weight(w2), splits + [slack])):
        g, nn, rr = b.shape
        args = (a.rowwise_data, a.rowwise_scale_inv, b.rowwise_data.view(g, nn, rr),
                b.rowwise_scale_inv.view(g, nn // 128, rr // 128), s)
        ref = grouped_gemm(a, b, s, out_dtype=torch.float32, backend="reference")
        for dtype in (torch.float32, torch.bfloat16):
            got = backend.grouped_gemm(*args, out_dtype=dtype)
            assert relerr(got, ref) < (1e-6 if dtype == torch.float32 else 4e-3), dtype
            assert torch.equal(got[m:], torch.zeros_like(got[m:]))
    wsplits = [128, 0, 256, 128]
    dyt, xt = (scaling_aware_transpose(quantize_blockwise(torch.randn(sum(wsplits), c)), wsplits) for c in (n, r))
    ref = grouped_gemm_wgrad(dyt, xt, wsplits, backend="reference")
    start = torch.randn(ref.shape)
    for accumulate in (False, True):
        out = start.clone()
        backend.grouped_gemm_wgrad(dyt.columnwise_data, dyt.columnwise_scale_inv, xt.columnwise_data,
                                   xt.columnwise_scale_inv, wsplits, out, accumulate)
        want = ref + start if accumulate else torch.where(torch.tensor(wsplits)[:, None, None] > 0, ref, 0)
        assert relerr(out, want) < 1e-6, accumulate
    assert model.modes == {(cublaslt.BLK128x128, cublaslt.VEC128), (cublaslt.VEC128, cublaslt.VEC128)}


@gpu_lt
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "hybrid_e5m2"])
def test_gpu_fprop_is_each_experts_scaled_mm_where_torch_is_right(fp8):
    """Reduction 1024 (a multiple of 512, where torch 2.11's ``_scaled_mm`` is right): each expert's rows bitwise
    its own ``torch._scaled_mm`` (same cuBLASLt kernel; the offsets into the operands, their expert-major 1x128
    scales and the 128x128 scales are right); E5M2 activations are HYBRID's dgrad operand."""
    n, r = 384, 1024
    x, w = fprop_operands(RAGGED, n, r, fp8)
    wd, ws = w.rowwise_data.view(len(RAGGED), n, r), w.rowwise_scale_inv.view(len(RAGGED), n // 128, r // 128)
    for dtype in (torch.bfloat16, torch.float32):
        got = grouped_gemm(x, w, RAGGED, out_dtype=dtype, backend="cublas")
        lo = 0
        for g, m in enumerate(RAGGED):
            if m:
                want = torch._scaled_mm(x.rowwise_data[lo:lo + m], wd[g].t(),
                                        x.rowwise_scale_inv[lo:lo + m].t().contiguous().t(), ws[g].t(), out_dtype=dtype)
                assert torch.equal(got[lo:lo + m], want), (g, dtype)
            lo += m


@gpu_lt
@pytest.mark.parametrize("r", [768, 2176], ids=["r768-qwen-fc2", "r2176-scaled-mm-pitfall"])
def test_gpu_fprop_dgrad_any_reduction_match_reference(r):
    """Reduction dims that are not multiples of 512 (R/128 = 6, 17: the 128x128 scales' rows padded to 8 and 20):
    fprop (E4M3) and dgrad (HYBRID's E5M2 dY against the byte-transposed weights) within the GEMM tolerance of the
    dequantized float32 reference, ragged groups with empty experts; a trailing weightless group's rows zero where
    the output's memory held NaN; no host sync."""
    n, slack = 256, 48
    x, w = fprop_operands(RAGGED, n, r)
    _, w2 = fprop_operands(RAGGED, r, n)  # dgrad: dY [M, r] @ W2 [G, r, n] through W2^T [G, n, r]
    dy = quantize_blockwise(torch.randn(sum(RAGGED), r, device="cuda"), fp8_dtype=E5M2)
    for a, b in ((x, w), (dy, transpose_grouped_weight(w2))):
        ref = grouped_gemm(a, b, RAGGED, out_dtype=torch.float32, backend="reference")
        for dtype in (torch.bfloat16, torch.float32):
            assert relerr(grouped_gemm(a, b, RAGGED, out_dtype=dtype, backend="cublas"), ref) < TOL, dtype
    xs = quantize_blockwise(torch.randn(sum(RAGGED) + slack, r, device="cuda"))
    torch.full((sum(RAGGED) + slack, n), float("nan"), dtype=torch.bfloat16, device="cuda")  # freed: reused
    out = grouped_gemm(xs, w, RAGGED + [slack], backend="cublas")
    assert torch.equal(out[sum(RAGGED):], torch.zeros_like(out[sum(RAGGED):]))
    assert relerr(out, grouped_gemm(xs, w, RAGGED + [slack], out_dtype=torch.float32, backend="reference")) < TOL
    assert_no_host_sync(lambda: grouped_gemm(x, w, RAGGED, backend="cublas"))
