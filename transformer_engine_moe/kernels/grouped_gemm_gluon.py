"""Grouped blockwise-FP8 GEMMs in Gluon (Triton 3.6's Hopper dialect): warp-specialized, persistent, sync-free.

Same signature and same math as ``kernels/grouped_gemm.py``'s ``grouped_gemm``, its Triton twin (which the CPU
suite runs under the interpreter): ``C [M, N] = A @ B_g^T`` per group, A ``[M, R]`` FP8 with 1x128 scales
``[M, R/128]``, B ``[G, N, R]`` FP8 with 128x128 scales ``[G, N/128, R/128]``, every element promoted as
``acc += dot_kb * (sa_kb * sb_kb)`` in K-block order: bitwise the twin's output (GPU tests). Group sizes are
read on the device (a host list or a device tensor: no host sync, CUDA-graph capturable), a trailing
weightless group written as zeros; 128-row blocks whose rows are all padding are skipped without loading.

One program per SM walks the (group-relative 128-row block, 256-column tile) tiles in the twin's swizzled order,
three partitions: a loader warp issues the TMA loads of A ``[128, 128]`` and B ``[256, 128]`` into a
``NUM_STAGES`` ring (ready/empty mbarriers) and runs on into the next tile while the math warpgroups write the
last one; two math warpgroups own 64 rows each. A math warpgroup multiplies and promotes the tile's two
128-column halves in turn (one weight scale each), waiting for each MMA before promoting it: nothing of its own in
flight while it reads an accumulator, so ptxas keeps the wgmmas asynchronous (an earlier draft that promoted one
block under the next block's MMA in the same warpgroup had every wgmma serialized, ptxas C7514: half the rate). The
other math warpgroup's MMAs run meanwhile, as DeepGEMM's two math warpgroups. A tile of 128 rows of one group
leaves through shared memory by TMA stores; a partial one (its rows past the group are the next group's) by
masked stores. docs/grouped_gemm.md has the measurements.

``grouped_gemm_wgrad``: the twin of ``kernels/grouped_gemm.py``'s wgrad for a written ``C [G, N, K]`` (BF16 or
float32; same promotion ``acc += dot_j * (sa_j[:, None] * sb_j[None, :])`` in token-block order, so the same bits),
persistent: one program per SM walks the 128x192 tiles (``WGRAD_TILE_K``; the last strip of K partial, its loads
zero-filled and its stores clipped) group by group, in bands of ``WGRAD_GROUP_N`` 128-row strips of N. A loader
warpgroup makes each group's TMA descriptors on the device (the expert-major operands have a row stride per group:
groups of multiples of 16 rows), once per group after the previous group's loads have landed, and fills the ring:
each stage holds the FP8 tiles and their token block's scales (1-D TMA loads), so the math warpgroups read the
scales from shared memory. Two math warpgroups own 64 of the tile's rows each; per token block a warpgroup runs a
64x128 MMA, waits, promotes, then a 64x64 one (the tile's last 64 columns: Gluon's shapes are powers of two), frees
the stage and promotes; the tile leaves by TMA stores from shared memory, which drain while the warpgroup goes on
to its next tile. Other wgrads (added into ``out``, rounded, G separate outputs, ragged groups on the host) run on
the twin.

Both take at most ``MAX_GROUPS`` groups (more run on the twin). Written against Triton 3.6's Gluon API, which
moves between releases: ``available`` is False on any other Triton (``auto`` then runs the twin).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)
from triton.runtime import _allocation

from ..layout import all_multiples_of, check_on_device, num_column_blocks
from . import is_hopper
from .grouped_gemm import (grouped_gemm as twin_gemm, grouped_gemm_wgrad as twin_wgrad, swizzled_tile,
                           takes_tma_epilogue, zero_weightless_rows)
from .groups import group_sizes_arg

TRITON_VERSION = "3.6"
BLOCK_N = 256  # two 128-column halves: one weight scale each
# (NUM_STAGES, GROUP_M, math warpgroups' registers) measured on an H200 (docs/grouped_gemm.md); a float32 C takes
# FPROP_FLOAT32_STAGES (its [2, 64, 128] staging tile beside 48 KiB stages)
CONFIG = (4, 16, 232)
FPROP_FLOAT32_STAGES = 3
_GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}
_GL_OUT = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
# groups are looked up in MAX_GROUPS slots (warp_specialize hands constexprs to the partitions as run-time values,
# so the slot count is a global); more groups run on the twin
MAX_GROUPS = gl.constexpr(256)
# the wgrad's tiles: 128 rows of N x WGRAD_TILE_K columns of K (a 128- and a 64-column part: Gluon's shapes are powers
# of two); its ring stages by output: BF16 4, float32 3 (41 KiB stages beside 48 / 96 KiB of staging tiles); its math
# warpgroups' registers (the two parts' accumulators, an MMA's and the scales: 240 compiles without spills in the
# loop); its tile order, bands of WGRAD_GROUP_N 128-row strips of N (H200, docs/grouped_gemm.md)
WGRAD_TILE_K = 192
WGRAD_STAGES = {torch.bfloat16: 4, torch.float32: 3}
WGRAD_MATH_REGS = 240
WGRAD_GROUP_N = gl.constexpr(8)
WGRAD_ROW_ALIGNMENT = 16  # TMA: each group's row stride (its rows, in FP8 bytes) a multiple of 16 bytes


@torch.compiler.assume_constant_result  # a host fact: torch.compile takes its value at trace time
def available(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: a Hopper (SM90) GPU under Triton 3.6."""
    return _available(device)


