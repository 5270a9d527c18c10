"""ExchangeTokenDispatcher: dispatch/combine and their autograd over three communication primitives.

The primitives are DeepEP's ``Buffer`` calls; ``alltoall`` writes them with
``torch.distributed.all_to_all_single`` and ``deepep`` maps them onto DeepEP, so everything in
this file (FP8 packing, the autograd rules, the quantization of combine's gradient) is shared
and tested through the alltoall backend. Rows travel as ``(data [N, H], scale_inv [N, ceil(H/128)]
float32 or None)``: FP8 data with its COMPACT 1x128 scales, or BF16 data alone.

Autograd:
- dispatch backward: a BF16 combine of the received tokens' gradient (summed over ranks in
  float32, one cast) to ``hidden``'s gradient, straight through to whatever quantized it; the
  received probs' gradient (float32, 0 on foreign slots) travels back with it to ``[T, k]``.
- combine backward: a dispatch of the BF16 gradient, quantized to FP8 1x128 first when the
  forward dispatch carried FP8 (``recipe``'s gradient format; the BF16 baseline sends BF16);
  the receiver dequantizes it to the BF16 gradient of ``x``.
Both backward passes reuse the handle's layout: no host sync.
"""

from __future__ import annotations

import abc
from typing import Callable, Optional

import torch

from ..quantizer import Float8BlockQuantizer
from ..recipe import FP8FlowRecipe, Role
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from .base import (
    DispatchHandle,
    DispatchResult,
    Hidden,
    TokenDispatcher,
    check_combine_input,
    check_dispatch_inputs,
    mask_foreign_slots,
)

Rows = tuple[torch.Tensor, Optional[torch.Tensor]]


class ExchangeTokenDispatcher(TokenDispatcher):
    """A dispatcher that moves tokens between EP ranks through the three primitives below.

    Args: ``num_experts``, ``ep_size``, ``ep_rank`` as for TokenDispatcher; ``recipe`` fixes the
    FP8 format combine's backward quantizes gradients to (``Role.GRAD``: E5M2 with
    ``Format.HYBRID``), in 1x128 blocks.
    """

    def __init__(self, num_experts: int, ep_size: int, ep_rank: int, recipe: Optional[FP8FlowRecipe] = None):
        super().__init__(num_experts, ep_size, ep_rank)
        self.grad_quantizer = Float8BlockQuantizer.from_recipe(recipe or FP8FlowRecipe(), Role.GRAD)

    def dispatch(self, hidden: Hidden, topk_ids: torch.Tensor, topk_probs: torch.Tensor,
                 before_host_wait: Optional[Callable[[], object]] = None) -> DispatchResult:
        check_dispatch_inputs(hidden, topk_ids, topk_probs, self.num_experts, before_host_wait)
        return DispatchResult(*_Dispatch.apply(self, hidden, topk_probs, topk_ids.contiguous(), before_host_wait))

    def combine(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        check_combine_input(x, handle)
        return _Combine.apply(self, x, handle)

    @abc.abstractmethod
    def _dispatch(self, rows: Rows, topk_ids: torch.Tensor, topk_probs: torch.Tensor, before_host_wait):
        """Send ``rows`` of T tokens with their top-k to the ranks of their experts (``before_host_wait``:
        as ``dispatch``'s).

        Returns ``(rows [R, H] as sent, topk_ids [R, k] local ids or -1, topk_probs [R, k],
        tokens_per_expert host list, layout)``."""

    @abc.abstractmethod
    def _dispatch_cached(self, rows: Rows, layout) -> Rows:
        """Send ``rows`` of T tokens along a previous dispatch's ``layout``; returns ``[R, H]`` rows."""

    @abc.abstractmethod
    def _combine(self, x: torch.Tensor, layout, probs: Optional[torch.Tensor] = None):
        """Sum BF16 ``x [R, H]`` (and float32 ``probs [R, k]``) back along ``layout``:
        ``(out [T, H] BF16, out_probs [T, k] float32 or None)``."""


def _rows(t: Hidden) -> Rows:
    """``(data, scale_inv)`` of a rowwise 1x128 Float8BlockwiseQTensor; ``(t, None)`` of a BF16 tensor."""
    if isinstance(t, Float8BlockwiseQTensor):
        return t.rowwise_data.contiguous(), t.rowwise_scale_inv.contiguous()
    return t.contiguous(), None


def _hidden_like(rows: Rows, like: Hidden) -> Hidden:
    """Received ``rows`` as a tensor of ``like``'s kind: a rowwise 1x128 Float8BlockwiseQTensor
    with ``like``'s formats, or the BF16 data."""
    data, scale_inv = rows
    if scale_inv is None:
        return data
    return Float8BlockwiseQTensor(
        shape=data.shape, dtype=like.dtype, fp8_dtype=like.fp8_dtype, force_pow_2_scales=like.force_pow_2_scales,
        rowwise_data=data, rowwise_scale_inv=scale_inv,
    )


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dispatcher: ExchangeTokenDispatcher, hidden, topk_probs, topk_ids, before_host_wait):
        rows, ids, probs, tokens_per_expert, layout = dispatcher._dispatch(
            _rows(hidden), topk_ids, topk_probs.contiguous(), before_host_wait
        )
        handle = DispatchHandle(layout, hidden.shape[0], rows[0].shape[0], rows[1] is not None)
        ctx.dispatcher, ctx.handle = dispatcher, handle
        ctx.save_for_backward(ids)
        ctx.mark_non_differentiable(ids)
        return _hidden_like(rows, hidden), ids, mask_foreign_slots(ids, probs), tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_hidden, _grad_ids, grad_probs, _grad_counts, _grad_handle):
        # autograd passes zeros for an unused output, so both gradients always travel: every rank
        # runs the same collectives
        (ids,) = ctx.saved_tensors
        grad_in, grad_in_probs = ctx.dispatcher._combine(
            grad_hidden.contiguous(), ctx.handle.layout, mask_foreign_slots(ids, grad_probs).contiguous()
        )
        return None, grad_in, grad_in_probs, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dispatcher: ExchangeTokenDispatcher, x, handle: DispatchHandle):
        ctx.dispatcher, ctx.handle = dispatcher, handle
        out, _ = dispatcher._combine(x.contiguous(), handle.layout)
        return out

    @staticmethod
    def backward(ctx, grad):
        sent = ctx.dispatcher.grad_quantizer(grad.contiguous()) if ctx.handle.fp8 else grad
        recv = _hidden_like(ctx.dispatcher._dispatch_cached(_rows(sent), ctx.handle.layout), sent)
        return None, recv.dequantize(torch.bfloat16) if ctx.handle.fp8 else recv, None
