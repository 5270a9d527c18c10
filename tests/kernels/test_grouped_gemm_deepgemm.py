"""The DeepGEMM backend of grouped_gemm / grouped_gemm_wgrad: against the float32 reference (ragged, empty
and single-expert groups of multiples of 128 rows, host and device splits, accumulation into main_grad), the wgrad
on device splits bitwise its host-splits call (eager and replayed from a CUDA graph),
the choice ``auto`` makes (E4M3 -> DeepGEMM; HYBRID's E5M2 and unaligned groups -> another backend), no
host sync, GroupedLinear on it, and a clear error where DeepGEMM is absent or cannot run the call."""

import pytest
import torch

from conftest import CUDA, KERNEL_DEVICE, assert_no_host_sync, relerr, same_bits
from transformer_engine_moe import FP8FlowRecipe, Format, quantize_blockwise, quantize_grouped_weight
from transformer_engine_moe.kernels import grouped_gemm_deepgemm as dg
from transformer_engine_moe.module import GroupedLinear
from transformer_engine_moe.ops import scaling_aware_transpose
from transformer_engine_moe.ops.grouped_gemm import GemmCall, _impl, grouped_gemm, grouped_gemm_wgrad, why_not

HAVE_DG = CUDA and dg.available(torch.device("cuda"))
requires_deepgemm = pytest.mark.skipif(not HAVE_DG, reason="needs DeepGEMM on a Hopper GPU")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOL = 2e-3  # as tests/ops/test_grouped_gemm.py on the GPU
# Four experts and one (N, K) everywhere: DeepGEMM compiles a kernel per (groups, N, K), tens of seconds each.
SPLITS = [[0, 384, 128, 512], [1024, 0, 0, 0], [128] * 4, [0, 0, 0, 256]]


def operands(splits, n=256, k=512, fp8=E4M3):
    m = sum(splits)
    w, wt = quantize_grouped_weight([torch.randn(n, k, device="cuda") * 0.05 for _ in splits])
    x = quantize_blockwise(torch.randn(m, k, device="cuda"))
    dy = quantize_blockwise(torch.randn(m, n, device="cuda"), fp8_dtype=fp8)
    return w, wt, x, dy


@pytest.mark.skipif(dg._module() is not None, reason="DeepGEMM is installed")
def test_absent_deepgemm_is_a_clear_import_error():
    x = quantize_blockwise(torch.randn(128, 128))
    w = quantize_grouped_weight([torch.randn(128, 128)])[0]
    with pytest.raises(ImportError, match=r"deep_gemm.*transformer_engine_moe\[deepgemm\]"):
        grouped_gemm(x, w, [128], backend="deepgemm")


@requires_deepgemm
@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_fprop_dgrad_match_reference(splits, as_tensor):
    w, wt, x, dy = operands(splits)
    ms = torch.tensor(splits, device="cuda") if as_tensor else splits
    for a, b in ((x, w), (dy, wt)):
        out = grouped_gemm(a, b, ms, backend="deepgemm")
        ref = grouped_gemm(a, b, splits, out_dtype=torch.float32, backend="reference")
        assert out.dtype == torch.bfloat16 and relerr(out, ref) < TOL


@requires_deepgemm
@pytest.mark.parametrize("splits", SPLITS, ids=str)
def test_wgrad_matches_reference_and_accumulates(splits):
    w, _, x, dy = operands(splits)
    xt, dyt = scaling_aware_transpose(x, splits), scaling_aware_transpose(dy, splits)
    ref = grouped_gemm_wgrad(dyt, xt, splits, backend="reference")
    out = grouped_gemm_wgrad(dyt, xt, splits, backend="deepgemm")
    assert out.dtype == torch.float32 and relerr(out, ref) < TOL
    bf16 = grouped_gemm_wgrad(dyt, xt, splits, out_dtype=torch.bfloat16, backend="deepgemm")
    assert bf16.dtype == torch.bfloat16 and relerr(bf16, ref) < TOL
    main_grad = torch.randn(ref.shape, device="cuda")
    want = main_grad + ref
    grouped_gemm_wgrad(dyt, xt, splits, out=main_grad, accumulate=True, backend="deepgemm")
    assert relerr(main_grad, want) < TOL
    grouped_gemm_wgrad(dyt, xt, splits, out=main_grad, backend="deepgemm")  # overwritten, not added
    assert relerr(main_grad, ref) < TOL


