"""grouped_gemm / grouped_gemm_wgrad: Triton kernels (interpreter on CPU) and cuBLAS (GPU) vs the float32
reference on dequantized operands; ragged and empty groups; list vs tensor splits; bad inputs (the weights' byte
transpose: test_transpose.py)."""

import dataclasses

import pytest
import torch

from conftest import CUDA, KERNEL_DEVICE, relerr, requires_cuda
from transformer_engine_moe import quantize_blockwise, quantize_grouped_weight, scaling_aware_transpose
from transformer_engine_moe.ops.grouped_gemm import (CUBLAS_MIN_WEIGHT, GemmCall, _impl, auto_backend, cublas_pays,
                                                     grouped_gemm, grouped_gemm_wgrad, stacked_view, why_not)
from transformer_engine_moe.ops.transpose import transpose_grouped_weight

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Kernel vs reference, float32 output: the same exact FP8 products summed in another order. On Hopper the
# FP8 tensor cores keep a reduced-precision accumulator inside each 128-wide block (~14 bits, DeepSeek-V3
# report), hence the looser GPU bound; under the interpreter the products are summed in float32.
TOL = 2e-3 if CUDA else 1e-5


def weights(g, n, k, device=KERNEL_DEVICE):
    w = torch.randn(g * n, k, device=device) * 0.05
    return quantize_blockwise(w, "128x128").view(g, n, k)


def act(m, k, fp8=E4M3, device=KERNEL_DEVICE):
    return quantize_blockwise(torch.randn(m, k, device=device), fp8_dtype=fp8)


SPLITS = [[0, 130, 0, 70], [64, 64, 64, 64], [256, 0, 0, 0], [1, 2, 3, 250]]


@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_fprop_and_dgrad_match_reference(splits, as_tensor):
    m, n, k = sum(splits), 256, 384
    w, x = weights(4, n, k), act(m, k)
    ms = torch.tensor(splits, device=KERNEL_DEVICE) if as_tensor else splits
    out = grouped_gemm(x, w, ms, out_dtype=torch.float32, backend="triton")
    ref = grouped_gemm(x, w, splits, out_dtype=torch.float32, backend="reference")
    assert out.shape == (m, n) and relerr(out, ref) < TOL
    lo = 0
    for g, s in enumerate(splits):  # each group used its own expert: independent check of the reference
        want = x.dequantize()[lo:lo + s] @ w.dequantize()[g].t()
        assert relerr(ref[lo:lo + s], want) < 1e-5 if s else True
        lo += s
    dy = act(m, n, E5M2)
    dgrad = grouped_gemm(dy, transpose_grouped_weight(w), ms, out_dtype=torch.float32, backend="triton")
    assert relerr(dgrad, grouped_gemm(dy, transpose_grouped_weight(w), splits, out_dtype=torch.float32,
                                      backend="reference")) < TOL


@pytest.mark.parametrize("k", [128, 640], ids=["one-k-block", "odd-k-blocks"])
def test_fprop_odd_number_of_k_blocks(k):
    """The kernel takes K blocks two at a time: an odd count ends with one block alone (one block: only it)."""
    splits = [72, 0, 128]
    w, x = weights(3, 128, k), act(200, k)
    out = grouped_gemm(x, w, splits, out_dtype=torch.float32, backend="triton")
    assert relerr(out, grouped_gemm(x, w, splits, out_dtype=torch.float32, backend="reference")) < TOL


def test_bf16_output_and_list_tensor_splits_identical():
    splits = [100, 0, 156]
    w, x = weights(3, 128, 256), act(256, 256)
    a = grouped_gemm(x, w, splits, backend="triton")
    b = grouped_gemm(x, w, torch.tensor(splits, device=KERNEL_DEVICE), backend="triton")
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)


@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_wgrad_matches_reference_and_accumulates(splits, as_tensor):
    m, n, k = sum(splits), 128, 256
    ms = torch.tensor(splits, device=KERNEL_DEVICE) if as_tensor else splits
    dy = scaling_aware_transpose(act(m, n, E5M2), ms)
    x = scaling_aware_transpose(act(m, k), ms)
    ref = grouped_gemm_wgrad(dy, x, ms, backend="reference")
    out = grouped_gemm_wgrad(dy, x, ms, backend="triton")
    assert out.shape == (4, n, k) and relerr(out, ref) < TOL
    for g, s in enumerate(splits):
        if s == 0:
            assert (out[g] == 0).all()
    main_grad = torch.ones(4, n, k, device=KERNEL_DEVICE)
    grouped_gemm_wgrad(dy, x, ms, out=main_grad, accumulate=True, backend="triton")
    assert relerr(main_grad - 1, ref) < TOL
    bf16 = grouped_gemm_wgrad(dy, x, ms, out_dtype=torch.bfloat16, backend="triton")  # the weights' dtype
    assert bf16.dtype == torch.bfloat16 and relerr(bf16, ref) < 2**-8


WGRAD_BACKENDS = ["reference", "triton"] + (["cublas"] if CUDA else [])