@functools.lru_cache(maxsize=None)
def _available(device: torch.device) -> bool:
    return triton.__version__.startswith(TRITON_VERSION) and is_hopper(device)


def supports(a_dtype: torch.dtype, b_dtype: torch.dtype, n: int, out_dtype: torch.dtype) -> bool:
    """Whether the kernel takes these operands: FP8 A and B, N a multiple of 256, a floating output."""
    return (a_dtype in _GL_DTYPES and b_dtype in _GL_DTYPES and n > 0 and n % BLOCK_N == 0
            and out_dtype in (torch.bfloat16, torch.float16, torch.float32))


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _group_extent(g, sizes_ptr, num_groups):
    """Group g's (first row, rows, first 128-row block), as ``groups.group_extent``."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    i = gl.arange(0, MAX_GROUPS, layout=layout)
    sizes = gl.load(sizes_ptr + i, mask=i < num_groups, other=0)
    before = i < g
    first_row = gl.sum(gl.where(before, sizes, 0), axis=0)
    first_block = gl.sum(gl.where(before, (sizes + 127) // 128, 0), axis=0)
    return first_row, gl.sum(gl.where(i == g, sizes, 0), axis=0), first_block


@gluon.jit
def _tile(t, num_pid_m, num_pid_n, GROUP_M, sizes_ptr, num_groups):
    """Tile ``t``'s (first row, row count, group, column tile): its group-relative 128-row block as the twin's
    ``groups.column_block_rows`` (count 0: past the groups), in the twin's swizzled order."""
    pid_m, pid_n = swizzled_tile(t, num_pid_m, num_pid_n, GROUP_M)
    g = gl.arange(0, MAX_GROUPS, layout=gl.BlockedLayout([1], [32], [4], [0]))
    sizes = gl.load(sizes_ptr + g, mask=g < num_groups, other=0)
    gi = gl.sum((gl.associative_scan((sizes + 127) // 128, 0, _add) <= pid_m).to(gl.int32), axis=0)
    first_row, size, first_block = _group_extent(gi, sizes_ptr, num_groups)
    start = first_row + (pid_m - first_block) * 128
    count = gl.maximum(gl.minimum(first_row + size - start, 128), 0)
    return start, count, gi, pid_n


@gluon.jit
def _ring_barriers(NUM_STAGES: gl.constexpr):
    """The ring's (ready, empty) mbarriers, one per stage: ready completes when a stage's TMA loads land (one
    arrive, the loader's expect), empty when both math warpgroups are done with the stage (one arrive each)."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return ready, empty


@gluon.jit
def _load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, a_row, b_row, col, extra_bytes=0):
    """TMA loads of the ``it``-th A and B tiles (rows ``a_row`` / ``b_row``, columns from ``col``) into ring slot
    ``it % NUM_STAGES`` once both math warpgroups freed it; the slot's ready barrier also expects ``extra_bytes``
    (the caller's further loads into the slot)."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    s = it % NUM_STAGES
    mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)  # barriers start with phase 1 complete
    mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes + extra_bytes)
    tma.async_copy_global_to_shared(a_desc, [a_row, col], ready.index(s), a_bufs.index(s))
    tma.async_copy_global_to_shared(b_desc, [b_row, col], ready.index(s), b_bufs.index(s))


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, sizes_ptr, num_groups, N, num_pid_m, GROUP_M,
            KB: gl.constexpr):
    """This program's tiles (``t = pid, pid + programs, ...``, past-the-groups tiles skipped): K block kb's A and
    B tiles into the ring, on into the next tile while the math warpgroups write the last."""
    num_pid_n = N // 256
    it = 0
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        start, count, g, pid_n = _tile(t, num_pid_m, num_pid_n, GROUP_M, sizes_ptr, num_groups)
        if count > 0:
            for kb in range(KB):
                _load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it + kb, start, g * N + pid_n * 256,
                            kb * 128)
            it += KB


