"""The Gluon kernels (``kernels/grouped_gemm_gluon.py``) against their Triton twins, bit for bit, and the float32
reference. fprop/dgrad: ragged, empty and single-expert groups (any sizes, not only multiples of 128), programs
walking many tiles, more groups than the kernel takes, a trailing weightless group, host and device splits, E4M3
and E5M2 activations, BF16 and float32 output, zeros and non-finite values; no host sync; what ``auto`` picks;
GroupedLinear on it. wgrad: groups of multiples of 16 rows (empty, small, ragged; programs walking many tiles of a
group), K off its 192-column tiles, host and device splits, E4M3 and E5M2 dY, BF16 and float32 written, non-finite
values; the calls it leaves to the twin; no host sync; replays of a CUDA graph with other routings. The twins run on
the CPU suite under the interpreter (tests/ops/test_grouped_gemm.py); these kernels need a Hopper GPU under Triton
3.6."""

import pytest
import torch

from conftest import CUDA, assert_no_host_sync, relerr, same_bits
from transformer_engine_moe import quantize_blockwise, quantize_grouped_weight, scaling_aware_transpose
from transformer_engine_moe.kernels import grouped_gemm as twin, grouped_gemm_gluon as gk
from transformer_engine_moe.module import GroupedLinear
from transformer_engine_moe.ops.grouped_gemm import GemmCall, _impl, grouped_gemm, grouped_gemm_wgrad

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
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_programs_walk_many_tiles_and_groups(as_tensor):
    """The persistent walk: more tiles than SMs, so each program takes several, full tiles (TMA-stored) beside
    partial ones (masked stores) over 40 ragged groups; more than ``MAX_GROUPS`` groups run on the twin."""
    gen = torch.Generator().manual_seed(7)
    for splits in (torch.randint(0, 700, (40,), generator=gen).tolist(), [3] * (gk.MAX_GROUPS.value + 1)):
        x, w = operands(splits, n=1024, k=256)
        ms = torch.tensor(splits, device="cuda", dtype=torch.int32) if as_tensor else splits
        for out_dtype in (torch.bfloat16, torch.float32):
            got = gk.grouped_gemm(*raw(x), *raw(w), ms, out_dtype)
            assert same_bits(got, twin.grouped_gemm(*raw(x), *raw(w), ms, out_dtype))


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


# ------------------------------------------------------------------------------------------------------------ wgrad
WGRAD_SPLITS = [[0, 384, 128, 512], [16, 0, 48, 1024], [0, 0, 0, 256], [2048, 0, 0, 0], [0, 0, 0, 0]]


def wgrad_operands(splits, n=512, k=768, fp8=E5M2, nonfinite=False):
    """Raw ``(dY^T, its scales, X^T, its scales)``: the grouped 128x1 columnwise copies of ``dY [M, n]`` (``fp8``)
    and ``X [M, k]`` (E4M3, rows over 12 decades) by ``splits``; ``nonfinite``: a NaN and an inf in dY."""
    m = sum(splits)
    dy = torch.randn(m, n, device="cuda")
    if nonfinite and m:
        dy[0, 5], dy[-1, 300] = float("nan"), float("inf")
    x = torch.randn(m, k, device="cuda") * torch.logspace(-6, 6, m, device="cuda")[:, None]
    dyt = scaling_aware_transpose(quantize_blockwise(dy, fp8_dtype=fp8), splits)
    xt = scaling_aware_transpose(quantize_blockwise(x), splits)
    return dyt.columnwise_data.view(-1), dyt.columnwise_scale_inv, xt.columnwise_data.view(-1), xt.columnwise_scale_inv


