"""COMPACT <-> TransformerEngine GEMM_READY scale layouts, groups, and the TE adapters."""

import pytest
import torch

from conftest import interpreter_only, requires_cuda, survives
from transformer_engine_moe import quantize_blockwise
from transformer_engine_moe.layout import (
    HostSplits,
    all_multiples_of,
    check_m_splits,
    column_block_of_row,
    columnwise_data_shape,
    compact_to_gemm_ready,
    from_columnwise,
    gemm_ready_to_compact,
    m_splits_tensor,
    num_column_blocks,
    own_m_splits,
    to_columnwise,
)


@pytest.mark.parametrize(
    "block,usage,expected",
    [
        # TE's Float8BlockQuantizer.get_scale_shape for a [M=300, K=520] tensor
        ("1x128", "rowwise", (5, 300)),  # (ceil(K/128), pad4(M))
        ("1x128", "columnwise", (3, 520)),  # (ceil(M/128), pad4(K))
        ("128x128", "rowwise", (3, 8)),  # (ceil(M/128), pad4(ceil(K/128)))
        ("128x128", "columnwise", (5, 4)),  # (ceil(K/128), pad4(ceil(M/128)))
    ],
)
def test_gemm_ready_shapes_match_te_and_round_trip(block, usage, expected):
    q = quantize_blockwise(torch.randn(300, 520), block, columnwise=True)
    compact = getattr(q, f"{usage}_scale_inv")
    g = q.scale_inv_gemm_ready(usage)
    assert tuple(g.shape) == expected
    is_2d, col = block == "128x128", usage == "columnwise"
    transposed = not is_2d and not col
    n = compact.shape[0] if transposed else compact.shape[1]
    assert torch.equal(gemm_ready_to_compact(g, is_2d, col, n), compact)
    unpadded = compact.t() if transposed else compact
    assert torch.equal(g[:, : unpadded.shape[1]], unpadded)
    assert (g[:, unpadded.shape[1]:] == 0).all()


def test_gemm_ready_padding_of_rows():
    s = torch.rand(5, 2)  # 1x128 rowwise scales of M=5 rows
    g = compact_to_gemm_ready(s, False, False)
    assert g.shape == (2, 8)
    with pytest.raises(ValueError, match="at least 9 columns"):
        gemm_ready_to_compact(g, False, False, 9)