@pytest.mark.parametrize("backend", WGRAD_BACKENDS)
@pytest.mark.parametrize("order", ["reversed", "scattered", "in_order"])
@pytest.mark.parametrize("accumulate", [True, False], ids=["added", "written"])
def test_wgrad_into_a_list_of_main_grads(backend, order, accumulate):
    """``out`` as G separate [N, K] (each expert's main_grad): in reverse order in one buffer (Megatron's DDP
    layout), in separate allocations, or in order (made one [G, N, K] view): each gets its own group's
    gradient added or written (NaN there overwritten), bitwise what a [G, N, K] out gets; zero-row experts
    added nothing / written zeros; the list comes back as given."""
    splits = [128, 0, 256, 128] if backend == "cublas" else [100, 0, 156, 128]  # cuBLAS: groups of 128-multiples
    m, n, k = sum(splits), 128, 256
    dy, x = scaling_aware_transpose(act(m, n), splits), scaling_aware_transpose(act(m, k), splits)
    start = torch.randn(4, n, k, device=KERNEL_DEVICE) if accumulate else torch.full((4, n, k), float("nan"),
                                                                                       device=KERNEL_DEVICE)
    want = start.clone()
    grouped_gemm_wgrad(dy, x, splits, out=want, accumulate=accumulate, backend=backend)
    if order == "reversed":  # experts G-1 .. 0 one after another: outs[g] at decreasing addresses
        outs = list(start.flip(0).contiguous().unbind(0))[::-1]
    else:
        outs = [t.clone() for t in start.unbind(0)] if order == "scattered" else list(start.clone().unbind(0))
    assert (stacked_view(outs) is not None) == (order == "in_order")
    got = grouped_gemm_wgrad(dy, x, splits, out=outs, accumulate=accumulate, backend=backend)
    assert got is outs
    for g in range(4):
        assert torch.equal(outs[g], want[g]), g
    assert torch.equal(outs[1], start[1] if accumulate else torch.zeros_like(start[1]))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("splits", [[100, 0, 156, 128], [384, 0, 0, 0]], ids=str)
@pytest.mark.parametrize("as_list", [False, True], ids=["one-buffer", "list"])
@pytest.mark.parametrize("accumulate", [True, False], ids=["added", "written"])
def test_wgrad_rounded_to_bf16_is_what_adding_a_bf16_grad_gives(backend, splits, as_list, accumulate):
    """``out_dtype=torch.bfloat16`` with ``out``: each sum rounded to BF16, then added into (or written over) the
    float32 ``out``: bit for bit what writing the BF16 gradient and adding it (Megatron DDP's hook without
    gradient-accumulation fusion: ``main_grad.add_(grad)``) or copying it gives. main_grad holds NaN, infinities,
    signed zeros and subnormals; empty experts add +0 (or write zeros)."""
    m, n, k = sum(splits), 128, 256
    dy, x = scaling_aware_transpose(act(m, n), splits), scaling_aware_transpose(act(m, k), splits)
    start = torch.randn(4, n, k, device=KERNEL_DEVICE)
    start[0, 0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40])
    grad = grouped_gemm_wgrad(dy, x, splits, out_dtype=torch.bfloat16, backend=backend)
    want = start.clone()
    (torch._foreach_add_ if accumulate else torch._foreach_copy_)(list(want.unbind(0)), list(grad.unbind(0)))
    got = start.clone()
    out = list(got.flip(0).contiguous().unbind(0))[::-1] if as_list else got  # a list: DDP's reversed layout
    grouped_gemm_wgrad(dy, x, splits, out=out, accumulate=accumulate, out_dtype=torch.bfloat16, backend=backend)
    got = torch.stack(out) if as_list else got
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    unrounded = start.clone()
    grouped_gemm_wgrad(dy, x, splits, out=unrounded, accumulate=accumulate, backend=backend)
    assert not torch.equal(unrounded, got)  # float32 sums: other bits


@pytest.mark.parametrize("library", ["cublas", "deepgemm"])
@pytest.mark.parametrize("as_list", [False, True], ids=["one-buffer", "list"])
def test_rounded_wgrad_on_a_library_is_the_bf16_gradient_then_added(monkeypatch, library, as_list):
    """cuBLAS and DeepGEMM hand over float32 sums: there a wgrad rounded to BF16 into ``out`` is the BF16 gradient
    written by the library, then added, the same bits as the reference's rounding; "auto" decides it as a call of its
    own (``GemmCall`` kind "wgrad_rounded": cuBLAS and DeepGEMM from 8192 rows per expert, Triton below). The library
    stands in as the reference under its name (CPU)."""
    import importlib

    from transformer_engine_moe import backend

    ops = importlib.import_module("transformer_engine_moe.ops.grouped_gemm")  # the module, not its function
    seen = []

    def written_only(a, a_s, b, b_s, m, out, accumulate, out_dtype):
        seen.append((out, accumulate, out_dtype))
        return backend.REFERENCE.grouped_gemm_wgrad(a, a_s, b, b_s, m, out, accumulate, out_dtype)

    lib = dataclasses.replace(backend.REFERENCE, name=library, grouped_gemm_wgrad=written_only)
    calls = []
    monkeypatch.setattr(ops, "_impl", lambda backend, call, a, op: calls.append(call) or lib)
    splits = [100, 0, 156, 128]
    m, n, k = sum(splits), 128, 256
    dy, x = scaling_aware_transpose(act(m, n, device="cpu"), splits), scaling_aware_transpose(act(m, k, device="cpu"),
                                                                                               splits)
    start = torch.randn(4, n, k)
    start[0, 0, :3] = torch.tensor([float("nan"), -0.0, 1e-40])
    want = start.clone()
    backend.REFERENCE.grouped_gemm_wgrad(dy.columnwise_data, dy.columnwise_scale_inv, x.columnwise_data,
                                         x.columnwise_scale_inv, splits, want, True, torch.bfloat16)
    got = start.clone()
    out = list(got.flip(0).contiguous().unbind(0))[::-1] if as_list else got
    assert grouped_gemm_wgrad(dy, x, splits, out=out, accumulate=True, out_dtype=torch.bfloat16) is out
    assert torch.equal((torch.stack(out) if as_list else got).view(torch.int32), want.view(torch.int32))
    assert seen == [(None, False, torch.bfloat16)]
    assert (calls[0].kind, calls[0].out_dtype, calls[0].out_list) == ("wgrad_rounded", torch.bfloat16, False)