@gluon.jit
def _tma_store(acc, c_desc, c_buf, row, col):
    """A warpgroup's 64-row ``acc`` to ``c_desc`` at (``row``, ``col``), through shared ``c_buf`` by one TMA
    store, which drains while the warpgroup goes on (waited for at the buffer's next use)."""
    tma.store_wait(0)  # the buffer's previous tile has left (waited for by its issuing thread)
    gl.thread_barrier()
    c_buf.store(acc.to(c_desc.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(c_desc, [row, col], c_buf)


@gluon.jit
def _write_half(acc, c_desc, c_buf, c_ptr, row, rows, row_ok, full, col, N):
    """A 64x128 half of the warpgroup's tile (rows ``rows`` from ``row``, columns from ``col``): TMA-stored through
    ``c_buf`` when the tile is ``full`` (128 rows of one group), else masked stores (the rows past the group are
    another tile's)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    if full:
        _tma_store(acc, c_desc, c_buf, row, col)
    else:
        cols = col + gl.arange(0, 128, layout=gl.SliceLayout(0, mma))
        gl.store(c_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@gluon.jit
def _math(a_bufs, b_bufs, ready, empty, c_smem, c_desc, as_ptr, bs_ptr, c_ptr, sizes_ptr, num_groups, N,
          num_pid_m, GROUP_M, stride_bsg, stride_bsr, stride_bsn, KB: gl.constexpr, ROW0: gl.constexpr):
    """Rows ROW0..ROW0+63 of each of the program's 128x256 tiles (the loader's walk), one warpgroup: per K block
    each 128-column half's MMA, waited for, then promoted into that half's accumulator; the halves leave in turn
    through ``c_smem[ROW0 // 64]``."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    c_buf = c_smem.index(ROW0 // 64)
    num_pid_n = N // 256
    it = 0
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        start, count, g, pid_n = _tile(t, num_pid_m, num_pid_n, GROUP_M, sizes_ptr, num_groups)
        if count > 0:
            rows = start + ROW0 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
            row_ok = rows < start + count
            sa_row = as_ptr + rows.to(gl.int64) * KB
            sb_base = bs_ptr + g * stride_bsg + 2 * pid_n * stride_bsn
            acc_lo = gl.zeros([64, 128], gl.float32, mma)
            acc_hi = gl.zeros([64, 128], gl.float32, mma)
            for kb in range(KB):
                s = (it + kb) % NUM_STAGES
                mbarrier.wait(ready.index(s), ((it + kb) // NUM_STAGES) & 1)
                a_tile = a_bufs.index(s).slice(ROW0, 64)
                sa = gl.load(sa_row + kb, mask=row_ok, other=0.0)
                cur = warpgroup_mma(a_tile, b_bufs.index(s).slice(0, 128).permute((1, 0)),
                                    gl.zeros([64, 128], gl.float32, mma), use_acc=False, is_async=True)
                scale = sa * gl.load(sb_base + kb * stride_bsr)
                done = warpgroup_mma_wait(num_outstanding=0, deps=(cur, ))
                acc_lo += done * scale[:, None]
                cur = warpgroup_mma(a_tile, b_bufs.index(s).slice(128, 128).permute((1, 0)),
                                    gl.zeros([64, 128], gl.float32, mma), use_acc=False, is_async=True)
                scale = sa * gl.load(sb_base + stride_bsn + kb * stride_bsr)
                done = warpgroup_mma_wait(num_outstanding=0, deps=(cur, ))
                gl.thread_barrier()  # the warpgroup's four warps past block kb's MMAs
                mbarrier.arrive(empty.index(s), count=1)
                acc_hi += done * scale[:, None]
            it += KB
            full = count == 128
            _write_half(acc_lo, c_desc, c_buf, c_ptr, start + ROW0, rows, row_ok, full, pid_n * 256, N)
            _write_half(acc_hi, c_desc, c_buf, c_ptr, start + ROW0, rows, row_ok, full, pid_n * 256 + 128,
                        N)
    tma.store_wait(0)


@gluon.jit
def _math_lo(a_bufs, b_bufs, ready, empty, c_smem, c_desc, as_ptr, bs_ptr, c_ptr, sizes_ptr, num_groups, N,
             num_pid_m, GROUP_M, stride_bsg, stride_bsr, stride_bsn, KB: gl.constexpr):
    _math(a_bufs, b_bufs, ready, empty, c_smem, c_desc, as_ptr, bs_ptr, c_ptr, sizes_ptr, num_groups, N,
          num_pid_m, GROUP_M, stride_bsg, stride_bsr, stride_bsn, KB, 0)


@gluon.jit
def _math_hi(a_bufs, b_bufs, ready, empty, c_smem, c_desc, as_ptr, bs_ptr, c_ptr, sizes_ptr, num_groups, N,
             num_pid_m, GROUP_M, stride_bsg, stride_bsr, stride_bsn, KB: gl.constexpr):
    _math(a_bufs, b_bufs, ready, empty, c_smem, c_desc, as_ptr, bs_ptr, c_ptr, sizes_ptr, num_groups, N,
          num_pid_m, GROUP_M, stride_bsg, stride_bsr, stride_bsn, KB, 64)


@gluon.jit
def _grouped_gemm_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, c_ptr, sizes_ptr, num_groups, N, num_pid_m, GROUP_M,
                         stride_bsg, stride_bsr, stride_bsn,
                         R: gl.constexpr, NUM_STAGES: gl.constexpr, MATH_REGS: gl.constexpr,
                         num_warps: gl.constexpr):
    KB: gl.constexpr = R // 128
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, 128, 128], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, 256, 128], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, 64, 128], c_desc.layout)
    ready, empty = _ring_barriers(NUM_STAGES)
    args = (a_bufs, b_bufs, ready, empty, c_smem, c_desc, as_ptr, bs_ptr, c_ptr, sizes_ptr, num_groups, N,
            num_pid_m, GROUP_M, stride_bsg, stride_bsr, stride_bsn, KB)
    gl.warp_specialize([
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, sizes_ptr, num_groups, N, num_pid_m, GROUP_M, KB)),
        (_math_lo, args),
        (_math_hi, args),
    ], [4, 4], [MATH_REGS, MATH_REGS])


