"""Token dispatchers for expert parallelism, with DeepEP's semantics (see docs/dispatch.md).

``get_dispatcher(name, ep_group, num_experts=...)`` picks a backend by name:
``"local"`` (no expert parallelism), ``"alltoall"`` (``torch.distributed.all_to_all_single``,
any process group), ``"deepep"`` (DeepEP's ``Buffer``; imported when constructed).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from ..recipe import FP8FlowRecipe
from .alltoall import AllToAllLayout, AllToAllTokenDispatcher
from .base import (
    DispatchHandle,
    DispatchResult,
    TokenDispatcher,
    combine_payload_bytes,
    dispatch_payload_bytes,
)
from .deepep import DeepEPTokenDispatcher
from .local import LocalTokenDispatcher

DISPATCHERS = {
    "local": LocalTokenDispatcher,
    "alltoall": AllToAllTokenDispatcher,
    "deepep": DeepEPTokenDispatcher,
}


def get_dispatcher(
    name: str, ep_group: Optional[dist.ProcessGroup] = None, *, num_experts: int,
    recipe: Optional[FP8FlowRecipe] = None, **kwargs,
) -> TokenDispatcher:
    """The ``name`` dispatcher (``"local"``, ``"alltoall"`` or ``"deepep"``) for ``num_experts``
    experts over ``ep_group`` (None: local: no EP; others: the default group). ``recipe``: the
    FP8 format of gradients combine's backward quantizes (alltoall, deepep). ``kwargs`` go to
    the backend (local: ``host_counts``, ``align_size``; deepep: ``num_nvl_bytes``, ``num_rdma_bytes``)."""
    if not isinstance(name, str) or name not in DISPATCHERS:
        raise ValueError(f"unknown token dispatcher {name!r}; choose one of {sorted(DISPATCHERS)}")
    if name == "local":
        if recipe is not None or set(kwargs) - {"host_counts", "align_size"}:
            raise ValueError(f"the local dispatcher quantizes nothing and takes no recipe; its options are "
                             f"host_counts and align_size, got {sorted(kwargs)}")
        return LocalTokenDispatcher(num_experts, ep_group, **kwargs)
    if recipe is not None and not isinstance(recipe, FP8FlowRecipe):  # before the backend asks torch.distributed
        raise TypeError(f"recipe must be an FP8FlowRecipe or None, got {recipe!r}")
    return DISPATCHERS[name](num_experts, ep_group, recipe, **kwargs)


__all__ = [
    "AllToAllLayout",
    "AllToAllTokenDispatcher",
    "DISPATCHERS",
    "DeepEPTokenDispatcher",
    "DispatchHandle",
    "DispatchResult",
    "LocalTokenDispatcher",
    "TokenDispatcher",
    "combine_payload_bytes",
    "dispatch_payload_bytes",
    "get_dispatcher",
]
