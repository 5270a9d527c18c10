"""Float8BlockwiseQTensor: construction checks, views, split, autograd, dispatch, pickling, the columnwise groups
it owns, strided components."""

import io
import pickle

import numpy as np
import pytest
import torch

from conftest import KERNEL_DEVICE, survives
from transformer_engine_moe import (
    Float8BlockwiseQTensor,
    grouped_gemm,
    grouped_gemm_wgrad,
    quantize_blockwise,
    scaling_aware_transpose,
    transpose_grouped_weight,
)


def _q(m=300, k=256, **kw):
    return quantize_blockwise(torch.randn(m, k, dtype=torch.bfloat16), **kw)


def test_metadata_and_compact_shapes():
    q = quantize_blockwise(torch.randn(3, 100, 300, dtype=torch.bfloat16), columnwise=True)
    assert q.shape == (3, 100, 300) and q.dtype == torch.bfloat16 and q.device.type == "cpu"
    assert q.fp8_dtype == torch.float8_e4m3fn and q.block == "1x128" and not q.is_2D_scaled
    assert q.rowwise_data.shape == (300, 300) and q.rowwise_data.dtype == torch.float8_e4m3fn
    assert q.rowwise_scale_inv.shape == (300, 3) and q.rowwise_scale_inv.dtype == torch.float32
    assert q.columnwise_data.shape == (300, 300) and q.columnwise_scale_inv.shape == (3, 300)
    assert q.force_pow_2_scales and q.columnwise_m_splits is None
    assert q.usages == ("rowwise", "columnwise")
    assert "Float8BlockwiseQTensor(shape=[3, 100, 300]" in repr(q)


def test_constructor_rejects_inconsistent_components():
    d = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    s = torch.ones(4, 2)
    ok = dict(shape=(4, 256), dtype=torch.bfloat16, fp8_dtype=torch.float8_e4m3fn)
    Float8BlockwiseQTensor(**ok, rowwise_data=d, rowwise_scale_inv=s)
    with pytest.raises(ValueError, match=r"rowwise_scale_inv must have COMPACT shape \[4, 2\], got \[2, 4\]"):
        Float8BlockwiseQTensor(**ok, rowwise_data=d, rowwise_scale_inv=torch.ones(2, 4))
    with pytest.raises(TypeError, match="rowwise_data must have dtype torch.float8_e4m3fn"):
        Float8BlockwiseQTensor(**ok, rowwise_data=d.view(torch.uint8), rowwise_scale_inv=s)
    with pytest.raises(ValueError, match=r"rowwise_data must have shape \[8, 256\], got \[4, 256\]"):
        Float8BlockwiseQTensor(**{**ok, "shape": (8, 256)}, rowwise_data=d, rowwise_scale_inv=s)
    with pytest.raises(ValueError, match="must be given together"):
        Float8BlockwiseQTensor(**ok, rowwise_data=d)
    with pytest.raises(TypeError, match="scale_inv must be float32"):
        Float8BlockwiseQTensor(**ok, rowwise_data=d, rowwise_scale_inv=s.double())
    with pytest.raises(ValueError, match="needs rowwise or columnwise data"):
        Float8BlockwiseQTensor(**ok)
    with pytest.raises(TypeError, match="dtype must be one of"):
        Float8BlockwiseQTensor(**{**ok, "dtype": torch.int32}, rowwise_data=d, rowwise_scale_inv=s)