def grouped_gemm(a, a_scale_inv, b, b_scale_inv, m_splits, out_dtype=torch.bfloat16, config=None):
    """``a [M, R]`` FP8 (contiguous, ``a_scale_inv [M, R/128]`` contiguous float32); ``b [G, N, R]`` FP8
    contiguous with 128x128 ``b_scale_inv [G, N/128, R/128]``; ``m_splits`` list or device int tensor (G groups,
    or G + 1: the last one weightless, its rows zero) -> ``C [M, N] = A @ B_g^T`` per group in ``out_dtype``,
    bitwise ``kernels.grouped_gemm.grouped_gemm``'s. N a multiple of 256, R of 128 (``supports``); more than
    ``MAX_GROUPS`` groups run on the twin. ``config``: ``(NUM_STAGES, GROUP_M, math registers)`` (``CONFIG``; a
    float32 C at most ``FPROP_FLOAT32_STAGES`` stages)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m, r = a.shape
    num_weights, n, _ = b.shape
    if n % BLOCK_N or r % 128:
        raise ValueError(f"the Gluon grouped GEMM needs N % {BLOCK_N} == 0 and R % 128 == 0, got N={n}, R={r}")
    if len(m_splits) > MAX_GROUPS.value:
        return twin_gemm(a, a_scale_inv, b, b_scale_inv, m_splits, out_dtype)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if r == 0:
        return c.zero_()
    num_stages, group_m, math_regs = config or CONFIG
    if out_dtype == torch.float32:
        num_stages = min(num_stages, FPROP_FLOAT32_STAGES)
    a, a_scale_inv, b = a.contiguous(), a_scale_inv.contiguous(), b.contiguous()
    sizes, g, _, _ = group_sizes_arg(m_splits, a.device)
    a_layout = gl.NVMMASharedLayout.get_default_for([128, 128], _GL_DTYPES[a.dtype])
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], _GL_DTYPES[b.dtype])
    c_layout = gl.NVMMASharedLayout.get_default_for([64, 128], _GL_OUT[out_dtype])
    a_desc = TensorDescriptor(a, [m, r], [r, 1], [128, 128], a_layout)
    b_desc = TensorDescriptor(b.view(num_weights * n, r), [num_weights * n, r], [r, 1], [BLOCK_N, 128], b_layout)
    c_desc = TensorDescriptor(c, [m, n], [n, 1], [64, 128], c_layout)
    num_pid_m = num_column_blocks(m, m_splits)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    _grouped_gemm_kernel[(min(num_pid_m * (n // BLOCK_N), sms),)](
        # a trailing weightless group is left out: the kernel sees the weights' groups only (its blocks find none)
        a_desc, b_desc, c_desc, a_scale_inv, b_scale_inv, c, sizes, min(g, num_weights), n, num_pid_m, group_m,
        b_scale_inv.stride(0), b_scale_inv.stride(2), b_scale_inv.stride(1),
        R=r, NUM_STAGES=num_stages, MATH_REGS=math_regs, num_warps=4, maxnreg=168)
    return zero_weightless_rows(c, m_splits, num_weights)


# ------------------------------------------------------------------------------------------------------------ wgrad
@gluon.jit
def _first_tile(g, per_group, pid, nprog):
    """This program's first tile of group g (programs take tiles pid, pid + nprog, ...)."""
    return g * per_group + (pid - g * per_group % nprog + nprog) % nprog


