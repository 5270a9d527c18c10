"""AllToAllTokenDispatcher: the exchange primitives on ``torch.distributed.all_to_all_single``.

Works on any process group: NCCL on the GPU, gloo on the CPU. The send buffer is rank-major
(rows for rank 0, then rank 1, ...), in token order within a rank: ``moe_permute``'s layout with
the EP ranks as its "experts" (the permute kernels move the FP8 rows with their scales), so
combine is ``moe_unpermute``'s float32 sum over ranks in ascending rank order, cast to BF16 once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..layout import host_list
from ..ops.permute import permute_rows, row_id_map_of, unpermute_rows
from ..recipe import FP8FlowRecipe
from .base import check_ep_group, slots_per_expert
from .exchange import ExchangeTokenDispatcher, Rows


@dataclass(frozen=True, slots=True)
class AllToAllLayout:
    """``row_id_map``: int32 ``[T, 2G+1]``, the permute ops' map with the G ranks as experts (the
    send row of each (token, rank) pair); ``input_splits`` / ``output_splits``: host lists of rows
    sent to / received from each rank."""

    row_id_map: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]


class AllToAllTokenDispatcher(ExchangeTokenDispatcher):
    """Token dispatch with one ``all_to_all_single`` per payload tensor.

    Dispatch sends, per (token, rank owning one of its experts): the FP8 row as bytes and its
    float32 scale_inv row (or the BF16 row), the token's int64 global ``topk_ids`` and float32
    ``topk_probs``; the receiver maps ids to local ones. Host sync: ONE device-to-host copy per
    dispatch, of the per-rank row counts and the per-expert slot counts received (exchanged
    first, in one fixed-size all_to_all), which size the receive buffers and give
    ``tokens_per_expert``. Combine and both backward passes reuse those sizes: no sync.

    Args: ``num_experts``; ``ep_group`` (None: the default group); ``recipe`` (see
    ExchangeTokenDispatcher).
    """

    def __init__(self, num_experts: int, ep_group: Optional[dist.ProcessGroup] = None,
                 recipe: Optional[FP8FlowRecipe] = None):
        check_ep_group(ep_group)
        if not dist.is_initialized():
            raise RuntimeError("the alltoall dispatcher needs torch.distributed initialized (init_process_group)")
        self.ep_group = ep_group if ep_group is not None else dist.group.WORLD
        super().__init__(num_experts, dist.get_world_size(self.ep_group), dist.get_rank(self.ep_group), recipe)

    def _all_to_all(self, send: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        """Rows of ``send`` to each rank (``input_splits``), rows from each (``output_splits``). A group of
        one rank receives what it sends: ``send`` itself, no collective (as Megatron's ``all_to_all`` at
        world size 1; at EP=1 a layer made about ten one-rank NCCL calls, each a launch and a copy)."""
        if self.ep_size == 1:
            return send
        recv = send.new_empty((sum(output_splits),) + tuple(send.shape[1:]))
        dist.all_to_all_single(_wire(recv), _wire(send), output_splits, input_splits, group=self.ep_group)
        return recv

    def _send_rows(self, rows: Rows, layout: AllToAllLayout) -> Rows:
        """Permute ``rows`` of T tokens to the send layout and exchange them: ``[R, H]`` rows."""
        data, scale_inv = permute_rows(rows[0], rows[1], layout.row_id_map, sum(layout.input_splits))
        return tuple(t if t is None else self._all_to_all(t, layout.output_splits, layout.input_splits)
                     for t in (data, scale_inv))

    def _dispatch(self, rows: Rows, topk_ids: torch.Tensor, topk_probs: torch.Tensor, before_host_wait=None):
        g, e_local = self.ep_size, self.num_local_experts
        num_tokens = topk_ids.shape[0]
        owner = topk_ids.div(e_local, rounding_mode="floor") + 1  # 0: slot not selected (id -1)
        in_rank = torch.zeros((num_tokens, g + 1), dtype=torch.bool, device=topk_ids.device)
        in_rank = in_rank.scatter_(1, owner, True)[:, 1:].contiguous()
        # per destination rank: [rows, slots of each of its experts]; exchanged, then one host copy of
        # rows to send, rows to receive (per rank) and slots received per local expert
        counts = torch.cat([in_rank.sum(0, keepdim=True).t(),
                            slots_per_expert(topk_ids, self.num_experts).view(g, e_local)], 1)
        recv_counts = self._all_to_all(counts, [1] * g, [1] * g)
        host = host_list(torch.cat([counts[:, 0], recv_counts[:, 0], recv_counts[:, 1:].sum(0)]), before_host_wait)
        input_splits, output_splits, tokens_per_expert = host[:g], host[g:2 * g], host[2 * g:]

        row_id_map = row_id_map_of(in_rank)
        layout = AllToAllLayout(row_id_map, input_splits, output_splits)
        recv_rows = self._send_rows(rows, layout)
        token = _send_row_tokens(row_id_map, sum(input_splits))
        recv_ids, recv_probs = (self._all_to_all(t[token], output_splits, input_splits) for t in (topk_ids, topk_probs))
        self._record_dispatch(sum(input_splits), rows[0].shape[1], topk_ids.shape[1], rows[1] is not None)
        local = recv_ids - self.ep_rank * e_local
        recv_ids = torch.where((local >= 0) & (local < e_local), local, -1)
        return recv_rows, recv_ids, recv_probs, tokens_per_expert, layout

    def _dispatch_cached(self, rows: Rows, layout: AllToAllLayout) -> Rows:
        self._record_dispatch(sum(layout.input_splits), rows[0].shape[1], 0, rows[1] is not None)
        return self._send_rows(rows, layout)

    def _combine(self, x: torch.Tensor, layout: AllToAllLayout, probs: Optional[torch.Tensor] = None):
        back = [self._all_to_all(t, layout.input_splits, layout.output_splits) if t is not None else None
                for t in (x, probs)]
        self._record_combine(x.shape[0], x.shape[1], probs.shape[1] if probs is not None else 0)
        return tuple(unpermute_rows(t, layout.row_id_map) if t is not None else None for t in back)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """FP8 viewed as bytes (collectives have no FP8 dtype); other tensors as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _send_row_tokens(row_id_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 ``[num_rows]``: the source token of each send row of ``row_id_map``. No host sync."""
    g = (row_id_map.shape[1] - 1) // 2
    rows = row_id_map[:, :g].long()
    tokens = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(rows)
    dest = torch.where(rows >= 0, rows, num_rows)  # unused entries land in a dropped extra slot
    out = torch.empty(num_rows + 1, dtype=torch.int64, device=rows.device)
    return out.scatter_(0, dest.reshape(-1), tokens.reshape(-1))[:num_rows]
