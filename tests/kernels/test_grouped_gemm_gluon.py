"""The Gluon fprop/dgrad kernel (``kernels/grouped_gemm_gluon.py``) against its Triton twin, bit for bit, and the
float32 reference: ragged, empty and single-expert groups (any sizes, not only multiples of 128), a trailing
weightless group, host and device splits, E4M3 and E5M2 activations, BF16 and float32 output, zeros and
non-finite values; no host sync; what ``auto`` picks; GroupedLinear on it. The twin runs on the CPU suite under
the interpreter (tests/ops/test_grouped_gemm.py); this kernel needs a Hopper GPU under Triton 3.6."""

import pytest
import torch

from conftest import CUDA, assert_no_host_sync, relerr, same_bits
from transformer_engine_moe import quantize_blockwise, quantize_grouped_weight
from transformer_engine_moe.kernels import grouped_gemm as twin, grouped_gemm_gluon as gk
from transformer_engine_moe.module import GroupedLinear
from transformer_engine_moe.ops.grouped_gemm import GemmCall, _impl, grouped_gemm

HAVE_GLUON = CUDA and gk.available(torch.device("cuda"))
requires_gluon = pytest.mark.skipif(not HAVE_GLUON, reason="needs a Hopper GPU and Triton 3.6")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPLITS = [[0, 384, 128, 512], [100, 0, 300, 129], [1024, 0, 0, 0], [0, 0, 0, 256], [1, 2, 3, 250]]


def raw(t):
    """``(data, scale_inv)`` of a rowwise FP8 tensor, as the launchers take them (a weight's as ``[G, N, K]``)."""
    if t.dim() == 3:
        g, n, k = t.shape
        return t.rowwise_data.view(g, n, k), t.rowwise_scale_inv.view(g, n // 128, k // 128)
    return t.rowwise_data, t.rowwise_scale_inv


def operands(splits, n=512, k=768, fp8=E4M3, special=None):
    """``(x, w)``: ``x [sum(splits), k]`` 1x128 in ``fp8`` (``special``: rows of zeros, or a row holding a NaN and
    an inf), ``w [len(splits), n, k]`` 128x128 E4M3."""
    w, _ = quantize_grouped_weight([torch.randn(n, k, device="cuda") * 0.05 for _ in splits])
    x = torch.randn(sum(splits), k, device="cuda")
    if special == "zeros":
        x[::3] = 0
    elif special == "nonfinite" and x.shape[0]:
        x[0, 5], x[-1, 300] = float("nan"), float("inf")
    return quantize_blockwise(x, fp8_dtype=fp8), w


@requires_gluon
@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_bitwise_the_twin_and_near_the_reference(splits, as_tensor, fp8):
    x, w = operands(splits, fp8=fp8)
    ms = torch.tensor(splits, device="cuda", dtype=torch.int32) if as_tensor else splits
    for out_dtype in (torch.bfloat16, torch.float32):
        got = gk.grouped_gemm(*raw(x), *raw(w), ms, out_dtype)
        assert same_bits(got, twin.grouped_gemm(*raw(x), *raw(w), ms, out_dtype))
        ref = grouped_gemm(x, w, splits, out_dtype=torch.float32, backend="reference")
        assert relerr(got, ref) < 2e-3


@requires_gluon
@pytest.mark.parametrize("special", ["zeros", "nonfinite"])
def test_special_values_as_the_twin(special):
    """Zero rows stay zero; a NaN or inf in a row reaches that row's outputs as in the twin (never made finite)."""
    splits = [256, 0, 384, 128]
    x, w = operands(splits, special=special)
    got = gk.grouped_gemm(*raw(x), *raw(w), splits)
    assert same_bits(got, twin.grouped_gemm(*raw(x), *raw(w), splits))
    if special == "zeros":
        assert (got[::3] == 0).all()
    else:
        assert not got[0].isfinite().all() and not got[-1].isfinite().all() and got[1:-1].isfinite().all()


@requires_gluon
def test_trailing_weightless_group_and_empty_input():
    """A worst-case buffer's slack (one group more than the weights) is written as zeros; M = 0 gives [0, N]."""
    splits = [128, 0, 256, 128]
    x, _ = operands(splits + [384])
    _, w = operands(splits)  # four experts' weights: the fifth group is weightless
    ms = torch.tensor(splits + [384], device="cuda")
    got = gk.grouped_gemm(*raw(x), *raw(w), ms)
    assert same_bits(got, twin.grouped_gemm(*raw(x), *raw(w), ms)) and (got[512:] == 0).all()
    empty, _ = operands([0, 0, 0, 0])
    assert gk.grouped_gemm(*raw(empty), *raw(w), [0, 0, 0, 0]).shape == (0, 512)


@requires_gluon
def test_no_host_sync_with_device_splits():
    x, w = operands([0, 384, 128, 512])
    ms = torch.tensor([0, 384, 128, 512], device="cuda")
    assert_no_host_sync(lambda: gk.grouped_gemm(*raw(x), *raw(w), ms))


@requires_gluon
def test_auto_takes_it_where_triton_would_run_and_grouped_linear_runs_on_it():
    """Without DeepGEMM and cuBLAS (too few rows a launch at these sizes) ``auto`` picks the Gluon kernel for N a
    multiple of 256, Triton's otherwise; ``GroupedLinear(backend="gluon")`` equals ``backend="triton"`` bitwise."""
    x, _ = operands([128] * 4)
    a = x.rowwise_data
    assert _impl("auto", GemmCall.of("fprop", a, E4M3, [128] * 4, torch.bfloat16, 512 * 768, n=512), a, "t").name in (
        "gluon", "deepgemm")
    assert _impl("auto", GemmCall.of("fprop", a, E4M3, [128] * 4, torch.bfloat16, 384 * 768, n=384), a, "t").name in (
        "triton", "deepgemm")
    torch.manual_seed(0)
    gluon = GroupedLinear(4, 768, 512, device="cuda", backend="gluon")
    triton = GroupedLinear(4, 768, 512, device="cuda", backend="triton")
    triton.load_state_dict(gluon.state_dict())
    inp = torch.randn(600, 768, device="cuda", dtype=torch.bfloat16)
    splits = [100, 0, 300, 200]
    outs = []
    for layer in (gluon, triton):
        xi = inp.clone().requires_grad_()
        y = layer(xi, splits)
        y.backward(torch.ones_like(y))
        outs.append((y, xi.grad, *[p.grad for p in layer.parameters()]))
    for u, v in zip(*outs):
        assert same_bits(u, v)


def test_launcher_refuses_n_off_its_tile():
    """N not a multiple of 256 (the kernel's tile): a ValueError before any launch, on any device."""
    a = torch.zeros(128, 128, dtype=E4M3)
    b = torch.zeros(1, 384, 128, dtype=E4M3)
    with pytest.raises(ValueError, match="needs N % 256 == 0 and R % 128 == 0, got N=384, R=128"):
        gk.grouped_gemm(a, torch.ones(128, 1), b, torch.ones(1, 3, 1), [128])
