"""Plain-PyTorch MoE permutation: the oracle and the CPU path.

Terms, for T tokens, E experts, hidden size H:

* ``routing_map`` ``[T, E]`` bool: token t goes to expert e.
* ``row_id_map`` int32 ``[T, 2E+1]`` (TransformerEngine's layout): for token t,
  ``[t, :n]`` the destination rows of its n routed experts in ascending expert
  order, ``[t, E:E+n]`` those experts, ``[t, 2E] = n``; unused entries are -1.
  Destination rows are expert-major, token order within an expert, *without*
  padding: row = (tokens of experts < e) + (rank of t among e's tokens).
* ``pad_offsets`` int64 ``[E]``: padding rows inserted before expert e's rows
  (exclusive cumsum of ``padded - tokens_per_expert``); the final row of a pair
  is ``row + pad_offsets[e]``.
* Outputs have ``capacity`` rows; rows that no pair lands on (padding between
  experts, slack at the end) hold zeros (FP8: zero bytes, scale_inv 1; probs 0).
* A map entry out of range is a dropped pair, here and in the kernels alike (``pair_slots``):
  token t's slot j is a pair only if ``j < n`` (n clamped to ``[0, E]``), its expert lies in
  ``[0, E)``, its row is >= 0 and its final row lies in the rows of the tensor it addresses.
  A dropped pair is not written (its row stays zero unless another pair lands there) and adds
  nothing to its token's merge or gradients. ``moe_unpermute`` refuses such a map by name when
  it checks it; a map written through ``.data`` (no version bump) reaches the launchers, which
  never index outside a tensor.

Merges (unpermute) accumulate in float32 in ascending expert order, one
rounding per multiply and per add, then cast once to the output dtype.
"""

from __future__ import annotations

from typing import Optional

import torch


def make_row_id_map(routing_map: torch.Tensor) -> torch.Tensor:
    """``routing_map [T, E]`` bool -> ``row_id_map`` int32 ``[T, 2E+1]`` (see module doc)."""
    t, e = routing_map.shape
    m = routing_map.to(torch.int64)
    counts = m.sum(0)
    rank = torch.cumsum(m, 0) - m
    dest = torch.where(routing_map, (torch.cumsum(counts, 0) - counts)[None, :] + rank, -1)
    order = torch.argsort((~routing_map).to(torch.int8), dim=1, stable=True)  # routed experts first
    routed = torch.gather(routing_map, 1, order)
    rows = torch.where(routed, torch.gather(dest, 1, order), -1)
    experts = torch.where(routed, order, -1)
    return torch.cat([rows, experts, m.sum(1, keepdim=True)], dim=1).to(torch.int32)


