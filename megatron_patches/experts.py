"""Where Megatron's routed experts and token dispatcher give way to the FP8-Flow block.

The swap happens in the layer spec: ``fp8_flow_layer_spec(spec, config)`` returns a copy of a
GPT layer (or block) spec whose MoE layers are ``FP8FlowMoELayer``. That layer keeps Megatron's
router (and so its aux losses) and shared experts, builds no Megatron token dispatcher and no
Megatron experts, and hands ``[T, H]`` hidden states with the router's ``probs`` and
``routing_map`` to one block that dispatches, computes and combines:

    block(hidden_states [T, H], probs [T, E] float32, routing_map [T, E] bool) -> [T, H]

``ExpertBlockBuilder`` is the adapter interface; ``build_fp8_flow_block`` is the production
builder (``transformer_engine_moe.module.FP8FlowMoE``). See docs/megatron.md.
"""

import dataclasses
import functools
import importlib.util
import warnings
from typing import Callable, Optional, Protocol, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.moe.moe_layer import BaseMoELayer, MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from transformer_engine_moe.ops.permute import routing_map_to_topk

from .config import _MARK
from .settings import MOE_EXPERT


class ExpertBlock(Protocol):
    """What ``FP8FlowMoELayer`` needs from an expert block (an ``nn.Module``).

    ``forward(hidden_states, probs, routing_map, is_first_microbatch=None)``: ``hidden_states
    [T, H]`` (the layer's local tokens), ``probs [T, E]`` float32 and ``routing_map [T, E]`` bool
    over all ``E`` experts as Megatron's ``TopKRouter`` returns them; returns ``[T, H]`` in the
    dtype of ``hidden_states``: the probability-weighted sum of each token's experts, gathered
    back from whichever expert-parallel rank computed them. ``is_first_microbatch``: TE's FP8
    weight-cache flag (None: no cache). Parameters live in ``linear_fc1`` / ``linear_fc2`` as
    ``weight0..weight{num_local_experts-1}`` (TE's GroupedLinear names). Optional:
    ``reset_fp8_weight_cache()``, which drops what ``is_first_microbatch=True`` cached
    (``FP8FlowMoELayer.reset_fp8_weight_cache`` calls it where the block has it).
    """

    def __call__(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
        is_first_microbatch: Optional[bool] = None,
    ) -> torch.Tensor: ...


# (config, num_local_experts, pg_collection) -> the expert block of one MoE layer.
ExpertBlockBuilder = Callable[..., torch.nn.Module]


def fp8_flow_dispatcher_backend(config) -> str:
    """The block's dispatcher: 'deepep' for Megatron's ``flex`` when ``deep_ep`` is importable,
    else 'alltoall' (a warning says so when ``flex`` was asked for)."""
    if config.moe_token_dispatcher_type == "flex":
        if importlib.util.find_spec("deep_ep") is not None:
            return "deepep"
        warnings.warn("moe_token_dispatcher_type 'flex': DeepEP is not importable, FP8-Flow "
                      "dispatches with all-to-all instead")
    return "alltoall"


def build_fp8_flow_block(config, num_local_experts: int, pg_collection) -> torch.nn.Module:
    """The production ``ExpertBlockBuilder``: ``transformer_engine_moe.module.FP8FlowMoE``.

    Initialisation. On the GPU (``use_cpu_initialization`` off) the weights are drawn exactly as
    Megatron's ``SequentialMLP`` experts draw theirs: on the current device, expert by expert, fc1
    (``init_method``) then fc2 (``output_layer_init_method``), each by
    ``_initialize_affine_weight_gpu`` under the expert-parallel CUDA RNG; so a stock run and an
    FP8-Flow run with one seed start from identical models. Otherwise (CPU) each EP rank draws
    from its own seed (``initial_seed + 1 + ep_rank``), so ranks never hold copies of one
    another's experts. ``perform_initialization=False`` leaves the GPU weights undrawn, as Megatron.

    Every parameter gets Megatron's ``allreduce = not expert_parallel``: with EP > 1 its
    gradient is reduced over the expert data-parallel group, not the whole data-parallel group.
    """
    from transformer_engine_moe import module

    ep_size = num_local_experts and config.num_moe_experts // num_local_experts
    if torch.cuda.is_available() and not config.use_cpu_initialization:
        block = _fp8_flow_block(module, config, pg_collection, ep_size,
                                device=torch.cuda.current_device(), undrawn=True)
        if config.perform_initialization:
            _draw_as_megatron_experts(block, config)
    elif ep_size <= 1:
        block = _fp8_flow_block(module, config, pg_collection, ep_size)
    else:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(torch.initial_seed() + 1 + torch.distributed.get_rank(pg_collection.ep))
            block = _fp8_flow_block(module, config, pg_collection, ep_size)
    for param in block.parameters():
        param.allreduce = ep_size <= 1
    return block


