"""The FP8-Flow settings, their defaults and the rules on combining them with Megatron's own.

One rule set serves both the command line (``arguments.py``, messages name ``--flags``) and
``TransformerConfig`` (``config.py``, messages name fields), so they cannot drift apart.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

# The recompute module FP8-Flow adds: keep only the FP8 dispatched input of the expert block and
# recompute permute -> fc1 -> SwiGLU in backward (never re-dispatch).
MOE_EXPERT = "moe_expert"

# Megatron's --moe-token-dispatcher-type values the FP8-Flow block can stand in for:
# all-to-all over the expert-parallel group, or DeepEP ("flex") when it is importable.
FP8_FLOW_DISPATCHERS = ("alltoall", "flex")


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


def fp8_flow_problems(view: FP8FlowView, name: Callable[[str], str]) -> list:
    """Every violated rule as a sentence; ``name(field)`` spells a setting (flag or field)."""
    problems = []
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
    if not view.moe_fp8_flow:
        return problems
    for field in ("hidden_size", "moe_ffn_hidden_size"):
        size = getattr(view, field)
        if size is not None and size % 128:
            problems.append(
                f"{name('moe_fp8_flow')} quantizes the experts' weights in 128x128 blocks: "
                f"{name(field)} must be a multiple of 128 (got {size})"
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


def raise_on_problems(problems: list, where: str) -> None:
    """One ValueError listing every problem, or nothing."""
    if problems:
        raise ValueError(f"invalid FP8-Flow settings ({where}):\n  - " + "\n  - ".join(problems))