@requires_deepgemm
def test_auto_picks_deepgemm_only_where_it_can_run():
    splits = [384, 128, 0, 0]
    w, wt, x, dy = operands(splits)
    def pick(a, b, s, out=torch.bfloat16, wgrad=False, accumulate=False, weight_elements=0):
        kind = ("wgrad_accumulate" if accumulate else "wgrad") if wgrad else "fprop"
        return _impl("auto", GemmCall.of(kind, a, b, s, out, weight_elements), a, "t").name

    assert pick(x.rowwise_data, E4M3, splits) == "deepgemm"
    assert pick(x.rowwise_data, E4M3, torch.tensor(splits, device="cuda")) == "deepgemm"
    assert pick(x.rowwise_data, E5M2, splits) != "deepgemm"  # HYBRID's E5M2 gradients
    assert pick(x.rowwise_data, E4M3, [300, 212, 0, 0]) != "deepgemm"  # groups not multiples of 128
    # main_grad: cuBLASLt's beta = 1 where its per-expert launches pay, else DeepGEMM
    assert pick(x.rowwise_data, E4M3, splits, torch.float32, wgrad=True, accumulate=True) == "deepgemm"
    assert pick(x.rowwise_data, E4M3, [512] * 4, torch.float32, wgrad=True, accumulate=True,
                weight_elements=4096 * 7168) == "cublas"
    # written, not added (BF16, or float32: overwrite_main_grad): DeepGEMM would zero and add; cuBLAS or Triton
    assert pick(x.rowwise_data, E4M3, splits, wgrad=True) != "deepgemm"
    assert pick(x.rowwise_data, E4M3, splits, torch.float32, wgrad=True) != "deepgemm"
    # device splits: DeepGEMM's wgrad added into main_grad where the release reads them on the device
    assert (pick(x.rowwise_data, E4M3, torch.tensor(splits, device="cuda"), torch.float32, wgrad=True,
                 accumulate=True) == "deepgemm") == dg.device_splits_wgrad()
    assert pick(x.rowwise_data, E4M3, torch.tensor(splits, device="cuda"), torch.float32, wgrad=True) != "deepgemm"
    with pytest.raises(ValueError, match="multiples of 128"):
        grouped_gemm(x, w, [300, 212, 0, 0], backend="deepgemm")
    _, wt5, _, dy5 = operands(splits, fp8=E5M2)
    with pytest.raises(ValueError, match="E4M3"):
        grouped_gemm(dy5, wt5, splits, backend="deepgemm")