def test_wgrad_list_out_is_checked():
    dy = x = scaling_aware_transpose(act(256, 256, device="cpu"), [128, 128])
    good = torch.zeros(256, 256)
    with pytest.raises(ValueError, match=r"2 contiguous float32 \[256, 256\] tensors on cpu .*got 1"):
        grouped_gemm_wgrad(dy, x, [128, 128], out=[good])
    with pytest.raises(ValueError, match=r"out\[1\] is torch.bfloat16"):
        grouped_gemm_wgrad(dy, x, [128, 128], out=[good, good.bfloat16()])
    with pytest.raises(ValueError, match=r"out\[0\] is torch.float32 \[256, 256\]"):  # not contiguous
        grouped_gemm_wgrad(dy, x, [128, 128], out=[good.t(), good])
    with pytest.raises(TypeError, match="out must be a tensor or a list of tensors, got dict"):
        grouped_gemm_wgrad(dy, x, [128, 128], out={})


@requires_cuda
@pytest.mark.parametrize("mode", ["written", "added"])
def test_gpu_wgrad_tma_epilogue_is_bitwise_the_pointer_stores(mode):
    """The Triton wgrad stores (or adds) its tiles into a 16-byte aligned [G, N, K] by TMA; the same out 4 bytes
    off that alignment takes the pointer stores: the same bits (a BF16 output: the float32 one rounded). Ragged and
    empty groups; main_grad holding NaN, infinities, signed zeros, and subnormals where the gradient is exactly
    zero (an atomic add in L2 flushes subnormals: the TMA addition must not)."""
    from transformer_engine_moe.kernels.grouped_gemm import takes_tma_epilogue

    splits = [100, 0, 156, 128]
    m, n, k = sum(splits), 256, 384
    xb = torch.randn(m, k, device="cuda")
    xb[:, :8] = 0  # gradient columns 0..7 exactly zero
    dy, x = scaling_aware_transpose(act(m, n, device="cuda"), splits), scaling_aware_transpose(quantize_blockwise(xb),
                                                                                                splits)
    start = torch.randn(4, n, k, device="cuda")
    start[:, :, :8] = 1e-40
    start[0, 0, 8:13] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    buffer = torch.empty(start.numel() + 1, device="cuda")
    off = buffer[1:].view(4, n, k).copy_(start)
    aligned = start.clone()
    assert takes_tma_epilogue(aligned) and not takes_tma_epilogue(off) and not takes_tma_epilogue(aligned.cpu())
    for out in (aligned, off):
        grouped_gemm_wgrad(dy, x, splits, out=out, accumulate=mode == "added", backend="triton")
    assert torch.equal(aligned.view(torch.int32), off.view(torch.int32))
    if mode == "added":
        assert (aligned[:, :, :8] == 1e-40).all() and aligned[0, 0, 8].isnan()
    else:  # written: a BF16 output is the float32 one rounded
        bf16 = grouped_gemm_wgrad(dy, x, splits, out_dtype=torch.bfloat16, backend="triton")
        assert torch.equal(bf16.view(torch.int16), off.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("splits", [[0, 130, 0, 70], [256, 0, 0, 0]], ids=str)
def test_wgrad_reads_each_experts_own_block(splits):
    """Expert-major operands built by hand, as DeepGEMM / TE's per-expert tensors give them: each expert's
    ungrouped columnwise copy flattened, one after another (scale rows concatenated). The Triton kernel and
    the reference on those buffers equal dY_g^T X_g from each expert's own copy."""
    from transformer_engine_moe.kernels import grouped_gemm as kernels
    from transformer_engine_moe.reference import grouped_gemm as reference

    m, n, k = sum(splits), 128, 256
    dy, x = act(m, n, E5M2), act(m, k)
    own = [(scaling_aware_transpose(a), scaling_aware_transpose(b))
           for a, b, s in zip(dy.split(splits), x.split(splits), splits) if s]
    a_t = torch.cat([d.columnwise_data.reshape(-1) for d, _ in own])
    b_t = torch.cat([c.columnwise_data.reshape(-1) for _, c in own])
    a_s = torch.cat([d.columnwise_scale_inv for d, _ in own])
    b_s = torch.cat([c.columnwise_scale_inv for _, c in own])
    grouped_dy, grouped_x = scaling_aware_transpose(dy, splits), scaling_aware_transpose(x, splits)
    assert torch.equal(a_t.view(torch.uint8), grouped_dy.columnwise_data.view(torch.uint8))
    assert torch.equal(b_s, grouped_x.columnwise_scale_inv)
    want, parts = torch.zeros(len(splits), n, k), iter(own)
    for g, s in enumerate(splits):
        if s:
            d, c = next(parts)
            want[g] = d.dequantize(usage="columnwise").t() @ c.dequantize(usage="columnwise")
    for impl in (kernels, reference):
        out = impl.grouped_gemm_wgrad(a_t, a_s, b_t, b_s, splits)
        assert out.shape == (len(splits), n, k) and relerr(out.cpu(), want) < TOL, impl.__name__


WEIGHTLESS = [([0, 130, 0, 70], 56), ([256, 0, 0, 0], 128), ([64, 64, 64, 64], 0), ([0, 0, 0, 0], 200)]


@pytest.mark.parametrize("splits,slack", WEIGHTLESS, ids=str)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_trailing_weightless_group(splits, slack, as_tensor):
    """G + 1 splits for G experts: the last group's rows (random values here, not zeros) come out zero from
    fprop and dgrad, and wgrad with ``num_groups=G`` never reads them: every other row and every weight
    gradient is bitwise what the G experts give on the leading rows alone (Triton, reference)."""
    m, n, k = sum(splits), 256, 384
    w, x, dy = weights(4, n, k), act(m + slack, k), act(m + slack, n, E5M2)
    full, lead = splits + [slack], splits
    head = lambda t: t.split([m, slack])[0]  # the leading rows' FP8 tensor
    ms = (lambda s: torch.tensor(s, device=KERNEL_DEVICE)) if as_tensor else (lambda s: s)
    for backend in ("triton", "reference"):
        for a, b in ((x, w), (dy, transpose_grouped_weight(w))):
            torch.full((m + slack, b.shape[1]), float("nan"), device=KERNEL_DEVICE)  # freed: the GPU reuses it
            out = grouped_gemm(a, b, ms(full), out_dtype=torch.float32, backend=backend)
            assert torch.equal(out[m:], torch.zeros(slack, b.shape[1], device=KERNEL_DEVICE))
            assert torch.equal(out[:m], grouped_gemm(head(a), b, ms(lead), out_dtype=torch.float32, backend=backend))
        s_full, s_lead = ms(full), ms(lead)
        got = grouped_gemm_wgrad(scaling_aware_transpose(dy, s_full), scaling_aware_transpose(x, s_full), s_full,
                                 num_groups=4, backend=backend)
        want = grouped_gemm_wgrad(scaling_aware_transpose(head(dy), s_lead), scaling_aware_transpose(head(x), s_lead),
                                  s_lead, backend=backend)
        assert got.shape == (4, n, k) and torch.equal(got, want)


def test_empty_input():
    w = weights(2, 128, 128)
    assert grouped_gemm(act(0, 128), w, [0, 0], backend="triton").shape == (0, 128)
    e = scaling_aware_transpose(act(0, 128), [0, 0])
    assert (grouped_gemm_wgrad(e, e, [0, 0], backend="triton") == 0).all()


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda x, w: grouped_gemm(x, w, [100, 100]), ValueError, r"sum to M=256"),
        (lambda x, w: grouped_gemm(x, w, [256, 0, 0, 0]), ValueError, r"4 groups but the weight has 2 experts"),
        (lambda x, w: grouped_gemm_wgrad(*[scaling_aware_transpose(x, [128, 128])] * 2, [128, 128], num_groups=0),
         ValueError, r"num_groups must be None, 2 or 1 .*got 0"),
        (lambda x, w: grouped_gemm(x, w, [300, -44]), ValueError, r">= 0"),
        (lambda x, w: grouped_gemm(x, w, None), ValueError, r"m_splits is required"),
        (lambda x, w: grouped_gemm(act(256, 384), w, [128, 128]), ValueError, r"384 features but weight expects K=256"),
        (lambda x, w: grouped_gemm(x.dequantize(), w, [128, 128]), TypeError, r"inp must be a Float8BlockwiseQTensor"),
        (lambda x, w: grouped_gemm(x, w.dequantize(), [128, 128]), TypeError, r"weight must be a Float8Blockwise"),
        (lambda x, w: grouped_gemm(x, x, [128, 128]), ValueError, r"128x128-scaled rowwise \[G, N, K\]"),
        (lambda x, w: grouped_gemm(x, w, [128, 128], out_dtype=torch.int32), TypeError, r"out_dtype"),
        (lambda x, w: grouped_gemm_wgrad(*[scaling_aware_transpose(x, [128, 128])] * 2, [128, 128],
                                         out_dtype=torch.float16), TypeError, r"out_dtype must be torch.float32"),
        (lambda x, w: grouped_gemm(x, w, [128, 128], backend="cutlass"), ValueError, r"backend must be one of"),
        (lambda x, w: grouped_gemm_wgrad(x, x, [128, 128]), ValueError, r"no columnwise data"),
        (lambda x, w: grouped_gemm_wgrad(scaling_aware_transpose(x, [128, 128]), scaling_aware_transpose(x, [256]),
                                         [128, 128]), ValueError, r"inp's columnwise copy is grouped by \[256\]"),
        (lambda x, w: grouped_gemm_wgrad(*[scaling_aware_transpose(x, [128, 128])] * 2, [128, 128],
                                         out=torch.zeros(2, 256, 255)), ValueError, r"out must be .*\[2, 256, 256\]"),
        (lambda x, w: transpose_grouped_weight(x), ValueError, r"weight must be 128x128-scaled rowwise"),
        (lambda x, w: transpose_grouped_weight(w.dequantize()), TypeError, r"weight must be a Float8BlockwiseQTensor"),
        (lambda x, w: transpose_grouped_weight(w, backend="cuda"), ValueError, r"transpose_grouped_weight: backend"),
        # the hostile-input probe: sizes whose int64 sum wraps to M (once silent garbage, or a crash), one buffer
        # for two groups (once two experts' gradients written into it), out on another device (once left
        # unwritten), accumulate="no" (once added)
        (lambda x, w: grouped_gemm(x, w, torch.tensor([2**63 - 1, 2**63 - 1, 258])), ValueError,
         r"each size at most M"),
        (lambda x, w: grouped_gemm_wgrad(*[scaling_aware_transpose(x, [128, 128])] * 2, [128, 128],
                                         out=[torch.zeros(256, 256)] * 2), ValueError,
         r"out\[0\] and out\[1\] share memory"),
        (lambda x, w: grouped_gemm_wgrad(*[scaling_aware_transpose(x, [128, 128])] * 2, [128, 128],
                                         out=torch.zeros(2, 256, 256, device="meta")), ValueError,
         r"on cpu .* on meta"),
        (lambda x, w: grouped_gemm_wgrad(*[scaling_aware_transpose(x, [128, 128])] * 2, [128, 128],
                                         out=torch.zeros(2, 256, 256), accumulate="no"), TypeError,
         r"accumulate must be a bool"),
    ],
    ids=["sum", "groups", "num-groups", "negative", "none", "features", "bf16-inp", "bf16-weight", "1x128-weight",
         "out-dtype", "wgrad-out-dtype", "backend", "no-columnwise", "other-splits", "out-shape",
         "transpose-1x128", "transpose-bf16", "transpose-backend", "splits-int64-wrap", "out-shared", "out-device",
         "accumulate-str"],
)
def test_bad_input_is_rejected_clearly(call, exc, match):
    x, w = act(256, 256, device="cpu"), weights(2, 256, 256, device="cpu")
    with pytest.raises(exc, match=match):
        call(x, w)