@pytest.mark.parametrize("change, exc, match", [
    (dict(shape=None), TypeError, "shape must be a sequence of ints .* got None"),
    (dict(shape=(4.0, 256)), TypeError, r"shape must be a sequence of ints .* got \(4.0, 256\)"),
    (dict(shape=(-4, 256)), ValueError, r"shape must hold sizes >= 0, got \[-4, 256\]"),
    (dict(rowwise_data=[[0] * 256] * 4), TypeError, "rowwise_data must be a plain torch.Tensor, got list"),
    (dict(rowwise_scale_inv=np.ones((4, 2), dtype=np.float32)), TypeError,
     "rowwise_scale_inv must be a plain torch.Tensor, got ndarray"),
    (dict(is_2D_scaled="yes"), TypeError, "is_2D_scaled must be a bool .*, got 'yes'"),
    (dict(force_pow_2_scales="false"), TypeError, "force_pow_2_scales must be a bool .*, got 'false'"),
    (dict(pow2_scales=0), TypeError, "pow2_scales must be a bool .*, got 0"),
], ids=["shape-none", "shape-float", "shape-negative", "data-list", "scale-numpy", "2d-str", "pow2-str", "pow2-int"])
def test_constructor_names_each_bad_argument(change, exc, match):
    """Issue 41's probe: once an AttributeError (a list), "must be float32, got float32" (numpy), torch.Size's
    message naming no argument, and a flag "false" read as True (a tensor claiming power-of-two scales)."""
    ok = dict(shape=(4, 256), dtype=torch.bfloat16, fp8_dtype=torch.float8_e4m3fn,
              rowwise_data=torch.zeros(4, 256, dtype=torch.float8_e4m3fn), rowwise_scale_inv=torch.ones(4, 2))
    with pytest.raises(exc, match=match):
        Float8BlockwiseQTensor(**{**ok, **change})


@pytest.mark.parametrize("call, exc, match", [
    (lambda q: q.view(-1, -1), ValueError, r"cannot be viewed as \[-1, -1\]: only one dimension can be inferred"),
    (lambda q: q.reshape(()), ValueError, r"cannot be viewed as \[\]"),
    (lambda q: q.update_usage(rowwise_usage="no", columnwise_usage=True), TypeError,
     "rowwise_usage must be a bool .*, got 'no'"),
], ids=["two-inferred", "0-d", "usage-str"])
def test_views_and_usages_name_bad_arguments(call, exc, match):
    """Once torch's RuntimeError from the shape arithmetic, and a usage "no" taken as True."""
    with pytest.raises(exc, match=match):
        call(quantize_blockwise(torch.randn(4, 256)))


def test_dequantize_usages_and_dtypes():
    x = torch.randn(200, 384)
    q = quantize_blockwise(x, columnwise=True)
    row, col = q.dequantize(), q.dequantize(usage="columnwise")
    assert row.dtype == torch.float32 and col.shape == (200, 384)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    only_col = quantize_blockwise(x, rowwise=False, columnwise=True)
    assert torch.equal(only_col.dequantize(), col)  # default usage: the one held
    with pytest.raises(ValueError, match="holds no rowwise data"):
        only_col.dequantize(usage="rowwise")
    with pytest.raises(ValueError, match="usage must be 'rowwise' or 'columnwise'"):
        q.dequantize(usage="both")
    with pytest.raises(TypeError, match="dequantize dtype must be a floating dtype"):
        q.dequantize(torch.int8)


def test_split_is_zero_copy_and_differentiable():
    x = torch.randn(300, 256, dtype=torch.bfloat16, requires_grad=True)
    q = quantize_blockwise(x)
    pieces = q.split([0, 1, 127, 172])
    assert [p.shape[0] for p in pieces] == [0, 1, 127, 172]
    assert pieces[2].rowwise_data.data_ptr() == q.rowwise_data[1:].data_ptr()
    assert pieces[3].rowwise_scale_inv.data_ptr() == q.rowwise_scale_inv[128:].data_ptr()
    for p, lo in zip(pieces, [0, 0, 1, 128]):
        assert torch.equal(p.dequantize(), q.dequantize()[lo : lo + p.shape[0]])
    (pieces[2].dequantize().sum() * 2 + pieces[3].dequantize().sum()).backward()
    expected = torch.cat([torch.zeros(1, 256), torch.full((127, 256), 2.0), torch.ones(172, 256)])
    assert torch.equal(x.grad.float(), expected)


def test_split_of_columnwise_and_2d_needs_block_aligned_splits():
    q = _q(columnwise=True)
    a, b = q.split([128, 172])
    assert a.columnwise_data.shape == (256, 128) and b.columnwise_scale_inv.shape == (2, 256)
    assert torch.equal(b.dequantize(usage="columnwise"), q.dequantize(usage="columnwise")[128:])
    with pytest.raises(ValueError, match=r"\[100, 200\] cut through 128-row blocks of the columnwise copy \(groups \[300\]\)"):
        q.split([100, 200])
    w = _q(block="128x128")
    a, b = w.split([256, 44])
    assert b.rowwise_scale_inv.shape == (1, 2)
    with pytest.raises(ValueError, match="128x128"):
        w.split([10, 290])


