"""quantize_blockwise: Triton kernel vs reference (bitwise), round trip, autograd, bad input.

The kernel runs compiled on a GPU, else in Triton's interpreter on CPU (where
it rounds to FP8 in software; both paths are compared on the GPU).
"""

import re

import pytest
import torch

from conftest import KERNEL_DEVICE, assert_no_host_sync, requires_cuda, same_bits
from transformer_engine_moe import (
    BlockShape,
    Float8BlockQuantizer,
    Float8BlockwiseQTensor,
    FP8FlowRecipe,
    Format,
    Role,
    quantize_blockwise,
    quantize_grouped_weight,
)
from transformer_engine_moe.ops.quantize import QuantizeArgs
from transformer_engine_moe.kernels import quantize as kq
from transformer_engine_moe.reference import dequantize as ref_dequantize
from transformer_engine_moe.reference import quantize as ref

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 448.0, -448.0, 500.0,
           1e-40, -3e-39, 2.0**-9, 2.0**-10, 57344.0, 1e5, -1e38]


def _input(m, k, dtype, device=KERNEL_DEVICE):
    """Random rows spanning 12 decades, with special values, a zero row and a NaN."""
    x = torch.randn(m, k) * torch.logspace(-6, 6, max(m, 1))[:m, None]
    x = x.to(dtype)
    if m > 2 and k > 20:
        x[0, : len(SPECIAL)] = torch.tensor(SPECIAL).to(dtype)
        x[1] = 0.0
        x[2, 5] = float("nan")
    return x.to(device)


def assert_same_fp8(a, b):
    """Bitwise equality of two Float8BlockwiseQTensors (data codes and scales, every usage)."""
    assert a.usages == b.usages and a.shape == b.shape and a.fp8_dtype == b.fp8_dtype
    for u in a.usages:
        da, sa = getattr(a, f"{u}_data"), getattr(a, f"{u}_scale_inv")
        db, sb = getattr(b, f"{u}_data"), getattr(b, f"{u}_scale_inv")
        assert same_bits(sa, sb), f"{u} scales differ"
        assert torch.equal(da.view(torch.uint8), db.view(torch.uint8)), f"{u} data differs"


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(0, 128), (1, 128), (37, 300), (130, 256)], ids=str)
@pytest.mark.parametrize("usage", ["rowwise", "columnwise", "both"])
def test_1x128_kernel_matches_reference(fp8, dtype, shape, usage):
    x = _input(*shape, dtype)
    kw = dict(rowwise=usage != "columnwise", columnwise=usage != "rowwise")
    assert_same_fp8(
        quantize_blockwise(x, "1x128", fp8, backend="triton", **kw),
        quantize_blockwise(x, "1x128", fp8, backend="reference", **kw),
    )


@pytest.mark.parametrize(
    "groups", [[0, 16, 128, 160, 32], [0, 1, 127, 128, 80]], ids=["16-aligned", "ragged"]
)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_grouped_128x1_kernel_matches_reference(groups, as_tensor):
    x = _input(sum(groups), 300, torch.bfloat16)
    m_splits = torch.tensor(groups, device=x.device) if as_tensor else groups
    kw = dict(rowwise=False, columnwise=True, m_splits=m_splits)
    a = quantize_blockwise(x, backend="triton", **kw)
    assert_same_fp8(a, quantize_blockwise(x, backend="reference", **kw))
    assert (a.columnwise_m_splits is m_splits) if as_tensor else (a.columnwise_m_splits == groups)
    # expert-major: each group's slice of the flat data is that group's own (ungrouped) columnwise quantization
    assert a.columnwise_data.shape == (sum(groups) * 300,)
    first = 0
    for size in groups:
        if size:
            own = quantize_blockwise(x[first:first + size], backend="triton", rowwise=False, columnwise=True)
            got = a.columnwise_data[300 * first:300 * (first + size)].view(torch.uint8)
            assert torch.equal(got, own.columnwise_data.view(torch.uint8).reshape(-1))
        first += size


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("shape", [(1, 1), (200, 333), (256, 128)], ids=str)
def test_128x128_kernel_matches_reference(fp8, shape):
    x = _input(*shape, torch.bfloat16)
    kw = dict(rowwise=True, columnwise=True)
    assert_same_fp8(
        quantize_blockwise(x, "128x128", fp8, backend="triton", **kw),
        quantize_blockwise(x, "128x128", fp8, backend="reference", **kw),
    )