def test_cublas_backend_refuses_what_it_cannot_do():
    x, w = act(256, 256, device="cpu"), weights(2, 256, 256, device="cpu")
    with pytest.raises(ValueError, match="backend='cublas' cannot run this call: it needs CUDA"):
        grouped_gemm(x, w, [128, 128], backend="cublas")


def test_cublas_pays_needs_rows_and_work_per_expert():
    v3_fc1, v3_fc2, small_fc1, small_fc2 = 4096 * 7168, 2048 * 7168, 2048 * 2048, 1024 * 2048
    assert v3_fc2 == CUBLAS_MIN_WEIGHT
    assert cublas_pays("wgrad", [512] * 64, v3_fc1) and cublas_pays("wgrad", [512] * 64, v3_fc2)
    assert not cublas_pays("wgrad", [384] * 64, v3_fc1)  # too few rows, whatever the weight
    # DeepSeek-small experts at 512 rows: too little GPU work per launch; 4x the rows are enough
    assert not cublas_pays("wgrad", [512] * 64, small_fc1) and not cublas_pays("wgrad", [512] * 64, small_fc2)
    assert cublas_pays("wgrad", [1792] * 8, small_fc1) and not cublas_pays("wgrad", [1792] * 8, small_fc2)
    assert not cublas_pays("fprop", [1024] * 8, v3_fc1) and cublas_pays("fprop", [2048] * 8, v3_fc2)
    assert cublas_pays("wgrad_accumulate", [0, 1024], v3_fc2) and not cublas_pays("wgrad_accumulate", [0, 1022], v3_fc2)