def topk_routing(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """DeepEP's top-k format -> ``(routing_map [T, E] bool, probs [T, E], errors [2] int32)``.

    ``topk_idx [T, k]`` int32/int64 expert ids (-1: an unused slot), ``topk_weights [T, k]`` float: ``probs[t, e]``
    is the weight of token ``t``'s slot naming ``e`` (0 where no slot names it; an unused slot's weight is not
    read), in the weights' dtype. ``errors[0]``: how many ids lie outside ``[-1, E)``; ``errors[1]``: how many
    (token, expert) pairs more than one slot names; where either is nonzero the map and probs are meaningless
    (the op turns them into errors). No host sync."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    idx = torch.where(valid, topk_idx, 0).long()
    hits = torch.zeros((topk_idx.shape[0], num_experts), dtype=torch.int32, device=topk_idx.device)
    hits.scatter_add_(1, idx, valid.int())
    probs = torch.zeros((topk_idx.shape[0], num_experts), dtype=topk_weights.dtype, device=topk_idx.device)
    probs.scatter_add_(1, idx, torch.where(valid, topk_weights, 0.0))
    errors = torch.stack([((topk_idx < -1) | (topk_idx >= num_experts)).sum(), (hits > 1).sum()])
    return hits > 0, probs, errors.to(torch.int32)


def padding(tokens_per_expert: torch.Tensor, align_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pad_offsets, padded_tokens_per_expert)``, int64 ``[E]``: each expert's rows padded up to a
    multiple of ``align_size`` (<= 1: no padding)."""
    tpe = tokens_per_expert.to(torch.int64)
    padded = (tpe + align_size - 1) // align_size * align_size if align_size > 1 else tpe.clone()
    extra = padded - tpe
    return torch.cumsum(extra, 0) - extra, padded


def routing_layout(routing_map: torch.Tensor, align_size: int):
    """``(row_id_map, tokens_per_expert, pad_offsets, padded_tokens_per_expert)`` of a routing map."""
    counts = routing_map.sum(0)
    return (make_row_id_map(routing_map), counts) + padding(counts, align_size)


def pair_slots(row_id_map: torch.Tensor, pad_offsets: Optional[torch.Tensor], num_rows: int):
    """``(valid, expert, final)``, each ``[T, E]``: whether token t's slot j is a pair (module doc: j < n,
    expert in ``[0, E)``, row >= 0, final row in ``[0, num_rows)``), its expert and its final row (row +
    ``pad_offsets[expert]``); expert and final are 0 where not valid, so they index any tensor safely."""
    e = (row_id_map.shape[1] - 1) // 2
    rows, experts, n = row_id_map[:, :e].long(), row_id_map[:, e : 2 * e].long(), row_id_map[:, 2 * e :].long()
    valid = (torch.arange(e, device=row_id_map.device) < n) & (experts >= 0) & (experts < e) & (rows >= 0)
    experts = torch.where(valid, experts, 0)
    final = rows + (pad_offsets.long()[experts] if pad_offsets is not None else 0)
    valid &= (final >= 0) & (final < num_rows)
    return valid, torch.where(valid, experts, 0), torch.where(valid, final, 0)


def _pairs(row_id_map: torch.Tensor, pad_offsets: Optional[torch.Tensor], num_rows: int):
    """(token, expert, final row) of every pair (``pair_slots``), in token-major, ascending-slot order."""
    valid, experts, final = pair_slots(row_id_map, pad_offsets, num_rows)
    token = torch.arange(row_id_map.shape[0], device=row_id_map.device)[:, None].expand_as(valid)
    return token[valid], experts[valid], final[valid]


def permute(
    x: torch.Tensor,
    row_id_map: torch.Tensor,
    capacity: int,
    pad_offsets: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    scale_inv: Optional[torch.Tensor] = None,
):
    """Move rows of ``x [T, H]`` (any dtype, FP8 included: bytes are copied) to their expert-major
    rows of a ``[capacity, H]`` output; ``scale_inv [T, S]`` rows and ``probs [T, E]`` entries move
    with them. Returns ``(out, out_probs or None, out_scale_inv or None)``."""
    token, expert, final = _pairs(row_id_map, pad_offsets, capacity)
    out = torch.zeros((capacity, x.shape[1]), dtype=x.dtype, device=x.device)
    if x.dtype.itemsize == 1 and x.is_floating_point():  # FP8: move the bytes
        out.view(torch.uint8)[final] = x.view(torch.uint8)[token]
    else:
        out[final] = x[token]
    out_probs = out_scale = None
    if probs is not None:
        out_probs = torch.zeros(capacity, dtype=probs.dtype, device=probs.device)
        out_probs[final] = probs[token, expert]
    if scale_inv is not None:
        out_scale = torch.ones((capacity, scale_inv.shape[1]), dtype=scale_inv.dtype, device=scale_inv.device)
        out_scale[final] = scale_inv[token]
    return out, out_probs, out_scale


def unpermute(
    x: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: Optional[torch.Tensor] = None,
    pad_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[t] = sum_e merging_probs[t, e] * x[row(t, e)]`` over t's routed experts (no probs:
    plain sum), float32 accumulation in ascending expert order, cast to ``x``'s dtype. ``[T, H]``."""
    valid, experts, final = pair_slots(row_id_map, pad_offsets, x.shape[0])
    acc = torch.zeros((row_id_map.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
    tokens = torch.arange(row_id_map.shape[0], device=x.device)
    for j, used in enumerate(valid.any(0).tolist()):  # slot j: the j-th routed expert of every token
        if not used:
            continue
        term = x[final[:, j]].float()
        if merging_probs is not None:
            term = term * merging_probs[tokens, experts[:, j]].float()[:, None]
        acc = torch.where(valid[:, j, None], acc + term, acc)
    return acc.to(x.dtype)


def unpermute_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor,
    capacity: int,
    pad_offsets: Optional[torch.Tensor] = None,
):
    """Gradients of ``unpermute`` with merging probs: ``dinp [capacity, H]`` (``grad[t] * p[t, e]``
    at row(t, e), cast to ``grad``'s dtype; zeros elsewhere) and ``dprobs [T, E]``
    (``sum_h x[row(t, e), h] * grad[t, h]``, float32, 0 where not routed). A pair's row must be a row of
    both ``dinp`` and ``x`` (``min(capacity, x.shape[0])``; the two are equal from ``moe_unpermute``)."""
    token, expert, final = _pairs(row_id_map, pad_offsets, min(capacity, x.shape[0]))
    dinp = torch.zeros((capacity, grad.shape[1]), dtype=grad.dtype, device=grad.device)
    p = merging_probs[token, expert].float()
    dinp[final] = (grad[token].float() * p[:, None]).to(grad.dtype)
    dprobs = torch.zeros(merging_probs.shape, dtype=torch.float32, device=grad.device)
    dprobs[token, expert] = (x[final].float() * grad[token].float()).sum(1)
    return dinp, dprobs