@pytest.mark.parametrize(
    "splits,exc,match",
    [
        (torch.tensor([100, 200]), TypeError, "list of Python ints"),
        (300, TypeError, "list of Python ints"),
        ([100, 100], ValueError, "sum to M=300"),
        ([400, -100], ValueError, ">= 0"),
        ([100.0, 200.0], TypeError, "m_splits must be a list of ints"),
        ([], ValueError, "non-empty"),
    ],
    ids=["tensor", "int", "sum", "negative", "floats", "empty"],
)
def test_split_bad_input(splits, exc, match):
    with pytest.raises(exc, match=match):
        _q().split(splits)


def test_split_of_no_rows():
    """Zero rows split by ``[]`` into no pieces, or by zeros into empty pieces (the checks of ``check_m_splits``)."""
    q = quantize_blockwise(torch.randn(0, 256))
    assert q.split([]) == ()
    assert [p.shape for p in q.split([0, 0])] == [(0, 256), (0, 256)]


def test_view_and_reshape_keep_storage_and_gradients():
    x = torch.randn(6, 256, requires_grad=True)
    q = quantize_blockwise(x)
    v = q.view(2, 3, 256)
    assert isinstance(v, Float8BlockwiseQTensor) and v.shape == (2, 3, 256)
    assert v.rowwise_data.data_ptr() == q.rowwise_data.data_ptr()
    r = v.reshape(-1, 256)
    assert r.shape == (6, 256)
    (v.dequantize() * torch.arange(6.0).view(2, 3, 1)).sum().backward()
    assert torch.equal(x.grad, torch.arange(6.0).view(6, 1).expand(6, 256))
    with pytest.raises(ValueError, match="only reshape between"):
        q.view(12, 128)


def test_passes_through_autograd_function_and_save_for_backward():
    class ScaledSum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t, w):
            ctx.save_for_backward(t, w)
            return (t.dequantize() * w).sum()

        @staticmethod
        def backward(ctx, g):
            t, w = ctx.saved_tensors
            assert isinstance(t, Float8BlockwiseQTensor)
            return (g * w).to(t.dtype), g * t.dequantize()

    x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 256, requires_grad=True)
    q = quantize_blockwise(x)
    ScaledSum.apply(q, w).backward()
    assert torch.equal(x.grad, w.detach().to(torch.bfloat16))
    assert torch.equal(w.grad, q.dequantize().detach())


def test_dispatch_falls_back_to_dequantized_values_and_refuses_writes():
    q = _q(m=4)
    out = q + 1
    assert type(out) is torch.Tensor and out.dtype == torch.bfloat16
    assert torch.equal(out, q.dequantize(torch.bfloat16) + 1)
    assert torch.equal(q.float(), q.dequantize())
    d = q.detach()
    assert isinstance(d, Float8BlockwiseQTensor) and d.rowwise_data.data_ptr() == q.rowwise_data.data_ptr()
    c = q.clone()
    assert c.rowwise_data.data_ptr() != q.rowwise_data.data_ptr() and torch.equal(c.float(), q.float())
    with pytest.raises(TypeError, match="would write into a Float8BlockwiseQTensor"):
        q.add_(1)
    with pytest.raises(TypeError, match="would write into a Float8BlockwiseQTensor"):
        q.copy_(torch.zeros(4, 256))
    plain = torch.empty(4, 256, dtype=torch.bfloat16)
    plain.copy_(q)  # writing *from* it is fine
    assert torch.equal(plain, q.dequantize(torch.bfloat16))


@pytest.mark.parametrize("write", ["setitem", "slice-setitem", "select-add_", "data"])
def test_writes_through_indexing_or_data_raise_instead_of_vanishing(write):
    """``q[0] = 0`` and friends used to write into a dequantized temporary: silent no-ops."""
    q = _q(m=4)
    before = q.dequantize()
    writes = {"setitem": lambda: q.__setitem__(0, 0.0),
              "slice-setitem": lambda: q.__setitem__(slice(1, 3), torch.zeros(2, 256)),
              "select-add_": lambda: q[0].add_(1),
              "data": lambda: setattr(q, "data", torch.zeros(4, 256))}
    with pytest.raises(TypeError, match="Float8BlockwiseQTensor"):
        writes[write]()
    assert torch.equal(q.dequantize(), before)