@requires_cuda
@pytest.mark.parametrize("n,k,rows,picked", [(2048, 7168, 512, "cublas"), (2048, 2048, 512, "own"),
                                             (2048, 2048, 2048, "cublas"), (4096, 7168, 384, "own")])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_auto_written_wgrad_takes_cublas_only_where_it_pays(n, k, rows, picked, out_dtype):
    """A wgrad written, not added (BF16, or float32: overwrite_main_grad), has 'auto' order cuBLAS > Gluon > Triton
    (no DeepGEMM, which would zero and add): cuBLAS only for large expert GEMMs, else the Gluon kernel where it runs
    (a Hopper GPU under Triton 3.6), Triton's elsewhere."""
    from transformer_engine_moe.ops.grouped_gemm import gluon_available

    a = torch.empty(n, rows * 4, dtype=torch.float8_e4m3fn, device="cuda")
    impl = _impl("auto", GemmCall.of("wgrad", a, a.dtype, [rows] * 4, out_dtype, weight_elements=n * k), a, "t")
    own = "gluon" if gluon_available(a.device) else "triton"
    assert impl.name == (own if picked == "own" else picked)


@requires_cuda
@pytest.mark.parametrize("e,m,n,k", [(8, 65536, 4096, 7168), (32, 32768, 7168, 2048)])
def test_gpu_deepseek_shapes_all_backends(e, m, n, k):
    """DeepSeek-V3 expert shapes: fc1 (7168 -> 2*2048) and fc2 (2048 -> 7168), ragged splits."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(e), m, replacement=True, generator=gen).bincount(minlength=e)
    splits = (counts // 512 * 512).tolist()  # cuBLAS: groups of 128-multiples (wgrad), reductions of 512
    splits[0] = 0
    splits[-1] += m - sum(splits)
    ragged = counts.tolist()  # Triton only
    w, x, dy = weights(e, n, k, "cuda"), act(m, k, device="cuda"), act(m, n, device="cuda")
    ref = grouped_gemm(x, w, splits, out_dtype=torch.float32, backend="reference")
    ms = torch.tensor(splits, device="cuda")
    for backend, s in (("triton", ms), ("cublas", splits), ("auto", splits)):
        assert relerr(grouped_gemm(x, w, s, out_dtype=torch.float32, backend=backend), ref) < TOL
    wt = transpose_grouped_weight(w)
    ref = grouped_gemm(dy, wt, splits, out_dtype=torch.float32, backend="reference")
    for backend, s in (("triton", ms), ("cublas", splits)):
        assert relerr(grouped_gemm(dy, wt, s, out_dtype=torch.float32, backend=backend), ref) < TOL
    for s in (splits, ragged):
        dyt, xt = scaling_aware_transpose(dy, s), scaling_aware_transpose(x, s)
        ref = grouped_gemm_wgrad(dyt, xt, s, backend="reference")
        st = torch.tensor(s, device="cuda")
        out = grouped_gemm_wgrad(scaling_aware_transpose(dy, st), scaling_aware_transpose(x, st), st, backend="triton")
        assert relerr(out, ref) < TOL
        if s is splits:
            assert relerr(grouped_gemm_wgrad(dyt, xt, s, backend="cublas"), ref) < TOL
        else:
            with pytest.raises(ValueError, match="multiple of 128 rows"):
                grouped_gemm_wgrad(dyt, xt, s, backend="cublas")
    rt = torch.tensor(ragged, device="cuda")
    assert relerr(grouped_gemm(x, w, rt, out_dtype=torch.float32, backend="triton"),
                  grouped_gemm(x, w, ragged, out_dtype=torch.float32, backend="reference")) < TOL


@requires_cuda
def test_gpu_trailing_weightless_group_cublas():
    """cuBLAS (host splits): the weightless group's rows are zero even where the output's memory held NaN
    before, the experts' rows within the GEMM tolerance of the reference; wgrad over the leading groups."""
    splits, slack = [512, 0, 1024], 384
    w, x = weights(3, 256, 512, "cuda"), act(sum(splits) + slack, 512, device="cuda")
    torch.full((sum(splits) + slack, 256), float("nan"), dtype=torch.bfloat16, device="cuda")  # freed: reused
    out = grouped_gemm(x, w, splits + [slack], backend="cublas")
    assert torch.equal(out[1536:], torch.zeros_like(out[1536:]))
    assert relerr(out, grouped_gemm(x, w, splits + [slack], out_dtype=torch.float32, backend="reference")) < TOL
    dy = act(sum(splits) + slack, 256, device="cuda")
    dyt, xt = scaling_aware_transpose(dy, splits + [slack]), scaling_aware_transpose(x, splits + [slack])
    ref = grouped_gemm_wgrad(dyt, xt, splits + [slack], num_groups=3, backend="reference")
    assert relerr(grouped_gemm_wgrad(dyt, xt, splits + [slack], num_groups=3, backend="cublas"), ref) < TOL


