"""Interop with TransformerEngine's blockwise FP8, against real TE on the GPU (issue 38).

Needs a CUDA GPU and ``transformer_engine.pytorch`` (written against TE main d0067d0, 2.20.0.dev0); skipped
otherwise, so CPU CI only collects these tests.

1. Adapters: ``to_te`` gives TE's ``Float8BlockwiseQTensor`` holding our bytes, with GEMM_READY scales bitwise
   what TE's own quantizer writes (their valid region: TE leaves the padding uninitialised), for 1x128 and
   128x128, rowwise and columnwise; TE dequantizes it and its GEMMs read it as they read their own tensors;
   ``from_te`` turns TE's tensor into ours (COMPACT) bitwise.
2. Quantization: ``quantize_blockwise`` and our ``Float8BlockQuantizer``, built with TE's constructor arguments,
   give TE's ``Float8BlockQuantizer`` bytes and scale_inv bitwise on finite input (E4M3/E5M2, 1x128/128x128,
   power-of-two scales or not, amax epsilon 0 or not, BF16/FP32, ragged rows, zeros, all-zero blocks, values
   at the FP8 max, tiny values whose scale overflows float32). TE's columnwise data is ``[K, M]``, transposed,
   like ours; its 1x128 columnwise scales ``[ceil(M/128), pad4(K)]`` are ours ``[ceil(M/128), K]`` padded.
   Inf and NaN are left out: there we differ on purpose (docs/quantization.md).
3. ``GroupedLinear``: ours with an FP8 input against TE's under ``Float8BlockScaling``, same weights and ragged
   ``m_splits`` with empty experts: forward, dgrad and wgrad, each against float64 math on the FP8 operands that
   implementation used, within a stated GEMM tolerance, and against each other.

TE's ``_rowwise_data`` / ``_columnwise_data`` / ``_*_scale_inv`` / ``_fp8_dtype`` / ``_is_2D_scaled`` are read
directly: they are TE's storage attributes (``tensor/storage/float8_blockwise_tensor_storage.py``), what our
adapters read and write.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from conftest import relerr, same_bits
from transformer_engine_moe import (
    Float8BlockQuantizer,
    FP8FlowRecipe,
    Format,
    GroupedLinear,
    from_te,
    quantize_blockwise,
    scaling_aware_transpose,
    to_te,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: TransformerEngine's blockwise FP8 runs there only")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
BLOCKS = {"1x128": 1, "128x128": 2}  # our block name -> TE's block_scaling_dim
USAGES = ("rowwise", "columnwise")
OUR_BACKENDS = ("auto", "reference")  # on CUDA tensors "auto" is the Triton kernels


@pytest.fixture(scope="module")
def te():
    """``transformer_engine.pytorch``, skipping where it is missing or its blockwise FP8 is unavailable."""
    te = pytest.importorskip("transformer_engine.pytorch", reason="TransformerEngine not installed")
    ok, why = te.is_fp8_block_scaling_available(return_reason=True)
    if not ok:
        pytest.skip(f"TransformerEngine's blockwise FP8 is unavailable here: {why}")
    return te


def _te_dtype(te, fp8: torch.dtype):
    """TE's ``DType`` for a torch FP8 dtype (``transformer_engine.pytorch.DType``, TE's canonical enum)."""
    return te.DType.kFloat8E4M3 if fp8 == torch.float8_e4m3fn else te.DType.kFloat8E5M2


def _te_quantizer(te, fp8, block_scaling_dim, *, rowwise=True, columnwise=True, force_pow_2_scales=True,
                  amax_epsilon=0.0):
    """TE's ``Float8BlockQuantizer`` with every constructor argument spelled out (TE's defaults differ from
    ours: ``block_scaling_dim=2`` there, 1 here)."""
    return te.Float8BlockQuantizer(_te_dtype(te, fp8), rowwise=rowwise, columnwise=columnwise,
                                   amax_epsilon=amax_epsilon, force_pow_2_scales=force_pow_2_scales,
                                   block_scaling_dim=block_scaling_dim)


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def _te_scales(t, usage: str, m: int, k: int) -> torch.Tensor:
    """A TE tensor's ``usage`` scale_inv, its GEMM_READY shape checked, cut to the valid region and laid out
    COMPACT. Written out here from TE's ``Float8BlockQuantizer.get_scale_shape``, not with ``layout.py``:
    1x128 rowwise ``[ceil(K/128), pad4(M)]`` (transposed), 128x1 columnwise ``[ceil(M/128), pad4(K)]``,
    128x128 rowwise ``[ceil(M/128), pad4(ceil(K/128))]``, columnwise ``[ceil(K/128), pad4(ceil(M/128))]``."""
    s = getattr(t, f"_{usage}_scale_inv")
    nm, nk = -(-m // 128), -(-k // 128)
    if t._is_2D_scaled:
        rows, valid = (nm, nk) if usage == "rowwise" else (nk, nm)
    else:
        rows, valid = (nk, m) if usage == "rowwise" else (nm, k)
    assert s.dtype == torch.float32 and tuple(s.shape) == (rows, _pad4(valid)), \
        f"TE's {usage} scale_inv is {s.dtype} {list(s.shape)}, expected float32 {[rows, _pad4(valid)]}"
    s = s[:, :valid]
    return (s.t() if usage == "rowwise" and not t._is_2D_scaled else s).contiguous()


def _te_data(t, usage: str, m: int, k: int) -> torch.Tensor:
    """A TE tensor's ``usage`` data as uint8 ``[M, K]`` (rowwise) or ``[K, M]`` (columnwise, TE's transposed
    layout: ``[K, *leading dims]``)."""
    d = getattr(t, f"_{usage}_data")
    assert d.dtype == torch.uint8, f"TE's {usage} data is {d.dtype}, expected uint8"
    return d.reshape(m, k) if usage == "rowwise" else d.reshape(k, m)


def _assert_same_bytes(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equality of two FP8/uint8 tensors; on failure, how many bytes differ and the first."""
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert a.shape == b.shape, f"{what}: shapes {list(a.shape)} vs {list(b.shape)}"
    diff = a != b
    if diff.any():
        first = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} bytes differ; first at {first}: "
                             f"0x{int(a[first]):02x} vs 0x{int(b[first]):02x}")