@pytest.mark.parametrize("pow2,eps", [(False, 0.0), (True, 1e-2), (False, 3.0)])
def test_scale_options_kernel_matches_reference(pow2, eps):
    x = _input(64, 384, torch.float16)
    for block in ("1x128", "128x128"):
        assert_same_fp8(
            quantize_blockwise(x, block, force_pow_2_scales=pow2, amax_epsilon=eps, backend="triton"),
            quantize_blockwise(x, block, force_pow_2_scales=pow2, amax_epsilon=eps, backend="reference"),
        )


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_fp8_rounding_is_exact_on_every_bf16_value(fp8):
    """Blocks whose amax fixes scale = 1 make quantization a plain cast: check it over all
    bf16 bit patterns below the block max (normals, subnormals, ties, signed zeros, NaNs)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    v = bits.view(torch.bfloat16).float()
    limit = 300.0 if fp8 == torch.float8_e4m3fn else 40000.0  # pow2 scale of the block: exactly 1
    v = v[~(v.abs() > limit)]
    v = torch.nn.functional.pad(v, (0, (-v.numel()) % 127))
    x = torch.cat([torch.full((v.numel() // 127, 1), limit), v.view(-1, 127)], dim=1)
    q = quantize_blockwise(x.to(KERNEL_DEVICE), fp8_dtype=fp8, backend="triton")
    assert (q.rowwise_scale_inv == 1.0).all()
    expected = ref.cast_to_fp8(x, fp8).view(torch.uint8)
    assert torch.equal(q.rowwise_data.view(torch.uint8).cpu(), expected)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("block", ["1x128", "128x128"])
def test_dequantize_round_trip_within_half_an_fp8_step(fp8, block):
    x = torch.randn(300, 640) * torch.logspace(-4, 4, 300)[:, None]
    q = quantize_blockwise(x, block, fp8, columnwise=True)
    mbits = 3 if fp8 == torch.float8_e4m3fn else 2
    bias = 7 if fp8 == torch.float8_e4m3fn else 15
    for usage in ("rowwise", "columnwise"):
        y = q.dequantize(usage=usage)
        assert y.shape == x.shape and y.dtype == torch.float32
        data, sinv = getattr(q, f"{usage}_data"), getattr(q, f"{usage}_scale_inv")
        ones = torch.ones(data.shape)
        if block == "128x128":  # per-element scale_inv
            scale_inv = ref_dequantize.dequantize_128x128(ones, sinv, torch.float32)
            scale_inv = scale_inv if usage == "rowwise" else scale_inv.t()
        elif usage == "rowwise":
            scale_inv = ref_dequantize.dequantize_1x128(ones, sinv, torch.float32)
        else:
            scale_inv = ref_dequantize.dequantize_128x1(ones, sinv, torch.float32)
        # half an ulp for normals, half the subnormal step (times scale_inv) below them
        bound = torch.maximum(x.abs() * 2.0 ** -(mbits + 1), scale_inv * 2.0 ** (-bias - mbits))
        assert ((y - x).abs() <= bound).all()


def test_gradient_is_straight_through_and_reaches_input():
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16, requires_grad=True)
    q = quantize_blockwise(x)
    assert q.requires_grad and q.grad_fn is not None
    w = torch.randn(2, 3, 256)
    (q.dequantize() * w).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, w.to(torch.bfloat16))


def test_quantize_in_function_is_quantize_without_autograd():
    """What GroupedLinear's autograd Function quantizes with: the same bits as the quantizer, no graph node."""
    from transformer_engine_moe.ops.quantize import quantize_in_function

    x = torch.randn(3, 40, 256, device=KERNEL_DEVICE, requires_grad=True)
    quantizer = Float8BlockQuantizer(torch.float8_e5m2, backend="triton")
    a, b = quantize_in_function(x, quantizer.args), quantizer(x)
    assert a.grad_fn is None and not a.requires_grad and b.grad_fn is not None
    meta = lambda t: (t.shape, t.dtype, t.fp8_dtype, t.force_pow_2_scales)  # noqa: E731
    assert meta(a) == meta(b)
    assert torch.equal(a.rowwise_data.view(torch.uint8), b.rowwise_data.view(torch.uint8))
    assert same_bits(a.rowwise_scale_inv, b.rowwise_scale_inv)