@requires_cuda
def test_gpu_cublas_right_where_torch_scaled_mm_was_wrong():
    """K/128 not a multiple of 4 (K=2176): torch 2.11's ``_scaled_mm`` was silently wrong (relative error 0.40);
    cuBLASLt called with its own 128x128 scale layout is right, and so is 'auto'."""
    w, x = weights(2, 256, 2176, "cuda"), act(512, 2176, device="cuda")
    ref = grouped_gemm(x, w, [256, 256], out_dtype=torch.float32, backend="reference")
    assert relerr(grouped_gemm(x, w, [256, 256], out_dtype=torch.float32, backend="cublas"), ref) < TOL
    assert relerr(grouped_gemm(x, w, [256, 256], out_dtype=torch.float32), ref) < TOL


# One expert's weight elements (N x K) at Qwen3-30B-A3B's expert shapes and DeepSeek-V3's
QWEN_FC1, QWEN_FC2, V3_FC1, V3_FC2 = 1536 * 2048, 2048 * 768, 4096 * 7168, 7168 * 2048
QWEN_SPLITS = [1024] * 128  # 16384 tokens, top-8, 128 local experts


@pytest.mark.parametrize("deepgemm", [True, False], ids=["with-deepgemm", "without-deepgemm"])
def test_auto_policy_per_shape(monkeypatch, deepgemm):
    """Which backend 'auto' runs each GEMM on (``auto_backend``, the one place it is decided), from the call's facts
    alone: DeepGEMM first for fprop/dgrad where it runs (E4M3, groups of multiples of 128); cuBLAS (cuBLASLt per
    expert, any reduction dim now) only where its launch per expert pays (``cublas_pays``); Triton otherwise, and
    for device splits wherever DeepGEMM cannot take them (its wgrad: only added into main_grad, on the releases that
    read device splits); the reference off the GPU."""
    from transformer_engine_moe.kernels import grouped_gemm_deepgemm

    monkeypatch.setattr(grouped_gemm_deepgemm, "alignment", lambda: 128)
    bf16, f32 = torch.bfloat16, torch.float32

    def pick(kind, splits, weight, a=E4M3, out=bf16, **kw):
        return auto_backend(GemmCall(kind, a, E4M3, splits, out, weight, deepgemm=deepgemm, **{"cublaslt": True, **kw}))

    dg_or = lambda other: "deepgemm" if deepgemm else other  # noqa: E731
    # fprop/dgrad at Qwen3 shapes (K 2048 or 768): DeepGEMM, else Triton (too little work per cuBLAS launch)
    for weight in (QWEN_FC1, QWEN_FC2):
        assert pick("fprop", QWEN_SPLITS, weight) == dg_or("triton")
    assert pick("fprop", [2048] * 64, V3_FC2) == dg_or("cublas") and pick("fprop", [1024] * 128, V3_FC1) == dg_or("triton")
    # HYBRID's dgrad (E5M2 dY): never DeepGEMM; cuBLAS where it pays, at any reduction dim
    assert pick("fprop", [2048] * 64, V3_FC2, a=E5M2) == "cublas" and pick("fprop", QWEN_SPLITS, QWEN_FC2, a=E5M2) == "triton"
    # groups DeepGEMM cannot take (not multiples of 128) but cuBLAS can (16)
    assert pick("fprop", [2064] * 64, V3_FC2) == "cublas" and pick("fprop", [2056] * 64, V3_FC2) == "triton"
    # wgrads: cuBLAS for DeepSeek-sized experts; Qwen3's are too small per launch: Triton written, and added into
    # main_grad DeepGEMM where it runs (one [G, N, K]); a list of main_grads never DeepGEMM
    for out, kind in ((bf16, "wgrad"), (f32, "wgrad"), (f32, "wgrad_accumulate")):
        assert pick(kind, [1024] * 128, V3_FC2, out=out) == "cublas"
        assert pick(kind, QWEN_SPLITS, QWEN_FC1, out=out) == (dg_or("triton") if kind == "wgrad_accumulate" else "triton")
    assert pick("wgrad_accumulate", QWEN_SPLITS, QWEN_FC1, out=f32, out_list=True) == "triton"
    # device splits: DeepGEMM's fprop takes them (aligned on the device), and its wgrad added into main_grad where
    # the installed release reads them on the device (``DEVICE_SPLITS_WGRAD``); Triton otherwise
    splits = torch.tensor(QWEN_SPLITS)
    assert pick("fprop", splits, V3_FC1) == dg_or("triton") and pick("wgrad", splits, V3_FC1) == "triton"
    for reads_them in (True, False):
        monkeypatch.setattr(grouped_gemm_deepgemm, "device_splits_wgrad", lambda: reads_them)
        assert pick("wgrad_accumulate", splits, V3_FC1, out=f32) == ("deepgemm" if deepgemm and reads_them
                                                                     else "triton")
        # written: DeepGEMM zeroes a float32 copy, adds and casts; it pays from 8192 rows per expert on average
        # (M / G: known on the host for device splits too), where cuBLAS cannot take device splits
        for out in (bf16, f32):
            for sizes in ([16384] * 8, [8192] * 16):
                assert pick("wgrad", torch.tensor(sizes), V3_FC1, out=out, rows=131072) == (
                    "deepgemm" if deepgemm and reads_them else "triton")
            for sizes in (QWEN_SPLITS, [2048] * 64, [4096] * 32):
                assert pick("wgrad", torch.tensor(sizes), V3_FC1, out=out, rows=131072) == "triton"
    # host splits: cuBLAS writes large experts' wgrads; where cuBLASLt cannot run, DeepGEMM from 8192 rows on average
    assert pick("wgrad", [16384] * 8, V3_FC1, rows=131072) == "cublas"
    assert pick("wgrad", [16384] * 8, V3_FC1, rows=131072, cublaslt=False) == dg_or("triton")
    assert pick("wgrad", [4096] * 32, V3_FC1, rows=131072, cublaslt=False) == "triton"
    # rounded to BF16 into main_grad (DDP's hook's sums): cuBLAS and DeepGEMM write the gradient, which is then added
    # in a pass of its own, so they pay from 8192 rows per expert; below, Triton rounds and adds in its epilogue
    for sizes in ([1024] * 128, [2048] * 64, [4096] * 32):
        for weight in (V3_FC1, V3_FC2):
            assert pick("wgrad_rounded", sizes, weight, rows=131072) == "triton"
            assert pick("wgrad_rounded", torch.tensor(sizes), weight, rows=131072) == "triton"
    for sizes in ([8192] * 16, [16384] * 8):
        assert pick("wgrad_rounded", sizes, V3_FC1, rows=131072) == "cublas"
        assert pick("wgrad_rounded", sizes, V3_FC1, rows=131072, cublaslt=False) == dg_or("triton")
        monkeypatch.setattr(grouped_gemm_deepgemm, "device_splits_wgrad", lambda: True)
        assert pick("wgrad_rounded", torch.tensor(sizes), V3_FC1, rows=131072) == dg_or("triton")
    assert pick("wgrad_rounded", [16384] * 8, V3_FC1, rows=131072, out_list=True) == "cublas"
    assert auto_backend(GemmCall("fprop", E4M3, E4M3, QWEN_SPLITS, bf16, QWEN_FC1, cuda=False)) is None