def _draw_as_megatron_experts(block, config) -> None:
    """Megatron's GPU draws for ``SequentialMLP``'s expert ``MLP``s (ColumnParallelLinear fc1
    ``[2F, H]``, RowParallelLinear fc2 ``[H, F]``), in their order, into each expert's weight (a slice of
    the single grouped weight when there is one)."""
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_gpu

    with torch.no_grad():
        for i in range(block.num_local_experts):
            _initialize_affine_weight_gpu(block.linear_fc1.weights[i], config.init_method,
                                          partition_dim=0, stride=2, is_expert=True)
            _initialize_affine_weight_gpu(block.linear_fc2.weights[i],
                                          config.output_layer_init_method, partition_dim=1, is_expert=True)


def _undrawn(weight: torch.Tensor) -> None:
    """An init method that draws nothing (the weights are drawn afterwards, or loaded)."""


def _fp8_flow_block(module, config, pg_collection, ep_size: int, device=None,
                    undrawn: bool = False) -> torch.nn.Module:
    from transformer_engine_moe.recipe import Format, FP8FlowRecipe

    fp8_format = config.moe_fp8_flow_format or config.fp8
    recipe = FP8FlowRecipe(fp8_format=Format.HYBRID if fp8_format == "hybrid" else Format.E4M3)
    return module.FP8FlowMoE(
        num_experts=config.num_moe_experts,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.moe_ffn_hidden_size,
        topk=config.moe_router_topk,
        ep_group=pg_collection.ep if ep_size > 1 else None,
        dispatcher=fp8_flow_dispatcher_backend(config) if ep_size > 1 else "local",
        recipe=recipe,
        recompute=MOE_EXPERT if MOE_EXPERT in (config.recompute_modules or ()) else None,
        init_method=_undrawn if undrawn else config.init_method,
        output_init_method=_undrawn if undrawn else config.output_layer_init_method,
        params_dtype=config.params_dtype if config.params_dtype != torch.float16 else torch.bfloat16,
        device=device,
        # as TE's grouped experts; or for the experts alone (Megatron's own linears need Apex for the fusion)
        fuse_wgrad_accumulation=config.gradient_accumulation_fusion or config.moe_fp8_flow_gradient_accumulation_fusion,
        single_grouped_weight=config.moe_fp8_flow_single_grouped_weight,
        device_splits=config.moe_fp8_flow_cuda_graph,  # the path a CUDA graph replays (EP=1)
        # without fusion: DDP's hook's sums (each gradient rounded to the weights' dtype) added in the wgrad GEMMs,
        # where the weights have DDP's main_grad (FP8FlowMoE.into_main_grad); .grad elsewhere
        accumulate_into_main_grad=True,
    )


