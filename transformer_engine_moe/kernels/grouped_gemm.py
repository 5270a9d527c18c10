"""Triton grouped blockwise-FP8 GEMMs over all experts in one launch each: fprop/dgrad and wgrad.

Groups (experts) are row ranges of the token dimension M whose sizes sit in a
device tensor: no host copy of them, no per-expert launch. Every product of
two 128-wide FP8 blocks goes through the tensor cores into float32 and is
promoted into the float32 accumulator with its two block scales (DeepSeek-V3's
per-128 promotion), so a tile sees ``acc += dot(a_kb, b_kb) * sa * sb``.

- ``grouped_gemm``: ``C[M, N] = A[M, R] @ B_g^T`` for rows of group g. A is FP8
  with 1x128 scales ``[M, R/128]`` (COMPACT); B is K-major ``[G, N, R]`` with 128x128
  scales: the weights (fprop) or their per-expert transpose (dgrad; Hopper's FP8 tensor
  cores take both operands K-major, docs/grouped_gemm.md). Tiles
  are group-relative 128-row blocks, the same blocks as the 128x1 column scales,
  so a tile never straddles two experts. A trailing group past B's G (a weightless
  group: a worst-case buffer's slack) is left out of the launch and zeroed by
  ``zero_weightless_rows``.
- ``grouped_gemm_wgrad``: ``C_g[N, K] = A^T_g @ B^T_g^T`` with both operands in
  the expert-major columnwise layout of the scaling-aware transpose (group g's
  ``[N, m_g]`` and ``[K, m_g]`` blocks, block-major 128x1 scales ``[num_column_blocks, N]``),
  reducing over the group's tokens; float32 out, optionally accumulated into it (``main_grad``). On the GPU
  the tiles go into one aligned ``[G, N, K]`` by TMA (``takes_tma_epilogue``), else by pointer stores.
  The splits may cover only the leading rows: rows after them (a weightless group) are never read.
- Helpers other backends launch: ``zero_weightless_rows`` (DeepGEMM: the rows of a weightless group)
  and ``expert_major_scales`` (cuBLAS: each expert's 1x128 scales as its own transposed block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..layout import address_table, num_column_blocks
from .casts import cast_for_store, use_software_cast
from .groups import column_block_rows, group_extent, group_sizes_arg

# Launch shapes (BLOCK_N, GROUP_M, num_warps, num_stages), from benchmarks/bench_grouped_gemm.py's sweep:
# a 128x128 tile on two warpgroups (H100: 733-840 TFLOP/s at DeepSeek-V3 shapes, 559-596 for 128x64 on one).
GEMM_CONFIG = (128, 16, 8, 3)
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the wgrad kernel: one warpgroup on a 128x64 tile, so that
# several programs share an SM and one's MMAs run while another promotes (H200, 64x2048 / 128x1024 rows,
# fc1 and fc2: 614-630 / 514-522 TFLOP/s, against 505 / 428 for 128x128 with 8 warps; bitwise same).
WGRAD_CONFIG = (128, 64, 4, 3)
# Rows per program of ``expert_major_scales``.
EXPERT_MAJOR_ROWS = 128


@triton.jit
def _scaled_block(a_tile, b_tile, sa_row, sb_tile, row_ok, kb, stride_br, stride_bsr):
    """(dot of A's and B's 128-wide K block ``kb`` in float32, its per-row scale ``sa * sb``): one
    128x128 weight block spans the tile's columns, so the B scale is a scalar."""
    a = tl.load(a_tile + kb * 128, mask=row_ok[:, None], other=0.0)
    b = tl.load(b_tile + kb * 128 * stride_br)
    scale = tl.load(sa_row + kb, mask=row_ok, other=0.0) * tl.load(sb_tile + kb * stride_bsr)
    return tl.dot(a, b), scale