@gluon.jit
def _wgrad_tile(local, num_n, num_k):
    """(n0, k0) of a group's ``local``-th 128x192 tile: bands of ``WGRAD_GROUP_N`` 128-row strips of N, N fastest
    within a band (a wave of programs then reads a few strips of both operands)."""
    width = WGRAD_GROUP_N * num_k
    first_n = local // width * WGRAD_GROUP_N
    band = gl.minimum(num_n - first_n, WGRAD_GROUP_N)
    return (first_n + local % width % band) * 128, local % width // band * 192


@gluon.jit
def _wgrad_loader(at_ptr, bt_ptr, sa_desc, sb_desc, sbh_desc, a_bufs, b_bufs, bh_bufs, sa_bufs, sb_bufs, sbh_bufs,
                  ready, empty, sizes_ptr, num_groups, N, K):
    """Group by group: the group's descriptors (dY_g^T ``[N, m_g]``, X_g^T ``[K, m_g]``; tokens past m_g, and K
    past the last strip, zero-filled) are made once, after the loads through the previous ones have landed (the
    ready barriers of the last NUM_STAGES loads: the loader is their only producer), then this program's tiles of
    the group loaded: a stage holds token block j's FP8 tiles (dY^T 128 rows; X^T 128 + 64 rows) and their scales
    (128 of dY^T's, 128 + 64 of X^T's)."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    extra: gl.constexpr = sa_desc.block_type.nbytes + sb_desc.block_type.nbytes + sbh_desc.block_type.nbytes + \
        bh_bufs.type.shape[1] * bh_bufs.type.shape[2]
    num_n = N // 128
    num_k = gl.cdiv(K, 192)
    per_group = num_n * num_k
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    it = 0
    for g in range(num_groups):
        first_row, size, first_block = _group_extent(g, sizes_ptr, num_groups)
        blocks = (size + 127) // 128
        t0 = _first_tile(g, per_group, pid, nprog)
        if (blocks > 0) & (t0 < (g + 1) * per_group):
            for q in range(NUM_STAGES):
                if q < it:
                    p = it - 1 - q
                    mbarrier.wait(ready.index(p % NUM_STAGES), (p // NUM_STAGES) & 1)
            a_desc = tma.make_tensor_descriptor(at_ptr + first_row.to(gl.int64) * N, [N, size], [size, 1],
                                                [128, 128], a_bufs.type.layout)
            b_desc = tma.make_tensor_descriptor(bt_ptr + first_row.to(gl.int64) * K, [K, size], [size, 1],
                                                [128, 128], b_bufs.type.layout)
            bh_desc = tma.make_tensor_descriptor(bt_ptr + first_row.to(gl.int64) * K, [K, size], [size, 1],
                                                 [64, 128], bh_bufs.type.layout)
            for t in range(t0, (g + 1) * per_group, nprog):
                n0, k0 = _wgrad_tile(t - g * per_group, num_n, num_k)
                for j in range(blocks):
                    s = it % NUM_STAGES
                    _load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, n0, k0, j * 128, extra)
                    tma.async_copy_global_to_shared(bh_desc, [k0 + 128, j * 128], ready.index(s), bh_bufs.index(s))
                    tma.async_copy_global_to_shared(sa_desc, [(first_block + j) * N + n0], ready.index(s),
                                                    sa_bufs.index(s))
                    tma.async_copy_global_to_shared(sb_desc, [(first_block + j) * K + k0], ready.index(s),
                                                    sb_bufs.index(s))
                    tma.async_copy_global_to_shared(sbh_desc, [(first_block + j) * K + k0 + 128], ready.index(s),
                                                    sbh_bufs.index(s))
                    it += 1


@gluon.jit
def _wgrad_math(a_bufs, b_bufs, bh_bufs, sa_bufs, sb_bufs, sbh_bufs, ready, empty, c_smem, c_desc, ch_smem, ch_desc,
                sizes_ptr, num_groups, N, K, ROW0: gl.constexpr):
    """Rows ROW0..ROW0+63 of each of the program's 128x192 tiles (the loader's walk; every tile, empty groups'
    too: zeros), one warpgroup: per token block a 64x128 MMA, waited for and promoted, then a 64x64 one (the
    tile's last 64 columns); the two parts leave through ``c_smem`` / ``ch_smem`` by TMA stores (clipped at K)."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    mma64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
    num_n = N // 128
    num_k = gl.cdiv(K, 192)
    per_group = num_n * num_k
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    c_buf = c_smem.index(ROW0 // 64)
    ch_buf = ch_smem.index(ROW0 // 64)
    it = 0
    for g in range(num_groups):
        _, size, _ = _group_extent(g, sizes_ptr, num_groups)
        for t in range(_first_tile(g, per_group, pid, nprog), (g + 1) * per_group, nprog):
            n0, k0 = _wgrad_tile(t - g * per_group, num_n, num_k)
            acc = gl.zeros([64, 128], gl.float32, mma)
            acc_h = gl.zeros([64, 64], gl.float32, mma64)
            for j in range((size + 127) // 128):
                s = it % NUM_STAGES
                mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
                a_tile = a_bufs.index(s).slice(ROW0, 64)
                cur = warpgroup_mma(a_tile, b_bufs.index(s).permute((1, 0)), gl.zeros([64, 128], gl.float32, mma),
                                    use_acc=False, is_async=True)
                sa = sa_bufs.index(s).slice(ROW0, 64).load(gl.SliceLayout(1, mma))
                sb = sb_bufs.index(s).load(gl.SliceLayout(0, mma))
                done = warpgroup_mma_wait(num_outstanding=0, deps=(cur, ))
                acc = acc + done * (sa[:, None] * sb[None, :])
                cur_h = warpgroup_mma(a_tile, bh_bufs.index(s).permute((1, 0)),
                                      gl.zeros([64, 64], gl.float32, mma64), use_acc=False, is_async=True)
                sa_h = sa_bufs.index(s).slice(ROW0, 64).load(gl.SliceLayout(1, mma64))
                sb_h = sbh_bufs.index(s).load(gl.SliceLayout(0, mma64))
                done_h = warpgroup_mma_wait(num_outstanding=0, deps=(cur_h, ))
                gl.thread_barrier()  # the warpgroup's four warps past block j's MMAs
                mbarrier.arrive(empty.index(s), count=1)
                acc_h = acc_h + done_h * (sa_h[:, None] * sb_h[None, :])
                it += 1
            _tma_store(acc, c_desc, c_buf, g * N + n0 + ROW0, k0)
            _tma_store(acc_h, ch_desc, ch_buf, g * N + n0 + ROW0, k0 + 128)
    tma.store_wait(0)


@gluon.jit
def _wgrad_math_lo(a_bufs, b_bufs, bh_bufs, sa_bufs, sb_bufs, sbh_bufs, ready, empty, c_smem, c_desc, ch_smem,
                   ch_desc, sizes_ptr, num_groups, N, K):
    _wgrad_math(a_bufs, b_bufs, bh_bufs, sa_bufs, sb_bufs, sbh_bufs, ready, empty, c_smem, c_desc, ch_smem, ch_desc,
                sizes_ptr, num_groups, N, K, 0)


@gluon.jit
def _wgrad_math_hi(a_bufs, b_bufs, bh_bufs, sa_bufs, sb_bufs, sbh_bufs, ready, empty, c_smem, c_desc, ch_smem,
                   ch_desc, sizes_ptr, num_groups, N, K):
    _wgrad_math(a_bufs, b_bufs, bh_bufs, sa_bufs, sb_bufs, sbh_bufs, ready, empty, c_smem, c_desc, ch_smem, ch_desc,
                sizes_ptr, num_groups, N, K, 64)


@gluon.jit
def _grouped_wgrad_kernel(at_ptr, bt_ptr, sa_desc, sb_desc, sbh_desc, c_desc, ch_desc, sizes_ptr, num_groups, N, K,
                          NUM_STAGES: gl.constexpr, MATH_REGS: gl.constexpr, num_warps: gl.constexpr):
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 128], at_ptr.dtype.element_ty)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 128], bt_ptr.dtype.element_ty)
    bh_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], bt_ptr.dtype.element_ty)
    a_bufs = gl.allocate_shared_memory(at_ptr.dtype.element_ty, [NUM_STAGES, 128, 128], a_layout)
    b_bufs = gl.allocate_shared_memory(bt_ptr.dtype.element_ty, [NUM_STAGES, 128, 128], b_layout)
    bh_bufs = gl.allocate_shared_memory(bt_ptr.dtype.element_ty, [NUM_STAGES, 64, 128], bh_layout)
    sa_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 128], sa_desc.layout)
    sb_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 128], sb_desc.layout)
    sbh_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 64], sbh_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, 64, 128], c_desc.layout)
    ch_smem = gl.allocate_shared_memory(ch_desc.dtype, [2, 64, 64], ch_desc.layout)
    ready, empty = _ring_barriers(NUM_STAGES)
    args = (a_bufs, b_bufs, bh_bufs, sa_bufs, sb_bufs, sbh_bufs, ready, empty, c_smem, c_desc, ch_smem, ch_desc,
            sizes_ptr, num_groups, N, K)
    gl.warp_specialize([
        (_wgrad_loader, (at_ptr, bt_ptr, sa_desc, sb_desc, sbh_desc, a_bufs, b_bufs, bh_bufs, sa_bufs, sb_bufs,
                         sbh_bufs, ready, empty, sizes_ptr, num_groups, N, K)),
        (_wgrad_math_lo, args),
        (_wgrad_math_hi, args),
    ], [4, 4], [MATH_REGS, MATH_REGS])