@pytest.mark.parametrize("deepgemm", [True, False], ids=["with-deepgemm", "without-deepgemm"])
def test_auto_policy_takes_gluon_before_triton(monkeypatch, deepgemm):
    """Where the Gluon kernel runs (a Hopper GPU under Triton 3.6: ``GemmCall.gluon``), fprop/dgrad that would have
    gone to Triton go to it when N is a multiple of 256 (its tile), DeepGEMM and cuBLAS keeping their calls; so do
    written wgrads (its kernel, or Triton's for what that does not take), but not wgrads added or rounded into
    ``main_grad``; a backend='gluon' call it cannot take says why."""
    from transformer_engine_moe.kernels import grouped_gemm_deepgemm

    monkeypatch.setattr(grouped_gemm_deepgemm, "alignment", lambda: 128)
    bf16 = torch.bfloat16

    def pick(kind, splits, weight, n, a=E4M3, gluon=True, **kw):
        return auto_backend(GemmCall(kind, a, E4M3, splits, bf16, weight, deepgemm=deepgemm, cublaslt=True,
                                     gluon=gluon, n=n, **kw))

    dg_or = lambda other: "deepgemm" if deepgemm else other  # noqa: E731
    assert pick("fprop", QWEN_SPLITS, QWEN_FC1, 1536) == dg_or("gluon")
    assert pick("fprop", torch.tensor(QWEN_SPLITS), V3_FC1, 4096) == dg_or("gluon")  # device splits (graphs)
    assert pick("fprop", [2048] * 64, V3_FC2, 7168) == dg_or("cublas")
    assert pick("fprop", QWEN_SPLITS, QWEN_FC2, 2048, a=E5M2) == "gluon"  # HYBRID's dgrad: never DeepGEMM
    assert pick("fprop", QWEN_SPLITS, 1408 * 2048, 1408) == dg_or("triton")  # N not a multiple of 256
    assert pick("wgrad", QWEN_SPLITS, QWEN_FC1, 1536) == "gluon"
    # device splits (the CUDA-graph path): DeepGEMM's written wgrad from 8192 rows per expert where its release
    # takes device splits, else Gluon at every size, Triton without it
    monkeypatch.setattr(grouped_gemm_deepgemm, "device_splits_wgrad", lambda: True)
    for sizes in ([1024] * 128, [2048] * 64, [4096] * 32, [16384] * 8):
        splits = torch.tensor(sizes)
        assert pick("wgrad", splits, V3_FC1, 4096, rows=131072) == ("deepgemm" if deepgemm and sizes[0] >= 8192
                                                                     else "gluon")
        assert pick("wgrad", splits, V3_FC1, 4096, rows=131072, gluon=False) == ("deepgemm" if deepgemm and
                                                                                  sizes[0] >= 8192 else "triton")
    for kind in ("wgrad_accumulate", "wgrad_rounded"):
        assert pick(kind, QWEN_SPLITS, QWEN_FC1, 1536) in ("triton", "cublas", "deepgemm")
        assert pick(kind, QWEN_SPLITS, QWEN_FC1, 1536) != "gluon"
    no = GemmCall("fprop", E4M3, E4M3, QWEN_SPLITS, bf16, QWEN_FC1, n=1408, gluon=True)
    assert why_not("gluon", no) == "it needs FP8 operands and N a multiple of 256, got N=1408"
    assert why_not("gluon", dataclasses.replace(no, gluon=False, n=1536)).startswith(
        "it needs a Hopper (SM90) GPU and Triton 3.6")
    assert why_not("gluon", dataclasses.replace(no, cuda=False)) == "it needs CUDA tensors"
    assert why_not("gluon", dataclasses.replace(no, kind="wgrad")) is None
    assert why_not("gluon", dataclasses.replace(no, kind="wgrad", gluon=False)).startswith(
        "it needs a Hopper (SM90) GPU and Triton 3.6")


