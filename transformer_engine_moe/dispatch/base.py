"""Token dispatcher interface with DeepEP's semantics, its result and handle, argument checks, byte counts.

Expert parallelism over G ranks: of ``E`` experts (``E % G == 0``), rank r owns the
``E_local = E / G`` experts ``[r * E_local, (r + 1) * E_local)``. ``dispatch`` sends each token
ONCE to every rank owning at least one of its top-k experts; ``combine`` sums the per-rank
outputs back to the token's original position. Every backend (``local``, ``alltoall``,
``deepep``) implements :class:`TokenDispatcher`, so they are interchangeable.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from ..layout import check_on_device
from ..recipe import BLOCK_SIZE
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor

Hidden = Union[Float8BlockwiseQTensor, torch.Tensor]

_ID_BYTES, _PROB_BYTES, _SCALE_BYTES, _BF16_BYTES = 8, 4, 4, 2  # int64 ids, fp32 probs and scales


def dispatch_payload_bytes(num_tokens: int, hidden: int, topk: int, fp8: bool) -> int:
    """Bytes of ``num_tokens`` dispatched rows: FP8 data (1 byte per element) + float32
    scale_inv per 128 elements, or BF16 data (2 bytes); plus ``topk`` int64 ids and float32 probs."""
    row = hidden + _SCALE_BYTES * -(-hidden // BLOCK_SIZE) if fp8 else _BF16_BYTES * hidden
    return num_tokens * (row + topk * (_ID_BYTES + _PROB_BYTES))


def combine_payload_bytes(num_tokens: int, hidden: int, topk: int = 0) -> int:
    """Bytes of ``num_tokens`` combined BF16 rows, plus ``topk`` float32 probs (their gradients, when
    the backward of dispatch returns them)."""
    return num_tokens * (_BF16_BYTES * hidden + topk * _PROB_BYTES)


@dataclass(frozen=True, slots=True)
class DispatchHandle:
    """What ``combine`` and both backward passes reuse, so none of them syncs with the host.

    ``layout``: the backend's routing state (alltoall: ``AllToAllLayout``; DeepEP: its handle);
    ``num_tokens``: T, rows of the dispatch input and of the combine output; ``num_recv_tokens``: R,
    rows received; ``fp8``: the dispatch carried FP8 rows (then combine's backward sends FP8 too).
    """

    layout: Any
    num_tokens: int
    num_recv_tokens: int
    fp8: bool


@dataclass(frozen=True, slots=True)
class DispatchResult:
    """What ``dispatch`` returns on each rank, for its R received tokens.

    ``hidden``: ``[R, H]``, a rowwise 1x128 Float8BlockwiseQTensor (COMPACT: data ``[R, H]``,
    scale_inv ``[R, ceil(H/128)]``, bytes as sent) when the input was one, else BF16.
    ``topk_ids``: int64 ``[R, k]``, LOCAL expert ids in ``[0, E_local)``, -1 where the slot's expert
    lives on another rank (or was not selected). ``topk_probs``: float32 ``[R, k]``, 0 where -1.
    ``tokens_per_expert``: received slots per local expert: a host list of E_local ints (an int64
    device tensor ``[E_local]`` from ``LocalTokenDispatcher(host_counts=False)``; from the local dispatcher with an
    ``align_size``, its layout's counts, a read-only ``layout.HostSplits``: ``ops.layout_host_counts``).
    ``handle``: pass to ``combine``.
    ``routing``: ``(routing_map [R, E_local] bool, probs [R, E_local] float32, layout)``: ``topk_ids`` and
    ``topk_probs`` as ``ops.topk_to_routing_map`` converts them, where the dispatcher made it to check the ids
    (the local dispatcher: one kernel checks them and writes the map), and the map's ``ops.PermuteLayout`` where
    the dispatcher was given an ``align_size`` (else None); ``FP8FlowMoE`` permutes with them instead of
    converting the ids and laying out the map after the host wait. None from the exchanging dispatchers.
    """

    hidden: Hidden
    topk_ids: torch.Tensor
    topk_probs: torch.Tensor
    tokens_per_expert: Union[list[int], torch.Tensor]
    handle: DispatchHandle
    routing: Optional[tuple] = None


class TokenDispatcher(abc.ABC):
    """Sends tokens to the EP ranks of their experts and sums the results back.

    Args:
        num_experts: E, divisible by the EP group size.
        ep_size, ep_rank: the EP group's size and this rank's index in it.

    ``last_dispatch_bytes`` / ``last_combine_bytes``: payload bytes this rank sent in the last
    dispatch-direction exchange (dispatch, or combine's backward) and combine-direction exchange
    (combine, or dispatch's backward), its own share included (see ``dispatch_payload_bytes``).
    """

    def __init__(self, num_experts: int, ep_size: int, ep_rank: int):
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if num_experts % ep_size:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the EP group size {ep_size}"
            )
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.num_local_experts = num_experts // ep_size
        self._last_dispatch, self._last_combine = (0, 0, 0, False), (0, 0, 0)

    @abc.abstractmethod
    def dispatch(self, hidden: Hidden, topk_ids: torch.Tensor, topk_probs: torch.Tensor,
                 before_host_wait: Optional[Callable[[], object]] = None) -> DispatchResult:
        """Send ``hidden [T, H]`` (rowwise 1x128 Float8BlockwiseQTensor or BF16) with ``topk_ids``
        (int64 ``[T, k]`` global expert ids, -1: not selected) and ``topk_probs`` (float32
        ``[T, k]``) to the ranks of their experts. Differentiable in ``hidden`` and ``topk_probs``.

        ``before_host_wait``: called once, with no arguments, after the dispatcher has queued the work
        whose result the host waits for (the per-expert counts) and before it waits (``layout.host_list``):
        GPU work it queues runs while the host waits, and then while the host issues what follows.
        FP8FlowMoE queues its weight quantization there. DeepEP waits inside its own dispatch, after
        its communication stream has waited for the caller's: there it is called after that dispatch."""

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Sum ``x [R, H']`` BF16 (each received token's output, already weighted and summed over
        this rank's experts) back to ``[T, H']`` BF16 at the tokens' original positions. Differentiable."""

    @property
    def last_dispatch_bytes(self) -> int:
        rows, hidden, topk, fp8 = self._last_dispatch
        return dispatch_payload_bytes(int(rows), hidden, topk, fp8)

    @property
    def last_combine_bytes(self) -> int:
        rows, hidden, topk = self._last_combine
        return combine_payload_bytes(int(rows), hidden, topk)

    def _record_dispatch(self, rows, hidden: int, topk: int, fp8: bool) -> None:
        """Note a dispatch-direction exchange of ``rows`` (an int, or a device scalar read only when
        ``last_dispatch_bytes`` is)."""
        self._last_dispatch = (rows, hidden, topk, fp8)

    def _record_combine(self, rows, hidden: int, topk: int) -> None:
        self._last_combine = (rows, hidden, topk)


def check_ep_group(ep_group) -> None:
    """``ep_group`` None or a ``torch.distributed.ProcessGroup`` (TypeError naming it otherwise), before anything
    asks it for its size or rank."""
    if ep_group is not None and not isinstance(ep_group, dist.ProcessGroup):
        raise TypeError(f"ep_group must be None or a torch.distributed.ProcessGroup (e.g. dist.new_group(ranks), "
                        f"Megatron's expert-parallel group), got {type(ep_group).__name__} {ep_group!r}")


def check_dispatch_inputs(hidden, topk_ids, topk_probs, num_experts: int, before_host_wait=None,
                          check_ids: bool = True) -> None:
    """Raise TypeError/ValueError naming the bad argument of ``dispatch``: types, dtypes, shapes and devices on the
    host; with ``check_ids`` the ids' values on the device (``check_on_device``: in ``[-1, num_experts)``, no
    expert twice for one token). ``check_ids=False``: the caller checks the values itself, with the same
    messages (the local dispatcher, through the routing-map kernel's counts of bad ids)."""
    if before_host_wait is not None and not callable(before_host_wait):
        raise TypeError(f"before_host_wait must be None or a callable taking no arguments, got {before_host_wait!r}")
    if isinstance(hidden, Float8BlockwiseQTensor):
        if hidden.rowwise_data is None or hidden.is_2D_scaled:
            raise ValueError(
                f"hidden: a Float8BlockwiseQTensor must hold rowwise 1x128 data to be dispatched, got "
                f"block={hidden.block}, usages={hidden.usages}"
            )
    elif not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a BF16 tensor or a Float8BlockwiseQTensor, got {type(hidden).__name__}")
    if hidden.dtype != torch.bfloat16:
        raise TypeError(f"hidden must be BF16 (or an FP8 tensor of nominal dtype BF16), got {hidden.dtype}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [num_tokens, hidden_size], got shape {list(hidden.shape)}")
    num_tokens = hidden.shape[0]
    _check_topk("topk_ids", topk_ids, torch.int64, (num_tokens, None))
    _check_topk("topk_probs", topk_probs, torch.float32, tuple(topk_ids.shape))
    if topk_ids.device != hidden.device or topk_probs.device != hidden.device:
        raise ValueError(
            f"hidden, topk_ids and topk_probs must share a device, got {hidden.device}, {topk_ids.device}, "
            f"{topk_probs.device}"
        )
    if not check_ids:
        return
    check_on_device(((topk_ids >= -1) & (topk_ids < num_experts)).all(),
                     f"topk_ids holds expert ids outside [-1, num_experts={num_experts})")
    # an expert twice for one token was once sent (and counted in tokens_per_expert) twice; sorted ids: neighbours
    ids = topk_ids.sort(dim=1).values
    check_on_device(((ids[:, 1:] != ids[:, :-1]) | (ids[:, 1:] < 0)).all(),
                    "topk_ids names an expert twice for one token")


def _check_topk(name: str, t, dtype: torch.dtype, shape: tuple) -> None:
    """``t`` must be a ``dtype`` tensor of ``shape`` (None: any size >= 1)."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    want = "[" + ", ".join("k >= 1" if n is None else str(n) for n in shape) + "]"
    if t.dim() != len(shape) or any(a != b if b is not None else a < 1 for a, b in zip(t.shape, shape)):
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def check_combine_input(x, handle) -> None:
    """Raise TypeError/ValueError naming the bad argument of ``combine``."""
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be the DispatchHandle dispatch returned, got {type(handle).__name__}")
    if isinstance(x, Float8BlockwiseQTensor) or not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise TypeError(
            f"x must be the BF16 expert output [num_recv_tokens, hidden], got "
            f"{type(x).__name__} of dtype {getattr(x, 'dtype', None)}"
        )
    if x.dim() != 2 or x.shape[0] != handle.num_recv_tokens:
        raise ValueError(
            f"x must be [num_recv_tokens={handle.num_recv_tokens}, hidden], got shape {list(x.shape)}"
        )


def slots_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[num_experts]``: how many slots of ``topk_ids`` (-1 ignored) name each expert. No host sync."""
    flat = topk_ids.reshape(-1) + 1  # -1 lands in bin 0, dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))[1:]


def mask_foreign_slots(topk_ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``probs`` with 0 where ``topk_ids`` is -1 (the slot's expert lives on another rank)."""
    return torch.where(topk_ids >= 0, probs, 0.0)