def takes_wgrad(a_t: torch.Tensor, m_splits, out, accumulate: bool, out_dtype: torch.dtype) -> bool:
    """Whether ``grouped_gemm_wgrad`` runs the Gluon kernel (else the twin): on a Hopper GPU under Triton 3.6, a
    written (not added, not rounded into ``out``) BF16 or float32 ``C`` in one ``[G, N, K]`` (new, or a contiguous
    16-byte aligned ``out``), at most ``MAX_GROUPS`` groups of multiples of ``WGRAD_ROW_ALIGNMENT`` rows: a
    host list checked here, a device tensor on the device (no host sync)."""
    if accumulate or not (a_t.is_cuda and available(a_t.device)) or out_dtype not in WGRAD_STAGES:
        return False
    if out is not None and (isinstance(out, list) or out_dtype != torch.float32 or not takes_tma_epilogue(out)):
        return False
    if isinstance(m_splits, torch.Tensor):
        return m_splits.numel() <= MAX_GROUPS.value
    return len(m_splits) <= MAX_GROUPS.value and all_multiples_of(m_splits, WGRAD_ROW_ALIGNMENT)


def grouped_gemm_wgrad(a_t, a_t_scale_inv, b_t, b_t_scale_inv, m_splits, out=None, accumulate=False,
                       out_dtype=torch.float32, config=None):
    """As ``kernels.grouped_gemm.grouped_gemm_wgrad`` (its twin; same arguments, same bits): the Gluon kernel where
    ``takes_wgrad``, the twin otherwise. Device-tensor splits must then be multiples of 16 rows (asserted on the
    device, as DeepGEMM's 128). ``config``: ``(NUM_STAGES, math registers)`` (``WGRAD_STAGES``,
    ``WGRAD_MATH_REGS``)."""
    if not takes_wgrad(a_t, m_splits, out, accumulate, out_dtype):
        return twin_wgrad(a_t, a_t_scale_inv, b_t, b_t_scale_inv, m_splits, out, accumulate, out_dtype)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n, k = a_t_scale_inv.shape[1], b_t_scale_inv.shape[1]
    sizes, g, _, _ = group_sizes_arg(m_splits, a_t.device)
    if isinstance(m_splits, torch.Tensor):
        check_on_device((sizes % WGRAD_ROW_ALIGNMENT == 0).all(),
                        f"grouped_gemm_wgrad (gluon): every group's rows must be a multiple of {WGRAD_ROW_ALIGNMENT}")
    if out is None:
        out = torch.empty((g, n, k), dtype=out_dtype, device=a_t.device)
    total = g * (n // 128) * triton.cdiv(k, WGRAD_TILE_K)
    if total == 0:
        return out
    num_stages, math_regs = config or (WGRAD_STAGES[out.dtype], WGRAD_MATH_REGS)
    c_2d = out.view(g * n, k)
    c_desc, ch_desc = (TensorDescriptor(c_2d, [g * n, k], [k, 1], [64, cols],
                                        gl.NVMMASharedLayout.get_default_for([64, cols], _GL_OUT[out.dtype]))
                       for cols in (128, 64))
    # the scales [blocks, N] / [blocks, K] as flat rows: a token block's 128 (+ 64) of a tile, 1-D TMA boxes
    s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    # (no token blocks, all groups empty: nothing is loaded, the descriptors get a stand-in row)
    sa_flat, sb_flat = (t.contiguous().view(-1) if t.numel() else t.new_zeros(128) for t in (a_t_scale_inv,
                                                                                          b_t_scale_inv))
    sa_desc, sb_desc, sbh_desc = (TensorDescriptor(t, [t.numel()], [1], [box], s_layout)
                                  for t, box in ((sa_flat, 128), (sb_flat, 128), (sb_flat, 64)))
    sms = torch.cuda.get_device_properties(a_t.device).multi_processor_count
    # the device-made descriptors' scratch (a stream-ordered torch buffer), for this launch only
    token = _allocation._allocator.set(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                             device=a_t.device))
    try:
        _grouped_wgrad_kernel[(min(total, sms),)](
            a_t, b_t, sa_desc, sb_desc, sbh_desc, c_desc, ch_desc, sizes, g, n, k,
            NUM_STAGES=num_stages, MATH_REGS=math_regs, num_warps=4, maxnreg=168)
    finally:
        _allocation._allocator.reset(token)
    return out
