"""FP8FlowMoE: the expert block of an MoE layer, FP8 from dispatch to fc2's input.

``forward(hidden [T, H] BF16, probs [T, E], routing_map [T, E]) -> [T, H] BF16`` with Megatron's
router output, or ``forward_topk(hidden, topk_ids [T, k], topk_probs [T, k])`` with DeepEP's; the
router stays outside, as in Megatron. Phases (methods named after them, so recompute can wrap one):

1. ``quantize``: the tokens once, 1x128 E4M3 with power-of-two scales (cast 1 of 2);
2. ``dispatch``: FP8 rows + scales + top-k ids + probs to the experts' ranks;
3. ``experts``: permute+pad (FP8 rows, scales, probs) -> fc1 ``GroupedLinear`` on the FP8 tensor ->
   weighted SwiGLU + quantization (the router prob is applied here; its backward quantizes fc1's output
   gradient in the same pass) -> fc2 on that FP8 tensor
   -> unpermute+unpad (BF16, cast 2 of 2: fc2's output; its backward quantizes the output gradient per token
   and permutes FP8 rows to fc2);
4. ``combine``: BF16 sum back to the tokens' positions.

The block does FP8-Flow only; the BF16 and blockwise-FP8-with-casts blocks that benchmarks and tests
compare it with are subclasses overriding ``quantize`` and ``experts`` (``benchmarks/baselines.py``).
``recompute="moe_expert"`` keeps only the dispatched FP8 input (data, scales, probs, routing) and the
routing map unpermute reads for backward, and reruns permute -> fc1 -> SwiGLU there (plus fc2's input
transpose; no fc2 GEMM, ``routed_experts``); nothing is re-dispatched. A forward called with
``is_first_microbatch=True`` caches its FP8 weights and the rerun reuses fc1's; with None (no cache)
no FP8 weight is kept from the forward to the backward (``GroupedLinear.requantize_in_backward``): the rerun
quantizes fc1's W again, and fc1's and fc2's backward quantize for their dgrad, so one layer's FP8 weights
are alive at a time instead of every layer's, for two more weight quantizations per layer and micro-batch.

Host syncs: by default the dispatcher hands ``experts`` host counts per expert (one device-to-host
copy per step): buffers are sized exactly and every GEMM backend may run. The weights' quantization
(reusing a cache, ``is_first_microbatch=False``: the byte transpose that gives W from the cached W^T)
is queued while the host waits for that copy (``dispatch``'s ``before_host_wait``,
``prefetch_fp8_weights``): the GPU runs it through the wait and while the host issues what follows.
``device_splits=True`` (local dispatcher) keeps the counts on the device: permute writes a worst-case
buffer, the GEMMs take device splits (``auto``: DeepGEMM fprop/dgrad where installed, Triton wgrad),
and the block runs forward and backward without a host sync, so it can be captured in a CUDA graph
and replayed with other routings (docs/moe.md, CUDA graphs).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..dispatch import get_dispatcher
from ..dispatch.base import check_ep_group
from ..layout import HostSplits
from ..ops.permute import (
    checked_topk_probs,
    moe_permute_and_pad_with_probs,
    moe_unpermute,
    routing_map_to_topk,
    topk_to_routing_map,
)
from ..ops.swiglu import weighted_swiglu_quant
from ..recipe import HIGH_PRECISION_DTYPES, FP8FlowRecipe, Role, check_bool
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from .grouped_linear import GroupedLinear, check_init_method, check_is_first_microbatch

RECOMPUTE = (None, "moe_expert")
PROB_DTYPES = (*HIGH_PRECISION_DTYPES, torch.float64)  # Megatron's router: moe_router_dtype fp32 or fp64


class FP8FlowMoE(nn.Module):
    """The MoE expert block with FP8-Flow.

    Args:
        num_experts: E over the EP group; ``E % ep_size == 0``, this rank holds ``E / ep_size``.
        hidden_size: H, ffn_hidden_size: F (multiples of 128); topk: k.
        ep_group: the expert-parallel process group (None: no EP).
        dispatcher: ``"local"``, ``"alltoall"`` or ``"deepep"`` (``dispatch.get_dispatcher``); None:
            ``"local"`` without an EP group, else ``"alltoall"``.
        recipe: ``FP8FlowRecipe``; recompute: None or ``"moe_expert"``.
        align_size: experts' rows padded to a multiple of this (128: the tile DeepGEMM's grouped
            GEMMs and cuBLAS's wgrad need, docs/grouped_gemm.md). With ``device_splits`` the counts are
            not seen on the host: DeepGEMM (128) and the Gluon written wgrad (16) assert their alignment on
            the device, so keep it a multiple of 128 there.
        init_method, output_init_method: in-place initialisers of fc1's and fc2's weights (Megatron's
            ``config.init_method`` / ``output_layer_init_method``); default: as ``GroupedLinear``.
        device_splits: keep the per-expert counts on the device (local dispatcher only): no host sync,
            worst-case ``round_up(T*k + E*(align_size-1), align_size)`` permuted rows, the slack (zero
            rows) a trailing weightless group the GEMMs skip; CUDA-graph capturable. Default False: host
            counts.
        fuse_wgrad_accumulation: both ``GroupedLinear``s add weight gradients into each weight's FP32
            ``main_grad`` (Megatron's ``gradient_accumulation_fusion``, as TE's grouped experts take it).
        single_grouped_weight: each ``GroupedLinear`` holds one ``weight`` ``[E_local, N, K]`` parameter
            (TE's option of that name): less host work per backward than one parameter per expert.
        accumulate_into_main_grad: without ``fuse_wgrad_accumulation``, where at a training forward every weight
            has a ``main_grad`` of Megatron DDP's (and no Megatron-FSDP ``get_main_grad``), add each weight
            gradient rounded to the weights' dtype into it in the wgrad GEMMs (``into_main_grad``): what DDP's
            hook adds from ``.grad``, bit for bit, without the ``.grad`` buffer and the hook's pass over it;
            elsewhere ``.grad`` as without the flag. Default False.
    Parameters: ``linear_fc1.weight{i}`` ``[2F, H]`` (gate rows first, then up) and ``linear_fc2.weight{i}``
    ``[H, F]`` per local expert, as Megatron's TE grouped experts name them (or ``linear_fc1.weight``
    ``[E_local, 2F, H]`` and ``linear_fc2.weight`` with ``single_grouped_weight``).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, topk: int,
                 ep_group: Optional[dist.ProcessGroup] = None, dispatcher: Optional[str] = None,
                 recipe: Optional[FP8FlowRecipe] = None, recompute: Optional[str] = None, align_size: int = 128,
                 params_dtype=torch.bfloat16, device=None, gemm_backend: str = "auto", init_method=None,
                 output_init_method=None, device_splits: bool = False, fuse_wgrad_accumulation: bool = False,
                 single_grouped_weight: bool = False, accumulate_into_main_grad: bool = False):
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be None or 'moe_expert', got {recompute!r}")
        if not isinstance(align_size, int) or isinstance(align_size, bool) or align_size <= 0:
            raise ValueError(f"align_size must be a positive int (rows each expert is padded to a multiple of), "
                             f"got {align_size!r}")
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if not isinstance(topk, int) or isinstance(topk, bool) or not 0 < topk <= num_experts:
            raise ValueError(f"topk must be an int in [1, num_experts={num_experts}], got {topk!r}")
        check_ep_group(ep_group)
        check_init_method(output_init_method, "output_init_method")
        ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the EP group size {ep_size}")
        self.recipe = recipe or FP8FlowRecipe()
        self.recompute, self.topk, self.align_size = recompute, topk, align_size
        self.num_experts, self.num_local_experts = num_experts, num_experts // ep_size
        name = dispatcher or ("local" if ep_group is None else "alltoall")
        if not isinstance(device_splits, bool):
            raise TypeError(f"device_splits must be a bool, got {device_splits!r}")
        if device_splits and name != "local":
            raise ValueError(f"device_splits=True needs the 'local' dispatcher, got {name!r}: all-to-all and "
                             "DeepEP size their receive buffers from host counts")
        self.device_splits = device_splits
        check_bool(accumulate_into_main_grad, "accumulate_into_main_grad")
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.dispatcher = get_dispatcher(name, ep_group, num_experts=num_experts,
                                         **({"host_counts": not device_splits, "align_size": align_size}
                                            if name == "local" else {"recipe": self.recipe}))
        # moe_expert without a cache: no layer keeps FP8 weights from its forward to its backward
        common = dict(params_dtype=params_dtype, device=device, recipe=self.recipe, backend=gemm_backend,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation, single_grouped_weight=single_grouped_weight,
                      requantize_in_backward=recompute == "moe_expert")
        self.linear_fc1 = GroupedLinear(self.num_local_experts, hidden_size, 2 * ffn_hidden_size,
                                        init_method=init_method, **common)
        self.linear_fc2 = GroupedLinear(self.num_local_experts, ffn_hidden_size, hidden_size,
                                        init_method=init_method if output_init_method is None else output_init_method,
                                        **common)

    def into_main_grad(self, wanted: bool) -> bool:
        """Whether the wgrad GEMMs put the weight gradients into ``main_grad``: the linears' wgrad fusion, or
        ``wanted`` with a ``main_grad`` of Megatron DDP's on every weight (not Megatron-FSDP's, whose ``main_grad``
        its own hook makes, ``get_main_grad``, and copies ``.grad`` into), where the linears then add each gradient
        rounded to the weights' dtype (``GroupedLinear.add_wgrad_into_main_grad``, which this sets). Called by
        ``accumulate_into_main_grad`` at each training forward and by ``GraphedFP8FlowMoE``'s warm-up."""
        linears = (self.linear_fc1, self.linear_fc2)
        weights = [w for lin in linears for w in lin.weight_params]
        adds = wanted and not self.linear_fc1.fuse_wgrad_accumulation and all(
            getattr(w, "main_grad", None) is not None and not hasattr(w, "get_main_grad") for w in weights)
        for lin in linears:
            lin.add_wgrad_into_main_grad = adds
        return self.linear_fc1.into_main_grad

    # ------------------------------------------------------------------ phases
    def quantize(self, hidden: torch.Tensor) -> Float8BlockwiseQTensor:
        """``hidden [T, H]`` BF16 -> 1x128 FP8 (fc1's input quantizer: E4M3, power-of-two scales)."""
        return self.linear_fc1.quantizers[Role.INPUT](hidden)

    def dispatch(self, hidden, topk_ids, topk_probs, before_host_wait=None):
        return self.dispatcher.dispatch(hidden, topk_ids, topk_probs, before_host_wait)

    def prefetch_fp8_weights(self, is_first_microbatch: Optional[bool] = None,
                             transpose: Optional[bool] = None) -> None:
        """Quantize fc1's and fc2's weights for the coming ``routed_experts`` call with ``is_first_microbatch``
        (its weight work, done ahead: ``forward_topk`` queues it while the host waits for the dispatch's counts;
        ``GroupedLinear.prefetch_fp8_weights``; a second call before that forward does nothing). ``transpose``
        None: W and W^T, but under ``moe_expert`` fc1 writes W alone (a cache of W: the rerun reads it and
        backward transposes it, one quantization and one transpose per step, where caching W^T would need a
        transpose in the rerun too), and without a cache fc2 too (backward quantizes again:
        ``requantize_in_backward``)."""
        lean = self.recompute == "moe_expert"
        fc1_transpose = not lean if transpose is None else transpose
        fc2_transpose = not (lean and is_first_microbatch is None) if transpose is None else transpose
        self.linear_fc1.prefetch_fp8_weights(is_first_microbatch, fc1_transpose)
        self.linear_fc2.prefetch_fp8_weights(is_first_microbatch, fc2_transpose)

    def drop_prefetched_fp8_weights(self) -> None:
        """Discard prefetched FP8 weights no forward took (``GroupedLinear.drop_prefetched_fp8_weights``)."""
        for linear in (self.linear_fc1, self.linear_fc2):
            linear.drop_prefetched_fp8_weights()

    def reset_fp8_weight_cache(self) -> None:
        """Drop the FP8 weights fc1 and fc2 cached with ``is_first_microbatch=True`` (and any prefetched): one
        byte per expert parameter, stale once the weights change (``GroupedLinear.reset_fp8_weight_cache``).
        Megatron's DDP calls it when a step's gradients are final, before the optimizer step
        (``megatron_patches.experts.patch_finish_grad_sync``)."""
        for linear in (self.linear_fc1, self.linear_fc2):
            linear.reset_fp8_weight_cache()

    def experts(self, hidden, topk_ids: torch.Tensor, topk_probs: torch.Tensor, tokens_per_expert,
                is_first_microbatch: Optional[bool] = None, *, routing: Optional[tuple] = None):
        """Received ``hidden [R, H]`` (1x128 FP8), local ``topk_ids``/``topk_probs [R, k]`` and
        ``tokens_per_expert`` (host list, or device tensor: ``_permute``) -> ``[R, H]`` BF16 (each token's
        prob-weighted sum over local experts). ``routing``: the dispatch's ``DispatchResult.routing`` for these
        tokens (the local dispatcher's map and permute layout), taken instead of converting the ids again."""
        y, row_id_map, pad_offsets = self._mlp(hidden, topk_ids, topk_probs, tokens_per_expert, is_first_microbatch,
                                               routing=routing)
        return self._unpermute(y, row_id_map, pad_offsets)

    def _unpermute(self, y: torch.Tensor, row_id_map: torch.Tensor, pad_offsets) -> torch.Tensor:
        """unpermute+unpad of fc2's output ``y``, whose backward hands fc2 its output gradient quantized already:
        each token's gradient row quantized once (fc2's GRAD quantizer) and its FP8 copies permuted, bitwise what
        fc2 would quantize after a BF16 permute (``moe_unpermute(grad_quantize=...)``; with a nonzero
        ``amax_epsilon`` the padding rows' scales would differ: BF16 then)."""
        args = self.linear_fc2.quantizers[Role.GRAD].args
        return moe_unpermute(y, row_id_map, pad_offsets=pad_offsets,
                             grad_quantize=None if args.amax_epsilon else args)

    def _mlp(self, hidden, topk_ids, topk_probs, tokens_per_expert, is_first_microbatch, rerun: bool = False,
             routing=None):
        """``experts`` up to fc2: -> ``(y [M, H] BF16 in the permuted, padded layout, row_id_map, pad_offsets)``.
        ``rerun``: the ``moe_expert`` rerun, which regenerates only what backward reads: fc2 saves its FP8 input
        and runs no GEMM (``GroupedLinear.recompute_saved_input``); returns None. ``routing``:
        ``_permute``'s."""
        x, probs, row_id_map, pad_offsets, padded = self._permute(hidden, topk_ids, topk_probs, tokens_per_expert,
                                                                  routing)
        h = self.linear_fc1(x, padded, is_first_microbatch)
        # its backward hands fc1 the gradient quantized: bitwise what fc1 quantizes (amax_epsilon 0, as the kernel's)
        act = weighted_swiglu_quant(h, probs, self.recipe, quantize_grad=not self.recipe.amax_epsilon)
        if rerun:
            self.linear_fc2.recompute_saved_input(act, padded)
            return None
        return self.linear_fc2(act, padded, is_first_microbatch), row_id_map, pad_offsets

    def routed_experts(self, hidden, topk_ids: torch.Tensor, topk_probs: torch.Tensor, tokens_per_expert,
                       is_first_microbatch: Optional[bool] = None, *, routing: Optional[tuple] = None) -> torch.Tensor:
        """``experts`` with its FP8 weights prefetched (``prefetch_fp8_weights``: a no-op after ``dispatch``'s),
        inside the ``moe_expert`` recompute when set (``routing``: as for ``experts``; unused in the recompute).

        ``moe_expert``: permute -> fc1 -> SwiGLU -> fc2 run under a non-reentrant checkpoint that keeps only
        their inputs; unpermute runs after it and keeps the routing map it reads (``row_id_map [R, 2E+1]``
        int32 and ``pad_offsets``, E local experts). The rerun in backward regenerates fc1's and SwiGLU's
        saved tensors and fc2's FP8 input, and ends there (checkpoint's early stop): no fc2 GEMM and
        no fc2 weights. fc1 reads the FP8 weights the forward cached (``is_first_microbatch`` True or False)
        or quantizes W alone again (None: the first pass kept no FP8 weight, and fc1's and fc2's backward
        quantize theirs again; the rerun's own autograd state is dropped). The region keeps its inputs until
        backward, the ``[R, k]`` ids and probs rather than the ``[R, E]`` probs: its first pass takes ``routing``
        (no conversion on the host's path after the dispatch's wait) and lets its probs go; the rerun makes them
        again from the ids, on the dispatch's map and layout where it laid one out (``_rerunnable_mlp``). Without
        ``routing`` both passes convert the ids."""
        try:
            self.prefetch_fp8_weights(is_first_microbatch)
            if self.recompute != "moe_expert":
                return self.experts(hidden, topk_ids, topk_probs, tokens_per_expert, is_first_microbatch,
                                    routing=routing)
            # no RNG state kept: the experts draw no random numbers, and reading the CUDA generator's state is
            # refused inside a CUDA graph capture (GraphedFP8FlowMoE captures this checkpoint)
            y, row_id_map, pad_offsets = torch.utils.checkpoint.checkpoint(
                self._rerunnable_mlp(tokens_per_expert, is_first_microbatch, routing), hidden, topk_ids, topk_probs,
                use_reentrant=False, preserve_rng_state=False)
        finally:  # weights prefetched for a call that raised are never used later
            self.drop_prefetched_fp8_weights()
        return self._unpermute(y, row_id_map, pad_offsets)

    def _rerunnable_mlp(self, tokens_per_expert, is_first_microbatch, routing=None):
        """``_mlp`` as the ``moe_expert`` checkpoint runs it: the first call computes (on ``routing``, the
        dispatch's map, probs and layout of the ids, when given), later ones are reruns. The ``[R, E]`` probs are
        let go after the first pass. A layout (the local dispatcher's) is kept to the rerun with its map (bool
        ``[R, E]``; its ``row_id_map`` is unpermute's, kept anyway): the rerun makes only the probs again
        (``checked_topk_probs``: the ids were checked in the dispatch), not the map, its layout and the counts'
        check (about 12 launches). Without a layout the rerun converts the ids again (map and probs, checked).
        Either way outside autograd, the probs a leaf that requires grad, so the ops save what they saved on the
        dispatch's probs."""
        passes, given = [], [routing]  # the closure holds neither ``routing`` nor its probs past the first pass
        layout = routing[2] if routing is not None else None
        convert = routing is not None and layout is None

        def mlp(hidden, topk_ids, topk_probs):
            if not passes:
                passes.append("first")
                first_routing, given[0] = given[0], None
                try:  # what the first pass saves is dropped: fc1 and fc2 make no transpose of their inputs for it
                    self.linear_fc1._saved_input_dropped = self.linear_fc2._saved_input_dropped = True
                    return self._mlp(hidden, topk_ids, topk_probs, tokens_per_expert, is_first_microbatch,
                                     routing=first_routing)
                finally:
                    self.linear_fc1._saved_input_dropped = self.linear_fc2._saved_input_dropped = False
            rerouted = None
            if layout is not None:
                probs = checked_topk_probs(topk_ids, topk_probs, self.num_local_experts)
                rerouted = (layout.routing_map, probs.requires_grad_(), layout)
            elif convert:
                with torch.no_grad():
                    routing_map, probs = topk_to_routing_map(topk_ids, topk_probs, self.num_local_experts)
                rerouted = (routing_map, probs.requires_grad_(), None)
            if is_first_microbatch is not None:  # fc1's cached W
                return self._mlp(hidden, topk_ids, topk_probs, tokens_per_expert, False, rerun=True, routing=rerouted)
            try:
                self.linear_fc1.prefetch_fp8_weights(None, transpose=False)
                return self._mlp(hidden, topk_ids, topk_probs, tokens_per_expert, None, rerun=True, routing=rerouted)
            finally:
                self.linear_fc1.drop_prefetched_fp8_weights()

        return mlp

    def _permute(self, hidden, topk_ids, topk_probs, tokens_per_expert, routing=None):
        """-> ``(x [M, H], probs [M], row_id_map, pad_offsets, m_splits)``, each expert's rows padded to
        ``align_size``. Host counts: M is the padded total, ``m_splits`` a host list (a ``HostSplits``: checked
        here, once per step, for every op after). A device tensor of
        counts: M is the worst case ``round_up(R*k + E*(a-1), a)``, fixed by the shapes (a CUDA graph's
        static buffer), and ``m_splits`` the E padded counts on the device and the slack (zero rows, a
        multiple of ``a``) as a trailing weightless group: the GEMMs write zeros there without computing
        them, and wgrad never reads them (``ops.grouped_gemm``). ``routing``: ``DispatchResult.routing`` of these
        ids and probs, taken instead of converting them (``topk_to_routing_map``) and laying out the map again."""
        a, e = self.align_size, self.num_local_experts
        if not isinstance(tokens_per_expert, (list, tuple, torch.Tensor)):  # None: once "not iterable" below
            raise TypeError(f"tokens_per_expert must be the dispatch's host list of {e} ints or its [{e}] device "
                            f"tensor, got {type(tokens_per_expert).__name__}")
        routing_map, probs, layout = (*topk_to_routing_map(topk_ids, topk_probs, e), None) if routing is None \
            else routing
        if not isinstance(tokens_per_expert, torch.Tensor):
            # as given: the local dispatcher's counts are its layout's (ops.layout_host_counts), taken as they are
            x, probs, row_id_map, pad_offsets, _ = moe_permute_and_pad_with_probs(
                hidden, probs, routing_map, tokens_per_expert, a, layout=layout)
            if torch.compiler.is_compiling():  # a plain list (torch.compile traces the checks once, not per step)
                return x, probs, row_id_map, pad_offsets, [-(-c // a) * a for c in tokens_per_expert]
            counts = tokens_per_expert if type(tokens_per_expert) is HostSplits else HostSplits(tokens_per_expert)
            return x, probs, row_id_map, pad_offsets, counts.padded(a)
        slack = e * (a - 1)
        rows = -(-(topk_ids.numel() + slack) // a) * a
        x, probs, row_id_map, pad_offsets, padded = moe_permute_and_pad_with_probs(
            hidden, probs, routing_map, tokens_per_expert, a, num_out_tokens=rows - slack, layout=layout)
        return x, probs, row_id_map, pad_offsets, torch.cat([padded, (rows - padded.sum()).view(1)])

    def _check_hidden(self, hidden) -> torch.device:
        """``hidden`` a plain BF16 or FP32 ``[T, H]`` tensor on the parameters' device; returns that device."""
        device = self.linear_fc1.weight_params[0].device
        dims = (("T", None), ("H", self.linear_fc1.in_features))
        _check_tensor("hidden", hidden, (torch.bfloat16, torch.float32), dims, device)
        return device

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        return self.dispatcher.combine(y, handle)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``hidden [T, H]`` BF16 with Megatron's router output: ``probs [T, E]`` (zero off the routed
        experts), ``routing_map [T, E]`` bool, E = ``num_experts`` (all experts, over the EP group) -> ``[T, H]``
        BF16. ``is_first_microbatch``: FP8 weight caching as in TE (``GroupedLinear.fp8_weights``; None: quantize
        the weights every call). Every argument's type, dtype, shape and device is checked on the host (no sync);
        at most ``topk`` experts per token on the device (``routing_map_to_topk``)."""
        device = self._check_hidden(hidden)
        dims = (("T", hidden.shape[0]), ("num_experts", self.num_experts))
        _check_tensor("routing_map", routing_map, (torch.bool,), dims, device)
        _check_tensor("probs", probs, PROB_DTYPES, dims, device)
        check_is_first_microbatch(is_first_microbatch)
        topk_ids, topk_probs = routing_map_to_topk(probs, routing_map, self.topk)
        return self._forward_topk(hidden, topk_ids, topk_probs, is_first_microbatch)

    def forward_topk(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_probs: torch.Tensor,
                     is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``hidden [T, H]`` BF16 (FP32: cast to BF16 at entry and the output back), ``topk_ids [T, k]``
        int64 global expert ids (-1: unused slot), ``topk_probs [T, k]`` floating -> ``[T, H]``. Types, dtypes,
        shapes and devices checked on the host; the ids' values (in ``[-1, num_experts)``, no expert twice for one
        token) on the device (the dispatcher's check; the local one's kernel also writes the routing map)."""
        device = self._check_hidden(hidden)
        dims = (("T", hidden.shape[0]), ("topk", self.topk))
        _check_tensor("topk_ids", topk_ids, (torch.int64,), dims, device)
        _check_tensor("topk_probs", topk_probs, PROB_DTYPES, dims, device)
        check_is_first_microbatch(is_first_microbatch)
        return self._forward_topk(hidden, topk_ids, topk_probs, is_first_microbatch)

    def _forward_topk(self, hidden, topk_ids, topk_probs, is_first_microbatch):
        """``forward_topk`` on arguments already checked (by it, or by ``forward``, whose ids and probs come from
        ``routing_map_to_topk``): each is checked once per call."""
        if hidden.dtype == torch.float32:
            return self._forward_topk(hidden.bfloat16(), topk_ids, topk_probs, is_first_microbatch).float()
        # The weights' quantization (reusing a cache: W's byte transpose from the cached W^T) is queued while the
        # host waits for the dispatch's counts: the GPU runs it then, and while the host issues the permute after
        # the wait (it would idle there).
        # (in the forward's grad mode: a dispatcher may call it inside its autograd Function's forward)
        grad = torch.is_grad_enabled()
        if self.accumulate_into_main_grad and grad and self.training:
            self.into_main_grad(True)

        def prefetch():
            with torch.set_grad_enabled(grad):
                self.prefetch_fp8_weights(is_first_microbatch)

        try:
            res = self.dispatch(self.quantize(hidden), topk_ids, topk_probs.float(), prefetch)
        except BaseException:  # weights prefetched for a forward that raised are never used later
            self.drop_prefetched_fp8_weights()
            raise
        y = self.routed_experts(res.hidden, res.topk_ids, res.topk_probs, res.tokens_per_expert, is_first_microbatch,
                                routing=res.routing)
        return self.combine(y, res.handle)


def _check_tensor(name: str, t, dtypes: tuple, dims: tuple, device: torch.device) -> None:
    """``t`` a plain tensor (not FP8) of one of ``dtypes``, shaped ``dims`` (``(label, size)`` pairs; size None: any),
    on ``device``: TypeError/ValueError naming ``name``, what it got and what was expected. Host-side: no sync."""
    want = f"[{', '.join(label if size is None else f'{label}={size}' for label, size in dims)}]"
    if not isinstance(t, torch.Tensor) or isinstance(t, Float8BlockwiseQTensor) or t.dtype not in dtypes:
        kinds = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        got = f"{type(t).__name__}" + (f" of dtype {t.dtype}" if isinstance(t, torch.Tensor) else "")
        raise TypeError(f"{name} must be a tensor {want} of dtype {kinds}, got {got}")
    if t.dim() != len(dims) or any(size is not None and n != size for n, (_, size) in zip(t.shape, dims)):
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the block's parameters on {device}: move one of them")