def test_gluon_backend_refuses_cpu_tensors_by_name():
    """``backend="gluon"`` on CPU tensors: a ValueError naming the backend and why (no Gluon interpreter)."""
    x = quantize_blockwise(torch.randn(256, 256))
    w, _ = quantize_grouped_weight([torch.randn(256, 256) for _ in range(2)])
    with pytest.raises(ValueError, match="backend='gluon' cannot run this call: it needs CUDA tensors"):
        grouped_gemm(x, w, [128, 128], backend="gluon")


def test_cublas_refusals_name_what_it_needs():
    """``backend="cublas"`` on a call it cannot run says why (``why_not``): no cuBLASLt >= 12.9 on a Hopper GPU,
    groups not multiples of 16 rows (fprop/dgrad) or 128 (wgrad), a device tensor of splits, FP16 output, two E5M2
    operands; a reduction dim that is not a multiple of 512 is no longer one of them."""
    def why(kind="fprop", splits=(256, 512), a=E4M3, b=E4M3, out=torch.bfloat16, cublaslt=True):
        return why_not("cublas", GemmCall(kind, a, b, list(splits) if isinstance(splits, tuple) else splits, out,
                                          cublaslt=cublaslt))

    assert why() is None and why(out=torch.float32) is None and why(a=E5M2) is None and why(splits=(16, 0, 48)) is None
    assert "cuBLASLt >= 12.9" in why(cublaslt=False)
    assert "multiple of 16 rows" in why(splits=(256, 100)) and "host list" in why(splits=torch.tensor([256]))
    assert "BF16 or float32 output (got torch.float16)" in why(out=torch.float16)
    assert "not both operands E5M2" in why(a=E5M2, b=E5M2)
    assert why("wgrad", (128, 256)) is None and "multiple of 128 rows" in why("wgrad", (128, 144))
    assert why_not("cublas", GemmCall("fprop", E4M3, E4M3, [256], torch.bfloat16, cuda=False)) == "it needs CUDA tensors"


def test_auto_runs_the_next_backend_where_cublaslt_has_no_kernel(monkeypatch):
    """A call "auto" sends to cuBLAS whose shapes cuBLASLt's heuristic has no kernel for (``cublaslt.NoKernel``,
    raised before any launch; seen on an H200 for DeepSeek-V3's fc2 wgrad over 1152 rows) runs on the next backend
    of ``AUTO_ORDER``; ``backend="cublas"`` keeps the error."""
    import importlib

    from transformer_engine_moe.kernels import cublaslt

    ops = importlib.import_module("transformer_engine_moe.ops.grouped_gemm")  # the module, not the op

    ran = []

    def backend(name, result=None):
        def wgrad(*args):
            ran.append(name)
            if result is None:
                raise cublaslt.NoKernel(f"{name}: no kernel")
            return result
        return type(name, (), {"grouped_gemm_wgrad": staticmethod(wgrad)})()

    monkeypatch.setitem(ops.IMPLEMENTATIONS, "cublas", backend("cublas"))
    monkeypatch.setitem(ops.IMPLEMENTATIONS, "triton", backend("triton", "dW"))
    call = GemmCall("wgrad", E4M3, E4M3, [1152] * 32, torch.bfloat16, V3_FC2, cublaslt=True)
    run = lambda impl: impl.grouped_gemm_wgrad()  # noqa: E731
    assert auto_backend(call) == "cublas"
    assert ops._run("auto", call, torch.empty(0), "grouped_gemm_wgrad", run) == "dW" and ran == ["cublas", "triton"]
    with pytest.raises(cublaslt.NoKernel, match="cublas: no kernel"):
        ops._run("cublas", call, torch.empty(0), "grouped_gemm_wgrad", run)


@requires_cuda
@pytest.mark.parametrize("accumulate", [False, True], ids=["written", "added"])
def test_gpu_auto_wgrad_over_rows_cublaslt_may_lack_a_kernel_for(accumulate):
    """DeepSeek-V3's fc2 wgrad (7168 x 2048) over experts of 1152 and 1024 rows through "auto" (cuBLAS where
    cuBLASLt has a kernel, the next backend where it has none: the H200 Megatron run that found it stopped there)
    matches the reference."""
    splits, n, k = [1152, 1024], 7168, 2048
    dy, x = act(sum(splits), n), act(sum(splits), k)
    dyt, xt = scaling_aware_transpose(dy, splits), scaling_aware_transpose(x, splits)
    start = torch.randn(len(splits), n, k, device="cuda") if accumulate else None
    out = grouped_gemm_wgrad(dyt, xt, splits, out=None if start is None else start.clone(), accumulate=accumulate,
                             backend="auto")
    ref = grouped_gemm_wgrad(dyt, xt, splits, backend="reference") + (0 if start is None else start)
    assert relerr(out, ref) < TOL