def test_strided_rows_and_leading_dims():
    base = torch.randn(64, 512, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    x = base[:, 64:320]  # row stride 512, unit stride along K
    assert_same_fp8(quantize_blockwise(x, backend="triton"), quantize_blockwise(x.contiguous(), backend="reference"))
    x3 = torch.randn(4, 5, 256, device=KERNEL_DEVICE)
    q3 = quantize_blockwise(x3, backend="triton")
    assert q3.shape == (4, 5, 256) and q3.rowwise_data.shape == (20, 256)
    assert q3.rowwise_scale_inv.shape == (20, 2)


@pytest.mark.parametrize("layout", ["sliced", "expanded", "transposed", "expanded-along-k"])
def test_transposed_sliced_and_expanded_inputs(layout):
    """Sliced rows and columns, and rows expanded from one (stride 0), quantize in place to the bits of their
    contiguous copy on every layout (rowwise with grouped 128x1 columnwise, 128x128): the kernels take any row
    stride. A transposed input, or one expanded along K, has no unit stride along K, the documented requirement:
    refused by name."""
    base = torch.randn(256, 512, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    x = {"sliced": base[::2, 128:384], "expanded": base[:1, :256].expand(128, 256),
         "transposed": base[:256, :128].t(), "expanded-along-k": base[:128, :1].expand(128, 256)}[layout]
    if layout in ("transposed", "expanded-along-k"):
        with pytest.raises(ValueError, match=re.escape(f"x must have unit stride in its last dimension, got strides "
                                                       f"{x.stride()} for shape [128, 256]")):
            quantize_blockwise(x, backend="triton")
        return
    for kw in (dict(columnwise=True, m_splits=[100, 28]), dict(block="128x128", columnwise=True)):
        assert_same_fp8(quantize_blockwise(x, backend="triton", **kw),
                        quantize_blockwise(x.contiguous(), backend="reference", **kw))


def test_quantizer_and_recipe():
    recipe = FP8FlowRecipe(fp8_format=Format.HYBRID)
    x = torch.randn(300, 256)
    g = Float8BlockQuantizer.from_recipe(recipe, Role.GRAD, columnwise=True)(x)
    assert g.fp8_dtype == torch.float8_e5m2 and g.usages == ("rowwise", "columnwise")
    w = Float8BlockQuantizer.from_recipe(recipe, Role.WEIGHT)(x)
    assert w.fp8_dtype == torch.float8_e4m3fn and w.block == "128x128"
    assert_same_fp8(w, quantize_blockwise(x, "128x128"))
    quantizer = Float8BlockQuantizer(torch.float8_e4m3fn)
    quantizer.set_usage(rowwise=False, columnwise=True)
    assert quantizer(x).usages == ("columnwise",)
    assert FP8FlowRecipe().fp8_dtype(Role.GRAD) == torch.float8_e4m3fn


def test_block_shapes_are_an_enum_that_still_takes_the_strings():
    x = torch.randn(256, 256)
    w = quantize_blockwise(x, BlockShape.TILE_128x128)
    assert w.block is BlockShape.TILE_128x128 and w.block == "128x128" and f"{w.block}" == "128x128"
    assert_same_fp8(w, quantize_blockwise(x, "128x128"))
    assert quantize_blockwise(x).block is BlockShape.ROW_1x128 and QuantizeArgs("1x128").block is BlockShape.ROW_1x128
    assert (BlockShape.ROW_1x128.dim, BlockShape.TILE_128x128.dim) == (1, 2) and BlockShape.TILE_128x128.is_2D
    assert FP8FlowRecipe.block(Role.WEIGHT) is BlockShape.TILE_128x128
    assert Float8BlockQuantizer.from_recipe(FP8FlowRecipe(), Role.WEIGHT).block_scaling_dim == 2


def test_one_spelling_for_power_of_two_scales_with_the_old_names_as_aliases():
    """TE's quantizer's ``force_pow_2_scales`` everywhere; ``pow2_scales`` (functions, tensor, args) and the
    recipe's ``power_2_scales`` still read, the keywords taking precedence."""
    x = torch.randn(4, 256)
    q = quantize_blockwise(x, force_pow_2_scales=False)
    assert not q.force_pow_2_scales and not q.pow2_scales
    alias = quantize_blockwise(x, pow2_scales=False)
    assert not alias.force_pow_2_scales and same_bits(alias.rowwise_scale_inv, q.rowwise_scale_inv)
    assert quantize_blockwise(x, force_pow_2_scales=True, pow2_scales=False).force_pow_2_scales is False
    w, _ = quantize_grouped_weight([torch.randn(128, 128)], pow2_scales=False, transpose=False)
    assert not w.force_pow_2_scales
    t = Float8BlockwiseQTensor(shape=q.shape, dtype=q.dtype, fp8_dtype=q.fp8_dtype, rowwise_data=q.rowwise_data,
                               rowwise_scale_inv=q.rowwise_scale_inv, pow2_scales=True)
    assert t.force_pow_2_scales and QuantizeArgs(force_pow_2_scales=False).pow2_scales is False
    assert FP8FlowRecipe(force_pow_2_scales=False).power_2_scales is False


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "make_x,kwargs,exc,match",
    [
        (lambda: torch.randn(256), {}, ValueError, r"at least 2-D .* shape \[256\]"),
        (lambda: torch.randint(0, 5, (4, 128)), {}, TypeError, "must have dtype in"),
        (lambda: torch.randn(4, 128).to(torch.float8_e4m3fn), {}, TypeError, "must have dtype in"),
        (lambda: torch.randn(128, 4).t(), {}, ValueError, "unit stride in its last dimension"),
        (lambda: torch.randn(4, 8, 256)[:, :3], {}, ValueError, "cannot be viewed as"),
        (lambda: torch.randn(4, 0), {}, ValueError, "empty last dimension"),
        (lambda: [[1.0] * 128], {}, TypeError, "must be a torch.Tensor"),
        (lambda: quantize_blockwise(torch.randn(2, 128)), {}, TypeError, "already a Float8BlockwiseQTensor"),
        (lambda: torch.randn(4, 128), {"block": "1x64"}, ValueError,
         r"block must be a BlockShape or one of \[.1x128., .128x128.\], got .1x64."),
        (lambda: torch.randn(4, 128), {"fp8_dtype": torch.int8}, TypeError, "fp8_dtype must be one of"),
        (lambda: torch.randn(4, 128), {"amax_epsilon": -1.0}, ValueError, "amax_epsilon must be finite"),
        (lambda: torch.randn(4, 128), {"amax_epsilon": float("nan")}, ValueError, "amax_epsilon"),
        (lambda: torch.randn(4, 128), {"rowwise": False}, ValueError, "at least one of rowwise"),
        (lambda: torch.randn(4, 128), {"force_pow_2_scales": 1}, TypeError, "force_pow_2_scales must be a bool"),
        (lambda: torch.randn(4, 128), {"backend": "cuda"}, ValueError, "backend must be one of"),
        (lambda: torch.randn(4, 128), {"m_splits": [4]}, ValueError, "needs block='1x128', columnwise=True"),
        (lambda: torch.randn(4, 128), {"m_splits": [1, 2], "columnwise": True}, ValueError, "sum to M=4"),
        # the hostile-input probe: sizes whose int64 sum wraps around to M (once a segfault), a meta tensor (once
        # NotImplementedError from Triton's interpreter, a meta result from the reference)
        (lambda: torch.randn(4, 128), {"m_splits": torch.tensor([2**63 - 1, 2**63 - 1, 6]), "columnwise": True},
         ValueError, r"sum to M=4 \(each size at most M\)"),
        (lambda: torch.randn(4, 128, device="meta"), {}, ValueError, "quantize_blockwise: got a tensor on the meta"),
        (lambda: torch.randn(4, 128, device="meta"), {"backend": "triton"}, ValueError, "on the meta device"),
    ],
    ids=["1d", "int", "fp8-in", "transposed", "non-viewable", "k0", "list", "quantized", "block",
         "fp8-dtype", "neg-eps", "nan-eps", "no-usage", "pow2-int", "backend", "splits-rowwise",
         "splits-sum", "splits-int64-wrap", "meta", "meta-triton"],
)
def test_bad_input_is_rejected_clearly(make_x, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        quantize_blockwise(make_x(), **kwargs)


def test_triton_backend_on_cpu_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        quantize_blockwise(torch.randn(4, 128), backend="triton")


# ---------------------------------------------------------------------------- GPU only
@requires_cuda
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_gpu_kernel_bitwise_at_full_size(fp8):
    """65536 x 7168 bf16 (DeepSeek-V3 hidden size), rowwise + columnwise, and 128x128."""
    x = torch.randn(65536, 7168, device="cuda", dtype=torch.bfloat16) * 3
    x[::97] *= 1e-3
    for block in ("1x128", "128x128"):
        cols = block == "1x128"
        assert_same_fp8(
            quantize_blockwise(x, block, fp8, columnwise=cols, backend="triton"),
            quantize_blockwise(x, block, fp8, columnwise=cols, backend="reference"),
        )


@requires_cuda
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_gpu_software_cast_equals_hardware_cast(fp8):
    """The interpreter's integer rounding path gives the GPU's hardware-cast bits."""
    x = _input(4096, 1024, torch.float32, "cuda") * torch.rand(4096, 1024, device="cuda")
    for launch in (kq.quantize_1x128, kq.quantize_128x1, kq.quantize_128x128):
        a, sa = launch(x, fp8, True, 0.0, software_cast=False)
        b, sb = launch(x, fp8, True, 0.0, software_cast=True)
        assert same_bits(sa, sb) and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@requires_cuda
def test_gpu_hot_path_has_no_host_sync():
    x = torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor([1024, 3072], device="cuda")  # made outside: a pageable host copy syncs

    def step():
        q = quantize_blockwise(x, columnwise=True, m_splits=splits)
        quantize_blockwise(x, "128x128")
        quantize_blockwise(x).split([1024, 3072])
        q.dequantize(torch.bfloat16)

    assert_no_host_sync(step)


@pytest.mark.parametrize("config", [(16, 2, 4), (8, 4, 2), (64, 1, 8)], ids=str)
def test_rowwise_launch_shapes_agree(config):
    """Every launch shape the benchmark sweeps computes the same bits (ragged last K tile)."""
    x = _input(70, 1000, torch.bfloat16)
    q, s = kq.quantize_1x128(x, torch.float8_e4m3fn, True, 0.0, config=config)
    rq, rs = ref.quantize_1x128(x, torch.float8_e4m3fn)
    assert same_bits(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
