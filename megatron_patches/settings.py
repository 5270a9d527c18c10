"""The FP8-Flow settings, their defaults and the rules on combining them with Megatron's own.

One rule set serves both the command line (``arguments.py``, messages name ``--flags``) and
``TransformerConfig`` (``config.py``, messages name fields), so they cannot drift apart.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

# The recompute module FP8-Flow adds: keep only the FP8 dispatched input of the expert block and
# recompute permute -> fc1 -> SwiGLU in backward (never re-dispatch).
MOE_EXPERT = "moe_expert"

# Megatron's --moe-token-dispatcher-type values the FP8-Flow block can stand in for:
# all-to-all over the expert-parallel group, or DeepEP ("flex") when it is importable.
FP8_FLOW_DISPATCHERS = ("alltoall", "flex")

_NO_DELAYED_WGRAD = "the FP8-Flow block computes its weight gradients in its backward (no backward_dw to delay)"
_DISPATCHER_REPLACED = "FP8-Flow replaces Megatron's token dispatcher, where this happens"
_ROUTER_PADDING = ("FP8-Flow aligns each expert's tokens itself (to 128 rows); the router's padding would route "
                   "tokens to more than top-k experts")
# Megatron settings FP8FlowMoELayer cannot honour: refused by name when set (field -> why), never ignored.
UNSUPPORTED_WITH_FP8_FLOW = {
    "overlap_moe_expert_parallel_comm": (
        "Megatron's EP-overlap schedule (combined 1F1B, fine_grained_callables) runs the MoE phases as "
        "separate schedule nodes on CUDA streams, detaches every tensor between them and reaches into the "
        "token dispatcher (flex: its DeepEP comm manager); FP8-Flow's dispatch hands an FP8 tensor and a "
        "dispatch handle to its experts and combine, which that schedule does not carry"),
    "delay_wgrad_compute": _NO_DELAYED_WGRAD,
    "overlap_dispatch_backward_with_experts_wgrad": _NO_DELAYED_WGRAD,
    "moe_shared_expert_overlap": (
        "the shared experts would overlap with Megatron's token dispatcher, which FP8-Flow replaces; "
        "without it they run before routing"),
    "moe_pad_expert_input_to_capacity": (
        "FP8-Flow pads each expert's tokens to a multiple of 128 rows, not to the capacity (token dropping "
        "with moe_expert_capacity_factor alone works)"),
    "moe_expert_rank_capacity_factor": f"per-rank token dropping: {_DISPATCHER_REPLACED}",
    "moe_router_padding_for_quantization": _ROUTER_PADDING,
    "moe_router_padding_for_fp8": _ROUTER_PADDING,
    "moe_apply_probs_on_input": "FP8-Flow applies the router probabilities in its fused SwiGLU, on fc1's output",
    "moe_latent_size": "FP8FlowMoELayer builds no MoE latent projections (TransformerEngine linears)",
}


_OWN_CUDA_GRAPHS = ("Megatron's own CUDA graphs capture whole layers (FP8FlowMoELayer refuses partial capture); the "
                    "FP8-Flow graphs capture the expert block alone: use one or the other")
_OFFLOADING = "activation offloading moves saved tensors to the host, which a graph's replays cannot follow"
# Settings the CUDA graphs of the FP8-Flow block cannot run with: field -> (is this value refused, what is
# expected, why). Refused by name when set, as UNSUPPORTED_WITH_FP8_FLOW (a setting the installed Megatron or
# the source lacks counts as unset).
CUDA_GRAPH_CONFLICTS = {
    "expert_model_parallel_size": (
        lambda v: v > 1, "1",
        "the graphs replay the local dispatcher's path, which keeps the per-expert counts on the GPU "
        "(device_splits); all-to-all and DeepEP size their buffers from host counts, a host sync per step"),
    "pipeline_model_parallel_size": (
        lambda v: v > 1, "1",
        "pipeline schedules run several micro-batches' forwards before their backwards, and each layer's graphs "
        "hold the activations of one micro-batch"),
    "recompute_granularity": (
        lambda v: v == "full", "'selective' or unset",
        "full recompute reruns each layer's forward in backward, out of the order in which the layers' graphs "
        "share their memory pool"),
    "cuda_graph_impl": (lambda v: v != "none", "'none'", _OWN_CUDA_GRAPHS),
    "enable_cuda_graph": (bool, "it unset", _OWN_CUDA_GRAPHS),
    "external_cuda_graph": (bool, "it unset", _OWN_CUDA_GRAPHS),
    "cpu_offloading": (bool, "it unset", _OFFLOADING),
    "fine_grained_activation_offloading": (bool, "it unset", _OFFLOADING),
    "overlap_param_gather": (
        bool, "it unset",
        "the parameters' all-gather is awaited in forward pre-hooks of the modules that hold them, which a "
        "replay does not call"),
}

# Megatron-LM settings under which the expert weights have no main_grad from forward on (where GroupedLinear checks
# the buffer its fused wgrad writes into): field -> why. moe_fp8_flow_gradient_accumulation_fusion refuses them by
# name on the command line; TransformerConfig has no such fields (a model wrapped so by hand meets GroupedLinear's
# own check, which names the weight without a main_grad).
NO_MAIN_GRAD = {
    "use_megatron_fsdp": (
        "Megatron-FSDP gives a weight its main_grad only in backward (get_main_grad, which TE's linears call "
        "before their wgrad GEMM); the FP8-Flow experts need it from forward on"),
    "use_torch_fsdp2": "torch FSDP2 keeps gradients in .grad (sharded DTensors): the weights have no main_grad",
}


@dataclass
class FP8FlowFields:
    """The fields ``apply()`` adds to ``TransformerConfig`` (copied from this dataclass)."""

    moe_fp8_flow: bool = False
    """Run the routed experts as the FP8-Flow block: tokens quantized once (1x128 blocks), sent
    as FP8, permuted and fed to blockwise-FP8 grouped GEMMs. Needs fp8_recipe='blockwise',
    fp8 in ('e4m3', 'hybrid'), moe_grouped_gemm, swiglu experts without bias, and
    moe_token_dispatcher_type 'alltoall' or 'flex'."""

    moe_fp8_flow_format: Optional[str] = None
    """FP8 format of the expert block, 'e4m3' or 'hybrid' (E5M2 gradients); None takes ``fp8``.
    Set it when TransformerEngine is absent: Megatron then refuses ``fp8`` with MoE layers, so the
    experts carry the format and the dense layers stay BF16."""

    moe_fp8_flow_single_grouped_weight: bool = False
    """Hold each expert GroupedLinear's weights as one ``[num_local_experts, N, K]`` parameter
    (TransformerEngine's ``single_grouped_weight``) instead of one per expert: autograd and the
    DDP hooks then run once per layer and GEMM, not once per expert, in every backward.
    Checkpoints keep the per-expert names. (Megatron's own ``moe_single_grouped_weight`` is
    TransformerEngine's and needs it.)"""

    moe_fp8_flow_cuda_graph: bool = False
    """Replay each MoE layer's FP8-Flow block (``transformer_engine_moe.GraphedFP8FlowMoE``) from CUDA graphs
    in training: one graph launch per layer and pass instead of about 70 kernel launches, and the FP8 weights
    quantized into static buffers on a step's first micro-batch. Captured at the first training micro-batch for
    its token count. Needs moe_fp8_flow at expert_model_parallel_size 1 (the local dispatcher keeps its counts
    on the GPU: worst-case padded buffers); ``CUDA_GRAPH_CONFLICTS`` and 'moe' recompute are refused."""

    moe_fp8_flow_gradient_accumulation_fusion: bool = False
    """Add the FP8-Flow experts' weight gradients straight into Megatron DDP's ``main_grad`` (the GroupedLinears'
    ``fuse_wgrad_accumulation``: cuBLASLt beta=1, DeepGEMM C=D, Triton read-add-write; no Apex) even when
    ``gradient_accumulation_fusion`` is off, as it must be for Megatron's own linears without Apex (with it on,
    the experts fuse anyway). Needs moe_fp8_flow and Megatron's DDP (its ``main_grad`` buffers): the settings of
    ``NO_MAIN_GRAD`` are refused."""


def fp8_flow_fields(source) -> dict:
    """``{field: value}`` of every ``FP8FlowFields`` field from ``source`` (parsed args), its default where
    unset: the keywords a ``TransformerConfig`` built by hand takes, so none is left behind."""
    return {f.name: getattr(source, f.name, f.default) for f in dataclasses.fields(FP8FlowFields)}


@dataclass(frozen=True)
class FP8FlowView:
    """The settings the rules read, gathered from argparse args or a TransformerConfig."""

    moe_fp8_flow: bool
    num_moe_experts: Optional[int]
    fp8: Optional[str]
    moe_fp8_flow_format: Optional[str]
    fp8_recipe: Optional[str]
    moe_grouped_gemm: bool
    moe_token_dispatcher_type: str
    swiglu: bool
    add_bias_linear: bool
    recompute_granularity: Optional[str]
    recompute_modules: Sequence[str]
    moe_router_topk: Optional[int] = None
    hidden_size: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_flex_dispatcher_backend: Optional[str] = None
    moe_fp8_flow_single_grouped_weight: bool = False
    unsupported: Mapping[str, object] = field(default_factory=dict)
    """The settings of ``UNSUPPORTED_WITH_FP8_FLOW`` that are set: field -> value."""
    moe_fp8_flow_cuda_graph: bool = False
    graph_conflicts: Mapping[str, object] = field(default_factory=dict)
    """The settings of ``CUDA_GRAPH_CONFLICTS`` whose value is refused: field -> value."""
    moe_fp8_flow_gradient_accumulation_fusion: bool = False
    no_main_grad: Mapping[str, object] = field(default_factory=dict)
    """The settings of ``NO_MAIN_GRAD`` that are set: field -> value."""


# FP8FlowFields' switches, and the sizes the rules compute with: their types are checked first (a truthy "no" once
# switched FP8-Flow on; a size given as a string once failed with Python's TypeError, naming nothing).
_SWITCHES = ("moe_fp8_flow", "moe_fp8_flow_single_grouped_weight", "moe_fp8_flow_cuda_graph",
             "moe_fp8_flow_gradient_accumulation_fusion")
_SIZES = ("num_moe_experts", "moe_router_topk", "hidden_size", "moe_ffn_hidden_size")


def _type_problems(view: FP8FlowView, name: Callable[[str], str]) -> list:
    """The settings of the wrong type, one sentence each: the rules below read them as bools, ints and names."""
    problems = [f"{name(s)} must be a bool (True or False), got {getattr(view, s)!r}" for s in _SWITCHES
                if not isinstance(getattr(view, s), bool)]
    for setting in _SIZES:
        value = getattr(view, setting)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(f"{name(setting)} must be a positive int, got {value!r}")
    modules = view.recompute_modules
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
        problems.append(f"{name('recompute_modules')} must be a list of module names (e.g. [{MOE_EXPERT!r}]), "
                        f"got {modules!r}")
    return problems


def fp8_flow_problems(view: FP8FlowView, name: Callable[[str], str]) -> list:
    """Every violated rule as a sentence; ``name(field)`` spells a setting (flag or field)."""
    problems = _type_problems(view, name)
    if problems:  # the rules below would misread them
        return problems
    modules = list(view.recompute_modules or ())
    if MOE_EXPERT in modules:
        if view.recompute_granularity != "selective":
            problems.append(
                f"{name('recompute_modules')} contains {MOE_EXPERT!r}, which requires "
                f"{name('recompute_granularity')} 'selective' (got {view.recompute_granularity!r})"
            )
        if not view.moe_fp8_flow:
            problems.append(
                f"{name('recompute_modules')} {MOE_EXPERT!r} is the FP8-Flow expert block's "
                f"recompute: it requires {name('moe_fp8_flow')}"
            )
        if "moe" in modules:
            problems.append(
                f"{name('recompute_modules')} has both 'moe' (the whole MoE layer) and "
                f"{MOE_EXPERT!r} (inside it): choose one"
            )
    if view.num_moe_experts and view.moe_router_topk is not None \
            and not 1 <= view.moe_router_topk <= view.num_moe_experts:
        problems.append(
            f"{name('moe_router_topk')} must be in [1, {name('num_moe_experts')}={view.num_moe_experts}] "
            f"(got {view.moe_router_topk})"
        )
    if view.moe_fp8_flow_single_grouped_weight and not view.moe_fp8_flow:
        problems.append(f"{name('moe_fp8_flow_single_grouped_weight')} shapes the FP8-Flow experts' weights: it "
                        f"requires {name('moe_fp8_flow')}")
    if view.moe_fp8_flow_cuda_graph:
        problems += _cuda_graph_problems(view, name)
    if view.moe_fp8_flow_gradient_accumulation_fusion:
        problems += _fusion_problems(view, name)
    if not view.moe_fp8_flow:
        return problems
    for setting in ("hidden_size", "moe_ffn_hidden_size"):
        size = getattr(view, setting)
        if size is not None and size % 128:
            problems.append(
                f"{name('moe_fp8_flow')} quantizes the experts' weights in 128x128 blocks: "
                f"{name(setting)} must be a multiple of 128 (got {size})"
            )
    if not view.num_moe_experts:
        problems.append(f"{name('moe_fp8_flow')} requires {name('num_moe_experts')} (MoE layers)")
    if view.fp8_recipe != "blockwise":
        problems.append(
            f"{name('moe_fp8_flow')} requires {name('fp8_recipe')} 'blockwise' "
            f"(got {view.fp8_recipe!r})"
        )
    if view.moe_fp8_flow_format not in (None, "e4m3", "hybrid"):
        problems.append(
            f"{name('moe_fp8_flow_format')} must be 'e4m3' or 'hybrid' "
            f"(got {view.moe_fp8_flow_format!r})"
        )
    elif (view.moe_fp8_flow_format or view.fp8) not in ("e4m3", "hybrid"):
        problems.append(
            f"{name('moe_fp8_flow')} needs the experts' FP8 format: {name('fp8')} or "
            f"{name('moe_fp8_flow_format')} 'e4m3' or 'hybrid' (got {view.fp8!r})"
        )
    if not view.moe_grouped_gemm:
        problems.append(f"{name('moe_fp8_flow')} requires {name('moe_grouped_gemm')}")
    for setting, value in view.unsupported.items():
        problems.append(f"{name('moe_fp8_flow')} does not support {name(setting)} (got {value!r}; expected it "
                        f"unset): {UNSUPPORTED_WITH_FP8_FLOW[setting]}")
    if view.moe_token_dispatcher_type == "flex" and view.moe_flex_dispatcher_backend not in (None, "deepep"):
        problems.append(
            f"{name('moe_token_dispatcher_type')} 'flex' runs FP8-Flow's DeepEP dispatcher (all-to-all "
            f"without DeepEP): {name('moe_flex_dispatcher_backend')} must be 'deepep' "
            f"(got {view.moe_flex_dispatcher_backend!r})")
    if view.moe_token_dispatcher_type not in FP8_FLOW_DISPATCHERS:
        problems.append(
            f"{name('moe_fp8_flow')} dispatches FP8 tokens all-to-all: "
            f"{name('moe_token_dispatcher_type')} must be one of {FP8_FLOW_DISPATCHERS} "
            f"(got {view.moe_token_dispatcher_type!r})"
        )
    if not view.swiglu:
        problems.append(f"{name('moe_fp8_flow')} fuses a SwiGLU: it requires {name('swiglu')}")
    if view.add_bias_linear:
        problems.append(
            f"{name('moe_fp8_flow')} experts have no bias: set {name('add_bias_linear')}"
        )
    return problems


def _cuda_graph_problems(view: FP8FlowView, name: Callable[[str], str]) -> list:
    """What ``moe_fp8_flow_cuda_graph`` cannot run with, one sentence each."""
    graph = name("moe_fp8_flow_cuda_graph")
    problems = [] if view.moe_fp8_flow else [
        f"{graph} replays the FP8-Flow expert block from CUDA graphs: it requires {name('moe_fp8_flow')}"]
    if view.recompute_granularity == "selective" and "moe" in (view.recompute_modules or ()):
        problems.append(
            f"{graph} does not support 'moe' in {name('recompute_modules')}: the MoE layer's rerun in backward would "
            f"replay its forward graph out of the order in which the layers' graphs share their memory pool; "
            f"{MOE_EXPERT!r} works with the graphs")
    for setting, value in view.graph_conflicts.items():
        expected, why = CUDA_GRAPH_CONFLICTS[setting][1:]
        problems.append(f"{graph} does not support {name(setting)} (got {value!r}; expected {expected}): {why}")
    return problems


def _fusion_problems(view: FP8FlowView, name: Callable[[str], str]) -> list:
    """What ``moe_fp8_flow_gradient_accumulation_fusion`` cannot run with, one sentence each."""
    fusion = name("moe_fp8_flow_gradient_accumulation_fusion")
    problems = [] if view.moe_fp8_flow else [
        f"{fusion} adds the FP8-Flow experts' weight gradients into main_grad: it requires {name('moe_fp8_flow')}"]
    for setting, value in view.no_main_grad.items():
        problems.append(f"{fusion} does not support {name(setting)} (got {value!r}; expected it unset): "
                        f"{NO_MAIN_GRAD[setting]}")
    return problems


def cuda_graph_conflicts(source) -> dict:
    """``{field: value}`` of the ``CUDA_GRAPH_CONFLICTS`` settings whose value ``source`` (argparse args or a
    TransformerConfig) sets to one the graphs refuse; settings the source lacks count as unset."""
    values = {f: getattr(source, f, None) for f in CUDA_GRAPH_CONFLICTS}
    return {f: v for f, v in values.items() if v is not None and _refused(CUDA_GRAPH_CONFLICTS[f][0], v)}


def _refused(rule: Callable[[object], bool], value) -> bool:
    """``rule(value)``; a value the rule cannot compare (``"2"`` for a size) is refused too, not a TypeError."""
    try:
        return bool(rule(value))
    except TypeError:
        return True


def unsupported_settings(source, table: Mapping[str, str] = UNSUPPORTED_WITH_FP8_FLOW) -> dict:
    """``{field: value}`` of the settings of ``table`` (``UNSUPPORTED_WITH_FP8_FLOW``, or ``NO_MAIN_GRAD``) that
    ``source`` (argparse args or a TransformerConfig) sets; settings the installed Megatron lacks count as unset."""
    return {f: getattr(source, f) for f in table if getattr(source, f, None)}


def raise_on_problems(problems: list, where: str) -> None:
    """One ValueError listing every problem, or nothing."""
    if problems:
        raise ValueError(f"invalid FP8-Flow settings ({where}):\n  - " + "\n  - ".join(problems))