class FP8FlowMoELayer(MoELayer):
    """Megatron's ``MoELayer`` with dispatcher and experts replaced by one expert block.

    Built from the spec like ``MoELayer`` (``submodules: MoESubmodules`` whose ``experts`` is an
    ``ExpertBlockBuilder``); ``self.experts`` is the block (state-dict keys
    ``mlp.experts.linear_fc1.weight0``...), ``self.token_dispatcher`` is None.
    ``recompute_modules`` 'moe' checkpoints the whole layer as in Megatron; 'moe_expert' is the
    block's own recompute. ``is_first_microbatch`` is TE's flag, which Megatron's schedules set
    through ``set_is_first_microbatch`` on a step's first micro-batch (patched by
    ``patch_set_is_first_microbatch`` to reach these layers when ``config.fp8`` is None, i.e. TE
    absent): the block's FP8 weights are quantized then and reused by the step's other
    micro-batches. A training loop of one's own must call ``model.set_is_first_microbatch()``
    before each step, as for Megatron's TE layers. ``disable_parameter_transpose_cache``: the
    weights are quantized on every micro-batch (with 'moe_expert', and again in backward: no layer keeps
    FP8 weights from its forward to its backward, ``GroupedLinear.requantize_in_backward``).

    ``moe_fp8_flow_cuda_graph``: ``self.cuda_graph`` is a ``GraphedFP8FlowMoE`` over the block (built with
    ``device_splits``), which training forwards go through: the block's forward and backward replayed from
    CUDA graphs, weight gradients added into DDP's ``main_grad`` inside the backward graph; the graphs of all
    layers built from one config share one memory pool (``_graph_pool``). None: the block runs eagerly.
    """

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None,
                 pg_collection=None, **kwargs):
        from megatron.core.transformer.moe.moe_utils import MoECudaGraphTensorStore, get_default_pg_collection

        if submodules is None:
            raise TypeError("FP8FlowMoELayer: submodules (MoESubmodules) is required")
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        # kwargs: 0.19's is_mtp_layer / name; MoELayer.__init__ would build Megatron's dispatcher
        # (flex needs DeepEP at construction) and experts, so the base initialiser runs directly.
        mtp = {"is_mtp_layer": kwargs["is_mtp_layer"]} if "is_mtp_layer" in kwargs else {}
        BaseMoELayer.__init__(self, config=config, layer_number=layer_number,
                              pg_collection=pg_collection, **mtp)
        self.submodules = submodules
        self.tp_group = pg_collection.tp
        self.pg_collection = pg_collection
        selective = config.recompute_granularity == "selective"
        self.moe_layer_recompute = selective and "moe" in config.recompute_modules
        self.shared_experts_recompute = selective and "shared_experts" in config.recompute_modules
        self.router = submodules.router(config=config, pg_collection=pg_collection, **mtp)
        self.experts = submodules.experts(config, self.num_local_experts, pg_collection)
        self.cuda_graph = _graphed_block(self.experts, config) if config.moe_fp8_flow_cuda_graph else None
        self.is_first_microbatch = True
        self._phase: Optional[_PhaseState] = None
        self.cudagraph_tensor_store = MoECudaGraphTensorStore()  # read by Megatron's route() under CUDA graphs
        self._register_load_state_dict_pre_hook(_drop_extra_states)
        if self.use_shared_expert:
            self.shared_experts = _build_shared_experts(submodules.shared_experts, config,
                                                        pg_collection)

    def _take_first_microbatch(self) -> Optional[bool]:
        """The block's ``is_first_microbatch`` for this forward (None: no FP8 weight cache); False after it."""
        cache = not self.config.disable_parameter_transpose_cache
        first, self.is_first_microbatch = self.is_first_microbatch if cache else None, False
        return first

    def reset_fp8_weight_cache(self) -> None:
        """Drop the block's cached FP8 weights (``FP8FlowMoE.reset_fp8_weight_cache``) where it has them; the
        next micro-batch quantizes the weights again whatever its flag. ``patch_finish_grad_sync`` calls it once
        a step's gradients are final. (The graphs' static FP8 weights stay allocated: the graphs own them.)"""
        reset = getattr(self.cuda_graph or self.experts, "reset_fp8_weight_cache", None)
        if reset is not None:
            reset()

    def _moe(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor]):
        """``[S, B, H]`` -> ``[S, B, H]``: shared experts, route, the whole expert block."""
        shared = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        experts = self.experts if self.cuda_graph is None else self.cuda_graph
        output = experts(tokens, probs, routing_map, is_first_microbatch=self._take_first_microbatch())
        output = output.view(hidden_states.shape)
        return output if shared is None else output + shared

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        """``hidden_states [S, B, H]`` -> ``(output [S, B, H], None)`` as ``MoELayer.forward``."""
        if intermediate_tensors is not None:
            raise ValueError("FP8FlowMoELayer does not support partial CUDA-graph capture of the "
                             "MoE layer (intermediate_tensors); capture whole layers or none")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        if self.moe_layer_recompute:
            output = tensor_parallel.checkpoint(self._moe, False, hidden_states, padding_mask)
        else:
            output = self._moe(hidden_states, padding_mask)
        return output, None

    # ------------------------------------------------------------ Megatron's MoE phases
    # MoELayer's phase methods, for Megatron's callers that run the layer phase by phase, mapped onto the
    # block's: preprocess -> FP8FlowMoE.quantize, dispatch -> .dispatch, routed_experts_compute ->
    # .routed_experts (the moe_expert recompute when set), combine -> .combine. route, shared_experts_compute
    # are Megatron's.
    # In sequence they compute what forward computes, bit for bit (tests/megatron/test_phases.py).
    def _state(self, phase: str) -> "_PhaseState":
        if self._phase is None:
            raise RuntimeError(f"FP8FlowMoELayer.{phase}: run the phases in Megatron's order, from preprocess "
                               "(route -> preprocess -> dispatch -> routed_experts_compute -> combine -> postprocess)")
        return self._phase

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """``hidden_states [S, B, H]`` (or ``[T, H]``) BF16/FP32, the router's ``probs [T, E]`` and
        ``routing_map [T, E]`` -> ``(tokens, topk_probs)``: ``tokens [T, H]`` 1x128 FP8
        (``FP8FlowMoE.quantize`` of the BF16 tokens), ``topk_probs [T, k]`` float32. The top-k ids and the
        input's shape and dtype stay with the layer."""
        missing = [m for m in ("quantize", "dispatch", "routed_experts", "combine") if not hasattr(self.experts, m)]
        if missing:
            raise TypeError(f"FP8FlowMoELayer's phase methods need the block's phases; "
                            f"{type(self.experts).__name__} lacks {missing} (forward needs none of them)")
        if hidden_states.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"hidden_states must be BF16 or FP32, got {hidden_states.dtype}")
        topk_ids, topk_probs = routing_map_to_topk(probs, routing_map, self.experts.topk)
        self._phase = _PhaseState(hidden_states.shape, hidden_states.dtype, topk_ids)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1]).to(torch.bfloat16)
        return self.experts.quantize(tokens), topk_probs

    def router_and_preprocess(self, hidden_states: torch.Tensor):
        """``route`` then ``preprocess`` (Megatron's deprecated combination) -> ``(tokens, topk_probs)``."""
        return self.preprocess(hidden_states, *self.route(hidden_states))

    def dispatch(self, hidden_states, probs: torch.Tensor):
        """``preprocess``'s ``(tokens, topk_probs)`` -> the ``(tokens [R, H] FP8, topk_probs [R, k])`` this
        rank's experts receive (``FP8FlowMoE.dispatch``); the local top-k ids, tokens per expert and the
        dispatch handle stay with the layer."""
        state = self._state("dispatch")
        res = self.experts.dispatch(hidden_states, state.topk_ids, probs)
        state.topk_ids, state.tokens_per_expert, state.handle = res.topk_ids, res.tokens_per_expert, res.handle
        state.routing, state.dispatched = res.routing, (res.hidden, res.topk_probs)
        return res.hidden, res.topk_probs

    def routed_experts_compute(self, hidden_states, probs: torch.Tensor):
        """The received ``(tokens [R, H], topk_probs [R, k])`` -> ``(output [R, H] BF16, None)``:
        ``FP8FlowMoE.routed_experts`` (``experts`` with the FP8 weight cache, inside the ``moe_expert``
        recompute when set)."""
        state = self._state("routed_experts_compute")
        # the dispatch's routing only for the tokens and probs it returned (a caller may hand others)
        routing = state.routing if hidden_states is state.dispatched[0] and probs is state.dispatched[1] else None
        return self.experts.routed_experts(hidden_states, state.topk_ids, probs, state.tokens_per_expert,
                                           self._take_first_microbatch(), routing=routing), None

    def combine(self, output: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` -> ``[T, H]`` BF16: each token's experts summed back (``FP8FlowMoE.combine``)."""
        return self.experts.combine(output, self._state("combine").handle)

    def postprocess(self, output: torch.Tensor, shared_expert_output: Optional[torch.Tensor]):
        """``[T, H]`` -> ``[S, B, H]`` in the layer input's dtype, plus the shared experts' output."""
        state, self._phase = self._state("postprocess"), None
        output = output.to(state.dtype).view(state.shape)
        return output if shared_expert_output is None else output + shared_expert_output

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's distributed-checkpoint view; the block's weights under the sharded keys of
        Megatron's ``SequentialMLP`` / ``TEGroupedMLP`` (interchangeable with both).

        Local expert ``i`` of EP rank ``r`` is global expert ``g = r * L + i``: ``linear_fc{1,2}.weight{i}``
        maps to ``{prefix}experts.experts.linear_fc{1,2}.weight`` with an expert axis ``(axis, g, E)``
        prepended to the layer's offsets (``singleton_local_shards``: key ``...experts.experts.{g}.``,
        no axis), tensor-parallel axes 0 / 1 over the expert TP group, fc1 split into its gate and up
        halves by Megatron's SwiGLU factory, and replica id ``(pp, tp, expert data-parallel rank)``.
        Each expert linear also gets the (empty) ``_extra_state`` object Megatron's linears save, so
        stock models load these checkpoints; on load the block drops them (``_drop_extra_states``).
        With ``single_grouped_weight`` the same per-expert keys hold slices of the one weight, and the
        loaded ``weight{i}`` are stacked back into it (``GroupedLinear._load_from_state_dict``).
        """
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        block_prefix = f"{prefix}experts."
        sharded = {k: v for k, v in super().sharded_state_dict(prefix, sharded_offsets, metadata).items()
                   if not k.startswith(block_prefix)}
        singleton = metadata.get("singleton_local_shards", False)
        ep, expt_tp, expt_dp = self.pg_collection.ep, self.pg_collection.expt_tp, self.pg_collection.expt_dp
        local = self.num_local_experts
        for i in range(local):
            g = torch.distributed.get_rank(ep) * local + i
            offsets = sharded_offsets if singleton else (
                *sharded_offsets, (len(sharded_offsets), g, local * torch.distributed.get_world_size(ep)))
            key_prefix = f"{block_prefix}experts.{g}." if singleton else f"{block_prefix}experts."
            for fc, tp_axis in (("linear_fc1", 0), ("linear_fc2", 1)):
                weight = getattr(self.experts, fc).weights[i]  # a view of `weight` when single grouped
                tensors = make_sharded_tensors_for_checkpoint(
                    {"weight": weight, "_extra_state": None}, f"{key_prefix}{fc}.", {"weight": tp_axis},
                    offsets, tp_group=expt_tp, dp_cp_group=metadata["dp_cp_group"])
                for tensor in tensors.values():
                    tensor.replica_id = (*tensor.replica_id[:2], torch.distributed.get_rank(expt_dp))
                tensor = tensors[f"{key_prefix}{fc}.weight"]
                if fc == "linear_fc1" and self.config.gated_linear_unit:
                    tensor = apply_swiglu_sharded_factory(tensor, offsets, singleton)
                sharded[f"{block_prefix}{fc}.weight{i}"] = tensor
                sharded[f"{block_prefix}{fc}._extra_state{i}"] = tensors[f"{key_prefix}{fc}._extra_state"]
        return sharded

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False):
        """Delayed weight gradients are not split out of the FP8-Flow block."""
        raise NotImplementedError("FP8FlowMoELayer computes weight gradients in backward; "
                                  "delay_wgrad_compute is not supported with moe_fp8_flow")


def _graphed_block(block, config):
    """``block`` replayed from CUDA graphs (``moe_fp8_flow_cuda_graph``) in the memory pool of ``config``'s layers."""
    from transformer_engine_moe.module import FP8FlowMoE, GraphedFP8FlowMoE

    if not isinstance(block, FP8FlowMoE):
        raise TypeError(f"moe_fp8_flow_cuda_graph replays the FP8FlowMoE block; this layer's expert builder made a "
                        f"{type(block).__name__}")
    return GraphedFP8FlowMoE(block, _graph_pool(config), accumulate_into_main_grad=True)


def _graph_pool(config):
    """The ``GraphPool`` of every FP8-Flow layer built from ``config`` (one model), kept on it: the layers' graphs
    are captured together in the order they replay, forwards in layer order, backwards in reverse, at the second
    micro-batch, so one graph's temporaries serve the next instead of each layer keeping its own."""
    from transformer_engine_moe.module import GraphPool

    if not isinstance(getattr(config, "_fp8_flow_graph_pool", None), GraphPool):
        config._fp8_flow_graph_pool = GraphPool()
    return config._fp8_flow_graph_pool


@dataclasses.dataclass(slots=True)
class _PhaseState:
    """What ``FP8FlowMoELayer``'s phases pass one another besides Megatron's ``(hidden, probs)`` pairs, as
    Megatron's token dispatcher keeps its routing state: the layer input's ``shape`` and ``dtype``,
    ``topk_ids [T, k]`` (global expert ids; after dispatch ``[R, k]`` local ones), ``tokens_per_expert`` of
    the local experts (a host list; a device tensor with ``moe_fp8_flow_cuda_graph``'s device splits), the
    dispatch ``handle`` combine needs, and the dispatch's ``routing`` (``DispatchResult.routing``) with the
    ``(tokens, probs)`` it returned (``dispatched``): the experts take the routing only for those."""

    shape: torch.Size
    dtype: torch.dtype
    topk_ids: torch.Tensor
    tokens_per_expert: Union[list, torch.Tensor, None] = None
    handle: object = None
    routing: Optional[tuple] = None
    dispatched: tuple = (None, None)


def _drop_extra_states(state_dict, prefix, *args) -> None:
    """Load pre-hook: drop the experts' ``_extra_state`` entries of ``sharded_state_dict`` (always
    None, written for stock models' sake); the block has no module state to put them in."""
    for key in [k for k in state_dict if k.startswith(f"{prefix}experts.") and "._extra_state" in k]:
        del state_dict[key]


def _fp8_flow_layers(module: torch.nn.Module) -> list:
    """The ``FP8FlowMoELayer``s inside ``module``, found once and kept on it."""
    if not hasattr(module, "_fp8_flow_layers"):
        module._fp8_flow_layers = [m for m in module.modules() if isinstance(m, FP8FlowMoELayer)]
    return module._fp8_flow_layers


def patch_set_is_first_microbatch() -> None:
    """Make ``MegatronModule.set_is_first_microbatch`` reset ``FP8FlowMoELayer`` flags too (idempotent).

    Megatron's schedules call it on each step's first micro-batch, but stock resets its modules
    only when ``config.fp8`` is set, and without TransformerEngine FP8-Flow runs with ``fp8``
    None: the layers would never see True again and keep the first step's FP8 weights.
    """
    from megatron.core.transformer.module import MegatronModule

    original = MegatronModule.set_is_first_microbatch
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def set_is_first_microbatch(self):
        original(self)
        for layer in _fp8_flow_layers(self):
            layer.is_first_microbatch = True

    setattr(set_is_first_microbatch, _MARK, True)
    MegatronModule.set_is_first_microbatch = set_is_first_microbatch


def patch_finish_grad_sync() -> None:
    """Make Megatron's ``DistributedDataParallel.finish_grad_sync`` drop the FP8-Flow layers' cached FP8
    weights (idempotent).

    Megatron calls it once per step, after the last micro-batch's backward and before the optimizer step
    (``finalize_model_grads``). The cache, one byte per expert parameter quantized on the step's first
    micro-batch, is stale once the optimizer writes the weights, and the optimizer step is where a run
    near its memory limit peaks (without TE or Apex, torch's foreach AdamW allocates an FP32 temporary per
    parameter): dropped here, it is not alive then. The next step's first micro-batch quantizes the weights
    anyway. (TransformerEngine keeps its FP8 weight workspaces across steps.)
    """
    from megatron.core.distributed import DistributedDataParallel

    original = DistributedDataParallel.finish_grad_sync
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def finish_grad_sync(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        for layer in _fp8_flow_layers(self.module):
            layer.reset_fp8_weight_cache()
        return out

    setattr(finish_grad_sync, _MARK, True)
    DistributedDataParallel.finish_grad_sync = finish_grad_sync


def _build_shared_experts(spec, config, pg_collection):
    """0.16 passes a ModuleSpec, 0.19 a builder callable."""
    if isinstance(spec, ModuleSpec):
        return build_module(spec, config=config, pg_collection=pg_collection,
                            gate=config.moe_shared_expert_gate)
    return spec(config=config, pg_collection=pg_collection, gate=config.moe_shared_expert_gate)


def _swap_mlp(mlp, experts, layer_class):
    """``mlp`` as ``layer_class`` with ``experts``, or None if it is not Megatron's MoE layer spec."""
    if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:  # megatron-core 0.16
        submodules = dataclasses.replace(mlp.submodules, experts=experts)
        return dataclasses.replace(mlp, module=layer_class, submodules=submodules)
    if isinstance(mlp, functools.partial) and mlp.func is MoELayer:  # megatron-core 0.19
        keywords = dict(mlp.keywords)
        keywords["submodules"] = dataclasses.replace(keywords["submodules"], experts=experts)
        return functools.partial(layer_class, *mlp.args, **keywords)
    return None


def _swap_layer(layer_spec, experts, layer_class):
    submodules = getattr(layer_spec, "submodules", None)
    mlp = _swap_mlp(getattr(submodules, "mlp", None), experts, layer_class)
    if mlp is None:
        return layer_spec, False
    return dataclasses.replace(layer_spec,
                               submodules=dataclasses.replace(submodules, mlp=mlp)), True


def replace_moe_experts(spec, experts, layer_class=MoELayer):
    """A copy of ``spec`` whose MoE layers are ``layer_class`` with ``MoESubmodules.experts = experts``.

    ``spec``: a transformer-layer ``ModuleSpec`` or ``TransformerBlockSubmodules`` (with ``layer_specs``)
    from Megatron's GPT spec helpers, in 0.16's ``ModuleSpec`` or 0.19's ``functools.partial`` form;
    ``experts``: what Megatron's ``MoELayer`` builds the experts from (``layer_class`` MoELayer) or an
    ``ExpertBlockBuilder`` (``FP8FlowMoELayer``). Dense layers stay as they are. Raises ValueError when
    no layer is an MoE layer.
    """
    if hasattr(spec, "layer_specs"):
        swapped = [_swap_layer(layer, experts, layer_class) for layer in spec.layer_specs]
        found = any(done for _, done in swapped)
        spec = dataclasses.replace(spec, layer_specs=[layer for layer, _ in swapped])
    else:
        spec, found = _swap_layer(spec, experts, layer_class)
    if not found:
        raise ValueError("the layer spec has no MoELayer to replace; build the spec with num_experts set "
                         "(get_gpt_layer_local_spec / _with_transformer_engine_spec / get_gpt_decoder_block_spec)")
    return spec


def fp8_flow_layer_spec(spec, config, block_builder: ExpertBlockBuilder = build_fp8_flow_block):
    """A copy of ``spec`` whose MoE layers are ``FP8FlowMoELayer`` (experts: ``block_builder``) when
    ``config.moe_fp8_flow``; ``spec`` unchanged otherwise. ValueError when FP8-Flow is on but no layer is
    MoE (``replace_moe_experts``)."""
    if not config.moe_fp8_flow:
        return spec
    return replace_moe_experts(spec, block_builder, FP8FlowMoELayer)
