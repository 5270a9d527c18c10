"""scaling_aware_transpose: the rule (against a float formula using torch's cast), Triton kernel vs
reference (bitwise), groups, special values, accuracy against double quantization, bad input;
transpose_grouped_weight: the byte transpose of stacked 128x128 weights."""

import pytest
import torch
import triton
import triton.language as tl

from conftest import KERNEL_DEVICE, assert_no_host_sync, requires_cuda, same_bits
from transformer_engine_moe import (
    Float8BlockwiseQTensor,
    quantize_blockwise,
    scaling_aware_transpose,
    transpose_grouped_weight,
)
from transformer_engine_moe.kernels import transpose as kt
from transformer_engine_moe.layout import column_block_of_row
from transformer_engine_moe.reference import transpose as ref
from transformer_engine_moe.reference.dequantize import dequantize_128x1, dequantize_1x128
from transformer_engine_moe.reference.quantize import cast_to_fp8

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
GROUPS = [0, 1, 127, 128, 129, 1000]


def activations(m, k, device=KERNEL_DEVICE, dtype=torch.bfloat16):
    """Realistic dynamic range: per-token magnitudes over 8 decades, log-normal channels,
    plus exact zeros, a NaN and values that quantize to +-448 and to FP8 subnormals."""
    x = torch.randn(m, k) * torch.exp(torch.randn(k)) * 10 ** (8 * torch.rand(m, 1) - 4)
    if m > 8:
        x[3] = 0.0
        x[4, :4] = torch.tensor([448.0, -448.0, 1e-3, -1e-30])
        x[5, 7] = float("nan")
    return x.to(dtype).to(device)


def expected_columnwise(t: Float8BlockwiseQTensor, m_splits):
    """The rule as a float formula: fp8_rne(dequantize(rowwise) / s_col) * s_col, where s_col is the
    largest row scale_inv in each (column block, 128-column block) among the rows not all zero there (1 if
    none), and fp8() the quantizer's cast (round-to-nearest-even; NaN -> 0x7F, E5M2 inf -> max; nothing
    finite overflows: s_col >= s_row)."""
    m, k = t.rowwise_data.shape
    rows = dequantize_1x128(t.rowwise_data, t.rowwise_scale_inv, torch.float32).cpu()
    kb = t.rowwise_scale_inv.shape[1]
    live = torch.nn.functional.pad(rows != 0, (0, kb * 128 - k)).view(m, kb, 128).any(-1)  # NaN counts
    s_row = torch.where(live, t.rowwise_scale_inv.cpu(), 0.0).repeat_interleave(128, dim=1)[:, :k]
    block = column_block_of_row(m, m_splits, "cpu")
    s_col = torch.empty_like(s_row)
    for b in block.unique():
        sel = block == b
        s_col[sel] = s_row[sel].amax(dim=0)
    s_col = torch.where(s_col > 0, s_col, 1.0)
    return torch.where(rows == 0, rows, cast_to_fp8(rows / s_col, t.fp8_dtype).float() * s_col), s_col