def test_grouped_scales_have_no_gemm_ready_form():
    q = quantize_blockwise(torch.randn(300, 256), columnwise=True, m_splits=[100, 200])
    with pytest.raises(ValueError, match="no grouped 128x1"):
        q.scale_inv_gemm_ready("columnwise")


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_column_blocks_of_groups(as_tensor):
    sizes = [0, 1, 127, 128, 129, 0, 300]
    splits = torch.tensor(sizes) if as_tensor else sizes
    m = sum(sizes)
    exact = 0 + 1 + 1 + 1 + 2 + 0 + 3
    assert num_column_blocks(m, splits) == (m // 128 + len(sizes) if as_tensor else exact)
    block = column_block_of_row(m, splits, "cpu")
    expected = torch.cat([torch.full((1,), 0), torch.full((127,), 1), torch.full((128,), 2),
                          torch.full((128,), 3), torch.full((1,), 4), torch.full((128,), 5),
                          torch.full((128,), 6), torch.full((44,), 7)])
    assert torch.equal(block, expected)
    assert num_column_blocks(m, None) == -(-m // 128)


@pytest.mark.parametrize(
    "splits,exc,match",
    [
        ([100, 100], ValueError, "sum to M=300"),
        ([], ValueError, "non-empty"),
        ([-1, 301], ValueError, ">= 0"),
        ("300", TypeError, "list of ints or an integer tensor"),
        (torch.tensor([[300]]), TypeError, "1-D int32/int64"),
        (torch.tensor([300.0]), TypeError, "1-D int32/int64"),
        ([True] * 300, TypeError, "list of ints"),
        ([100.0, 200], TypeError, "list of ints"),
        ((150, 150, -0.0), TypeError, "list of ints"),
    ],
    ids=["sum", "empty", "negative", "str", "2d", "float", "bools", "float_size", "tuple_float"],
)
def test_bad_m_splits(splits, exc, match):
    with pytest.raises(exc, match=match):
        check_m_splits(splits, 300)


def test_good_host_m_splits_come_back_as_a_list():
    assert check_m_splits((0, 300, 0), 300) == [0, 300, 0] and check_m_splits([300], 300) == [300]


def test_host_splits_are_checked_once_and_read_only():
    """``HostSplits``: checked when made (ints >= 0, non-empty), its total and column blocks cached; ``check_m_splits``
    and ``own_m_splits`` return it as it is (only the total compared with M), ``num_column_blocks`` reads it; every
    write is refused (what the checks cached would go stale); copies are itself, pickling keeps the type."""
    import copy
    import pickle

    sizes = [0, 128, 300, 1, 256]
    splits = HostSplits(sizes)
    assert splits == sizes and splits.total == 685 and num_column_blocks(685, splits) == 0 + 1 + 3 + 1 + 2
    assert check_m_splits(splits, 685) is splits and own_m_splits(splits, 685).values is splits
    assert num_column_blocks(685, splits) == num_column_blocks(685, sizes)
    assert all_multiples_of(splits, 1) and not all_multiples_of(splits, 128) and not splits.multiple_of(128)
    assert all_multiples_of(HostSplits([0, 256, 128]), 128) and all_multiples_of([0, 256, 128], 128)
    with pytest.raises(ValueError, match=r"m_splits must be non-empty, >= 0 and sum to M=684, got \[0, 128, 300, 1"):
        check_m_splits(splits, 684)
    for write in (lambda s: s.append(1), lambda s: s.__setitem__(0, 5), lambda s: s.pop(), lambda s: s.sort(),
                  lambda s: s.extend([1]), lambda s: s.__delitem__(0), lambda s: s.__iadd__([1])):
        with pytest.raises(TypeError, match="HostSplits is read-only"):
            write(splits)
    assert splits == sizes and copy.copy(splits) is splits and copy.deepcopy(splits) is splits
    back = pickle.loads(pickle.dumps(splits))
    assert type(back) is HostSplits and back == sizes and back.total == 685
    for bad, exc in (([], ValueError), ([1, -1], ValueError), ([1, 2.0], TypeError), ([True], TypeError)):
        with pytest.raises(exc, match="HostSplits"):
            HostSplits(bad)


@pytest.mark.parametrize("align", [1, 3, 128])
def test_host_splits_padded_are_made_once_and_read_only(align):
    """``HostSplits.padded(align)``: each size rounded up to a multiple of ``align``, a ``HostSplits`` with its total,
    multiples and column blocks as if made from the list, the same object at every call (a permute and its
    rerun)."""
    sizes = [0, 128, 300, 1, 256, 127]
    splits = HostSplits(sizes)
    padded = splits.padded(align)
    want = [-(-s // align) * align for s in sizes]
    made = HostSplits(want)
    assert type(padded) is HostSplits and padded == want and padded.total == made.total == sum(want)
    assert padded.column_blocks == made.column_blocks == num_column_blocks(sum(want), want)
    assert padded.multiple_of(align) and padded.multiple_of(128) == made.multiple_of(128)
    assert splits.padded(align) is padded and padded.padded(align) == padded
    with pytest.raises(TypeError, match="HostSplits is read-only"):
        padded.append(1)
    for bad in (0, -128, 1.5, True):
        with pytest.raises(ValueError, match="align must be an int >= 1"):
            splits.padded(bad)


def test_te_adapters_round_trip():
    pytest.importorskip("transformer_engine.pytorch", reason="TransformerEngine not installed")
    from transformer_engine_moe import from_te, to_te

    for block in ("1x128", "128x128"):
        q = quantize_blockwise(torch.randn(300, 512, dtype=torch.bfloat16, device="cuda"), block,
                               columnwise=True)
        te_t = to_te(q)
        assert torch.equal(te_t.dequantize(dtype=torch.float32), q.dequantize())
        back = from_te(te_t)
        for u in q.usages:
            assert torch.equal(getattr(back, f"{u}_scale_inv"), getattr(q, f"{u}_scale_inv"))
            assert torch.equal(back.dequantize(usage=u), q.dequantize(usage=u))


def test_te_adapters_without_te_raise_import_error():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        from transformer_engine_moe import to_te

        with pytest.raises(ImportError, match="need TransformerEngine"):
            to_te(quantize_blockwise(torch.randn(2, 128)))
    else:
        pytest.skip("TransformerEngine is installed")


@pytest.mark.parametrize("groups", [None, [3, 0, 7], [10], [0, 0, 10]], ids=str)
def test_columnwise_index_round_trip_and_expert_major_order(groups):
    """to_columnwise / from_columnwise invert each other (list and device-tensor groups), and a grouped copy
    holds each group's own transpose, one after another."""
    x = torch.arange(40, dtype=torch.int32).view(10, 4)
    for splits in ([groups] if groups is None else [groups, torch.tensor(groups)]):
        c = to_columnwise(x, splits)
        assert c.shape == columnwise_data_shape(10, 4, splits)
        assert torch.equal(from_columnwise(c, 10, 4, splits), x)
    if groups is not None:
        want = torch.cat([part.t().reshape(-1) for part in x.split(groups)])
        assert torch.equal(to_columnwise(x, groups), want)
    else:
        assert torch.equal(to_columnwise(x, None), x.t())


def test_te_adapter_refuses_grouped_columnwise_copy():
    """An expert-major columnwise copy has no TE form: refused before TE is even imported."""
    from transformer_engine_moe import to_te

    q = quantize_blockwise(torch.randn(300, 256), columnwise=True, m_splits=[100, 200])
    with pytest.raises(ValueError, match="columnwise copy is grouped"):
        to_te(q)
    with pytest.raises(TypeError, match="to_te expects this package's Float8BlockwiseQTensor, got Tensor"):
        to_te(q.dequantize())  # once an AttributeError


def _calls_with_splits(splits):
    from transformer_engine_moe import Float8BlockwiseQTensor, scaling_aware_transpose
    from transformer_engine_moe.ops.grouped_gemm import grouped_gemm

    q = quantize_blockwise(torch.randn(4, 128))
    w = quantize_blockwise(torch.randn(256, 128), block="128x128").reshape(2, 128, 128)
    return {
        "quantize": lambda: quantize_blockwise(torch.randn(4, 128), columnwise=True, m_splits=splits),
        "quantize_triton": lambda: quantize_blockwise(torch.randn(4, 128), columnwise=True, m_splits=splits,
                                                      backend="triton"),
        "transpose": lambda: scaling_aware_transpose(q, splits),
        "transpose_triton": lambda: scaling_aware_transpose(q, splits, backend="triton"),
        "grouped_gemm": lambda: grouped_gemm(q, w, splits),
        "tensor": lambda: Float8BlockwiseQTensor(
            shape=(4, 128), dtype=torch.float32, fp8_dtype=torch.float8_e4m3fn, force_pow_2_scales=True,
            columnwise_data=torch.zeros(512, dtype=torch.float8_e4m3fn),
            columnwise_scale_inv=torch.ones(2, 128), columnwise_m_splits=splits),
    }


@pytest.mark.parametrize("splits", [[6, -2], [2**63 - 1, 2**63 - 1, 6]], ids=["negative", "int64-wrap"])
@pytest.mark.parametrize("op", ["quantize", "quantize_triton", "transpose", "transpose_triton", "grouped_gemm",
                                "tensor"])
def test_device_splits_with_a_negative_size_are_refused_by_every_op(op, splits):
    """``[6, -2]`` sums to M=4: each op taking splits refuses it before any kernel indexes with it (it
    used to abort the process from torch's repeat_interleave, and the Triton transpose accepted it). So do sizes
    whose int64 sum wraps around to M (a segfault, or a GEMM of garbage): each size is at most M."""
    with pytest.raises(ValueError, match=r"m_splits must be >= 0 and sum to M=4"):
        _calls_with_splits(torch.tensor(splits))[op]()


def test_splits_on_another_device_than_the_rows_are_refused():
    with pytest.raises(ValueError, match="m_splits is on cpu, the rows it splits on meta"):
        check_m_splits(torch.tensor([2, 2]), 4, device="meta")


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=interpreter_only)])
def test_negative_splits_once_aborted_the_process_now_refused_in_a_subprocess(backend):
    """The abort itself (``free(): invalid next size`` from repeat_interleave, then a columnwise dequantize),
    run in its own process: whatever regresses, this suite survives to report it."""
    out = survives(f"""
import torch
from transformer_engine_moe import quantize_blockwise
for splits in ([6, -2], [2**63 - 1, 2**63 - 1, 6]):  # the second: once a segfault
    try:
        q = quantize_blockwise(torch.randn(4, 128), columnwise=True, m_splits=torch.tensor(splits), backend={backend!r})
        q.dequantize(usage="columnwise")
    except ValueError as e:
        print("ValueError:", e)
""")
    assert out.count("ValueError: m_splits must be >= 0 and sum to M=4") == 2


def test_m_splits_tensor_converts_a_host_list_once_per_values_dtype_and_stream(monkeypatch):
    """On a GPU a host list's device tensor is made once per (values, device, dtype, stream) and shared
    (one layer converted the same list about ten times); never while a CUDA graph is captured. The
    CUDA side is stood in for here; the GPU test below runs it for real."""
    import transformer_engine_moe.layout as layout

    made = []
    monkeypatch.setattr(layout, "_to_device", lambda v, d, t: made.append((v, t)) or torch.tensor(v, dtype=t))
    stream = [1]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": stream[0]}))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    layout._device_splits.cache_clear()
    a = m_splits_tensor([3, 0, 5], "cuda:0")
    assert a is m_splits_tensor((3, 0, 5), "cuda:0") and a.tolist() == [3, 0, 5] and a.dtype == torch.int64
    b = m_splits_tensor([3, 0, 5], "cuda:0", torch.int32)
    assert b is not a and b.dtype == torch.int32
    assert m_splits_tensor([3, 0, 6], "cuda:0").tolist() == [3, 0, 6]
    stream[0] = 2  # another stream: its own copy, queued where it is read
    assert m_splits_tensor([3, 0, 5], "cuda:0") is not a
    capturing[0] = True
    assert m_splits_tensor([3, 0, 5], "cuda:0") is not m_splits_tensor([3, 0, 5], "cuda:0")
    assert len(made) == 6
    layout._device_splits.cache_clear()
    cpu = m_splits_tensor([1, 2], "cpu")
    assert cpu.tolist() == [1, 2] and cpu is not m_splits_tensor([1, 2], "cpu")


def test_row_groups_of_a_host_list_made_once_per_values_and_stream(monkeypatch):
    """Each grouped GEMM of a layer asks for the group of every row (DeepGEMM's m_indices): on a GPU a host
    list's is made once per (values, device, stream, dtype) and shared, equal to group_of_row; not under
    torch.compile or CUDA graph capture. CUDA stood in for, as above."""
    import transformer_engine_moe.layout as layout

    monkeypatch.setattr(layout, "_to_device", lambda v, d, t: torch.tensor(v, dtype=t))
    stream = [1]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": stream[0]}))
    compiling = [False]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(layout, "group_of_row", lambda s, m, dtype=torch.int64: torch.repeat_interleave(
        torch.arange(s.numel(), dtype=dtype), s, output_size=m))
    layout._device_row_groups.cache_clear()
    a = layout.row_groups([2, 0, 3], 5, "cuda:0", torch.int32)
    assert a.tolist() == [0, 0, 2, 2, 2] and a.dtype == torch.int32
    assert layout.row_groups((2, 0, 3), 5, "cuda:0", torch.int32) is a
    assert layout.row_groups([2, 0, 3], 5, "cuda:0").dtype == torch.int64
    stream[0] = 2
    assert layout.row_groups([2, 0, 3], 5, "cuda:0", torch.int32) is not a
    compiling[0] = True
    assert layout.row_groups([2, 0, 3], 5, "cuda:0", torch.int32) is not layout.row_groups([2, 0, 3], 5, "cuda:0",
                                                                                            torch.int32)
    layout._device_row_groups.cache_clear()


@requires_cuda
def test_m_splits_tensor_on_the_gpu_is_shared_per_stream():
    import transformer_engine_moe.layout as layout

    a = m_splits_tensor([128, 0, 256], "cuda")
    assert a.is_cuda and a.tolist() == [128, 0, 256] and a is m_splits_tensor([128, 0, 256], "cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        b = m_splits_tensor([128, 0, 256], "cuda")
    side.synchronize()
    assert b is not a and b.tolist() == [128, 0, 256]
    groups = layout.row_groups([128, 0, 256], 384, "cuda", torch.int32)
    assert groups is layout.row_groups([128, 0, 256], 384, "cuda", torch.int32)
    assert torch.equal(groups.cpu(), torch.tensor([0] * 128 + [2] * 256, dtype=torch.int32))


def test_own_m_splits_keeps_a_copy_that_the_caches_still_share(monkeypatch):
    """What a stored object keeps of its splits: a new list of host sizes, a clone of a device tensor (the
    caller's tensor kept beside it for its identity), so later writes into the caller's splits do not reach
    it; owned splits pass as they are. A host list's copy keys layout's per-(values, stream) device caches as
    the caller's list does (CUDA stood in for, as above)."""
    import transformer_engine_moe.layout as layout

    sizes = [3, 0, 5]
    owned = own_m_splits(sizes, 8)
    sizes[0] = 4
    assert owned.values == [3, 0, 5] and owned.given is None
    assert owned.as_given() == [3, 0, 5] and owned.as_given() is not owned.values
    t = torch.tensor([3, 0, 5])
    owned_t = own_m_splits(t, 8)
    t[0] = 4
    assert owned_t.values.tolist() == [3, 0, 5] and owned_t.given is t and owned_t.as_given() is t
    assert own_m_splits(owned_t, 8) is owned_t and own_m_splits(None, 8) is None
    with pytest.raises(ValueError, match="m_splits must be >= 0 and sum to M=8"):
        own_m_splits(torch.tensor([9, -1]), 8)
    monkeypatch.setattr(layout, "_to_device", lambda v, d, dt: torch.tensor(v, dtype=dt))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 1}))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    layout._device_splits.cache_clear()
    assert m_splits_tensor(owned.values, "cuda:0") is m_splits_tensor([3, 0, 5], "cuda:0")
    layout._device_splits.cache_clear()