def test_row_preserving_torch_views_stay_fp8_and_others_raise():
    q = _q(m=4)
    for r in (torch.reshape(q, (2, 2, 256)), q.flatten(0, 0), q.reshape(4, 256).view(1, 4, 256)):
        assert isinstance(r, Float8BlockwiseQTensor) and r.rowwise_data.data_ptr() == q.rowwise_data.data_ptr()
        assert torch.equal(r.dequantize().reshape(4, 256), q.dequantize())
    with pytest.raises(ValueError, match="same last dim|K=256"):
        torch.reshape(q, (-1,))
    for view in (lambda: q[0], lambda: q[1:3], lambda: q.t(), lambda: q.transpose(0, 1)):
        with pytest.raises(TypeError, match="would return a view of a Float8BlockwiseQTensor"):
            view()


def test_update_usage():
    w = _q(block="128x128")
    w.update_usage(columnwise_usage=True)
    assert w.usages == ("rowwise", "columnwise")
    assert torch.equal(w.columnwise_data.view(torch.uint8), w.rowwise_data.view(torch.uint8).t())
    assert torch.equal(w.dequantize(usage="columnwise"), w.dequantize())
    w.update_usage(rowwise_usage=False)
    assert w.usages == ("columnwise",)
    w.update_usage(rowwise_usage=True)
    assert w.usages == ("rowwise", "columnwise")
    a = _q()
    a.update_usage(columnwise_usage=True, m_splits=[100, 200])  # the scaling-aware transpose
    assert a.usages == ("rowwise", "columnwise") and a.columnwise_m_splits == [100, 200]
    assert a.columnwise_scale_inv.shape == (1 + 2, 256)
    with pytest.raises(ValueError, match="must keep rowwise or columnwise"):
        a.update_usage(rowwise_usage=False, columnwise_usage=False)
    a.update_usage(rowwise_usage=False)
    with pytest.raises(ValueError, match="cannot recover rowwise data"):
        a.update_usage(rowwise_usage=True)
    with pytest.raises(ValueError, match="not powers of two"):
        _q(force_pow_2_scales=False).update_usage(columnwise_usage=True)


@pytest.mark.parametrize("how", ["torch.save", "torch.save-weights-only", "pickle"])
def test_pickle_round_trip(how):
    """torch.save and plain pickle (which cannot serialise float8 storages itself) both round-trip; so does
    torch.load's default ``weights_only=True`` (once an UnpicklingError: the rebuild function is a safe global)."""
    q = _q(columnwise=True, m_splits=[100, 200])
    if how == "pickle":
        r = pickle.loads(pickle.dumps(q))
    else:
        buf = io.BytesIO()
        torch.save(q, buf)
        buf.seek(0)
        r = torch.load(buf, weights_only=how.endswith("weights-only"))
    assert isinstance(r, Float8BlockwiseQTensor) and r.usages == q.usages and r.fp8_dtype == q.fp8_dtype
    assert r.columnwise_m_splits == [100, 200] and r.rowwise_data.dtype == q.rowwise_data.dtype
    assert torch.equal(r.dequantize(), q.dequantize())
    assert torch.equal(r.dequantize(usage="columnwise"), q.dequantize(usage="columnwise"))


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_grouped_columnwise_copy_is_flat_expert_major(as_tensor):
    """Grouped 128x1 columnwise data is 1-D [M*K] (a [K, M] buffer is refused), survives view, clone and
    pickling, and dequantizes to the logical [M, K] (equal to each group's own ungrouped copy)."""
    groups = [100, 0, 200]
    splits = torch.tensor(groups) if as_tensor else groups
    q = _q(columnwise=True, m_splits=splits)
    assert q.columnwise_data.shape == (300 * 256,) and q.columnwise_scale_inv.shape[1] == 256
    parts = dict(shape=(300, 256), dtype=torch.bfloat16, fp8_dtype=torch.float8_e4m3fn,
                 columnwise_scale_inv=q.columnwise_scale_inv, columnwise_m_splits=splits)
    with pytest.raises(ValueError, match=r"columnwise_data must have shape \[76800\], got \[256, 300\]"):
        Float8BlockwiseQTensor(**parts, columnwise_data=q.columnwise_data.view(256, 300))
    col = q.dequantize(usage="columnwise")
    assert torch.equal(q.view(3, 100, 256).dequantize(usage="columnwise").view(300, 256), col)
    c = q.clone()  # copies data and scales, keeps the groups (a device tensor: the same object)
    assert torch.equal(c.dequantize(usage="columnwise"), col)
    assert (c.columnwise_m_splits is q.columnwise_m_splits) if as_tensor else (c.columnwise_m_splits == groups)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False).dequantize(usage="columnwise"), col)
    x = q.dequantize()
    first = 0
    for size in groups:
        if size:
            own = quantize_blockwise(x[first:first + size], rowwise=False, columnwise=True)
            assert torch.equal(col[first:first + size], own.dequantize())
        first += size