@triton.jit
def swizzled_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid`` over a ``num_pid_m x num_pid_n`` grid of tiles: GROUP_M row blocks
    sweep the N tiles together, so B_g's tiles are reused from L2 (also the Gluon kernel's order)."""
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * num_pid_n)) % rows_in_group, (pid % (GROUP_M * num_pid_n)) // rows_in_group


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, sizes_ptr, num_groups, M, N,
    stride_bg, stride_br, stride_bn, stride_bsg, stride_bsr, stride_bsn,
    R: tl.constexpr, GROUPED: tl.constexpr, MAX_GROUPS: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """One [128, BLOCK_N] tile of C (N % BLOCK_N == 0, BLOCK_N <= 128 within one 128-column weight block):
    A's column block ``pid_m`` (group-relative 128 rows) times B_g. Two K blocks per iteration: the second
    block's MMAs are issued before the first one's promotion (docs/grouped_gemm.md). Rows after the
    ``num_groups`` groups are not touched."""
    num_pid_n = N // BLOCK_N
    num_pid_m = tl.num_programs(0) // num_pid_n
    pid_m, pid_n = swizzled_tile(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)

    start, count, g, _, _ = column_block_rows(pid_m, sizes_ptr, num_groups, M, GROUPED, MAX_GROUPS)
    if count > 0:
        rows = start + tl.arange(0, 128)
        row_ok = rows < start + count
        rows64 = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, 128)
        a_tile = a_ptr + rows64[:, None] * R + kk[None, :]
        b_tile = b_ptr + g.to(tl.int64) * stride_bg + kk[:, None] * stride_br + cols[None, :] * stride_bn
        sa_row = as_ptr + rows64 * (R // 128)
        sb_tile = bs_ptr + g * stride_bsg + (pid_n * BLOCK_N // 128) * stride_bsn
        acc = tl.zeros((128, BLOCK_N), tl.float32)
        for kp in tl.range(0, R // 256, num_stages=NUM_STAGES):
            p0, s0 = _scaled_block(a_tile, b_tile, sa_row, sb_tile, row_ok, 2 * kp, stride_br, stride_bsr)
            p1, s1 = _scaled_block(a_tile, b_tile, sa_row, sb_tile, row_ok, 2 * kp + 1, stride_br, stride_bsr)
            acc += p0 * s0[:, None]
            acc += p1 * s1[:, None]
        if R // 128 % 2:
            p, s = _scaled_block(a_tile, b_tile, sa_row, sb_tile, row_ok, R // 128 - 1, stride_br, stride_bsr)
            acc += p * s[:, None]
        c = c_ptr + rows64[:, None] * N + cols[None, :]
        tl.store(c, cast_for_store(acc, c_ptr.dtype.element_ty, SOFTWARE_CAST), mask=row_ok[:, None])


@triton.jit
def _wgrad_step(acc, at_ptr, ats_ptr, bt_ptr, bts_ptr, j, first_row, size, first_block, N, K, n_rows, k_rows):
    """acc += (dY_g^T block j) @ (X_g^T block j)^T with both 128x1 scales; group g's operands are its
    expert-major ``[N, size]`` / ``[K, size]`` blocks at elements ``first_row * N`` / ``first_row * K``."""
    kk = j * 128 + tl.arange(0, 128)
    ok = kk < size
    a = tl.load(at_ptr + first_row.to(tl.int64) * N + n_rows.to(tl.int64)[:, None] * size + kk[None, :],
                mask=ok[None, :], other=0.0)
    b = tl.load(bt_ptr + first_row.to(tl.int64) * K + k_rows.to(tl.int64)[:, None] * size + kk[None, :],
                mask=ok[None, :], other=0.0)
    cb = first_block + j
    sa = tl.load(ats_ptr + cb * N + n_rows)
    sb = tl.load(bts_ptr + cb * K + k_rows)
    return acc + tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    at_ptr, ats_ptr, bt_ptr, bts_ptr, c_ptr, sizes_ptr, num_groups, N, K,
    MAX_GROUPS: tl.constexpr, ACCUMULATE: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    C_TABLE: tl.constexpr = False, C_ALIGNED: tl.constexpr = True, C_DESC: tl.constexpr = False,
    ROUND_BF16: tl.constexpr = False,
):
    """One [BLOCK_N, BLOCK_K] tile of C_g [N, K] (float32; N % BLOCK_N == K % BLOCK_K == 0), reducing over
    group g's tokens. Consecutive programs take consecutive N tiles: they share X^T's rows in L2. C is
    ``[G, N, K]`` at ``c_ptr``; with ``C_DESC`` the same seen as ``[G * N, K]`` through ``c_ptr``, a TMA
    descriptor of ``[BLOCK_N, BLOCK_K]`` blocks (the tile is stored, or added in L2, by one bulk copy); with
    ``C_TABLE`` G separate ``[N, K]`` whose addresses ``c_ptr`` lists (int64; ``C_ALIGNED``: all 16-byte
    aligned). ``ROUND_BF16``: the float32 tile rounded to BF16 before it is written into or added to a float32 C
    (what adding a BF16 ``.grad`` gives)."""
    num_n = N // BLOCK_N
    num_k = K // BLOCK_K
    pid = tl.program_id(0)
    g = pid // (num_n * num_k)
    n0 = pid % num_n * BLOCK_N  # the tile's first row and column of C_g
    k0 = (pid // num_n) % num_k * BLOCK_K
    n_rows = n0 + tl.arange(0, BLOCK_N)
    k_rows = k0 + tl.arange(0, BLOCK_K)
    first_row, size, first_block = group_extent(g, sizes_ptr, num_groups, MAX_GROUPS)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    if SOFTWARE_CAST:  # the interpreter: it cannot range() over run-time values
        j = 0
        while j * 128 < size:
            acc = _wgrad_step(acc, at_ptr, ats_ptr, bt_ptr, bts_ptr, j, first_row, size, first_block,
                              N, K, n_rows, k_rows)
            j += 1
    elif (first_row % 16 == 0) & (size % 16 == 0):
        # Rewritten so the compiler can prove the group's row stride and the mask's edge multiples of 16:
        # loads then vectorize and pipeline (4.5x faster than the general loop below, docs/grouped_gemm.md).
        first16 = first_row // 16 * 16
        size16 = size // 16 * 16
        for j in tl.range(0, tl.cdiv(size, 128), num_stages=NUM_STAGES):
            acc = _wgrad_step(acc, at_ptr, ats_ptr, bt_ptr, bts_ptr, j, first16, size16, first_block,
                              N, K, n_rows, k_rows)
    else:
        for j in tl.range(0, tl.cdiv(size, 128), num_stages=NUM_STAGES):
            acc = _wgrad_step(acc, at_ptr, ats_ptr, bt_ptr, bts_ptr, j, first_row, size, first_block,
                              N, K, n_rows, k_rows)
    if ROUND_BF16:
        acc = cast_for_store(acc, tl.bfloat16, SOFTWARE_CAST).to(tl.float32)
    if C_DESC:
        if ACCUMULATE:
            c_ptr.atomic_add([g * N + n0, k0], acc)  # one addition per element, as below: the same bits
        else:
            c_ptr.store([g * N + n0, k0], cast_for_store(acc, c_ptr.dtype, SOFTWARE_CAST))
    else:
        if C_TABLE:
            c_g = tl.load(c_ptr + g).to(tl.pointer_type(tl.float32))
            if C_ALIGNED:
                c_g = tl.multiple_of(c_g, 16)
        else:
            c_g = c_ptr + g.to(tl.int64) * N * K
        c = c_g + n_rows.to(tl.int64)[:, None] * K + k_rows[None, :]
        if ACCUMULATE:
            acc += tl.load(c)
        tl.store(c, cast_for_store(acc, c.dtype.element_ty, SOFTWARE_CAST))


@triton.jit
def _zero_weightless_rows_kernel(c_ptr, sizes_ptr, num_groups, num_weights, M, N,
                                 MAX_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zero ``[128, BLOCK_N]`` of ``C [M, N]`` where its rows lie after the first ``num_weights`` groups;
    programs wholly before them return at once."""
    first, _, _ = group_extent(num_weights, sizes_ptr, num_groups, MAX_GROUPS)
    rows = tl.program_id(0) * 128 + tl.arange(0, 128)
    if tl.program_id(0) * 128 + 128 > first:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = ((rows >= first) & (rows < M))[:, None] & (cols < N)[None, :]
        zeros = tl.zeros((128, BLOCK_N), c_ptr.dtype.element_ty)
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], zeros, mask=ok)


