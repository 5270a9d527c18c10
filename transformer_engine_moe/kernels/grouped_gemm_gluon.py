"""Grouped blockwise-FP8 fprop/dgrad in Gluon (Triton 3.6's Hopper dialect): warp-specialized, sync-free.

Same signature and same math as ``kernels/grouped_gemm.py``'s ``grouped_gemm``, its Triton twin (which the CPU
suite runs under the interpreter): ``C [M, N] = A @ B_g^T`` per group, A ``[M, R]`` FP8 with 1x128 scales
``[M, R/128]``, B ``[G, N, R]`` FP8 with 128x128 scales ``[G, N/128, R/128]``, every element promoted as
``acc += dot_kb * (sa_kb * sb_kb)`` in K-block order: bitwise the twin's output (GPU tests). Group sizes are
read on the device (a host list or a device tensor: no host sync, CUDA-graph capturable), a trailing
weightless group written as zeros; 128-row blocks whose rows are all padding are skipped without loading.

One program per (group-relative 128-row block, 256-column tile), three partitions: a loader warp issues the TMA
loads of A ``[128, 128]`` and B ``[256, 128]`` into a ``NUM_STAGES`` ring (ready/empty mbarriers), and two math
warpgroups own 64 rows each. A math warpgroup multiplies and promotes the tile's two 128-column halves in turn
(one weight scale each), waiting for each MMA before promoting it: nothing of its own in flight while it reads an
accumulator, so ptxas keeps the wgmmas asynchronous (an earlier draft that promoted one block under the next
block's MMA in the same warpgroup had every wgmma serialized, ptxas C7514: half the rate). The other math
warpgroup's MMAs run meanwhile, as DeepGEMM's two math warpgroups. docs/grouped_gemm.md has the measurements.

Written against Triton 3.6's Gluon API, which moves between releases: ``available`` is False on any other Triton
(``auto`` then runs the twin).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ..layout import num_column_blocks
from . import is_hopper
from .grouped_gemm import swizzled_tile, zero_weightless_rows
from .groups import group_sizes_arg

TRITON_VERSION = "3.6"
BLOCK_N = 256  # two 128-column halves: one weight scale each
# (NUM_STAGES, GROUP_M, math warpgroups' registers) measured on an H200 (docs/grouped_gemm.md)
CONFIG = (4, 16, 232)
_GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}


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
def _block_rows(b, sizes_ptr, num_groups, MAX_GROUPS: gl.constexpr, layout: gl.constexpr):
    """(first row, row count, group) of group-relative 128-row block ``b`` (count 0: past the groups), as the
    twin's ``groups.column_block_rows``."""
    g = gl.arange(0, MAX_GROUPS, layout=layout)
    sizes = gl.load(sizes_ptr + g, mask=g < num_groups, other=0)
    blocks = (sizes + 127) // 128
    gi = gl.sum((gl.associative_scan(blocks, 0, _add) <= b).to(gl.int32), axis=0)
    before = g < gi
    first_row = gl.sum(gl.where(before, sizes, 0), axis=0)
    first_block = gl.sum(gl.where(before, blocks, 0), axis=0)
    size = gl.sum(gl.where(g == gi, sizes, 0), axis=0)
    start = first_row + (b - first_block) * 128
    count = gl.maximum(gl.minimum(first_row + size - start, 128), 0)
    return start, count, gi


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, start, b_row, KB: gl.constexpr):
    """TMA loads of K block kb's A and B tiles into ring slot kb % NUM_STAGES once both math warpgroups freed it."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    for kb in range(KB):
        s = kb % NUM_STAGES
        mbarrier.wait(empty.index(s), ((kb // NUM_STAGES) & 1) ^ 1)  # barriers start with phase 1 complete
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [start, kb * 128], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [b_row, kb * 128], ready.index(s), b_bufs.index(s))


@gluon.jit
def _math(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, start, count, g, pid_n, N,
          stride_bsg, stride_bsr, stride_bsn, KB: gl.constexpr, ROW0: gl.constexpr):
    """Rows ROW0..ROW0+63 of the 128x256 tile, one warpgroup: per K block each 128-column half's MMA, waited
    for, then promoted into that half's accumulator."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rows = start + ROW0 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    row_ok = rows < start + count
    sa_row = as_ptr + rows.to(gl.int64) * KB
    sb_base = bs_ptr + g * stride_bsg + 2 * pid_n * stride_bsn
    acc_lo = gl.zeros([64, 128], gl.float32, mma)
    acc_hi = gl.zeros([64, 128], gl.float32, mma)
    for kb in range(KB):
        s = kb % NUM_STAGES
        mbarrier.wait(ready.index(s), (kb // NUM_STAGES) & 1)
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
    cols = pid_n * 256 + gl.arange(0, 128, layout=gl.SliceLayout(0, mma))
    c = c_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :]
    gl.store(c, acc_lo.to(c_ptr.dtype.element_ty), mask=row_ok[:, None])
    gl.store(c + 128, acc_hi.to(c_ptr.dtype.element_ty), mask=row_ok[:, None])


@gluon.jit
def _math_lo(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, start, count, g, pid_n, N,
             stride_bsg, stride_bsr, stride_bsn, KB: gl.constexpr):
    _math(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, start, count, g, pid_n, N,
          stride_bsg, stride_bsr, stride_bsn, KB, 0)


@gluon.jit
def _math_hi(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, start, count, g, pid_n, N,
             stride_bsg, stride_bsr, stride_bsn, KB: gl.constexpr):
    _math(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, start, count, g, pid_n, N,
          stride_bsg, stride_bsr, stride_bsn, KB, 64)


@gluon.jit
def _grouped_gemm_kernel(
    a_desc, b_desc, as_ptr, bs_ptr, c_ptr, sizes_ptr, num_groups, N,
    stride_bsg, stride_bsr, stride_bsn,
    R: gl.constexpr, MAX_GROUPS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
    MATH_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    KB: gl.constexpr = R // 128
    num_pid_n = N // 256
    num_pid_m = gl.num_programs(0) // num_pid_n
    pid_m, pid_n = swizzled_tile(gl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    start, count, g = _block_rows(pid_m, sizes_ptr, num_groups, MAX_GROUPS, vec)
    if count > 0:
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, 128, 128], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, 256, 128], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrive per math warpgroup
        args = (a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, start, count, g, pid_n, N,
                stride_bsg, stride_bsr, stride_bsn, KB)
        gl.warp_specialize([
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, start, g * N + pid_n * 256, KB)),
            (_math_lo, args),
            (_math_hi, args),
        ], [4, 4], [MATH_REGS, MATH_REGS])