@requires_gluon
@pytest.mark.parametrize("splits", WGRAD_SPLITS, ids=str)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_wgrad_bitwise_the_twin_and_near_the_reference(splits, as_tensor, fp8):
    ops = wgrad_operands(splits, fp8=fp8)
    ms = torch.tensor(splits, device="cuda", dtype=torch.int32) if as_tensor else splits
    assert gk.takes_wgrad(ops[0], ms, None, False, torch.bfloat16)
    for out_dtype in (torch.bfloat16, torch.float32):
        got = gk.grouped_gemm_wgrad(*ops, ms, out_dtype=out_dtype)
        assert same_bits(got, twin.grouped_gemm_wgrad(*ops, ms, out_dtype=out_dtype))
    out = torch.full((len(splits), 512, 768), float("nan"), device="cuda")  # written: nothing of it is read
    assert gk.grouped_gemm_wgrad(*ops, ms, out=out) is out and same_bits(out, got)
    m = sum(splits)
    dy = quantize_blockwise(torch.randn(m, 512, device="cuda"), fp8_dtype=fp8)
    x = quantize_blockwise(torch.randn(m, 768, device="cuda"))
    dyt, xt = scaling_aware_transpose(dy, ms), scaling_aware_transpose(x, ms)
    ref = grouped_gemm_wgrad(scaling_aware_transpose(dy, splits), scaling_aware_transpose(x, splits), splits,
                             backend="reference")
    assert relerr(grouped_gemm_wgrad(dyt, xt, ms, backend="gluon"), ref) < 2e-3


@requires_gluon
@pytest.mark.parametrize("n, k, splits", [(2048, 2048, [1024, 0, 384, 2048, 16]), (4096, 1024, [2048] * 3)],
                         ids=["ragged", "even"])
def test_wgrad_programs_walking_many_tiles_of_a_group(n, k, splits):
    """More tiles per group than SMs: each program takes several tiles of one group before the next group."""
    ops = wgrad_operands(splits, n, k)
    ms = torch.tensor(splits, device="cuda")
    assert same_bits(gk.grouped_gemm_wgrad(*ops, ms, out_dtype=torch.bfloat16),
                     twin.grouped_gemm_wgrad(*ops, ms, out_dtype=torch.bfloat16))


@requires_gluon
@pytest.mark.parametrize("k", [128, 256, 640, 7168])
def test_wgrad_last_strip_of_k_partial_and_nothing_written_past_out(k):
    """Tiles are 192 columns of K wide: K = 128 (one strip, its 64-column part wholly past K), 256, 640 and 7168
    (the last strip's 128-column part partly past K). The columns past K are neither read into the sums nor
    written: ``out`` is the front of a NaN-filled buffer, whose tail stays NaN."""
    splits = [256, 0, 48, 128]
    ops = wgrad_operands(splits, 256, k)
    ms = torch.tensor(splits, device="cuda", dtype=torch.int32)
    for out_dtype in (torch.bfloat16, torch.float32):
        assert same_bits(gk.grouped_gemm_wgrad(*ops, ms, out_dtype=out_dtype),
                         twin.grouped_gemm_wgrad(*ops, ms, out_dtype=out_dtype))
    size = len(splits) * 256 * k
    buf = torch.full((size + 4096,), float("nan"), device="cuda")
    out = buf[:size].view(len(splits), 256, k)
    assert gk.takes_wgrad(ops[0], ms, out, False, torch.float32)
    gk.grouped_gemm_wgrad(*ops, ms, out=out)
    assert same_bits(out, twin.grouped_gemm_wgrad(*ops, ms)) and buf[size:].isnan().all()


@requires_gluon
def test_wgrad_nonfinite_values_reach_their_experts_as_in_the_twin():
    splits = [256, 0, 384, 128]
    ops = wgrad_operands(splits, nonfinite=True)
    got = gk.grouped_gemm_wgrad(*ops, splits)
    assert same_bits(got, twin.grouped_gemm_wgrad(*ops, splits))
    assert not got[0].isfinite().all() and not got[3].isfinite().all() and got[2].isfinite().all()


