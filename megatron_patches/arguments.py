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
    NO_MAIN_GRAD,
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
    "mmap_bin_files": "--no-mmap-bin-files",
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


_FUSION_HELP = (
    "Add the FP8-Flow experts' weight gradients straight into Megatron DDP's main_grad (cuBLASLt beta=1, "
    "DeepGEMM C=D, Triton; no Apex) even with --no-gradient-accumulation-fusion, which Megatron's own linears "
    "need without Apex: no BF16 weight gradient per expert and micro-batch for DDP's hook to add. With "
    "--gradient-accumulation-fusion on the experts fuse anyway. Needs --moe-fp8-flow and Megatron's DDP: refuses "
    "--use-megatron-fsdp and --use-torch-fsdp2 (no main_grad at forward)."
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
        ("--moe-fp8-flow-gradient-accumulation-fusion", dict(action="store_true", help=_FUSION_HELP)),
    ):
        existing = parser._option_string_actions.get(option)
        if existing is None:
            group.add_argument(option, **kwargs)
        else:
            existing.help = kwargs["help"]
    return parser


def _check_namespace(args, function: str) -> None:
    """``args`` the parsed namespace: a dict (or None) has no attributes, so every rule would read its defaults and
    pass silently."""
    if not isinstance(args, argparse.Namespace):
        raise TypeError(f"{function}: args must be the argparse.Namespace the parser returned, got "
                        f"{type(args).__name__} (a dict: argparse.Namespace(**d))")


def _view(args: argparse.Namespace) -> FP8FlowView:
    modules = getattr(args, "recompute_modules", None) or ()
    return FP8FlowView(
        moe_fp8_flow=getattr(args, "moe_fp8_flow", False),
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
        moe_fp8_flow_single_grouped_weight=getattr(args, "moe_fp8_flow_single_grouped_weight", False),
        unsupported=unsupported_settings(args),
        moe_fp8_flow_cuda_graph=getattr(args, "moe_fp8_flow_cuda_graph", False),
        graph_conflicts=cuda_graph_conflicts(args),
        moe_fp8_flow_gradient_accumulation_fusion=getattr(args, "moe_fp8_flow_gradient_accumulation_fusion", False),
        no_main_grad=unsupported_settings(args, NO_MAIN_GRAD),
    )


def validate_fp8_flow_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming every FP8-Flow rule the parsed ``args`` break (by flag), and every
    ``--moe-fp8-flow-*`` flag given without ``--moe-fp8-flow`` (it would do nothing). Warn once where the experts'
    weight gradients would take DDP's hook (``fusion_hint``)."""
    _check_namespace(args, "validate_fp8_flow_args")
    problems = fp8_flow_problems(_view(args), flag)
    # the format alone here: a TransformerConfig may carry it unused (the other flags' rules are shared)
    if getattr(args, "moe_fp8_flow_format", None) is not None and not getattr(args, "moe_fp8_flow", False):
        problems.append(f"{flag('moe_fp8_flow_format')} {args.moe_fp8_flow_format} sets the FP8-Flow experts' format: "
                        f"it requires {flag('moe_fp8_flow')} (without it the experts are Megatron's and the flag "
                        "would do nothing)")
    raise_on_problems(problems, "command line")
    hint = fusion_hint(args)
    if hint:
        warnings.warn(hint)


def fusion_hint(args: argparse.Namespace) -> str:
    """What a run with ``--moe-fp8-flow`` and ``--no-gradient-accumulation-fusion`` (Megatron's own linears without
    Apex) but without ``--moe-fp8-flow-gradient-accumulation-fusion`` gives away, where DDP's ``main_grad`` exists
    (none of ``NO_MAIN_GRAD``): the experts add each weight gradient rounded to BF16 into ``main_grad`` (DDP's hook's
    sums, ``FP8FlowMoE(accumulate_into_main_grad=True)``), where the fusion adds float32 sums, a faster GEMM epilogue.
    Empty otherwise."""
    if not getattr(args, "moe_fp8_flow", False) or getattr(args, "gradient_accumulation_fusion", True) \
            or getattr(args, "moe_fp8_flow_gradient_accumulation_fusion", False) \
            or unsupported_settings(args, NO_MAIN_GRAD):
        return ""
    return (f"{flag('moe_fp8_flow')} with --no-gradient-accumulation-fusion: the experts round each weight gradient to "
            "BF16 before adding it into Megatron DDP's main_grad, as DDP's hook adds a BF16 .grad (the eager "
            "DeepSeek-V3 expert block at 32 / 128 local experts: 1.67x / 1.61x the BF16 block, docs/moe.md); "
            f"{flag('moe_fp8_flow_gradient_accumulation_fusion')} adds them in the wgrad GEMMs as float32 sums "
            "(1.86x / 1.87x; no Apex needed)")