def grouped_gemm(a, a_scale_inv, b, b_scale_inv, m_splits, out_dtype=torch.bfloat16, config=None):
    """``a [M, R]`` FP8 (contiguous, ``a_scale_inv [M, R/128]`` contiguous float32); ``b [G, N, R]`` FP8
    contiguous with 128x128 ``b_scale_inv [G, N/128, R/128]``; ``m_splits`` list or device int tensor (G groups,
    or G + 1: the last one weightless, its rows zero) -> ``C [M, N] = A @ B_g^T`` per group in ``out_dtype``,
    bitwise ``kernels.grouped_gemm.grouped_gemm``'s. N a multiple of 256, R of 128 (``supports``); ``config``:
    ``(NUM_STAGES, GROUP_M, math registers)`` (``CONFIG``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m, r = a.shape
    num_weights, n, _ = b.shape
    if n % BLOCK_N or r % 128:
        raise ValueError(f"the Gluon grouped GEMM needs N % {BLOCK_N} == 0 and R % 128 == 0, got N={n}, R={r}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if r == 0:
        return c.zero_()
    num_stages, group_m, math_regs = config or CONFIG
    a, a_scale_inv, b = a.contiguous(), a_scale_inv.contiguous(), b.contiguous()
    sizes, g, _, max_groups = group_sizes_arg(m_splits, a.device)
    a_layout = gl.NVMMASharedLayout.get_default_for([128, 128], _GL_DTYPES[a.dtype])
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], _GL_DTYPES[b.dtype])
    a_desc = TensorDescriptor(a, [m, r], [r, 1], [128, 128], a_layout)
    b_desc = TensorDescriptor(b.view(num_weights * n, r), [num_weights * n, r], [r, 1], [BLOCK_N, 128], b_layout)
    grid = (num_column_blocks(m, m_splits) * (n // BLOCK_N),)
    _grouped_gemm_kernel[grid](
        # a trailing weightless group is left out: the kernel sees the weights' groups only (its blocks find none)
        a_desc, b_desc, a_scale_inv, b_scale_inv, c, sizes, min(g, num_weights), n,
        b_scale_inv.stride(0), b_scale_inv.stride(2), b_scale_inv.stride(1),
        R=r, MAX_GROUPS=max(max_groups, 32), GROUP_M=group_m, NUM_STAGES=num_stages, MATH_REGS=math_regs,
        num_warps=4, maxnreg=168)
    return zero_weightless_rows(c, m_splits, num_weights)