@triton.jit
def _expert_major_scales_kernel(s_ptr, out_ptr, sizes_ptr, num_groups, S: tl.constexpr, S_PAD: tl.constexpr,
                                MAX_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows ``[BLOCK_M * program_id(1), ...)`` of group ``program_id(0)`` of ``s [M, S]``, transposed into the
    group's ``[S, m_g]`` block at element ``S * first_g`` of ``out``."""
    first, size, _ = group_extent(tl.program_id(0), sizes_ptr, num_groups, MAX_GROUPS)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, S_PAD)
    ok = (r < size)[:, None] & (c < S)[None, :]
    first64 = first.to(tl.int64)
    v = tl.load(s_ptr + (first64 + r)[:, None] * S + c[None, :], mask=ok)
    tl.store(out_ptr + first64 * S + c.to(tl.int64)[None, :] * size + r[:, None], v, mask=ok)


def expert_major_scales(scale_inv: torch.Tensor, m_splits) -> torch.Tensor:
    """The 1x128 scales ``scale_inv [M, S]`` (float32, COMPACT) of the rows the host list ``m_splits`` groups (its
    leading ``sum(m_splits)`` rows) -> float32 ``[sum(m_splits) * S]``: each group's scales transposed, ``[S, m_g]``,
    at element ``S * (m_0 + ... + m_{g-1})``: ``layout.to_columnwise(scale_inv, m_splits)``, bit for bit, and the
    per-expert ``VEC128_32F`` layout cuBLASLt reads (``kernels/cublaslt.grouped_gemm``). One launch, no host
    sync."""
    rows, s = sum(m_splits), scale_inv.shape[1]
    scale_inv = scale_inv.contiguous()  # (COMPACT scales are: no copy)
    out = torch.empty(rows * s, dtype=scale_inv.dtype, device=scale_inv.device)
    if rows and s:
        sizes, g, _, max_groups = group_sizes_arg(m_splits, scale_inv.device)
        _expert_major_scales_kernel[(g, triton.cdiv(max(m_splits), EXPERT_MAJOR_ROWS))](
            scale_inv, out, sizes, g, S=s, S_PAD=triton.next_power_of_2(s), MAX_GROUPS=max_groups,
            BLOCK_M=EXPERT_MAJOR_ROWS)
    return out