# ---------------------------------------------------------------------------- the groups it owns
def _grouped(made_by: str, splits) -> Float8BlockwiseQTensor:
    """A [300, 256] 1x128 tensor whose 128x1 columnwise copy is grouped by ``splits``, made by ``made_by``."""
    x = torch.randn(300, 256)
    if made_by == "quantize":
        return quantize_blockwise(x, columnwise=True, m_splits=splits)
    q = quantize_blockwise(x)
    if made_by == "update_usage":
        q.update_usage(columnwise_usage=True, m_splits=splits)
        return q
    t = scaling_aware_transpose(q, splits)
    if made_by == "transpose":
        return t
    return Float8BlockwiseQTensor(shape=t.shape, dtype=t.dtype, fp8_dtype=t.fp8_dtype, columnwise_data=t.columnwise_data,
                                  columnwise_scale_inv=t.columnwise_scale_inv, columnwise_m_splits=splits)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
@pytest.mark.parametrize("made_by", ["quantize", "transpose", "update_usage", "constructor"])
def test_columnwise_groups_are_the_tensors_own_copy(made_by, as_tensor):
    """Each way of making a grouped columnwise copy stores a copy of its groups (a list copy, a device tensor's
    clone): other sizes written into the caller's splits afterwards change nothing the tensor, or a tensor made
    from its storage (detach, view, clone, pickle), computes. ``columnwise_m_splits`` is a new list of the sizes
    it was made with, or the caller's tensor itself (the identity ``grouped_gemm_wgrad`` checks). A device
    tensor used to be kept by reference: the columnwise dequantize read the new sizes (silently wrong values;
    sizes not summing to M crashed the process, next test)."""
    splits = torch.tensor([100, 200]) if as_tensor else [100, 200]
    t = _grouped(made_by, splits)
    want = t.dequantize(usage="columnwise")
    splits[0], splits[1] = 200, 100
    for u in (t, t.detach(), t.view(3, 100, 256), t.clone(), pickle.loads(pickle.dumps(t))):
        assert torch.equal(u.dequantize(usage="columnwise").view(300, 256), want)
    if as_tensor:
        assert t.columnwise_m_splits is splits and t.clone().columnwise_m_splits is splits
    else:
        t.columnwise_m_splits.append(0)  # a new list each time: the tensor's sizes stay its own
        assert t.columnwise_m_splits == [100, 200]


def test_sizes_written_into_the_callers_device_splits_once_crashed_the_process():
    """The issue's reproducer, in its own process: sizes that are negative or do not sum to M, written into the
    device splits after quantizing, made the columnwise dequantize index out of bounds (``free(): invalid
    pointer`` or a segfault). The tensor now reads its own clone."""
    out = survives("""
import torch
from transformer_engine_moe import quantize_blockwise
t = torch.tensor([2, 4])
q = quantize_blockwise(torch.randn(6, 256), columnwise=True, m_splits=t)
want = q.dequantize(usage="columnwise")
t[0] = -2; t[1] = 8
print(torch.equal(q.dequantize(usage="columnwise"), want), q.columnwise_m_splits is t)
""")
    assert out.split() == ["True", "True"]