@requires_deepgemm
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_trailing_weightless_group(as_tensor):
    """Five splits for four experts: DeepGEMM skips the last group's tiles (``m_indices`` -1) and its rows come
    out zero even where the output's memory held NaN before; wgrad with ``num_groups=4`` reads the leading
    rows only; no host sync with device splits."""
    splits, slack = [0, 384, 128, 512], 256
    (w, wt, _, _), (_, _, x, dy) = operands(splits), operands(splits + [slack])  # 4 experts, 5 groups of rows
    full = torch.tensor(splits + [slack], device="cuda") if as_tensor else splits + [slack]
    for a, b in ((x, w), (dy, wt)):
        torch.full((sum(splits) + slack, b.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")  # freed
        out = grouped_gemm(a, b, full, backend="deepgemm")
        ref = grouped_gemm(a, b, splits + [slack], out_dtype=torch.float32, backend="reference")
        assert torch.equal(out[sum(splits):], torch.zeros_like(out[sum(splits):])) and relerr(out, ref) < TOL
    xt, dyt = scaling_aware_transpose(x, splits + [slack]), scaling_aware_transpose(dy, splits + [slack])
    got = grouped_gemm_wgrad(dyt, xt, splits + [slack], num_groups=4, backend="deepgemm")
    assert got.shape == (4, 256, 512)
    assert relerr(got, grouped_gemm_wgrad(dyt, xt, splits + [slack], num_groups=4, backend="reference")) < TOL
    if as_tensor:
        assert_no_host_sync(lambda: grouped_gemm(x, w, full, backend="deepgemm"))


requires_device_splits_wgrad = pytest.mark.skipif(not HAVE_DG or not dg.device_splits_wgrad(),
                                                  reason="needs a DeepGEMM release in dg.DEVICE_SPLITS_WGRAD on Hopper")


@requires_device_splits_wgrad
@pytest.mark.parametrize("splits", SPLITS + [[0, 384, 128, 512, 256], [0, 0, 0, 0, 1024]], ids=str)
def test_wgrad_on_device_splits_is_bitwise_host_splits(splits):
    """The wgrad on device-tensor splits (a nominal host list beside them, ``_nominal_ks``), written and added into
    main_grad, four experts and a trailing weightless group or not: bitwise the host-splits call (each element's
    reduction order does not move with DeepGEMM's launch configuration), with no host sync."""
    _, _, x, dy = operands(splits)
    st = torch.tensor(splits, device="cuda")
    host = [scaling_aware_transpose(t, splits) for t in (dy, x)]
    dev = [scaling_aware_transpose(t, st) for t in (dy, x)]
    want = grouped_gemm_wgrad(*host, splits, num_groups=4, backend="deepgemm")
    assert same_bits(grouped_gemm_wgrad(*dev, st, num_groups=4, backend="deepgemm"), want)
    main_grad = torch.randn(want.shape, device="cuda")
    on_host, on_device = main_grad.clone(), main_grad.clone()
    grouped_gemm_wgrad(*host, splits, out=on_host, accumulate=True, num_groups=4, backend="deepgemm")
    grouped_gemm_wgrad(*dev, st, out=on_device, accumulate=True, num_groups=4, backend="deepgemm")
    assert same_bits(on_device, on_host)
    assert_no_host_sync(lambda: grouped_gemm_wgrad(*dev, st, out=on_device, accumulate=True, num_groups=4,
                                                   backend="deepgemm"))


@requires_device_splits_wgrad
def test_captured_wgrad_replays_other_routings_as_eager():
    """Both transposes and the wgrad into main_grad captured once on device splits (four experts and a weightless
    group); replayed after other routings are written into the splits tensor (ragged, all on one expert, all in the
    weightless group), main_grad equals the eager host-splits call's bitwise."""
    from utils import cuda_graph  # benchmarks/utils.py

    x = quantize_blockwise(torch.randn(1280, 512, device="cuda"))
    dy = quantize_blockwise(torch.randn(1280, 256, device="cuda"))
    st = torch.tensor([256] * 5, device="cuda")
    start = torch.randn(4, 256, 512, device="cuda")
    main_grad = start.clone()

    def step():
        main_grad.copy_(start)
        grouped_gemm_wgrad(scaling_aware_transpose(dy, st), scaling_aware_transpose(x, st), st, out=main_grad,
                           accumulate=True, num_groups=4, backend="deepgemm")

    graph = cuda_graph(step)
    for splits in ([0, 384, 128, 512, 256], [1280, 0, 0, 0, 0], [128, 0, 896, 128, 128], [0, 0, 0, 0, 1280]):
        st.copy_(torch.tensor(splits))
        graph.replay()
        want = start.clone()
        grouped_gemm_wgrad(scaling_aware_transpose(dy, splits), scaling_aware_transpose(x, splits), splits, out=want,
                           accumulate=True, num_groups=4, backend="deepgemm")
        assert same_bits(main_grad, want), splits


@requires_deepgemm
def test_no_host_sync_with_device_or_host_splits():
    splits = [384, 0, 640, 128]
    w, _, x, _ = operands(splits)
    st = torch.tensor(splits, device="cuda")
    assert_no_host_sync(lambda: grouped_gemm(x, w, st, backend="deepgemm"))
    assert_no_host_sync(lambda: grouped_gemm(x, w, splits, backend="deepgemm"))


@requires_deepgemm
@pytest.mark.parametrize("recipe", [FP8FlowRecipe(), FP8FlowRecipe(Format.HYBRID)], ids=["e4m3", "hybrid"])
def test_grouped_linear_on_deepgemm_matches_triton(recipe):
    splits = [512, 0, 1024, 128]
    gls = [GroupedLinear(4, 512, 256, backend=b, device="cuda", recipe=recipe) for b in ("auto", "triton")]
    gls[1].load_state_dict(gls[0].state_dict())
    x = torch.randn(sum(splits), 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(sum(splits), 256, device="cuda", dtype=torch.bfloat16)
    outs = []
    for gl in gls:
        xi = x.clone().requires_grad_()
        y = gl(xi, splits)
        y.backward(dy)
        outs.append((y, xi.grad, [w.grad for w in gl.weights]))
    (y0, dx0, dw0), (y1, dx1, dw1) = outs
    assert relerr(y0, y1) < 1e-2 and relerr(dx0, dx1) < 1e-2
    assert all(relerr(a, b) < 1e-2 for a, b in zip(dw0, dw1) if b.abs().sum() > 0)


def test_which_host_splits_deepgemm_and_cublas_take(monkeypatch):
    """Every group a multiple of DeepGEMM's alignment (asked once per call) / of 128 for cuBLAS's wgrad;
    a device tensor is DeepGEMM's to check on the device."""
    from transformer_engine_moe.kernels import grouped_gemm_cublas as cublas

    asked = []
    monkeypatch.setattr(dg, "alignment", lambda: asked.append(1) or 128)
    assert dg.supports_wgrad(E4M3, E4M3, [0, 384, 128, 512]) and len(asked) == 1
    assert not dg.supports_wgrad(E4M3, E4M3, [0, 384, 100, 540]) and not dg.supports_wgrad(E4M3, E5M2, [128])
    for version, reads_device_splits in (("2.8.2", True), ("2.9.0", False), (None, False)):
        monkeypatch.setattr(dg, "_module", lambda: type("DeepGEMM", (), {"__version__": version} if version else {}))
        assert dg.supports_wgrad(E4M3, E4M3, torch.tensor([128])) == reads_device_splits
        call = GemmCall("wgrad_accumulate", E4M3, E4M3, torch.tensor([128]), torch.float32, deepgemm=True)
        assert why_not("deepgemm", call) == (None if reads_device_splits else (
            "it needs E4M3 operands, and groups of multiples of 128 rows as a host list (its wgrad takes "
            f"device-tensor splits in DeepGEMM 2.8.2 only, found {version or 'no version'})"))
    assert dg.supports(E4M3, E4M3, torch.tensor([100]), torch.bfloat16)
    assert dg.supports(E4M3, E4M3, [256, 0], torch.bfloat16) and not dg.supports(E4M3, E4M3, [64, 192], torch.bfloat16)
    assert cublas.supports_wgrad(E4M3, E4M3, [0, 384, 128]) and cublas.supports_wgrad(E5M2, E4M3, (256,))
    assert not cublas.supports_wgrad(E4M3, E4M3, [128, 129])  # whole 1x128 blocks only
    assert not cublas.supports_wgrad(E4M3, E4M3, torch.tensor([128]))  # host splits only
    assert not cublas.supports_wgrad(E5M2, E5M2, [128])  # cuBLAS's FP8 pairs: not both E5M2


@pytest.mark.parametrize("splits", [[0, 384, 128, 512], [128, 0, 0, 0, 256], [512, 0, 0, 0, 100], [0, 0, 0, 0, 0]],
                         ids=str)
def test_device_splits_wgrad_gives_deepgemm_the_device_sizes_and_a_nominal_host_list(monkeypatch, splits):
    """A wgrad on device-tensor splits (``device_splits_wgrad``): DeepGEMM gets the G sizes as its ``ks_tensor`` and a
    host ``ks`` of the same count whose total is the operands' whole 128-row blocks (the slack after the groups
    included, never read), each a multiple of 128 and as even as they go. A fake ``deep_gemm`` holding the SM90
    kernel's contract (host ``ks`` sizes the operands and scales; each group's rows found from ``ks_tensor``; empty
    groups leave D = C) gives the reference's wgrad, written and added into ``main_grad``."""
    seen = []

    def k_grouped(a, b, d, ks, ks_tensor, c):
        (a, sa), (b, sb) = a, b
        n, k, total = d.shape[1], d.shape[2], sum(ks)
        assert len(ks) == d.shape[0] == ks_tensor.numel() and all(q % 128 == 0 for q in ks) and c is d
        assert a.numel() == total * n and b.numel() == total * k and sa.shape == (n, total // 128)
        assert sb.shape == (k, total // 128) and ks_tensor.dtype == torch.int32 and int(ks_tensor.sum()) <= total
        seen.append(list(ks))
        start = 0
        for g, size in enumerate(ks_tensor.tolist()):
            blocks = slice(start // 128, (start + size) // 128)
            ag = a[start * n:(start + size) * n].view(n, size).float() * sa[:, blocks].repeat_interleave(128, 1)
            bg = b[start * k:(start + size) * k].view(k, size).float() * sb[:, blocks].repeat_interleave(128, 1)
            d[g] += ag @ bg.t()
            start += size

    monkeypatch.setattr(dg, "_module", lambda: type("DeepGEMM", (), dict(
        __version__="2.8.2", k_grouped_fp8_gemm_nt_contiguous=staticmethod(k_grouped),
        get_mk_alignment_for_contiguous_layout=lambda: 128)))
    groups, m = 4, sum(splits)
    x = quantize_blockwise(torch.randn(m, 256, device=KERNEL_DEVICE))
    dy = quantize_blockwise(torch.randn(m, 128, device=KERNEL_DEVICE))
    st = torch.tensor(splits, device=KERNEL_DEVICE)
    xt, dyt = scaling_aware_transpose(x, st), scaling_aware_transpose(dy, st)
    ref = grouped_gemm_wgrad(scaling_aware_transpose(dy, splits), scaling_aware_transpose(x, splits), splits,
                             num_groups=groups, backend="reference")
    a, sa, b, sb = dyt.columnwise_data, dyt.columnwise_scale_inv, xt.columnwise_data, xt.columnwise_scale_inv
    out = dg.grouped_gemm_wgrad(a, sa, b, sb, st[:groups])
    assert out.shape == (groups, 128, 256) and relerr(out, ref) < 1e-5
    main_grad = torch.randn(ref.shape, device=KERNEL_DEVICE)
    want = main_grad + ref
    assert dg.grouped_gemm_wgrad(a, sa, b, sb, st[:groups], out=main_grad, accumulate=True) is main_grad
    assert relerr(main_grad, want) < 1e-5
    ks = seen[-1]
    assert len(seen) == 2 and ks == seen[0] and sum(ks) == m // 128 * 128 and max(ks) - min(ks) < 128 * groups
    with pytest.raises(ValueError, match="multiple of 128"):  # CPU splits; on the GPU an assert, no host sync
        dg.grouped_gemm_wgrad(a, sa, b, sb, torch.tensor([100, 28, 0, 0]))


@pytest.mark.parametrize("splits", [[0, 384, 128, 512], [128, 0, 0, 0, 256], [0, 0, 0, 0]], ids=str)
def test_fewer_rows_than_the_shape_has_had_run_as_more(monkeypatch, splits):
    """DeepGEMM's layout moves with the rows of a call; so a call with fewer rows than its weight shape has had
    runs as one of min(``MIN_ROWS``, the most it has had) rows: the extra rows a weightless group (``m_indices``
    -1) and the output the leading rows, equal to the unpadded product. Calls as large as any before, and calls
    of a shape that never had more, run as they are. A fake ``deep_gemm`` (its contract: the rows of group -1
    untouched; its scales MN-major), the zeroing kernel on the kernels' device; the real DeepGEMM is the GPU tests'
    above, whose later calls of one shape have fewer rows than its first."""
    seen = []

    def m_grouped(a, b, d, m_indices):
        (a, sa), (b, sb) = a, b
        assert a.shape[0] == sa.shape[0] == d.shape[0] == m_indices.shape[0] and d.is_contiguous()
        # the scales MN-major and TMA-aligned, as the SM90 kernel reads them: DeepGEMM then skips its own transform
        assert sa.stride() == (1, sa.shape[0]) and sa.shape[0] % 4 == 0
        seen.append((a.shape[0], m_indices.clone()))
        x = a.float() * sa.repeat_interleave(128, 1)
        w = b.float() * sb.repeat_interleave(128, 1).repeat_interleave(128, 2)
        for g in range(b.shape[0]):
            rows = m_indices == g
            d[rows] = (x[rows] @ w[g].t()).to(d.dtype)

    monkeypatch.setattr(dg, "MIN_ROWS", 1280)
    monkeypatch.setattr(dg, "_MOST_ROWS", {})
    monkeypatch.setattr(dg, "_module", lambda: type("DeepGEMM", (), dict(
        m_grouped_fp8_gemm_nt_contiguous=staticmethod(m_grouped), get_mk_alignment_for_contiguous_layout=lambda: 128)))
    w = quantize_grouped_weight([torch.randn(128, 256, device=KERNEL_DEVICE) * 0.05 for _ in range(4)])[0]
    b, sb = w.rowwise_data.view(4, 128, 256), w.rowwise_scale_inv.view(4, 1, 2)  # as ops.grouped_gemm passes them

    def call(sizes):
        x = quantize_blockwise(torch.randn(sum(sizes), 256, device=KERNEL_DEVICE))
        seen.clear()
        out = dg.grouped_gemm(x.rowwise_data, x.rowwise_scale_inv, b, sb, sizes)
        assert out.shape == (sum(sizes), 128) and out.is_contiguous() and out.dtype == torch.bfloat16
        return x, out, seen[0] if seen else None

    m = sum(splits)
    assert call([256, 0, 0, 0])[2][0] == 256  # a shape's first call: as it is
    assert call([0, 128, 0, 0])[2][0] == 256  # fewer rows than before: as many as the most before
    assert call([512, 512, 0, 256])[2][0] == 1280  # more rows than any before: as it is
    x, out, ran = call(splits)
    if not m:
        assert ran is None  # nothing to compute: no call
        return
    assert ran[0] == 1280 and (ran[1][m:] == -1).all() and (ran[1][:m] >= -1).all()
    ref = grouped_gemm(x, w, splits, out_dtype=torch.float32, backend="reference")
    assert relerr(out, ref) < 1e-2 and torch.equal(out[sum(splits[:4]):], torch.zeros_like(out[sum(splits[:4]):]))
    assert call([1024, 512, 512, 0])[2][0] == 2048  # above MIN_ROWS: as it is
    assert call(splits)[2][0] == 1280  # at most MIN_ROWS
