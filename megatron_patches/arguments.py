"""FP8-Flow command-line flags for Megatron-LM's parser, and their validation.

``add_fp8_flow_args`` is usable as Megatron-LM's ``extra_args_provider``. The FP8 format, the
recipe, the dispatcher and recompute keep Megatron's own flags (``--fp8-format``,
``--fp8-recipe``, ``--moe-token-dispatcher-type``, ``--recompute-modules``); FP8-Flow adds one
switch and one recompute module, and ``validate_fp8_flow_args`` checks how they combine.
"""

import argparse
import importlib.util
import warnings

from .settings import (
    MOE_EXPERT,
    FP8FlowView,
    cuda_graph_conflicts,
    fp8_flow_problems,
    raise_on_problems,
    unsupported_settings,
)

# Megatron-LM flags whose name is not "--" + the config field with dashes.
_FLAGS = {
    "fp8": "--fp8-format",
    "num_moe_experts": "--num-experts",
    "add_bias_linear": "--disable-bias-linear",
}

_HELP = (
    "Run the routed experts of every MoE layer as the FP8-Flow block "
    "(transformer_engine_moe): tokens are quantized once to blockwise FP8 (1x128, power-of-two "
    "scales), dispatched as FP8, permuted and fed to blockwise-FP8 grouped GEMMs with a fused "
    "SwiGLU+quantize between them; Megatron's router and aux losses are kept. Requires "
    "--fp8-format e4m3|hybrid --fp8-recipe blockwise --moe-grouped-gemm --swiglu "
    "--disable-bias-linear and --moe-token-dispatcher-type alltoall|flex (flex: DeepEP when "
    f"importable). Add {MOE_EXPERT!r} to --recompute-modules (with --recompute-granularity "
    "selective) to keep only the FP8 dispatched input and recompute permute, fc1 and SwiGLU in "
    "backward."
)

_FORMAT_HELP = (
    "FP8 format of the FP8-Flow experts (hybrid: E5M2 gradients); default: --fp8-format. "
    "Without TransformerEngine Megatron refuses --fp8-format with MoE layers: "
    "examples.pretrain_gpt then moves --fp8-format here and trains the dense layers in BF16."
)


_SINGLE_HELP = (
    "Hold each FP8-Flow expert GroupedLinear's weights as one [local experts, N, K] parameter "
    "(TransformerEngine's single_grouped_weight) instead of one per expert: less host work in every "
    "backward (autograd and Megatron's DDP hooks run per parameter). Checkpoints keep the per-expert names."
)


_CUDA_GRAPH_HELP = (
    "Replay each MoE layer's FP8-Flow block (quantize, dispatch, permute, grouped GEMMs, SwiGLU, unpermute, "
    "combine; forward and backward) from CUDA graphs in training: one graph launch per layer and pass instead "
    "of about 70 kernel launches. Captured at the first training micro-batch for its token count "
    "(--seq-length x --micro-batch-size); the FP8 weights are quantized into static buffers on each step's first "
    "micro-batch. Needs --moe-fp8-flow and --expert-model-parallel-size 1 (the local dispatcher keeps the "
    "per-expert counts on the GPU: worst-case padded buffers, Triton wgrad); works with --recompute-modules "
    f"{MOE_EXPERT}; refuses pipeline parallelism, 'moe' and full recompute, Megatron's own CUDA graphs, "
    "activation offloading and --overlap-param-gather."
)


def flag(field: str) -> str:
    """The Megatron-LM flag that sets config ``field``."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def add_fp8_flow_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the FP8-Flow flags to ``parser`` and return it (Megatron's extra_args_provider).

    On megatron-core 0.19 with ``apply()`` done first, Megatron's parser already generates
    them from the patched ``TransformerConfig`` fields; then only their help is set.
    """
    group = parser.add_argument_group(title="FP8-Flow MoE (megatron_patches)")
    for option, kwargs in (
        ("--moe-fp8-flow", dict(action="store_true", help=_HELP)),
        ("--moe-fp8-flow-format", dict(choices=("e4m3", "hybrid"), default=None,
                                       help=_FORMAT_HELP)),
        ("--moe-fp8-flow-single-grouped-weight", dict(action="store_true", help=_SINGLE_HELP)),
        ("--moe-fp8-flow-cuda-graph", dict(action="store_true", help=_CUDA_GRAPH_HELP)),
    ):
        existing = parser._option_string_actions.get(option)
        if existing is None:
            group.add_argument(option, **kwargs)
        else:
            existing.help = kwargs["help"]
    return parser


def _view(args: argparse.Namespace) -> FP8FlowView:
    modules = getattr(args, "recompute_modules", None) or ()
    return FP8FlowView(
        moe_fp8_flow=bool(getattr(args, "moe_fp8_flow", False)),
        num_moe_experts=getattr(args, "num_experts", None),
        fp8=getattr(args, "fp8", None),
        moe_fp8_flow_format=getattr(args, "moe_fp8_flow_format", None),
        fp8_recipe=getattr(args, "fp8_recipe", None),
        moe_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)),
        moe_token_dispatcher_type=getattr(args, "moe_token_dispatcher_type", "allgather"),
        swiglu=bool(getattr(args, "swiglu", False)),
        add_bias_linear=getattr(args, "add_bias_linear", True),
        recompute_granularity=getattr(args, "recompute_granularity", None),
        recompute_modules=modules,
        moe_router_topk=getattr(args, "moe_router_topk", None),
        hidden_size=getattr(args, "hidden_size", None),
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
        moe_flex_dispatcher_backend=getattr(args, "moe_flex_dispatcher_backend", None),
        moe_fp8_flow_single_grouped_weight=bool(getattr(args, "moe_fp8_flow_single_grouped_weight", False)),
        unsupported=unsupported_settings(args),
        moe_fp8_flow_cuda_graph=bool(getattr(args, "moe_fp8_flow_cuda_graph", False)),
        graph_conflicts=cuda_graph_conflicts(args),
    )


def validate_fp8_flow_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming every FP8-Flow rule the parsed ``args`` break (by flag)."""
    raise_on_problems(fp8_flow_problems(_view(args), flag), "command line")


def resolve_fp8_flow_format(args: argparse.Namespace) -> None:
    """Without TransformerEngine, move ``--fp8-format`` to ``--moe-fp8-flow-format`` (in place),
    with one warning: the experts run FP8-Flow, everything else BF16."""
    if not args.fp8 or importlib.util.find_spec("transformer_engine"):
        return
    if not args.moe_fp8_flow:
        raise ValueError(f"--fp8-format {args.fp8} needs TransformerEngine, which is not installed; add "
                         "--moe-fp8-flow to run the routed experts in FP8 with this package's kernels")
    args.moe_fp8_flow_format = args.moe_fp8_flow_format or args.fp8
    args.fp8 = None
    warnings.warn(f"TransformerEngine is not installed: the routed experts run FP8-Flow "
                  f"({args.moe_fp8_flow_format}, transformer_engine_moe kernels); attention and "
                  f"dense layers stay BF16")