def test_wgrad_takes_the_splits_its_operands_were_grouped_by():
    """``grouped_gemm_wgrad`` checks each operand's groups against its ``m_splits``: host sizes by value, so
    sizes the caller changed after the transposes are refused (the operands keep the ones they were made with);
    a device tensor by identity: the tensor the transposes got passes although each operand reads its own
    clone (``GroupedLinear`` passes the dispatcher's splits to both), an equal but other tensor is refused."""
    x, dy = quantize_blockwise(torch.randn(256, 128)), quantize_blockwise(torch.randn(256, 128))
    sizes = [128, 128]
    want = grouped_gemm_wgrad(scaling_aware_transpose(dy, sizes), scaling_aware_transpose(x, sizes), sizes)
    xt, dyt = scaling_aware_transpose(x, sizes), scaling_aware_transpose(dy, sizes)
    sizes[0], sizes[1] = 64, 192
    with pytest.raises(ValueError, match=r"grad_output's columnwise copy is grouped by \[128, 128\], not by these"):
        grouped_gemm_wgrad(dyt, xt, sizes)
    splits = torch.tensor([128, 128])
    xt, dyt = scaling_aware_transpose(x, splits), scaling_aware_transpose(dy, splits)
    assert torch.equal(grouped_gemm_wgrad(dyt, xt, splits), want)
    with pytest.raises(ValueError, match="grouped by another tensor, not by these m_splits"):
        grouped_gemm_wgrad(dyt, xt, torch.tensor([128, 128]))


# ---------------------------------------------------------------------------- strided components
def _view(t: torch.Tensor, layout: str) -> torch.Tensor:
    """2-D ``t`` as a non-contiguous view: "transposed" (the transpose of its contiguous transpose) and "sliced"
    (every other row of a tensor twice as tall) hold its values; "expanded" broadcasts row 0 (stride 0)."""
    if layout == "expanded":
        return t[:1].expand(t.shape)
    raw = t.view(torch.uint8) if t.element_size() == 1 else t  # FP8: moved as bytes
    raw = raw.t().contiguous().t() if layout == "transposed" else torch.stack([raw, raw], dim=1)[:, 0]
    return raw.view(t.dtype)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded"])
def test_rowwise_components_given_as_views_are_stored_contiguous(layout):
    """Rowwise data and scales given as a transposed, sliced or expanded view are stored contiguous (a copy; this
    package's own rowwise copies always are): the Triton dequantize, scaling-aware transpose, grouped GEMM and
    weight transpose, which read them densely, equal the reference on contiguous copies of the views. The
    kernels read a view's storage as if dense before (wrong values)."""
    spread = torch.logspace(-3, 3, 256, device=KERNEL_DEVICE)  # scales differing along M and K
    q = quantize_blockwise(torch.randn(256, 256, device=KERNEL_DEVICE) * spread[:, None])
    w = quantize_blockwise(torch.randn(256, 256, device=KERNEL_DEVICE) * spread, "128x128")

    def built(like, shape, data, scale):
        return Float8BlockwiseQTensor(shape=shape, dtype=like.dtype, fp8_dtype=like.fp8_dtype, force_pow_2_scales=True,
                                      is_2D_scaled=like.is_2D_scaled, rowwise_data=data, rowwise_scale_inv=scale)

    data, scale = _view(q.rowwise_data, layout), _view(q.rowwise_scale_inv, layout)
    wdata, wscale = _view(w.rowwise_data, layout), _view(w.rowwise_scale_inv, layout)
    a, ref = built(q, (256, 256), data, scale), built(q, (256, 256), data.contiguous(), scale.contiguous())
    wa, wref = built(w, (2, 128, 256), wdata, wscale), built(w, (2, 128, 256), wdata.contiguous(), wscale.contiguous())
    assert all(c.is_contiguous() for c in (a.rowwise_data, a.rowwise_scale_inv, wa.rowwise_data, wa.rowwise_scale_inv))
    assert torch.equal(a.dequantize(backend="triton"), ref.dequantize(backend="reference"))
    got, want = (scaling_aware_transpose(t, [100, 156], backend=b) for t, b in ((a, "triton"), (ref, "reference")))
    assert torch.equal(got.columnwise_data.view(torch.uint8), want.columnwise_data.view(torch.uint8))
    assert torch.equal(got.columnwise_scale_inv, want.columnwise_scale_inv)
    got, want = (transpose_grouped_weight(t, backend=b) for t, b in ((wa, "triton"), (wref, "reference")))
    assert torch.equal(got.rowwise_data.view(torch.uint8), want.rowwise_data.view(torch.uint8))
    assert torch.equal(grouped_gemm(a, wa, [100, 156], backend="triton"),
                       grouped_gemm(ref, wref, [100, 156], backend="triton"))