def _assert_same_scales(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equality of two float32 scale tensors; on failure, how many differ and the first."""
    if same_bits(a, b):
        return
    assert a.dtype == b.dtype == torch.float32, f"{what}: dtypes {a.dtype} vs {b.dtype}, expected float32"
    assert a.shape == b.shape, f"{what}: shapes {list(a.shape)} vs {list(b.shape)}"
    diff = a.contiguous().view(torch.int32) != b.contiguous().view(torch.int32)
    first = tuple(diff.nonzero()[0].tolist())
    raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} scales differ; first at {first}: "
                         f"{a[first].item()!r} vs {b[first].item()!r}")


def _assert_matches_te(ours, theirs, usages, m: int, k: int, what: str) -> None:
    """Our tensor (COMPACT) holds TE's tensor's bytes and scales, for each usage."""
    for u in usages:
        _assert_same_bytes(getattr(ours, f"{u}_data"), _te_data(theirs, u, m, k), f"{what}: {u} data")
        _assert_same_scales(getattr(ours, f"{u}_scale_inv"), _te_scales(theirs, u, m, k), f"{what}: {u} scale_inv")


def _finite_input(shape, dtype, seed: int = 0) -> torch.Tensor:
    """Finite ``shape`` input on the GPU (drawn on the CPU from a seeded generator): rows spanning six
    decades, then in rows of their own a block whose amax is 448 exactly (with -0.0 and 0.0), one whose amax is
    57344, an all-zero row, an all-zero 1x128 block, tiny blocks (amax ~3e-38 and ~1e-36: 448/amax overflows
    float32, TE's scale then the input dtype's max; ~1e-40: subnormal), blocks near the E4M3 and the E5M2
    max, a row near the float32/BF16 max; an all-zero column, a column of tiny values, and (where the shape has
    them) an all-zero and a tiny 128x128 tile. Every value is finite in BF16 and FP32."""
    g = torch.Generator().manual_seed(seed)
    m, k = math.prod(shape[:-1]), shape[-1]
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    x = randn(m, k) * torch.logspace(-3, 3, m, dtype=torch.float64)[:, None]
    b = min(k, 128)
    x[:, k - 1] = 0.0  # an all-zero column: every 128x1 block of it
    x[:, k - 2] = randn(m) * 1e-38  # a column of tiny values
    if m >= 256 and k >= 256:
        x[128:256, 128:256] = 0.0  # an all-zero 128x128 tile
        x[128:256, :128] = randn(128, 128) * 1e-38  # a tiny 128x128 tile
    x[0, :b] = randn(b) * 10
    x[0, :4] = torch.tensor([448.0, -448.0, -0.0, 0.0])  # amax = E4M3 max exactly: scale 1 (E4M3)
    x[1, :b] = randn(b) * 1e4
    x[1, :2] = torch.tensor([57344.0, -57344.0])  # amax = E5M2 max exactly
    x[2] = 0.0  # an all-zero row
    x[3, :b] = 0.0  # an all-zero 1x128 block in a non-zero row
    x[4, :b] = randn(b) * 1e-38  # 448 / amax overflows float32: scale = the input dtype's max
    if k > 128:
        x[4, 128:256] = randn(min(k, 256) - 128) * 4e-37  # amax near 448 / FLT_MAX: just either side
    x[5, :b] = randn(b) * 1e-40  # subnormal in FP32 and BF16
    x[6, :b] = 448.0 + randn(b) * 8  # around the E4M3 max
    x[7, :b] = 57344.0 + randn(b) * 1000  # around the E5M2 max
    x[8] = (randn(k) * 1e38).clamp(-3e38, 3e38)  # near the float32 / BF16 max, still finite in both
    x = x.to(dtype).reshape(shape)
    assert x.isfinite().all()
    return x.cuda()


def _te_autocast(te, recipe):
    """TE's quantization context with ``recipe``: ``te.autocast`` (TE >= 2.9), else ``te.fp8_autocast``."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def _float8_block_scaling(fmt: str):
    """TE's ``Float8BlockScaling`` in ``fmt`` (``"E4M3"`` or ``"HYBRID"``) with power-of-two scales and amax
    epsilon 0 stated (not read from ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``, which changes the defaults), 1x128
    inputs and gradients, 128x128 weights (the defaults), no ``backward_override``."""
    from transformer_engine.common.recipe import Float8BlockScaling, Format as TEFormat, QParams

    q = QParams(power_2_scale=True, amax_epsilon=0.0)
    kwargs = dict(fp8_format=getattr(TEFormat, fmt), fp8_quant_fwd_inp=q, fp8_quant_fwd_weight=q,
                  fp8_quant_bwd_grad=q, x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1)
    if "backward_override" in {f.name for f in dataclasses.fields(Float8BlockScaling)}:
        kwargs["backward_override"] = None
    return Float8BlockScaling(**kwargs)


# Elementwise GEMM tolerance against float64 math on the same FP8 operands: the BF16 output's rounding (half an
# ulp of 8 significant bits: <= 2^-8 |y|, y the rounded output) plus the accumulation error, FP32 with the
# products of each 128-long K block summed in the tensor cores first (Hopper's FP8 MMA keeps about 14 bits
# there; the block scales are applied at each 128 step, TE's "split accumulator" and ours alike): 2^-11 of the
# sum of |products| is 8x 2^-14. Accumulation order is all that may differ, so one bound serves TE and us. A
# wrong scale, block, expert or layout is off by O(|y|); an output 1% off fails it.
REL_TOL, ABS_TOL = 2.0 ** -8, 2.0 ** -11


def _assert_gemm_close(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """``out`` (BF16) within the GEMM tolerance of ``a @ b`` (float64 operands)."""
    ref, absref = a @ b, a.abs() @ b.abs()
    assert out.shape == ref.shape, f"{what}: shape {list(out.shape)}, expected {list(ref.shape)}"
    out64 = out.double()
    excess = (out64 - ref).abs() - (REL_TOL * torch.maximum(out64.abs(), ref.abs()) + ABS_TOL * absref)
    if (excess > 0).any():
        i = divmod(int(excess.argmax()), ref.shape[1])
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements outside "
                             f"2^-8 max(|out|, |ref|) + 2^-11 sum|a||b|; worst at {i}: got {out[i].item()!r}, "
                             f"ref {ref[i].item()!r}, sum|a||b| {absref[i].item()!r}")


# ----------------------------------------------------------------------------------------------- 1. adapters

@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("usages", [("rowwise",), ("columnwise",), USAGES], ids=["row", "col", "both"])
@pytest.mark.parametrize("shape", [(300, 512), (77, 256), (2, 75, 384)], ids=["300x512", "77x256", "2x75x384"])
def test_to_te_matches_te_quantizer_and_from_te_inverts(te, fp8, block, usages, shape):
    """to_te(ours): TE's class and metadata, our data shared (zero copy), TE's data layout and GEMM_READY scale
    shapes, bytes and valid scales bitwise those of TE's own quantizer on the same input; TE dequantizes it to
    our values exactly. from_te(TE's own tensor) and from_te(to_te(ours)): ours, bitwise, COMPACT."""
    x = _finite_input(shape, torch.bfloat16, seed=1)
    m, k = math.prod(shape[:-1]), shape[-1]
    rowwise, columnwise = "rowwise" in usages, "columnwise" in usages
    q = quantize_blockwise(x, block, fp8, rowwise=rowwise, columnwise=columnwise)
    with torch.no_grad():
        theirs = _te_quantizer(te, fp8, BLOCKS[block], rowwise=rowwise, columnwise=columnwise)(x)
    assert type(theirs) is te.Float8BlockwiseQTensor

    t = to_te(q)
    assert type(t) is te.Float8BlockwiseQTensor
    assert tuple(t.shape) == shape and t.dtype == torch.bfloat16 and t.device == x.device
    assert t._fp8_dtype == theirs._fp8_dtype == _te_dtype(te, fp8)
    assert t._is_2D_scaled is theirs._is_2D_scaled is (block == "128x128")
    assert t._quantizer.force_pow_2_scales and t._quantizer.block_scaling_dim == BLOCKS[block]
    for u in USAGES:
        if u not in usages:
            assert getattr(t, f"_{u}_data") is None and getattr(t, f"_{u}_scale_inv") is None
            continue
        data, want = getattr(t, f"_{u}_data"), getattr(theirs, f"_{u}_data")
        assert data.dtype == torch.uint8 and data.shape == want.shape, (u, data.dtype, data.shape, want.shape)
        assert data.data_ptr() == getattr(q, f"{u}_data").data_ptr(), f"{u} data was copied"
        _assert_same_bytes(data, want, f"to_te {u} data")
        assert getattr(t, f"_{u}_scale_inv").shape == getattr(theirs, f"_{u}_scale_inv").shape
        _assert_same_scales(_te_scales(t, u, m, k), _te_scales(theirs, u, m, k), f"to_te {u} scale_inv")
        _assert_same_scales(_te_scales(t, u, m, k), getattr(q, f"{u}_scale_inv"), f"to_te {u} scale_inv vs ours")

    # TE's own dequantize (its rowwise copy when held, else its columnwise one) reads our tensor as we do
    assert torch.equal(t.dequantize(dtype=torch.float32), q.dequantize(torch.float32, usage=usages[0]))

    for name, back in (("from_te(TE's)", from_te(theirs)), ("from_te(to_te(ours))", from_te(t))):
        assert isinstance(back, type(q)) and back.usages == q.usages and back.shape == q.shape
        assert back.dtype == q.dtype and back.fp8_dtype == fp8 and back.is_2D_scaled == q.is_2D_scaled
        assert back.force_pow_2_scales and back.columnwise_m_splits is None
        for u in usages:
            _assert_same_bytes(getattr(back, f"{u}_data"), getattr(q, f"{u}_data"), f"{name} {u} data")
            _assert_same_scales(getattr(back, f"{u}_scale_inv"), getattr(q, f"{u}_scale_inv"),
                                f"{name} {u} scale_inv")
            assert torch.equal(back.dequantize(usage=u), q.dequantize(usage=u))


def test_te_gemms_read_our_tensors_as_their_own(te):
    """TE's GEMM (``general_gemm``, as its ``Linear`` calls it) on ``to_te`` of our tensors gives bitwise what it
    gives on TE's own tensors of the same input, in its three layouts: fprop ``TN`` (128x128 weight rowwise x
    1x128 input rowwise), dgrad ``NN`` (weight columnwise x gradient rowwise), wgrad ``NT`` (128x1 input x 128x1
    gradient, both columnwise); and both are within the GEMM tolerance of float64 math on the operands."""
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    m, k, n = 272, 256, 384  # M ragged for 128 (a partial 128x1 block), a multiple of 16 as cuBLAS needs
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).bfloat16().cuda()
    dy = torch.randn(m, n, generator=g).bfloat16().cuda()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16().cuda()
    e4m3 = torch.float8_e4m3fn
    ours = {"x": quantize_blockwise(x, "1x128", rowwise=True, columnwise=True),
            "dy": quantize_blockwise(dy, "1x128", rowwise=True, columnwise=True),
            "w": quantize_blockwise(w, "128x128", rowwise=True, columnwise=True)}
    with torch.no_grad():
        theirs = {"x": _te_quantizer(te, e4m3, 1)(x), "dy": _te_quantizer(te, e4m3, 1)(dy),
                  "w": _te_quantizer(te, e4m3, 2)(w)}
    vals = {name: {u: t.dequantize(torch.float64, usage=u) for u in USAGES} for name, t in ours.items()}
    for name, a, b, layout, ref_a, ref_b in (
        ("fprop", "w", "x", "TN", vals["x"]["rowwise"], vals["w"]["rowwise"].t()),
        ("dgrad", "w", "dy", "NN", vals["dy"]["rowwise"], vals["w"]["columnwise"]),
        ("wgrad", "x", "dy", "NT", vals["dy"]["columnwise"].t(), vals["x"]["columnwise"]),
    ):
        kw = dict(out_dtype=torch.bfloat16, layout=layout, use_split_accumulator=True, grad=name != "fprop")
        out = general_gemm(to_te(ours[a]), to_te(ours[b]), **kw)[0]
        want = general_gemm(theirs[a], theirs[b], **kw)[0]
        assert out.dtype == torch.bfloat16 and out.shape == want.shape
        assert torch.equal(out, want), f"{name}: TE's GEMM on our tensors differs from it on its own " \
                                       f"(relerr {relerr(out, want):.3g})"
        _assert_gemm_close(out, ref_a, ref_b, f"{name} ({layout})")