@requires_gluon
def test_wgrad_calls_it_does_not_take_run_on_the_twin():
    """Added into ``out``, rounded into it, G separate outputs, ragged host groups, an ``out`` off 16-byte alignment,
    more than ``MAX_GROUPS`` groups: ``takes_wgrad`` is False and the twin's bits come back."""
    splits = [256, 0, 384, 128]
    ops = wgrad_operands(splits)
    init = torch.randn(4, 512, 768, device="cuda")
    for kw in (dict(accumulate=True), dict(out_dtype=torch.bfloat16), dict(accumulate=True, out_dtype=torch.bfloat16)):
        got, want = init.clone(), init.clone()
        assert not gk.takes_wgrad(ops[0], splits, got, kw.get("accumulate", False), kw.get("out_dtype", torch.float32))
        gk.grouped_gemm_wgrad(*ops, splits, out=got, **kw)
        twin.grouped_gemm_wgrad(*ops, splits, out=want, **kw)
        assert same_bits(got, want)
    parts = list(init.clone().unbind(0))
    assert not gk.takes_wgrad(ops[0], splits, parts, False, torch.float32)
    off = torch.empty(4 * 512 * 768 + 1, device="cuda")[1:].view(4, 512, 768)
    assert not gk.takes_wgrad(ops[0], splits, off, False, torch.float32)
    assert same_bits(gk.grouped_gemm_wgrad(*ops, splits, out=off), twin.grouped_gemm_wgrad(*ops, splits))
    ragged = [100, 0, 300, 368]
    rops = wgrad_operands(ragged)
    assert not gk.takes_wgrad(rops[0], ragged, None, False, torch.bfloat16)
    assert same_bits(gk.grouped_gemm_wgrad(*rops, ragged), twin.grouped_gemm_wgrad(*rops, ragged))
    many = [16] * (gk.MAX_GROUPS.value + 1)
    assert not gk.takes_wgrad(ops[0], many, None, False, torch.bfloat16)


@requires_gluon
def test_wgrad_no_host_sync_and_graph_replays_of_other_routings_equal_eager():
    """Captured once with device splits, replayed after the routing (splits and operands, same buffers) changed:
    the bits of an eager call on the new routing, with no host sync on the way."""
    routings = [[512, 0, 256, 256], [0, 1024, 0, 0], [128, 256, 384, 256], [256] * 4]  # 8 column blocks each
    ops = wgrad_operands(routings[0])
    ms = torch.tensor(routings[0], device="cuda", dtype=torch.int32)
    assert_no_host_sync(lambda: gk.grouped_gemm_wgrad(*ops, ms, out_dtype=torch.bfloat16))
    static = [t.clone() for t in ops]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gk.grouped_gemm_wgrad(*static, ms, out_dtype=torch.bfloat16)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gk.grouped_gemm_wgrad(*static, ms, out_dtype=torch.bfloat16)
    for splits in routings[1:] + routings[:1]:
        new = wgrad_operands(splits)
        for s, t in zip(static, new):
            s.copy_(t)
        ms.copy_(torch.tensor(splits))
        graph.replay()
        assert same_bits(out, gk.grouped_gemm_wgrad(*new, splits, out_dtype=torch.bfloat16))


@requires_gluon
def test_auto_takes_the_gluon_wgrad_for_written_gradients_on_device_splits():
    """Device splits, DeepGEMM's written wgrad not paying (under 8192 rows per expert), cuBLAS unable: ``auto``
    runs a written wgrad on the Gluon column, one added into ``main_grad`` on another."""
    a = torch.zeros(4096, dtype=E4M3, device="cuda")
    ms = torch.tensor([1024] * 4, device="cuda")
    call = GemmCall.of("wgrad", a, E4M3, ms, torch.bfloat16, 512 * 768, rows=4096)
    assert _impl("auto", call, a, "t").name == "gluon"
    acc = GemmCall.of("wgrad_accumulate", a, E4M3, ms, torch.float32, 512 * 768, rows=4096)
    assert _impl("auto", acc, a, "t").name in ("triton", "deepgemm")