def _same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("splits", ["none", "list", "tensor"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_rule_holds_for_every_element(fp8, splits, backend):
    x = activations(sum(GROUPS), 384)
    m_splits = {"none": None, "list": GROUPS, "tensor": torch.tensor(GROUPS, device=x.device)}[splits]
    t = scaling_aware_transpose(quantize_blockwise(x, fp8_dtype=fp8), m_splits, backend=backend)
    want, s_col = expected_columnwise(t, m_splits)
    got = t.dequantize(usage="columnwise")
    data_shape = (384, x.shape[0]) if m_splits is None else (384 * x.shape[0],)  # grouped: expert-major
    assert got.shape == x.shape and t.columnwise_data.shape == data_shape
    assert _same(got.cpu(), want)
    # exactly the rowwise value wherever nothing underflows
    rows = t.dequantize().cpu()
    min_normal = 2.0**-6 if fp8 == torch.float8_e4m3fn else 2.0**-14
    safe = (rows.abs() / s_col >= min_normal) | (rows == 0)
    assert _same(got.cpu()[safe], rows[safe])
    assert (~safe).any()  # the data does exercise underflow


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_zero_rows_do_not_set_the_column_scale(fp8, backend):
    """Padding rows (zero, scale 1 as TE quantizes an all-zero block) next to small gradients: the column
    scale is the largest scale of the nonzero rows, so those rows survive the transpose (with the zero rows'
    1 counted they were flushed to zero, and the wgrad of every expert's last, padded block with them)."""
    g = torch.zeros(128, 256)
    g[:40] = torch.randn(40, 256) * 1e-5
    g[40:48, :128] = torch.randn(8, 128) * 3e-6  # rows zero in one column block only
    t = scaling_aware_transpose(quantize_blockwise(g.to(KERNEL_DEVICE), fp8_dtype=fp8), [96, 32], backend=backend)
    assert (t.rowwise_scale_inv[48:] == 1).all()
    assert (t.columnwise_scale_inv[0] < 2.0**-10).all() and (t.columnwise_scale_inv[1] == 1).all()  # all zero
    want, _ = expected_columnwise(t, [96, 32])
    assert _same(t.dequantize(usage="columnwise").cpu(), want)
    rows, cols = t.dequantize().cpu(), t.dequantize(usage="columnwise").cpu()
    assert ((cols - rows).norm() / rows.norm()).item() < 0.05  # only the shifts of smaller rows lose bits


@pytest.mark.parametrize("k", [300, 384], ids=["bytes", "words"])
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("splits", ["none", "list", "tensor"])
def test_kernel_matches_reference_bitwise(fp8, splits, k):
    """Zero rows, empty groups, NaN codes and row blocks holding +-inf (scale_inv NaN: NaN column scales); the
    zero-row test on bytes (K = 300, ragged) and on 32-bit words (K % 16 == 0)."""
    x = activations(sum(GROUPS), k)
    x[6, 200], x[700, 5] = float("inf"), -float("inf")
    m_splits = {"none": None, "list": GROUPS, "tensor": torch.tensor(GROUPS, device=x.device)}[splits]
    q = quantize_blockwise(x, fp8_dtype=fp8)
    a = scaling_aware_transpose(q, m_splits, backend="triton")
    b = scaling_aware_transpose(q, m_splits, backend="reference")
    assert b.columnwise_scale_inv.isnan().any()
    assert same_bits(a.columnwise_scale_inv, b.columnwise_scale_inv)
    assert torch.equal(a.columnwise_data.view(torch.uint8), b.columnwise_data.view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("layout", ["words", "bytes_k", "bytes_offset"])
def test_zero_row_test_sees_every_byte(layout, fp8):
    """Rows whose one nonzero code sits at each column in turn (every byte of every 32-bit word, the partial last
    128-column block too) beside rows of -0 codes (0x80: zero rows) with a larger scale, in which a missed live row
    or a counted zero row changes the column scales: kernel and reference bit for bit. The zero-row test runs on
    words for K % 16 == 0 and 16-byte aligned data, on bytes for K = 140 or data one byte off alignment."""
    k = 140 if layout == "bytes_k" else 144
    rows = []
    for c in range(k):
        rows.append(torch.zeros(k, dtype=torch.uint8))
        rows[-1][c] = 0x38 + c % 7
        if c % 2:
            rows.append(torch.full((k,), 0x80, dtype=torch.uint8))
    data = torch.stack(rows)
    m = data.shape[0]
    zero = (data == 0x80).all(1)
    scale = torch.where(zero, 2.0**10, 2.0 ** -(torch.arange(m) % 5.0))[:, None].repeat(1, 2)
    data, scale = data.to(KERNEL_DEVICE), scale.to(KERNEL_DEVICE)
    if layout == "bytes_offset":  # the same bytes one past a 16-byte boundary (made there: .to() would realign)
        data = torch.empty(m * k + 1, dtype=torch.uint8, device=KERNEL_DEVICE)[1:].view(m, k).copy_(data)
    data = data.view(fp8)
    assert (data.data_ptr() % 16 == 0) == (layout != "bytes_offset")
    for m_splits in (None, [100, m - 100]):
        want = ref.scaling_aware_transpose(data, scale, m_splits)
        got = kt.scaling_aware_transpose(data, scale, m_splits)
        assert torch.equal(got[1], want[1]) and (want[1] < 2.0**10).all()
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


@triton.jit
def _f16_factor_bits(d_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, kt.f16_pow2_neg_bits(tl.load(d_ptr + i)))


def test_e4m3_half_precision_shift_is_exact():
    """``shift_e4m3_f16`` (the GPU's E4M3 re-encoding) is the exact shift for every E4M3 code (NaN, both zeros)
    and every d in 0..80 (and 254 / 255: shifts under a 2**-127 or NaN scale). Its factor is the Triton helper's
    (run here), and must be 2**-d exactly in f16 (0 past 2**-24); its three hardware conversions are done by torch,
    as the GPU does them (FP8 -> f16 exact, f16 multiply RNE, f16 -> FP8 RNE with NaN -> 0x7F), since the
    interpreter's FP8 casts are not IEEE (``kernels/casts.py``). The GPU runs the helper itself in
    ``test_gpu_software_reencoding_equals_hardware``."""
    d = torch.tensor(list(range(81)) + [254, 255], dtype=torch.int32)
    n = d.numel()
    bits = torch.zeros(128, dtype=torch.int32, device=KERNEL_DEVICE)
    _f16_factor_bits[(1,)](torch.nn.functional.pad(d, (0, 128 - n)).to(KERNEL_DEVICE), bits, N=128)
    factor = bits[:n].cpu().to(torch.int16).view(torch.float16)  # the kernel's int32 -> int16 -> f16 bitcast
    assert torch.equal(factor, (2.0 ** -d.double()).to(torch.float16))
    codes = torch.arange(256, dtype=torch.int32)
    product = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)[None, :] * factor[:, None]
    got = torch.where(product.isnan(), 0x7F, product.to(torch.float8_e4m3fn).view(torch.uint8).int())
    want = ref.shift_fp8_down(codes.expand(n, 256), d[:, None].expand(n, 256), torch.float8_e4m3fn)
    assert torch.equal(got, want)


@pytest.mark.parametrize("k", [300, 384], ids=["bytes", "words"])
@pytest.mark.parametrize("splits", [GROUPS, [0, 256, 112, 1008]], ids=["ragged", "multiples_of_16"])
@pytest.mark.parametrize("config", [(1, 1, 2), (2, 2, 4), (1, 4, 4), (2, 4, 8)], ids=str)
def test_every_launch_shape_gives_the_reference_bits(config, splits, k):
    """(KB_TILE, CHUNKS, num_warps): column slices of a ragged last 128-column block (K = 300) and a program's
    second block past K (K = 384, KB_TILE 2); groups that take the kernel's general path and groups that take its
    16-byte-store path; the zero-row test on bytes and on words."""
    q = quantize_blockwise(activations(sum(splits), k), fp8_dtype=torch.float8_e5m2)
    want = scaling_aware_transpose(q, splits, backend="reference")
    qt, st = kt.scaling_aware_transpose(q.rowwise_data, q.rowwise_scale_inv, splits, config=config)
    assert torch.equal(st, want.columnwise_scale_inv)
    assert torch.equal(qt.view(torch.uint8), want.columnwise_data.view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_every_code_at_every_shift(fp8):
    """All 256 codes in rows whose scales sit 0..11 binades below the block's largest: normals
    that stay normal, normals and subnormals that round to subnormals (ties to even), zeros."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(12, 1)  # [12, 256]
    data = torch.cat([codes, torch.zeros(1, 256, dtype=torch.uint8)]).view(fp8)
    scale = 2.0 ** -torch.arange(13.0)[:, None].repeat(1, 2)  # row r: 2**-r, last row largest shift
    t = Float8BlockwiseQTensor(shape=(13, 256), dtype=torch.bfloat16, fp8_dtype=fp8, force_pow_2_scales=True,
                               rowwise_data=data.to(KERNEL_DEVICE), rowwise_scale_inv=scale.to(KERNEL_DEVICE))
    for backend in ("triton", "reference"):
        got = scaling_aware_transpose(t, backend=backend)
        want, _ = expected_columnwise(got, None)
        assert _same(got.dequantize(usage="columnwise").cpu(), want), backend


def test_unused_blocks_of_device_groups_hold_scale_one():
    x = activations(300, 256)
    splits = torch.tensor([100, 200], device=x.device)
    t = scaling_aware_transpose(quantize_blockwise(x), splits)
    assert t.columnwise_scale_inv.shape == (300 // 128 + 2, 256)
    assert (t.columnwise_scale_inv[3:] == 1.0).all()  # 1 + 2 blocks used of 4


def test_split_by_groups_matches_per_group_transpose():
    """Expert-major: each group's slice of the flat columnwise data is that group's own transpose."""
    x = activations(sum(GROUPS), 256)
    q = quantize_blockwise(x)
    t = scaling_aware_transpose(q, GROUPS)
    first = 0
    for size, piece, part in zip(GROUPS, t.split(GROUPS), q.split(GROUPS)):
        assert piece.shape == (size, 256)
        if size:
            alone = scaling_aware_transpose(part)
            assert sum(piece.columnwise_m_splits) == size
            assert torch.equal(piece.columnwise_scale_inv, alone.columnwise_scale_inv)
            own = alone.columnwise_data.view(torch.uint8).reshape(-1)
            assert torch.equal(piece.columnwise_data.view(torch.uint8), own)
            assert torch.equal(t.columnwise_data.view(torch.uint8)[256 * first:256 * (first + size)], own)
        first += size
    with pytest.raises(ValueError, match="cut through 128-row blocks"):
        t.split([2, sum(GROUPS) - 2])  # row 2 is 1 row into the 127-row group


@pytest.mark.parametrize("groups", [[300], [0, 300, 0], [128, 0, 172]], ids=str)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_one_group_is_the_ungrouped_transpose_flattened(groups, as_tensor):
    """All rows in one group (empty groups around it): the expert-major data is the ungrouped [K, M]
    flattened; with two groups, each group's slice is its own [K, m_g]. Kernel and reference bitwise."""
    q = quantize_blockwise(activations(300, 256))
    splits = torch.tensor(groups, device=q.device) if as_tensor else groups
    alone = [scaling_aware_transpose(part) for part, s in zip(q.split(groups), groups) if s]
    want = torch.cat([a.columnwise_data.view(torch.uint8).reshape(-1) for a in alone])
    for backend in ("triton", "reference"):
        t = scaling_aware_transpose(q, splits, backend=backend)
        assert torch.equal(t.columnwise_data.view(torch.uint8), want), backend
        used = torch.cat([a.columnwise_scale_inv for a in alone])
        assert torch.equal(t.columnwise_scale_inv[:used.shape[0]], used), backend


def test_split_inside_one_group_and_across_groups():
    """A block-aligned part of one group is a strided [K, m] view of that group's block (ungrouped); a
    piece from inside one group into the next has no expert-major form and is refused."""
    q = quantize_blockwise(activations(640, 256))
    t = scaling_aware_transpose(q, [384, 256])
    a, b, c = t.split([128, 256, 256])
    for piece, lo, hi in ((a, 0, 128), (b, 128, 384)):
        assert piece.columnwise_m_splits is None and piece.columnwise_data.shape == (256, hi - lo)
        assert _same(piece.dequantize(usage="columnwise"), t.dequantize(usage="columnwise")[lo:hi])
    assert c.columnwise_m_splits == [256]
    with pytest.raises(ValueError, match="across groups"):
        t.split([128, 512])


def test_double_quantization_accuracy_direction():
    """Error against the BF16 source: dequantize+requantize with power-of-two scales <= the
    scaling-aware transpose < dequantize+requantize with FP32 scales (docs/transpose.md)."""
    x = activations(4096, 1024, "cpu")
    x[5, 7] = 0.0
    m_splits = [1000, 1096, 2000]
    q = quantize_blockwise(x)
    row = q.dequantize()
    tr = scaling_aware_transpose(q, m_splits).dequantize(usage="columnwise")
    dq = {}
    for pow2 in (True, False):
        data_t, scale_t = ref.double_quantize_columnwise(q.rowwise_data, q.rowwise_scale_inv, m_splits, pow2)
        dq[pow2] = dequantize_128x1(data_t, scale_t, torch.float32, m_splits)
    # the grids nest: a finer power-of-two grid is at least as close to every rowwise value
    assert ((dq[True] - row).abs() <= (tr - row).abs()).all()
    err = {name: ((y - x.float()).norm() / x.float().norm()).item()
           for name, y in (("rowwise", row), ("transpose", tr), ("dq_pow2", dq[True]), ("dq_fp32", dq[False]))}
    assert err["dq_pow2"] <= err["transpose"] < err["dq_fp32"]
    assert err["transpose"] < err["rowwise"] * 1.01  # underflow costs little on realistic data


def test_non_power_of_two_scales_are_rejected():
    x = activations(256, 256)
    with pytest.raises(ValueError, match="not powers of two"):
        scaling_aware_transpose(quantize_blockwise(x, force_pow_2_scales=False))
    q = quantize_blockwise(x, force_pow_2_scales=False)
    lying = Float8BlockwiseQTensor(shape=q.shape, dtype=q.dtype, fp8_dtype=q.fp8_dtype, force_pow_2_scales=True,
                                   rowwise_data=q.rowwise_data, rowwise_scale_inv=q.rowwise_scale_inv)
    with pytest.raises(ValueError, match="not powers of two"):
        scaling_aware_transpose(lying, backend="reference")
    poisoned = scaling_aware_transpose(lying, backend="triton")  # no host sync: NaN scales instead
    assert poisoned.columnwise_scale_inv.isnan().any()
    # one such row (not the block's largest) poisons exactly its own (column block, 128-column block)
    q = quantize_blockwise(x)
    scale = q.rowwise_scale_inv.clone()
    scale[5, 1] = scale[:128, 1].min() * 1.5
    one = kt.scaling_aware_transpose(q.rowwise_data, scale)[1]
    assert one[0, 128:].isnan().all() and one[:, :128].isfinite().all() and one[1:].isfinite().all()


@pytest.mark.parametrize(
    "make,kwargs,exc,match",
    [
        (lambda: torch.randn(4, 128), {}, TypeError, "must be a Float8BlockwiseQTensor"),
        (lambda: quantize_blockwise(torch.randn(256, 256), "128x128"), {}, ValueError, "128x128-scaled"),
        (lambda: quantize_blockwise(torch.randn(4, 128), rowwise=False, columnwise=True), {}, ValueError,
         "no rowwise data"),
        (lambda: quantize_blockwise(torch.randn(4, 128)), {"m_splits": [1, 2]}, ValueError, "sum to M=4"),
        (lambda: quantize_blockwise(torch.randn(4, 128)), {"m_splits": torch.tensor([4.0])}, TypeError,
         "int32/int64"),
        (lambda: quantize_blockwise(torch.randn(4, 128)), {"backend": "fast"}, ValueError, "backend"),
    ],
    ids=["plain", "2d", "columnwise-only", "splits-sum", "splits-dtype", "backend"],
)
def test_bad_input(make, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        scaling_aware_transpose(make(), **kwargs)


def test_device_splits_that_do_not_sum_to_m_fail_loudly():
    with pytest.raises(ValueError, match=r"m_splits must be >= 0 and sum to M=4"):
        scaling_aware_transpose(quantize_blockwise(torch.randn(4, 128)), torch.tensor([1, 2]))


def test_gradient_passes_through():
    x = torch.randn(256, 128, requires_grad=True)
    t = scaling_aware_transpose(quantize_blockwise(x))
    (t.dequantize(usage="columnwise") * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


# ---------------------------------------------------------------------------- GPU only
@requires_cuda
@pytest.mark.parametrize("groups", [8, 32])
def test_gpu_bitwise_at_full_size(groups):
    x = activations(65536, 7168, "cuda")
    sizes = torch.distributions.Dirichlet(torch.ones(groups)).sample() * 65536
    sizes = sizes.long()
    sizes[-1] = 65536 - sizes[:-1].sum()
    q = quantize_blockwise(x)
    for m_splits in (sizes.tolist(), sizes.cuda()):
        a = scaling_aware_transpose(q, m_splits, backend="triton")
        b = scaling_aware_transpose(q, m_splits, backend="reference")
        assert torch.equal(a.columnwise_scale_inv, b.columnwise_scale_inv)
        assert torch.equal(a.columnwise_data.view(torch.uint8), b.columnwise_data.view(torch.uint8))


@requires_cuda
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_gpu_software_reencoding_equals_hardware(fp8):
    """Every code at shifts 0..80 (and specials): integer path == the hardware casts (E4M3: in half precision)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(4096, 1)
    scale = 2.0 ** -(torch.arange(4096, dtype=torch.float32) % 81)[:, None].repeat(1, 2)  # d = r % 81
    q, s = codes.view(fp8).cuda(), scale.cuda()
    hw = kt.scaling_aware_transpose(q, s, software_cast=False)
    sw = kt.scaling_aware_transpose(q, s, software_cast=True)
    assert torch.equal(hw[1], sw[1]) and torch.equal(hw[0].view(torch.uint8), sw[0].view(torch.uint8))


@requires_cuda
def test_gpu_no_host_sync():
    q = quantize_blockwise(activations(8192, 1024, "cuda"))
    splits = torch.tensor([4000, 192, 4000], device="cuda")

    def step():
        scaling_aware_transpose(q, splits)
        scaling_aware_transpose(q, [4000, 192, 4000])
        q.dequantize(torch.bfloat16)

    assert_no_host_sync(step)


@pytest.mark.parametrize("g,n,k", [(3, 256, 384), (1, 128, 128), (0, 128, 256)], ids=str)
def test_transpose_grouped_weight_kernel_is_the_byte_transpose(g, n, k):
    """Every byte value (NaN and inf codes included) lands at its transposed place; scales transposed."""
    data = torch.randint(0, 256, (g * n, k), dtype=torch.uint8, device=KERNEL_DEVICE)
    scale = torch.rand(g * n // 128, k // 128, device=KERNEL_DEVICE)
    w = Float8BlockwiseQTensor(shape=(g, n, k), dtype=torch.bfloat16, fp8_dtype=torch.float8_e4m3fn,
                               is_2D_scaled=True, rowwise_data=data.view(torch.float8_e4m3fn), rowwise_scale_inv=scale)
    out = transpose_grouped_weight(w, backend="triton")
    reference = transpose_grouped_weight(w, backend="reference")
    assert out.shape == reference.shape == (g, k, n)
    assert torch.equal(out.rowwise_data.view(torch.uint8), reference.rowwise_data.view(torch.uint8))
    assert torch.equal(out.rowwise_scale_inv, reference.rowwise_scale_inv)
    expected = data.view(g, n, k).transpose(1, 2).reshape(g * k, n)
    assert torch.equal(reference.rowwise_data.view(torch.uint8), expected)


def test_transpose_grouped_weight_lives_with_the_transposes():
    """``ops/transpose.py`` holds it; the package root and ``ops`` re-export the same function."""
    import transformer_engine_moe
    from transformer_engine_moe import ops
    from transformer_engine_moe.ops import transpose

    assert transformer_engine_moe.transpose_grouped_weight is ops.transpose_grouped_weight
    assert ops.transpose_grouped_weight is transpose.transpose_grouped_weight
