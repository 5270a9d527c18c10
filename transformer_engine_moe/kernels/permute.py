"""Triton kernels for MoE permute / unpermute (see ``reference/permute.py`` for the layouts).

* ``routing_layout``: ``_chunk_counts_kernel`` (experts' tokens per chunk of
  tokens), ``_chunk_scan_kernel`` (prefix over chunks, totals), ``_expert_layout_kernel``
  (expert starts, padding) and ``_row_id_map_kernel`` (per token its
  destination rows and experts, routed first). A torch cumsum down the token
  dimension of the map took 2.9 ms at 16384 x 32; these take microseconds.
* ``_permute_kernel``: one program per token and hidden chunk reads the row once
  and writes it to each of its experts' rows (FP8 bytes, their scale row and the
  prob move together); a token is read once, not once per expert. It marks the
  rows it writes in an occupancy byte per row.
* ``_fill_kernel``: zeros (scale_inv 1, prob 0) into rows not marked occupied.
* ``_unpermute_kernel``: per token, float32 sum over its experts' rows (times the
  merging prob), ascending expert order, no FMA contraction (bitwise equal to
  the reference).
* ``_unpermute_backward_kernel``: per token, ``grad * p`` into each expert row
  and ``dprob = <row, grad>``.

Row data is moved as integers of the element size (bytes for FP8), never
converted. No kernel needs a host copy of any count.

The launchers take tensors of any strides (an expanded, sliced or transposed view is made
contiguous, a copy only then) and no kernel reads or writes outside a tensor on any map:
every index it loads is masked on the device against the tensor it addresses, an out-of-range
map entry being a dropped pair (``_pair``, as ``reference.permute.pair_slots``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .casts import cast_for_store, to_float, use_software_cast

# (BLOCK_H in elements, num_warps), from benchmarks/bench_permute.py's sweep.
PERMUTE_CONFIG = (2048, 4)
UNPERMUTE_CONFIG = (1024, 4)
FILL_ROWS = 32

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def as_int(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as integers of the element size (row data is copied, never converted)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


@triton.jit
def _topk_routing_kernel(idx_ptr, w_ptr, map_ptr, probs_ptr, err_ptr, T, K, E, K_PAD: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Tokens ``[BLOCK_T]`` x experts ``[BLOCK_E]``: each routing map and probs entry from the token's k slots,
    the duplicates counted there; the first expert block also counts the ids outside [-1, E)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, K_PAD)
    in_slot = (rows[:, None] < T) & (slots[None, :] < K)
    offs = rows[:, None].to(tl.int64) * K + slots[None, :]
    ids = tl.load(idx_ptr + offs, mask=in_slot, other=-1).to(tl.int64)
    w = tl.load(w_ptr + offs, mask=in_slot, other=0.0).to(tl.float32)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    hit = ids[:, :, None] == experts[None, None, :]
    count = tl.sum(hit.to(tl.int32), axis=1)
    # one term where valid, added to +0.0 as the reference's scatter into zeros adds it (a -0.0 weight gives +0.0)
    prob = tl.sum(tl.where(hit, w[:, :, None], 0.0), axis=1) + 0.0
    out = (rows[:, None] < T) & (experts[None, :] < E)
    dest = rows[:, None].to(tl.int64) * E + experts[None, :]
    tl.store(map_ptr + dest, (count > 0).to(tl.uint8), mask=out)
    tl.store(probs_ptr + dest, prob.to(probs_ptr.dtype.element_ty), mask=out)
    # atomics only where there is something to count: on one address from every program they serialise
    dups = tl.sum(tl.sum(tl.where(out & (count > 1), 1, 0), axis=1), axis=0)
    if dups > 0:
        tl.atomic_add(err_ptr + 1, dups)
    if tl.program_id(1) == 0:
        bad = tl.sum(tl.sum(tl.where(in_slot & ((ids < -1) | (ids >= E)), 1, 0), axis=1), axis=0)
        if bad > 0:
            tl.atomic_add(err_ptr, bad)


@triton.jit
def _chunk_counts_kernel(mask_ptr, counts_ptr, T, E, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """counts[c, e] = tokens of chunk c (BLOCK_T tokens) routed to expert e."""
    c = tl.program_id(0)
    t = (c * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    e = tl.arange(0, E_PAD)
    ok = (t < T)[:, None] & (e < E)[None, :]
    routed = (tl.load(mask_ptr + t[:, None] * E + e[None, :], mask=ok, other=0) != 0).to(tl.int32)
    tl.store(counts_ptr + c * E + e, tl.sum(routed, axis=0), mask=e < E)


@triton.jit
def _chunk_scan_kernel(counts_ptr, prefix_ptr, totals_ptr, NC, E, EB: tl.constexpr, CT: tl.constexpr):
    """Per expert: prefix[c, e] = tokens routed to e by chunks before c; totals[e] = all of them."""
    e = tl.program_id(0) * EB + tl.arange(0, EB)
    carry = tl.zeros([EB], tl.int32)
    c0 = 0
    while c0 < NC:  # while loops: Triton's interpreter cannot range() over run-time values
        c = c0 + tl.arange(0, CT)
        ok = (c < NC)[:, None] & (e < E)[None, :]
        counts = tl.load(counts_ptr + c[:, None] * E + e[None, :], mask=ok, other=0)
        tl.store(prefix_ptr + c[:, None] * E + e[None, :], carry[None, :] + tl.cumsum(counts, axis=0) - counts,
                 mask=ok)
        carry += tl.sum(counts, axis=0)
        c0 += CT
    tl.store(totals_ptr + e, carry, mask=e < E)


@triton.jit
def _expert_layout_kernel(totals_ptr, start_ptr, pad_ptr, padded_ptr, E, ALIGN, E_PAD: tl.constexpr):
    """start[e] (unpadded first row), pad_offsets[e] and padded counts from the per-expert totals."""
    e = tl.arange(0, E_PAD)
    totals = tl.load(totals_ptr + e, mask=e < E, other=0).to(tl.int64)
    padded = (totals + ALIGN - 1) // ALIGN * ALIGN
    extra = padded - totals
    tl.store(start_ptr + e, (tl.cumsum(totals, axis=0) - totals).to(tl.int32), mask=e < E)
    tl.store(pad_ptr + e, tl.cumsum(extra, axis=0) - extra, mask=e < E)
    tl.store(padded_ptr + e, padded, mask=e < E)


@triton.jit
def _row_id_map_kernel(
    mask_ptr, prefix_ptr, start_ptr, map_ptr, T, E,
    E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Chunk c (BLOCK_T tokens) -> its row_id_map rows [T, 2E+1] (rows, experts, count; -1 unused)."""
    c = tl.program_id(0)
    t = (c * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    e = tl.arange(0, E_PAD)
    ok = (t < T)[:, None] & (e < E)[None, :]
    routed = (tl.load(mask_ptr + t[:, None] * E + e[None, :], mask=ok, other=0) != 0) & ok
    r = routed.to(tl.int32)
    base_row = tl.load(start_ptr + e, mask=e < E, other=0) + tl.load(prefix_ptr + c * E + e, mask=e < E, other=0)
    row = base_row[None, :] + tl.cumsum(r, axis=0) - r  # rank among the expert's tokens
    pos = tl.cumsum(r, axis=1) - r  # place among the token's routed experts
    n = tl.sum(r, axis=1)
    width = 2 * E + 1
    base = map_ptr + t[:, None] * width
    unused = ok & (e[None, :] >= n[:, None])  # places past the routed ones
    tl.store(base + e[None, :], tl.full([BLOCK_T, E_PAD], -1, tl.int32), mask=unused)
    tl.store(base + E + e[None, :], tl.full([BLOCK_T, E_PAD], -1, tl.int32), mask=unused)
    tl.store(base + pos, row, mask=routed)
    tl.store(base + E + pos, (e[None, :] + tl.zeros([BLOCK_T, E_PAD], tl.int32)), mask=routed)
    tl.store(map_ptr + t * width + 2 * E, n, mask=t < T)


@triton.jit
def _count(map_ptr, t, E):
    """Token t's pair count ``row_id_map[t, 2E]``, clamped to [0, E]: its slots never leave its map row."""
    return tl.minimum(tl.maximum(tl.load(map_ptr + t * (2 * E + 1) + 2 * E), 0), E)


@triton.jit
def _pair(map_ptr, pad_ptr, t, j, n, E, R, PADDED: tl.constexpr):
    """``(row, expert, ok)`` of token t's slot j (scalar or vector; n from ``_count``): its output row
    (int64, after padding) and expert, and whether it is a pair: j < n, the expert in [0, E), the row >= 0
    and the final row in [0, R) (``reference.permute.pair_slots``). Row and expert are 0 where not ok, so
    every address formed from them is inside its tensor."""
    width = 2 * E + 1
    used = j < n
    row = tl.load(map_ptr + t * width + j, mask=used, other=-1).to(tl.int64)
    expert = tl.load(map_ptr + t * width + E + j, mask=used, other=-1)
    ok = used & (expert >= 0) & (expert < E) & (row >= 0)
    expert = tl.where(ok, expert, 0)
    if PADDED:
        row += tl.load(pad_ptr + expert, mask=ok, other=0).to(tl.int64)
    ok = ok & (row >= 0) & (row < R)
    return tl.where(ok, row, 0), expert, ok


@triton.jit
def _permute_kernel(
    x_ptr, map_ptr, pad_ptr, probs_ptr, s_ptr,
    out_ptr, out_probs_ptr, out_s_ptr, occupied_ptr,
    H, E, S, R,
    PADDED: tl.constexpr, HAS_PROBS: tl.constexpr, HAS_SCALES: tl.constexpr,
    E_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Token t, hidden chunk -> its row of each routed expert (of the R output rows); chunk 0 also moves
    scales and probs and marks the rows occupied."""
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    h = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + t * H + h, mask=h < H)
    n = _count(map_ptr, t, E)
    slot = tl.arange(0, E_PAD)
    rows, experts, ok = _pair(map_ptr, pad_ptr, t, slot, n, E, R, PADDED)
    first = chunk == 0
    if first:
        tl.store(occupied_ptr + rows, tl.full([E_PAD], 1, tl.int8), mask=ok)
        if HAS_PROBS:
            tl.store(out_probs_ptr + rows, tl.load(probs_ptr + t * E + experts, mask=ok), mask=ok)
    if HAS_SCALES:
        sj = tl.arange(0, S_PAD)
        scales = tl.load(s_ptr + t * S + sj, mask=(sj < S) & first)
    j = 0
    while j < n:  # while loops: Triton's interpreter cannot range() over run-time values
        row = tl.sum(tl.where(slot == j, rows, 0), axis=0)
        pair = tl.sum(tl.where((slot == j) & ok, 1, 0), axis=0) > 0
        tl.store(out_ptr + row * H + h, x, mask=(h < H) & pair)
        if HAS_SCALES:
            tl.store(out_s_ptr + row * S + sj, scales, mask=(sj < S) & first & pair)
        j += 1


@triton.jit
def _fill_kernel(
    out_ptr, out_probs_ptr, out_s_ptr, occupied_ptr, R, H, S,
    HAS_PROBS: tl.constexpr, HAS_SCALES: tl.constexpr,
    S_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rows [BLOCK_R] of an [R, H] output that no pair landed on (occupied == 0): padding after an
    expert's tokens, slack after the last expert -> 0 (scale_inv 1, prob 0). Fully occupied row
    blocks, the common case, only read their occupancy bytes."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    fill = tl.load(occupied_ptr + r, mask=r < R, other=1) == 0
    if tl.max(fill.to(tl.int32), axis=0) > 0:
        zeros = tl.zeros([BLOCK_R, BLOCK_H], out_ptr.dtype.element_ty)
        h0 = 0
        while h0 < H:  # while loops: Triton's interpreter cannot range() over run-time values
            h = h0 + tl.arange(0, BLOCK_H)
            tl.store(out_ptr + r[:, None] * H + h[None, :], zeros, mask=fill[:, None] & (h < H)[None, :])
            h0 += BLOCK_H
        if HAS_PROBS:
            tl.store(out_probs_ptr + r, tl.zeros([BLOCK_R], out_probs_ptr.dtype.element_ty), mask=fill)
        if HAS_SCALES:
            sj = tl.arange(0, S_PAD)
            ones = tl.full([BLOCK_R, S_PAD], 1.0, tl.float32)
            tl.store(out_s_ptr + r[:, None] * S + sj[None, :], ones, mask=fill[:, None] & (sj < S)[None, :])


@triton.jit
def _unpermute_kernel(
    x_ptr, map_ptr, pad_ptr, probs_ptr, out_ptr, H, E, R,
    PADDED: tl.constexpr, HAS_PROBS: tl.constexpr, SOFTWARE_CAST: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t, chunk] = sum over t's pairs (ascending) of prob * x[row] (x: R rows), float32, cast once."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    n = _count(map_ptr, t, E)
    acc = tl.zeros([BLOCK_H], tl.float32)
    j = 0
    while j < n:
        row, expert, ok = _pair(map_ptr, pad_ptr, t, j, n, E, R, PADDED)
        term = to_float(tl.load(x_ptr + row * H + h, mask=(h < H) & ok, other=0.0), SOFTWARE_CAST)
        if HAS_PROBS:
            term = term * to_float(tl.load(probs_ptr + t * E + expert, mask=ok, other=0.0), SOFTWARE_CAST)
        acc = tl.where(ok, acc + term, acc)
        j += 1
    tl.store(out_ptr + t * H + h, cast_for_store(acc, out_ptr.dtype.element_ty, SOFTWARE_CAST), mask=h < H)


@triton.jit
def _unpermute_backward_kernel(
    g_ptr, x_ptr, map_ptr, pad_ptr, probs_ptr, dx_ptr, dprobs_ptr, occupied_ptr, H, E, R,
    PADDED: tl.constexpr, SOFTWARE_CAST: tl.constexpr, E_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Token t: dx[row(t, e)] = g[t] * p[t, e]; dprobs[t, e] = <x[row(t, e)], g[t]> (float32);
    the rows (R, of dx and of x) are marked occupied."""
    t = tl.program_id(0).to(tl.int64)
    n = _count(map_ptr, t, E)
    slots = tl.arange(0, E_PAD)
    dots = tl.zeros([E_PAD], tl.float32)
    h0 = 0
    while h0 < H:
        h = h0 + tl.arange(0, BLOCK_H)
        g = to_float(tl.load(g_ptr + t * H + h, mask=h < H, other=0.0), SOFTWARE_CAST)
        j = 0
        while j < n:
            row, expert, ok = _pair(map_ptr, pad_ptr, t, j, n, E, R, PADDED)
            p = to_float(tl.load(probs_ptr + t * E + expert, mask=ok, other=0.0), SOFTWARE_CAST)
            tl.store(occupied_ptr + row, 1, mask=ok)
            tl.store(dx_ptr + row * H + h, cast_for_store(g * p, dx_ptr.dtype.element_ty, SOFTWARE_CAST),
                     mask=(h < H) & ok)
            x = to_float(tl.load(x_ptr + row * H + h, mask=(h < H) & ok, other=0.0), SOFTWARE_CAST)
            dots += tl.where(slots == j, tl.sum(x * g, axis=0), 0.0)
            j += 1
        h0 += BLOCK_H
    _, experts, ok = _pair(map_ptr, pad_ptr, t, slots, n, E, R, PADDED)
    tl.store(dprobs_ptr + t * E + experts, dots, mask=ok)


def _dense(*tensors):
    """The tensors (None passes) contiguous, as every kernel here addresses them: a copy only of a view
    with other strides (expanded, sliced, transposed)."""
    return tuple(t.contiguous() if t is not None else None for t in tensors)


def topk_routing(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """``topk_idx [T, k]`` int, ``topk_weights [T, k]`` float -> ``(routing_map [T, E] bool, probs [T, E],
    errors [2] int32)`` as the reference's; one launch (and the errors' zeroing), no host sync."""
    topk_idx, topk_weights = _dense(topk_idx, topk_weights)
    t, k = topk_idx.shape
    dev = topk_idx.device
    routing_map = torch.empty((t, num_experts), dtype=torch.bool, device=dev)
    probs = torch.empty((t, num_experts), dtype=topk_weights.dtype, device=dev)
    errors = torch.zeros(2, dtype=torch.int32, device=dev)
    if t * k == 0:
        return routing_map.fill_(False), probs.zero_(), errors
    k_pad = triton.next_power_of_2(k)
    block_e = min(128, triton.next_power_of_2(num_experts))
    block_t = max(1, min(64, 8192 // (k_pad * block_e)))
    grid = (triton.cdiv(t, block_t), triton.cdiv(num_experts, block_e))
    _topk_routing_kernel[grid](topk_idx, topk_weights, routing_map.view(torch.uint8), probs, errors, t, k,
                               num_experts, K_PAD=k_pad, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4)
    return routing_map, probs, errors


def routing_layout(routing_map: torch.Tensor, align_size: int):
    """``routing_map [T, E]`` bool -> ``(row_id_map [T, 2E+1] int32, tokens_per_expert [E] int64,
    pad_offsets [E] int64, padded_tokens_per_expert [E] int64)``; four small launches, no host sync."""
    (routing_map,) = _dense(routing_map)
    t, e = routing_map.shape
    dev = routing_map.device
    e_pad = triton.next_power_of_2(e)
    block_t = max(1, min(64, 4096 // e_pad))
    nc = triton.cdiv(t, block_t)
    mask = routing_map.view(torch.uint8)
    counts = torch.empty((nc, e), dtype=torch.int32, device=dev)
    prefix = torch.empty((nc, e), dtype=torch.int32, device=dev)
    totals = torch.zeros(e, dtype=torch.int32, device=dev)
    if t > 0:
        _chunk_counts_kernel[(nc,)](mask, counts, t, e, E_PAD=e_pad, BLOCK_T=block_t, num_warps=4)
        _chunk_scan_kernel[(triton.cdiv(e, 32),)](counts, prefix, totals, nc, e, EB=32, CT=64, num_warps=4)
    start = torch.empty(e, dtype=torch.int32, device=dev)
    pad_offsets = torch.empty(e, dtype=torch.int64, device=dev)
    padded = torch.empty(e, dtype=torch.int64, device=dev)
    _expert_layout_kernel[(1,)](totals, start, pad_offsets, padded, e, max(align_size, 1), E_PAD=e_pad, num_warps=4)
    rmap = torch.empty((t, 2 * e + 1), dtype=torch.int32, device=dev)
    if t > 0:
        _row_id_map_kernel[(nc,)](mask, prefix, start, rmap, t, e, E_PAD=e_pad, BLOCK_T=block_t, num_warps=4)
    return rmap, totals.to(torch.int64), pad_offsets, padded


def fill(out, out_probs, out_scale, occupied):
    """Zero the rows of ``out`` (and ``out_probs``; scale_inv 1 in ``out_scale``) whose ``occupied``
    byte is 0."""
    r, hsize = out.shape
    if r == 0:
        return
    s = out_scale.shape[1] if out_scale is not None else 1
    block_h = min(triton.next_power_of_2(max(hsize, 1)), 1024)
    dummy = out.new_empty(0)
    _fill_kernel[(triton.cdiv(r, FILL_ROWS),)](
        as_int(out), out_probs if out_probs is not None else dummy, out_scale if out_scale is not None else dummy,
        occupied, r, hsize, s,
        HAS_PROBS=out_probs is not None, HAS_SCALES=out_scale is not None,
        S_PAD=triton.next_power_of_2(s), BLOCK_R=FILL_ROWS, BLOCK_H=block_h, num_warps=4,
    )


def permute(x, row_id_map, capacity, pad_offsets=None, probs=None, scale_inv=None, config=None):
    """Rows of ``x [T, H]`` to their expert-major rows of ``[capacity, H]``, with ``scale_inv [T, S]`` and
    ``probs [T, E]``; every other row is zero (scale_inv 1, prob 0). Returns ``(out, out_probs, out_scale)``."""
    x, row_id_map, pad_offsets, probs, scale_inv = _dense(x, row_id_map, pad_offsets, probs, scale_inv)
    t, hsize = x.shape
    e = (row_id_map.shape[1] - 1) // 2
    out = torch.empty((capacity, hsize), dtype=x.dtype, device=x.device)
    out_probs = torch.empty(capacity, dtype=probs.dtype, device=x.device) if probs is not None else None
    out_scale = (torch.empty((capacity, scale_inv.shape[1]), dtype=torch.float32, device=x.device)
                 if scale_inv is not None else None)
    occupied = torch.zeros(capacity, dtype=torch.int8, device=x.device)
    if t > 0 and hsize > 0:
        block_h, num_warps = config or PERMUTE_CONFIG
        block_h = min(block_h, triton.next_power_of_2(hsize))
        s = scale_inv.shape[1] if scale_inv is not None else 1
        dummy = x.new_empty(0)
        _permute_kernel[(t, triton.cdiv(hsize, block_h))](
            as_int(x), row_id_map, pad_offsets if pad_offsets is not None else dummy,
            probs if probs is not None else dummy, scale_inv if scale_inv is not None else dummy,
            as_int(out), out_probs if out_probs is not None else dummy,
            out_scale if out_scale is not None else dummy, occupied,
            hsize, e, s, capacity,
            PADDED=pad_offsets is not None, HAS_PROBS=probs is not None, HAS_SCALES=scale_inv is not None,
            E_PAD=triton.next_power_of_2(e), S_PAD=triton.next_power_of_2(s), BLOCK_H=block_h, num_warps=num_warps,
        )
    fill(out, out_probs, out_scale, occupied)
    return out, out_probs, out_scale


def unpermute(x, row_id_map, merging_probs=None, pad_offsets=None, config=None):
    """``[T, H]``: per token, the float32 sum over its experts' rows of ``x`` (times ``merging_probs``)."""
    x, row_id_map, merging_probs, pad_offsets = _dense(x, row_id_map, merging_probs, pad_offsets)
    t, e = row_id_map.shape[0], (row_id_map.shape[1] - 1) // 2
    hsize = x.shape[1]
    out = torch.empty((t, hsize), dtype=x.dtype, device=x.device)
    if t > 0 and hsize > 0:
        block_h, num_warps = config or UNPERMUTE_CONFIG
        block_h = min(block_h, triton.next_power_of_2(hsize))
        dummy = x.new_empty(0)
        _unpermute_kernel[(t, triton.cdiv(hsize, block_h))](
            x, row_id_map, pad_offsets if pad_offsets is not None else dummy,
            merging_probs if merging_probs is not None else dummy, out, hsize, e, x.shape[0],
            PADDED=pad_offsets is not None, HAS_PROBS=merging_probs is not None,
            SOFTWARE_CAST=use_software_cast(x), BLOCK_H=block_h, num_warps=num_warps,
            enable_fp_fusion=False,  # one rounding per multiply and per add, as the reference
        )
    return out


def unpermute_backward(grad, x, row_id_map, merging_probs, capacity, pad_offsets=None):
    """``(dx [capacity, H], dprobs [T, E])`` of ``unpermute`` with merging probs; rows of ``dx`` no pair
    lands on are zero; dprobs is float32 (0 where not routed). A pair's row must be a row of both ``dx`` and
    ``x`` (``min(capacity, x.shape[0])``, as the reference)."""
    grad, x, row_id_map, merging_probs, pad_offsets = _dense(grad, x, row_id_map, merging_probs, pad_offsets)
    t, e = row_id_map.shape[0], (row_id_map.shape[1] - 1) // 2
    hsize = grad.shape[1]
    dx = torch.empty((capacity, hsize), dtype=grad.dtype, device=grad.device)
    dprobs = torch.zeros((t, e), dtype=torch.float32, device=grad.device)
    occupied = torch.zeros(capacity, dtype=torch.int8, device=grad.device)
    if t > 0 and hsize > 0:
        dummy = grad.new_empty(0)
        _unpermute_backward_kernel[(t,)](
            grad, x, row_id_map, pad_offsets if pad_offsets is not None else dummy, merging_probs, dx, dprobs,
            occupied, hsize, e, min(capacity, x.shape[0]), PADDED=pad_offsets is not None,
            SOFTWARE_CAST=use_software_cast(grad),
            E_PAD=triton.next_power_of_2(e), BLOCK_H=min(1024, triton.next_power_of_2(hsize)), num_warps=4,
            enable_fp_fusion=False,
        )
    fill(dx, None, None, occupied)
    return dx, dprobs
