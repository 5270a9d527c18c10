"""DeepEPTokenDispatcher: the exchange primitives on DeepEP's ``deep_ep.Buffer`` (V1 API).

Written to the V1 API as the team ran it on two H200s (``tokenspeed-deepep==1.2.1.post20251110``):
``get_dispatch_layout``, ``dispatch`` (fresh with a layout, or cached with a handle) and
``combine``, all synchronous (``async_finish=False``: DeepEP makes the current stream wait for
its communication stream, so no ``EventOverlap`` has to be waited on). Untested in CI (no
``deep_ep`` there); everything around the three calls is the code the alltoall backend tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..recipe import FP8FlowRecipe
from .base import check_ep_group
from .exchange import ExchangeTokenDispatcher, Rows

DEEP_EP_REQUIREMENT = "DeepEP with its V1 API (deep_ep.Buffer), e.g. tokenspeed-deepep==1.2.1.post20251110"


def _import_deep_ep():
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(f"the deepep dispatcher needs {DEEP_EP_REQUIREMENT}: {e}") from e
    if not hasattr(deep_ep, "Buffer"):
        raise ImportError(f"the deepep dispatcher needs {DEEP_EP_REQUIREMENT}; deep_ep has no Buffer")
    return deep_ep


@dataclass(frozen=True, slots=True)
class DeepEPLayout:
    """DeepEP's dispatch ``handle`` and the rows this rank sent (device scalar: read lazily)."""

    handle: Any
    num_sent: torch.Tensor


class DeepEPTokenDispatcher(ExchangeTokenDispatcher):
    """Token dispatch through DeepEP's NVLink/RDMA kernels.

    Dispatch sends per (token, rank) what alltoall sends: the FP8 row and its float32 scale_inv
    row as ``(x, scales)`` (or the BF16 row), int64 ``topk_idx`` and float32 ``topk_weights``;
    DeepEP maps ids to local ones on the receiver. Host sync: DeepEP's own, inside a fresh
    dispatch (it waits for the received counts to size its outputs and to return
    ``num_recv_tokens_per_expert_list``); combine and both backward passes reuse the handle.
    That wait comes after DeepEP's communication stream has waited for the caller's stream, so
    ``before_host_wait`` runs right after the dispatch returns: queued before it, its GPU work
    would lengthen the host's wait; queued after, the GPU runs it while the host issues what
    follows (the all-to-all backend runs it during its wait).
    ``last_dispatch_bytes`` reads the rows sent from the device when it is read.

    Args: ``num_experts``; ``ep_group`` (None: the default group); ``recipe`` (see
    ExchangeTokenDispatcher); ``num_nvl_bytes``, ``num_rdma_bytes``: DeepEP's buffer sizes.
    """

    def __init__(self, num_experts: int, ep_group: Optional[dist.ProcessGroup] = None,
                 recipe: Optional[FP8FlowRecipe] = None, *, num_nvl_bytes: int = int(1e9),
                 num_rdma_bytes: int = 0):
        check_ep_group(ep_group)
        deep_ep = _import_deep_ep()
        group = ep_group if ep_group is not None else dist.group.WORLD
        super().__init__(num_experts, dist.get_world_size(group), dist.get_rank(group), recipe)
        self.buffer = deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes)

    def _dispatch(self, rows: Rows, topk_ids: torch.Tensor, topk_probs: torch.Tensor, before_host_wait=None):
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_ids, self.num_experts)
        recv_x, recv_ids, recv_probs, tokens_per_expert, handle, _ = self.buffer.dispatch(
            _as_x(rows), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_ids,
            topk_weights=topk_probs,
        )
        if before_host_wait is not None:  # after: DeepEP's host wait also waits for the work queued before it
            before_host_wait()
        layout = DeepEPLayout(handle, per_rank.sum())
        self._record_dispatch(layout.num_sent, rows[0].shape[1], topk_ids.shape[1], rows[1] is not None)
        return _as_rows(recv_x), recv_ids, recv_probs, list(tokens_per_expert), layout

    def _dispatch_cached(self, rows: Rows, layout: DeepEPLayout) -> Rows:
        recv_x = self.buffer.dispatch(_as_x(rows), handle=layout.handle)[0]
        self._record_dispatch(layout.num_sent, rows[0].shape[1], 0, rows[1] is not None)
        return _as_rows(recv_x)

    def _combine(self, x: torch.Tensor, layout: DeepEPLayout, probs: Optional[torch.Tensor] = None):
        out, out_probs, _ = self.buffer.combine(x, layout.handle, topk_weights=probs)
        self._record_combine(x.shape[0], x.shape[1], probs.shape[1] if probs is not None else 0)
        return out, out_probs


def _as_x(rows: Rows):
    """DeepEP's ``x``: ``(data, scales)`` for FP8, the BF16 tensor otherwise."""
    return rows if rows[1] is not None else rows[0]


def _as_rows(recv_x) -> Rows:
    return recv_x if isinstance(recv_x, tuple) else (recv_x, None)
