"""LocalTokenDispatcher: no expert parallelism; every expert is on this rank, nothing is sent."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from .base import (
    DispatchHandle,
    DispatchResult,
    Hidden,
    TokenDispatcher,
    check_combine_input,
    check_dispatch_inputs,
    check_ep_group,
    mask_foreign_slots,
)
from ..layout import host_list
from ..ops.permute import checked_topk_routing, layout_host_counts, permute_layout


class LocalTokenDispatcher(TokenDispatcher):
    """EP size 1: ``dispatch`` returns the input tokens themselves (FP8 stays the same tensor, no
    copy, no quantization anywhere), global ids are the local ids; ``combine`` returns ``x``.
    Gradients pass through unchanged. Sends no bytes.

    Args: ``num_experts``; ``ep_group`` must be None or of size 1. ``host_counts``: True (default):
    ``tokens_per_expert`` is a host list, one device-to-host copy (a host sync) per dispatch, so that
    the block sizes its buffers exactly and may use the cuBLAS and DeepGEMM wgrad backends; False: it
    stays an int64 device tensor ``[E]``: no host sync, CUDA-graph capturable.

    The ids are checked on the device by the kernel that also writes their routing map (``topk_routing``), and the
    counts are the map's column sums, all queued before the host waits for the counts; the result carries the map
    (``DispatchResult.routing``), so ``FP8FlowMoE``'s permute does not convert the ids again. ``align_size``
    (None: not made): also queue there the padded permute's layout of that map (``ops.permute_layout``: row map,
    counts, padding), which the permute takes instead of computing it after the wait (``FP8FlowMoE`` passes its
    own ``align_size``); with host counts ``tokens_per_expert`` is then the layout's counts as read to the host
    (``ops.layout_host_counts``: a read-only ``HostSplits``, which the permute takes without checking them on the
    device again).
    """

    def __init__(self, num_experts: int, ep_group: Optional[dist.ProcessGroup] = None, host_counts: bool = True,
                 align_size: Optional[int] = None):
        check_ep_group(ep_group)
        if ep_group is not None and dist.get_world_size(ep_group) != 1:
            raise ValueError(
                f"the local dispatcher has no expert parallelism; got an ep_group of size "
                f"{dist.get_world_size(ep_group)} (use 'alltoall' or 'deepep')"
            )
        if not isinstance(host_counts, bool):
            raise TypeError(f"host_counts must be a bool, got {host_counts!r}")
        if align_size is not None and (not isinstance(align_size, int) or isinstance(align_size, bool)
                                       or align_size < 1):
            raise ValueError(f"align_size must be None or a positive int (the permute's padding), got {align_size!r}")
        super().__init__(num_experts, ep_size=1, ep_rank=0)
        self.host_counts, self.align_size = host_counts, align_size

    def dispatch(self, hidden: Hidden, topk_ids: torch.Tensor, topk_probs: torch.Tensor,
                 before_host_wait: Optional[Callable[[], object]] = None) -> DispatchResult:
        check_dispatch_inputs(hidden, topk_ids, topk_probs, self.num_experts, before_host_wait, check_ids=False)
        handle = DispatchHandle(None, hidden.shape[0], hidden.shape[0], isinstance(hidden, Float8BlockwiseQTensor))
        probs = mask_foreign_slots(topk_ids, topk_probs)
        routing_map, routing_probs = checked_topk_routing(topk_ids, probs, self.num_experts, "auto", "topk_ids")
        # not under torch.compile: the layout's check reads the map's version, which a traced graph does not keep
        layout = None if self.align_size is None or torch.compiler.is_compiling() else \
            permute_layout(routing_map, self.align_size)
        routing = (routing_map, routing_probs, layout)
        counts = routing_map.sum(0) if layout is None else layout.counts
        if self.host_counts:
            counts = host_list(counts, before_host_wait) if layout is None else \
                layout_host_counts(layout, before_host_wait)
        elif before_host_wait is not None:
            before_host_wait()
        return DispatchResult(hidden, topk_ids, probs, counts, handle, routing)

    def combine(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        check_combine_input(x, handle)
        return x