def zero_weightless_rows(c, m_splits, num_weights):
    """Zero the rows of ``c [M, N]`` after the first ``num_weights`` groups of ``m_splits`` (host list or
    device tensor: no host sync), for a GEMM that skips them (DeepGEMM's ``m_indices`` -1)."""
    m, n = c.shape
    if m and n and m_splits is not None and len(m_splits) > num_weights:
        sizes, g, _, max_groups = group_sizes_arg(m_splits, c.device)
        grid = (triton.cdiv(m, 128), triton.cdiv(n, 512))
        _zero_weightless_rows_kernel[grid](c, sizes, g, num_weights, m, n, MAX_GROUPS=max_groups, BLOCK_N=512)
    return c


def grouped_gemm(a, a_scale_inv, b, b_scale_inv, m_splits, out_dtype=torch.bfloat16, config=None):
    """``a [M, R]`` FP8 with ``a_scale_inv [M, R/128]``; ``b`` ``[G, N, R]`` FP8 (K-major: the weights for
    fprop, their per-expert transpose for dgrad) with 128x128 ``b_scale_inv`` ``[G, N/128, R/128]``;
    ``m_splits`` list or device int tensor (G groups, or G + 1: the last one weightless, its rows zero)
    -> ``C [M, N] = A @ B_g^T`` per group in ``out_dtype``."""
    m, r = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if r == 0:
        return c.zero_()
    block_n, group_m, num_warps, num_stages = config or GEMM_CONFIG
    num_weights = b.shape[0]
    sizes, g, grouped, max_groups = group_sizes_arg(m_splits, a.device)
    # B_g[r, n] = b[g, n, r]
    strides = (b.stride(0), b.stride(2), b.stride(1), b_scale_inv.stride(0), b_scale_inv.stride(2),
               b_scale_inv.stride(1))
    if n % block_n or 128 % block_n:
        raise ValueError(f"N={n} must be a multiple of BLOCK_N={block_n}, which must divide 128")
    grid = (num_column_blocks(m, m_splits) * (n // block_n),)
    _grouped_gemm_kernel[grid](
        # a trailing weightless group is left out: the kernel sees the weights' groups only (its blocks find none)
        a, a_scale_inv, b, b_scale_inv, c, sizes, min(g, num_weights), m, n, *strides,
        R=r, GROUPED=grouped, MAX_GROUPS=max_groups, SOFTWARE_CAST=use_software_cast(a),
        BLOCK_N=block_n, GROUP_M=group_m, NUM_STAGES=num_stages, num_warps=num_warps, num_stages=num_stages,
    )
    return zero_weightless_rows(c, m_splits, num_weights)


def grouped_gemm_wgrad(a_t, a_t_scale_inv, b_t, b_t_scale_inv, m_splits, out=None, accumulate=False,
                       out_dtype=torch.float32, config=None):
    """``a_t``, ``b_t``: the expert-major 128x1 columnwise data (``[M*N]``, ``[M*K]``, ``layout.py``) of
    ``dY [M, N]`` and ``X [M, K]`` grouped by ``m_splits``, with block-major scales ``[num_column_blocks, N]``
    and ``[.., K]`` -> ``C [G, N, K]`` in ``out_dtype`` (or written into ``out``, or added to it when
    ``accumulate``, float32, after rounding to ``out_dtype``; ``out`` may also be a list of G float32 ``[N, K]``,
    anywhere in memory). N and K multiples of the block shape (128). ``m_splits`` may sum to fewer rows than the
    operands hold: the rows after its G groups (a weightless group) are not read."""
    n, k = a_t_scale_inv.shape[1], b_t_scale_inv.shape[1]
    sizes, g, _, max_groups = group_sizes_arg(m_splits, a_t.device)
    given = out is not None
    if out is None:
        out = torch.empty((g, n, k), dtype=out_dtype, device=a_t.device)
    if g == 0 or n == 0 or k == 0:
        return out
    block_n, block_k, num_warps, num_stages = config or WGRAD_CONFIG
    if isinstance(out, list):
        c, aligned = address_table(out)
    elif takes_tma_epilogue(out):
        c, aligned = TensorDescriptor.from_tensor(out.view(g * n, k), [block_n, block_k]), True
    else:
        c, aligned = out, True
    grid = (g * (n // block_n) * (k // block_k),)
    _grouped_wgrad_kernel[grid](
        a_t, a_t_scale_inv, b_t, b_t_scale_inv, c, sizes, g, n, k,
        MAX_GROUPS=max_groups, ACCUMULATE=bool(accumulate), SOFTWARE_CAST=use_software_cast(a_t),
        BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages, C_TABLE=isinstance(out, list), C_ALIGNED=aligned,
        C_DESC=isinstance(c, TensorDescriptor), ROUND_BF16=given and out_dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def takes_tma_epilogue(out: torch.Tensor) -> bool:
    """Whether the wgrad kernel stores (or adds) its tiles into ``out [G, N, K]`` by TMA: on the GPU (CPU tensors
    are the interpreter's, which takes the pointer stores), for a contiguous ``out`` at a 16-byte aligned address
    (a ``main_grad`` view elsewhere in a buffer may not be; it takes the pointer stores, bitwise the same).
    Measured in docs/grouped_gemm.md ("The wgrad's TMA epilogue")."""
    return out.is_cuda and out.is_contiguous() and out.data_ptr() % 16 == 0