def test_columnwise_components_stay_views_and_the_wgrad_reads_them_densely():
    """A columnwise copy is kept as given (``split`` makes strided column slices of the ``[K, M]`` transpose, zero
    copy): the wgrad GEMM, the one kernel reading it, makes a strided one contiguous, so Triton on transposed
    scales equals Triton on contiguous ones (it read them as dense before). Its data must be unit-stride along
    its last dim, refused by name otherwise."""
    spread = torch.logspace(-3, 3, 128, device=KERNEL_DEVICE)  # 128x1 scales differing along K
    x, dy = (quantize_blockwise(torch.randn(256, 128, device=KERNEL_DEVICE) * spread, rowwise=False, columnwise=True,
                                m_splits=[128, 128]) for _ in range(2))
    scale = _view(x.columnwise_scale_inv, "transposed")
    common = dict(shape=x.shape, dtype=x.dtype, fp8_dtype=x.fp8_dtype, force_pow_2_scales=True,
                  columnwise_m_splits=[128, 128])
    xs = Float8BlockwiseQTensor(**common, columnwise_data=x.columnwise_data, columnwise_scale_inv=scale)
    assert xs.columnwise_scale_inv is scale
    assert torch.equal(grouped_gemm_wgrad(dy, xs, [128, 128], backend="triton"),
                       grouped_gemm_wgrad(dy, x, [128, 128], backend="triton"))
    doubled = torch.stack([x.columnwise_data.view(torch.uint8)] * 2, dim=1).view(x.fp8_dtype)
    with pytest.raises(ValueError, match=r"columnwise_data must be unit-stride in its last dimension, got strides "
                                         r"\(2,\)"):
        Float8BlockwiseQTensor(**common, columnwise_data=doubled[:, 0], columnwise_scale_inv=x.columnwise_scale_inv)


@pytest.mark.parametrize("recompute", [None, "moe_expert"])
def test_the_ops_tensors_pass_the_constructors_checks(monkeypatch, recompute):
    """The ops build their FP8 tensors with ``_of_launch`` (the constructor without its argument checks): every one
    they build in a block's forward and backward (permute, quantize, SwiGLU, the transposes and wgrad operands, the
    weights' byte transpose, device splits too) passes the checked constructor, and gives the same results."""
    from transformer_engine_moe import FP8FlowMoE

    def run():
        torch.manual_seed(0)
        block = FP8FlowMoE(4, 256, 128, 2, align_size=128, recompute=recompute, device=KERNEL_DEVICE)
        x = torch.randn(96, 256, dtype=torch.bfloat16, device=KERNEL_DEVICE, requires_grad=True)
        ids = torch.stack([torch.randperm(4, device=KERNEL_DEVICE)[:2] for _ in range(96)])
        ids[:40] = torch.tensor([1, 3])  # most tokens on two experts, some experts with few rows
        probs = torch.rand(96, 2, device=KERNEL_DEVICE)
        out = []
        for flag in (True, False):  # the weights quantized and cached, then the cache's byte transpose
            y = block.forward_topk(x, ids, probs, is_first_microbatch=flag)
            y.backward(torch.randn_like(y))
            out += [y, x.grad] + [p.grad for p in block.parameters()]
        return out

    built = []
    fast = run()
    checked = Float8BlockwiseQTensor.__new__
    monkeypatch.setattr(Float8BlockwiseQTensor, "_of_launch",
                        classmethod(lambda cls, **kw: built.append(sorted(kw)) or checked(cls, **kw)))
    slow = run()
    assert len(built) >= 10 and any("columnwise_data" in kw for kw in built)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))