# ------------------------------------------------------------------------------------------- 2. quantization

def test_quantizer_constructor_matches_te(te):
    """Our ``Float8BlockQuantizer`` takes TE's constructor arguments by the same names (keyword-only) and exposes
    the same attributes; the defaults that matter agree (power-of-two scales, epsilon 0). TE's
    ``block_scaling_dim`` defaults to 2 and its usages have no default: the tests pass all of them."""
    theirs = inspect.signature(te.Float8BlockQuantizer.__init__).parameters
    ours = inspect.signature(Float8BlockQuantizer.__init__).parameters
    assert list(theirs)[:2] == ["self", "fp8_dtype"] and list(ours)[:2] == ["self", "fp8_dtype"]
    keyword = [n for n, p in theirs.items() if p.kind is p.KEYWORD_ONLY]
    assert set(keyword) == {"rowwise", "columnwise", "amax_epsilon", "force_pow_2_scales", "block_scaling_dim"}
    for name in keyword:
        assert name in ours and ours[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    for name in ("amax_epsilon", "force_pow_2_scales"):
        assert ours[name].default == theirs[name].default, name
    kw = dict(rowwise=True, columnwise=False, amax_epsilon=0.5, force_pow_2_scales=False, block_scaling_dim=2)
    a, b = Float8BlockQuantizer(torch.float8_e5m2, **kw), te.Float8BlockQuantizer(te.DType.kFloat8E5M2, **kw)
    for attr in ("rowwise_usage", "columnwise_usage", "amax_epsilon", "force_pow_2_scales", "block_scaling_dim"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert a.dtype == torch.float8_e5m2 and b.dtype == te.DType.kFloat8E5M2


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(300, 512), (77, 256), (2, 75, 384), (256, 320)],
                         ids=["300x512", "77x256", "2x75x384", "256x320_ragged_k"])
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32_scales"])
def test_quantize_matches_te_quantizer(te, fp8, block, dtype, shape, pow2):
    """Bytes and scale_inv bitwise TE's, rowwise and columnwise, from ``quantize_blockwise`` and from our
    ``Float8BlockQuantizer`` with TE's constructor arguments, on each of our backends. Ragged rows (300, 77,
    150), K a multiple of 128 and one that is not (320: TE scales the last block over its valid columns too)."""
    x = _finite_input(shape, dtype, seed=3)
    m, k = math.prod(shape[:-1]), shape[-1]
    kw = dict(rowwise=True, columnwise=True, amax_epsilon=0.0, force_pow_2_scales=pow2,
              block_scaling_dim=BLOCKS[block])
    with torch.no_grad():
        theirs = te.Float8BlockQuantizer(_te_dtype(te, fp8), **kw)(x)
    for backend in OUR_BACKENDS:
        q = quantize_blockwise(x, block, fp8, force_pow_2_scales=pow2, amax_epsilon=0.0, rowwise=True,
                               columnwise=True, backend=backend)
        _assert_matches_te(q, theirs, USAGES, m, k, f"quantize_blockwise backend={backend}")
        q = Float8BlockQuantizer(fp8, **kw, backend=backend)(x)
        _assert_matches_te(q, theirs, USAGES, m, k, f"Float8BlockQuantizer backend={backend}")


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("usage", USAGES)
@pytest.mark.parametrize("amax_epsilon", [0.0, 0.5, 1e-37], ids=["eps0", "eps0.5", "eps1e-37"])
def test_one_usage_and_amax_epsilon_match_te(te, fp8, block, usage, amax_epsilon):
    """A quantizer asked for one usage only writes the same bytes and scales as one asked for both (TE's
    kernels skip the other copy); with an amax epsilon (0.5: small blocks scale as if their amax were 0.5;
    1e-37: the tiny blocks' scale no longer overflows), TE's and ours still agree bitwise."""
    x = _finite_input((300, 512), torch.bfloat16, seed=4)
    kw = dict(rowwise=usage == "rowwise", columnwise=usage == "columnwise", amax_epsilon=amax_epsilon,
              force_pow_2_scales=True, block_scaling_dim=BLOCKS[block])
    with torch.no_grad():
        theirs = te.Float8BlockQuantizer(_te_dtype(te, fp8), **kw)(x)
    assert getattr(theirs, f"_{'columnwise' if usage == 'rowwise' else 'rowwise'}_data") is None
    for backend in OUR_BACKENDS:
        q = Float8BlockQuantizer(fp8, **kw, backend=backend)(x)
        assert q.usages == (usage,)
        _assert_matches_te(q, theirs, (usage,), 300, 512, f"backend={backend}")


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("m_splits", [[272, 0, 48, 160], [0, 130, 1, 0, 99]], ids=str)
def test_grouped_columnwise_matches_te_per_expert(te, fp8, m_splits):
    """Our grouped 128x1 copy (``m_splits``: blocks restart at each expert; expert-major data) holds, expert by
    expert, the bytes and scales of TE quantizing that expert's rows alone (what TE's ``GroupedLinear`` does,
    splitting its input before quantizing it); empty experts hold nothing."""
    m, k = sum(m_splits), 256
    x = _finite_input((m, k), torch.bfloat16, seed=5)
    for backend in OUR_BACKENDS:
        q = quantize_blockwise(x, "1x128", fp8, rowwise=False, columnwise=True, m_splits=m_splits, backend=backend)
        data, scales = q.columnwise_data, q.columnwise_scale_inv
        assert data.shape == (m * k,) and scales.shape == (sum(-(-s // 128) for s in m_splits), k)
        row = blk = 0
        for g, s in enumerate(m_splits):
            nb = -(-s // 128)
            if s:
                with torch.no_grad():
                    theirs = _te_quantizer(te, fp8, 1, rowwise=False, columnwise=True)(x[row:row + s])
                what = f"backend={backend} expert {g}"
                _assert_same_bytes(data[k * row:k * (row + s)].view(k, s), _te_data(theirs, "columnwise", s, k),
                                   f"{what} data")
                _assert_same_scales(scales[blk:blk + nb], _te_scales(theirs, "columnwise", s, k), f"{what} scales")
            row, blk = row + s, blk + nb


# ------------------------------------------------------------------------------------------ 3. GroupedLinear

def _expert_rows(m_splits):
    starts = [sum(m_splits[:g]) for g in range(len(m_splits))]
    return [slice(a, a + s) for a, s in zip(starts, m_splits)]


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
@pytest.mark.parametrize("m_splits", [[272, 0, 48, 160], [0, 128, 16, 0, 96]], ids=str)
def test_grouped_linear_matches_te(te, fmt, m_splits):
    """Our GroupedLinear on an FP8 input against TE's GroupedLinear under ``Float8BlockScaling`` (same recipe:
    E4M3 or HYBRID, power-of-two scales), same BF16 weights, ragged ``m_splits`` with empty experts (multiples
    of 16: TE's ``Fp8Padding`` alignment for this recipe, and its FP8 GEMMs' reduction-dimension rule). TE takes
    the BF16 input and quantizes it itself; ours takes that input quantized by our input-role quantizer.
    Checked first: both quantize the input, the weights and the output gradient to the same bytes, so forward
    and dgrad multiply the same FP8 operands and may differ only in accumulation order: each within the GEMM
    tolerance of float64 math on those operands. wgrad's operands are not the same bytes: TE quantizes each
    expert's input and gradient 128x1 from BF16, we shift the exponents of the 1x128 copies (the scaling-aware
    transpose). With power-of-two scales both hold BF16 rounded to the FP8 significand, so the values agree
    except where one of them falls into FP8's subnormal range; each wgrad is checked against float64 math on
    its own operands, the two against each other (relerr < 2^-6: accumulation, BF16 rounding and those few
    values), and both against the BF16 math (relerr < 2^-4 for E4M3 operands, 2^-3 with E5M2 gradients:
    FP8's rounding error; 0.038 and 0.059 on these inputs in float64, CPU)."""
    g_count, k, n = len(m_splits), 256, 384
    m = sum(m_splits)
    rows = _expert_rows(m_splits)
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]).bfloat16()
    zero_row = next(r.start for r in rows if r.stop > r.start) + 3  # an all-zero input row: exact zeros out
    x[zero_row] = 0.0
    x, dy = x.cuda(), (torch.randn(m, n, generator=gen) * 0.1).bfloat16().cuda()
    weights = [(torch.randn(n, k, generator=gen) * 0.05).bfloat16().cuda() for _ in range(g_count)]

    recipe = FP8FlowRecipe(fp8_format=Format[fmt])
    ours = GroupedLinear(g_count, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda", recipe=recipe)
    te_kw = {"use_grouped_tensor": False} \
        if "use_grouped_tensor" in inspect.signature(te.GroupedLinear.__init__).parameters else {}
    theirs = te.GroupedLinear(g_count, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda", **te_kw)
    with torch.no_grad():
        for i, w in enumerate(weights):
            getattr(ours, f"weight{i}").copy_(w)
            getattr(theirs, f"weight{i}").copy_(w)

    # the premise: the same FP8 operands for forward and dgrad
    grad_fp8 = recipe.fp8_dtype("grad")
    assert grad_fp8 == (torch.float8_e5m2 if fmt == "HYBRID" else torch.float8_e4m3fn)
    x_ours = x.clone().requires_grad_()
    q = Float8BlockQuantizer.from_recipe(recipe, "input")(x_ours)  # straight-through: x_ours.grad is dgrad
    dy_q = Float8BlockQuantizer.from_recipe(recipe, "grad")(dy)
    w_fp8, w_t_fp8 = ours.fp8_weights()
    with torch.no_grad():
        _assert_matches_te(q, _te_quantizer(te, torch.float8_e4m3fn, 1, columnwise=False)(x), ("rowwise",), m, k,
                           "input")
        _assert_matches_te(dy_q, _te_quantizer(te, grad_fp8, 1, columnwise=False)(dy), ("rowwise",), m, n,
                           "output gradient")
        for i, w in enumerate(weights):
            tw = _te_quantizer(te, torch.float8_e4m3fn, 2)(w)
            _assert_same_bytes(w_fp8.rowwise_data[i * n:(i + 1) * n], _te_data(tw, "rowwise", n, k),
                               f"W[{i}]")
            _assert_same_scales(w_fp8.rowwise_scale_inv[i * n // 128:(i + 1) * n // 128],
                                _te_scales(tw, "rowwise", n, k), f"W[{i}] scales")
            _assert_same_bytes(w_t_fp8.rowwise_data[i * k:(i + 1) * k], _te_data(tw, "columnwise", n, k),
                               f"W^T[{i}] (TE's columnwise W)")
            _assert_same_scales(w_t_fp8.rowwise_scale_inv[i * k // 128:(i + 1) * k // 128],
                                _te_scales(tw, "columnwise", n, k), f"W^T[{i}] scales")
    del w_fp8, w_t_fp8

    y_ours = ours(q, m_splits)
    y_ours.backward(dy)
    x_te = x.clone().requires_grad_()
    with _te_autocast(te, _float8_block_scaling(fmt)):
        y_te = theirs(x_te, m_splits)
    y_te.backward(dy)

    # float64 math on the FP8 operands
    with torch.no_grad():
        xv, dyv = q.dequantize(torch.float64), dy_q.dequantize(torch.float64)
        wv = [quantize_blockwise(w, "128x128").dequantize(torch.float64) for w in weights]
        x_sat = scaling_aware_transpose(q.detach(), m_splits).dequantize(torch.float64, usage="columnwise")
        dy_sat = scaling_aware_transpose(dy_q, m_splits).dequantize(torch.float64, usage="columnwise")
    for name, got in (("ours", y_ours), ("TE", y_te)):
        assert got.dtype == torch.bfloat16 and got.shape == (m, n), (name, got.dtype, got.shape)
        assert torch.equal(got[zero_row], torch.zeros_like(got[zero_row])), f"{name}: a zero row's output"
        for g, r in enumerate(rows):
            if r.stop > r.start:
                _assert_gemm_close(got[r], xv[r], wv[g].t(), f"{name} forward, expert {g}")
    for name, got in (("ours", x_ours.grad), ("TE", x_te.grad)):
        assert got is not None and got.dtype == torch.bfloat16 and got.shape == (m, k), name
        for g, r in enumerate(rows):
            if r.stop > r.start:
                _assert_gemm_close(got[r], dyv[r], wv[g], f"{name} dgrad, expert {g}")

    # wgrad: each against its own operands; both against the BF16 math, within the operands' FP8 error
    fp8_err = 2.0 ** -4 if fmt == "E4M3" else 2.0 ** -3  # E4M3 / E5M2 rounding: at most half an ulp, relative
    for g, r in enumerate(rows):
        dw_ours, dw_te = getattr(ours, f"weight{g}").grad, getattr(theirs, f"weight{g}").grad
        for name, got in (("ours", dw_ours), ("TE", dw_te)):
            assert got is not None and got.dtype == torch.bfloat16 and got.shape == (n, k), name
        if r.stop == r.start:
            assert torch.equal(dw_ours, torch.zeros_like(dw_ours)), f"ours: wgrad of empty expert {g}"
            assert torch.equal(dw_te, torch.zeros_like(dw_te)), f"TE: wgrad of empty expert {g}"
            continue
        _assert_gemm_close(dw_ours, dy_sat[r].t(), x_sat[r], f"ours wgrad, expert {g}")
        with torch.no_grad():
            tx = _te_quantizer(te, torch.float8_e4m3fn, 1, rowwise=False)(x[r])
            tdy = _te_quantizer(te, grad_fp8, 1, rowwise=False)(dy[r])
        _assert_gemm_close(dw_te, tdy.dequantize(dtype=torch.float32).double().t(),
                           tx.dequantize(dtype=torch.float32).double(), f"TE wgrad, expert {g}")
        truth = dy[r].double().t() @ x[r].double()
        e_ours, e_te, e_cross = relerr(dw_ours, truth), relerr(dw_te, truth), relerr(dw_ours, dw_te)
        assert e_ours < fp8_err and e_te < fp8_err and e_cross < 2.0 ** -6, \
            f"expert {g}: wgrad relerr vs BF16 math: ours {e_ours:.3g}, TE {e_te:.3g}; ours vs TE {e_cross:.3g}"