# Integer flags (args field -> least value) of Megatron-LM's and the example's command line; checked when set.
_AT_LEAST = {
    **dict.fromkeys(("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
                     "num_query_groups", "seq_length", "max_position_embeddings", "num_experts",
                     "moe_ffn_hidden_size", "moe_router_topk", "tensor_model_parallel_size",
                     "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                     "micro_batch_size", "global_batch_size", "train_iters", "log_interval", "save_interval",
                     "eval_interval", "vocab_size", "make_vocab_size_divisible_by", "text_max_bytes"), 1),
    **dict.fromkeys(("lr_warmup_iters", "eval_iters", "tiktoken_num_special_tokens"), 0),
}
_INF = float("inf")
# Float flags -> (low, high, high included); NaN is refused too.
_IN_RANGE = {
    **dict.fromkeys(("hidden_dropout", "attention_dropout"), (0.0, 1.0, True)),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), (0.0, 1.0, False)),
    **dict.fromkeys(("lr", "min_lr", "weight_decay", "adam_eps", "clip_grad", "init_method_std",
                     "moe_aux_loss_coeff"), (0.0, _INF, False)),
}


def size_problems(args: argparse.Namespace) -> list:
    """Every zero, negative or inconsistent size (and out-of-range rate) of the parsed ``args``, one sentence each
    naming the flag, the value and what is expected; flags the parser lacks or leaves unset are skipped. The
    consistency rules are Megatron-LM's own ``validate_args`` assertions (``hidden_size % num_attention_heads``
    without ``--kv-channels``, ``max_position_embeddings >= seq_length``, ``min_lr <= lr``, experts divisible by
    the expert-parallel size), so a run fails here with the flag's name and not deep in training."""
    _check_namespace(args, "size_problems")
    problems = []
    for field, least in _AT_LEAST.items():
        value = getattr(args, field, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            problems.append(f"{flag(field)} must be >= {least}, got {value!r}")
    for field, (low, high, closed) in _IN_RANGE.items():
        value = getattr(args, field, None)
        # a list: Megatron's --moe-aux-loss-coeff, one per load-balancing type
        values = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):  # once Python's TypeError
            problems.append(f"{flag(field)} must be a number, got {value!r}")
        elif any(not (low <= v and (v <= high if closed else v < high)) for v in values):
            span = f">= {low}" if high == _INF else f"in [{low}, {high}{']' if closed else ')'}"
            problems.append(f"{flag(field)} must be {span}, got {value!r}")
    if problems:  # the rules below divide by these
        return problems
    value = {f: getattr(args, f, None) for f in ("hidden_size", "num_attention_heads", "kv_channels", "seq_length",
                                                 "max_position_embeddings", "lr", "min_lr", "num_experts",
                                                 "expert_model_parallel_size", "global_batch_size",
                                                 "micro_batch_size")}
    if value["hidden_size"] and value["num_attention_heads"] and value["kv_channels"] is None \
            and value["hidden_size"] % value["num_attention_heads"]:
        problems.append(f"--hidden-size {value['hidden_size']} must be a multiple of --num-attention-heads "
                        f"{value['num_attention_heads']} (each head's width, without --kv-channels)")
    if value["seq_length"] and value["max_position_embeddings"] and \
            value["max_position_embeddings"] < value["seq_length"]:
        problems.append(f"--max-position-embeddings {value['max_position_embeddings']} must be >= --seq-length "
                        f"{value['seq_length']} (a position past the embeddings has none)")
    if value["lr"] is not None and value["min_lr"] is not None and value["min_lr"] > value["lr"]:
        problems.append(f"--min-lr {value['min_lr']} must be <= --lr {value['lr']}")
    if value["num_experts"] and value["expert_model_parallel_size"] and \
            value["num_experts"] % value["expert_model_parallel_size"]:
        problems.append(f"--num-experts {value['num_experts']} must be a multiple of --expert-model-parallel-size "
                        f"{value['expert_model_parallel_size']} (each expert-parallel rank holds as many experts)")
    if value["global_batch_size"] and value["micro_batch_size"] and \
            value["global_batch_size"] % value["micro_batch_size"]:
        problems.append(f"--global-batch-size {value['global_batch_size']} must be a multiple of --micro-batch-size "
                        f"{value['micro_batch_size']} (times the data-parallel size: whole micro-batches per step)")
    return problems


def validate_size_args(args: argparse.Namespace) -> None:
    """Raise ValueError listing every problem ``size_problems`` finds, before anything is built."""
    problems = size_problems(args)
    if problems:
        raise ValueError("invalid sizes (command line):\n  - " + "\n  - ".join(problems))


def resolve_fp8_flow_format(args: argparse.Namespace) -> None:
    """Without TransformerEngine, move ``--fp8-format`` to ``--moe-fp8-flow-format`` (in place),
    with one warning: the experts run FP8-Flow, everything else BF16."""
    _check_namespace(args, "resolve_fp8_flow_format")
    if not getattr(args, "fp8", None) or importlib.util.find_spec("transformer_engine"):
        return
    if not getattr(args, "moe_fp8_flow", False):
        raise ValueError(f"--fp8-format {args.fp8} needs TransformerEngine, which is not installed; add "
                         "--moe-fp8-flow to run the routed experts in FP8 with this package's kernels")
    args.moe_fp8_flow_format = getattr(args, "moe_fp8_flow_format", None) or args.fp8
    args.fp8 = None
    warnings.warn(f"TransformerEngine is not installed: the routed experts run FP8-Flow "
                  f"({args.moe_fp8_flow_format}, transformer_engine_moe kernels); attention and "
                  f"dense layers stay BF16")
