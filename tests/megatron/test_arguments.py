"""Flag parsing and the FP8-Flow combination rules (command line and TransformerConfig)."""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

import argparse

import torch

import megatron_patches
from megatron_patches.arguments import add_fp8_flow_args, size_problems, validate_fp8_flow_args, validate_size_args
from examples.compact_loop import parse_args

FULL = ("--fp8-format e4m3 --fp8-recipe blockwise --moe-fp8-flow --recompute-granularity selective "
        "--recompute-modules moe_expert --moe-token-dispatcher-type flex --moe-grouped-gemm").split()
MODEL = ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 32 --num-experts 4 "
         "--moe-ffn-hidden-size 128 --micro-batch-size 2 --train-iters 2 --swiglu --disable-bias-linear").split()


def test_full_flag_set_parses():
    args = parse_args(MODEL + FULL)
    assert args.moe_fp8_flow and args.fp8_recipe == "blockwise" and args.moe_grouped_gemm
    assert args.recompute_modules == ["moe_expert"] and args.moe_token_dispatcher_type == "flex"
    # Without TransformerEngine the format moves to the experts and the dense layers run BF16.
    assert (args.fp8, args.moe_fp8_flow_format) in ((None, "e4m3"), ("e4m3", None))


def test_single_grouped_weight_flag_parses_and_needs_fp8_flow():
    assert parse_args(MODEL + FULL + ["--moe-fp8-flow-single-grouped-weight"]).moe_fp8_flow_single_grouped_weight
    args = argparse.Namespace(moe_fp8_flow=False, moe_fp8_flow_single_grouped_weight=True, recompute_modules=None)
    with pytest.raises(ValueError, match="--moe-fp8-flow-single-grouped-weight shapes the FP8-Flow experts' "
                                         "weights: it requires --moe-fp8-flow"):
        validate_fp8_flow_args(args)


def test_extra_args_provider_adds_help_once():
    parser = add_fp8_flow_args(add_fp8_flow_args(argparse.ArgumentParser()))
    assert "blockwise" in parser._option_string_actions["--moe-fp8-flow"].help
    assert parser.parse_args(["--moe-fp8-flow"]).moe_fp8_flow


@pytest.mark.parametrize("drop, message", [
    ("--fp8-recipe blockwise", "--fp8-recipe 'blockwise'"),
    ("--moe-grouped-gemm", "requires --moe-grouped-gemm"),
    ("--recompute-granularity selective", "requires --recompute-granularity 'selective'"),
    ("--fp8-format e4m3", "FP8 format"),
], ids=["recipe", "grouped-gemm", "granularity", "format"])
def test_rejected_combinations(drop, message, capsys):
    argv = " ".join(MODEL + FULL).replace(drop, "").split()
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_rules_by_flag_name():
    args = argparse.Namespace(moe_fp8_flow=True, fp8=None, fp8_recipe="delayed", num_experts=None,
                              moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
                              swiglu=False, add_bias_linear=True, recompute_granularity=None,
                              recompute_modules=["moe", "moe_expert"])
    with pytest.raises(ValueError) as error:
        validate_fp8_flow_args(args)
    text = str(error.value)
    for needle in ("--num-experts", "--fp8-recipe", "--moe-grouped-gemm", "--swiglu",
                   "--disable-bias-linear", "--moe-token-dispatcher-type", "choose one"):
        assert needle in text


@pytest.mark.parametrize("change, message", [
    (("--num-experts 4", "--num-experts 4 --moe-router-topk 5"), "--moe-router-topk must be in [1, --num-experts=4]"),
    (("--hidden-size 128", "--hidden-size 192"), "--hidden-size must be a multiple of 128 (got 192)"),
    (("--moe-ffn-hidden-size 128", "--moe-ffn-hidden-size 96"), "--moe-ffn-hidden-size must be a multiple of 128"),
    (("--micro-batch-size 2", "--micro-batch-size 0"), "--micro-batch-size must be >= 1, got 0"),
    (("--seq-length 32", "--seq-length 0"), "--seq-length must be >= 1, got 0"),
    (("--train-iters 2", "--train-iters -1"), "--train-iters must be >= 1, got -1"),
    # each once a ZeroDivisionError deep in training
    (("--hidden-size 128", "--hidden-size 0"), "--hidden-size must be >= 1, got 0"),
    (("--num-attention-heads 4", "--num-attention-heads 0"), "--num-attention-heads must be >= 1, got 0"),
    (("--num-layers 2", "--num-layers 0"), "--num-layers must be >= 1, got 0"),
    (("--num-experts 4", "--num-experts 4 --expert-model-parallel-size 0"),
     "--expert-model-parallel-size must be >= 1, got 0"),
    (("--num-layers 2", "--num-layers 2 --log-interval 0"), "--log-interval must be >= 1, got 0"),
    (("--num-layers 2", "--num-layers 2 --make-vocab-size-divisible-by 0"),
     "--make-vocab-size-divisible-by must be >= 1, got 0"),
    # once silently replaced by the default (4 x hidden)
    (("--num-layers 2", "--num-layers 2 --ffn-hidden-size 0"), "--ffn-hidden-size must be >= 1, got 0"),
    (("--num-layers 2", "--num-layers 2 --text-max-bytes -1"), "--text-max-bytes must be >= 1, got -1"),
    # inconsistent sizes, by Megatron-LM's rules (the positions: once an IndexError in the embedding)
    (("--seq-length 32", "--seq-length 32 --max-position-embeddings 16"),
     "--max-position-embeddings 16 must be >= --seq-length 32"),
    (("--num-attention-heads 4", "--num-attention-heads 3"),
     "--hidden-size 128 must be a multiple of --num-attention-heads 3"),
    (("--num-experts 4", "--num-experts 4 --expert-model-parallel-size 3"),
     "--num-experts 4 must be a multiple of --expert-model-parallel-size 3"),
    (("--num-layers 2", "--num-layers 2 --lr 0.1 --min-lr 1"), "--min-lr 1.0 must be <= --lr 0.1"),
    # rates
    (("--num-layers 2", "--num-layers 2 --hidden-dropout 1.5"), "--hidden-dropout must be in [0.0, 1.0], got 1.5"),
    (("--num-layers 2", "--num-layers 2 --adam-beta2 nan"), "--adam-beta2 must be in [0.0, 1.0), got nan"),
    # megatron-core's TransformerConfig, built at parse time: its own checks before anything is built
    (("--num-experts 4", "--num-experts 4 --moe-router-topk 1"), "Please use --moe-router-pre-softmax when topk is 1"),
], ids=["topk", "hidden", "ffn", "micro-batch", "seq-length", "train-iters", "hidden-0", "heads-0", "layers-0",
        "ep-0", "log-interval-0", "vocab-divisor-0", "ffn-0", "text-bytes", "positions", "heads-divide",
        "experts-divide", "min-lr", "dropout", "beta-nan", "megatron-config"])
def test_bad_sizes_are_refused_at_argument_validation(change, message, capsys):
    argv = " ".join(MODEL + FULL).replace(*change).split()
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_size_rules_skip_what_a_parser_leaves_unset():
    """Megatron's parser (megatron.training) leaves some sizes None and takes a list of aux-loss coefficients;
    every problem is listed at once, by flag."""
    args = argparse.Namespace(hidden_size=None, num_layers=0, moe_aux_loss_coeff=[1e-2, -1.0], train_iters=None,
                              hidden_dropout=0.0)
    assert size_problems(args) == ["--num-layers must be >= 1, got 0",
                                   "--moe-aux-loss-coeff must be >= 0.0, got [0.01, -1.0]"]
    with pytest.raises(ValueError, match="invalid sizes"):
        validate_size_args(args)
    heads = argparse.Namespace(hidden_size=128, num_attention_heads=3, kv_channels=32)  # explicit head width
    assert size_problems(heads) == []


@pytest.mark.parametrize("field, value", [("moe_fp8_flow_format", "hybrid"),
                                          ("moe_fp8_flow_single_grouped_weight", True),
                                          ("moe_fp8_flow_cuda_graph", True),
                                          ("moe_fp8_flow_gradient_accumulation_fusion", True)])
def test_fp8_flow_flags_need_moe_fp8_flow(field, value):
    """Every --moe-fp8-flow-* flag without --moe-fp8-flow would do nothing (Megatron's BF16 experts train): refused
    by name."""
    args = argparse.Namespace(moe_fp8_flow=False, recompute_modules=None, **{field: value})
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} .*requires --moe-fp8-flow"):
        validate_fp8_flow_args(args)


FUSION = "--moe-fp8-flow-gradient-accumulation-fusion"


def test_expert_gradient_accumulation_fusion_flag_parses_and_needs_ddp_main_grad(capsys):
    """The flag parses (Megatron's --no-gradient-accumulation-fusion left as it is: accepted with it on or off);
    Megatron-FSDP and torch FSDP2 give the weights no main_grad at forward: refused by flag, with the reason;
    without FP8-Flow, refused by config field too; the compact CPU loop has no DDP: refused by name."""
    parser = add_fp8_flow_args(argparse.ArgumentParser())
    assert parser.parse_args([FUSION]).moe_fp8_flow_gradient_accumulation_fusion
    assert not parser.parse_args([]).moe_fp8_flow_gradient_accumulation_fusion
    assert "--no-gradient-accumulation-fusion" in parser._option_string_actions[FUSION].help
    valid = dict(moe_fp8_flow=True, fp8="e4m3", fp8_recipe="blockwise", num_experts=4, moe_grouped_gemm=True,
                 moe_token_dispatcher_type="alltoall", swiglu=True, add_bias_linear=False, recompute_granularity=None,
                 recompute_modules=None, moe_fp8_flow_gradient_accumulation_fusion=True, use_megatron_fsdp=False,
                 use_torch_fsdp2=False)
    for fusion in (False, True):
        validate_fp8_flow_args(argparse.Namespace(**valid, gradient_accumulation_fusion=fusion))
    for setting, why in (("use_megatron_fsdp", "main_grad only in backward"), ("use_torch_fsdp2", "no main_grad")):
        with pytest.raises(ValueError) as error:
            validate_fp8_flow_args(argparse.Namespace(**{**valid, setting: True}))
        assert f"{FUSION} does not support --{setting.replace('_', '-')} (got True; expected it unset): " in \
            str(error.value) and why in str(error.value)
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_patches.apply()
    with pytest.raises(ValueError, match="moe_fp8_flow_gradient_accumulation_fusion adds the FP8-Flow experts' "
                                         "weight gradients into main_grad: it requires moe_fp8_flow"):
        TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                          moe_fp8_flow_gradient_accumulation_fusion=True)
    with pytest.raises(SystemExit):
        parse_args(MODEL + FULL + [FUSION])
    assert f"{FUSION} adds the experts' weight gradients into Megatron DDP's main_grad: the compact loop has no " \
           "DDP" in capsys.readouterr().err


def test_unfused_expert_gradients_are_pointed_at_the_fusion_flag():
    """--moe-fp8-flow with --no-gradient-accumulation-fusion and without the experts' own fusion flag: one warning
    naming the flag and what its float32 sums gain; none with either fusion on, without FP8-Flow, or where DDP's
    main_grad does not exist (Megatron-FSDP, torch FSDP2: the fusion flag is refused there)."""
    import warnings

    from megatron_patches.arguments import fusion_hint

    valid = dict(moe_fp8_flow=True, fp8="e4m3", fp8_recipe="blockwise", num_experts=4, moe_grouped_gemm=True,
                 moe_token_dispatcher_type="alltoall", swiglu=True, add_bias_linear=False, recompute_granularity=None,
                 recompute_modules=None, moe_fp8_flow_gradient_accumulation_fusion=False, use_megatron_fsdp=False,
                 use_torch_fsdp2=False, gradient_accumulation_fusion=False)
    with pytest.warns(UserWarning, match=f"--moe-fp8-flow with --no-gradient-accumulation-fusion: .* round each weight "
                                         f"gradient to BF16 .* {FUSION} adds them in the wgrad GEMMs as float32"):
        validate_fp8_flow_args(argparse.Namespace(**valid))
    for change in ({"gradient_accumulation_fusion": True}, {"moe_fp8_flow_gradient_accumulation_fusion": True},
                   {"use_megatron_fsdp": True}, {"use_torch_fsdp2": True}, {"moe_fp8_flow": False}):
        assert fusion_hint(argparse.Namespace(**{**valid, **change})) == "", change
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_fp8_flow_args(argparse.Namespace(**{**valid, "moe_fp8_flow_gradient_accumulation_fusion": True}))


def test_fp8_flow_format_without_fp8_flow_is_refused_on_the_command_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(MODEL + ["--moe-fp8-flow-format", "hybrid"])
    assert "--moe-fp8-flow-format hybrid sets the FP8-Flow experts' format: it requires --moe-fp8-flow" in \
        capsys.readouterr().err


def test_fp8_format_without_fp8_flow_or_transformer_engine_is_named(capsys):
    import importlib.util

    if importlib.util.find_spec("transformer_engine"):
        pytest.skip("TransformerEngine installed: --fp8-format is its flag")
    with pytest.raises(SystemExit):
        parse_args(MODEL + ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"])
    assert "needs TransformerEngine, which is not installed; add --moe-fp8-flow" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--sequence-parallel", "--bf16"])
def test_unsupported_megatron_flag_is_named(capsys, flag):
    with pytest.raises(SystemExit):
        parse_args(MODEL + [flag])
    assert f"does not support {flag}" in capsys.readouterr().err


def test_apply_is_idempotent_and_config_accepts_moe_expert():
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert megatron_patches.apply() == megatron_patches.apply()
    init, post = TransformerConfig.__init__, TransformerConfig.__post_init__
    megatron_patches.apply()
    assert (TransformerConfig.__init__, TransformerConfig.__post_init__) == (init, post)
    config = TransformerConfig(
        num_layers=1, hidden_size=128, num_attention_heads=4, num_moe_experts=4,
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        moe_fp8_flow=True, moe_fp8_flow_format="hybrid", fp8_recipe="blockwise",
        moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
        recompute_granularity="selective", recompute_modules=["moe_expert", "core_attn"])
    assert config.moe_fp8_flow and "moe_expert" in config.recompute_modules
    with pytest.raises(ValueError, match="it requires moe_fp8_flow"):
        TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                          recompute_granularity="selective", recompute_modules=["moe_expert"])


def test_apply_leaves_torch_alone():
    """apply() patches megatron-core only: in a fresh process, torch.cuda.current_device and synchronize are the
    same objects before and after it, with or without CUDA (the CPU shims are the CPU entry points' business)."""
    import subprocess
    import sys

    code = ("import torch, megatron_patches; names = ('current_device', 'synchronize'); "
            "before = [getattr(torch.cuda, n) for n in names]; megatron_patches.apply(); "
            "changed = [n for n, f in zip(names, before) if getattr(torch.cuda, n) is not f]; "
            "assert not changed, f'apply() replaced torch.cuda.{changed}'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_unsupported_version_is_named(monkeypatch):
    from megatron.core import package_info

    from megatron_patches.config import megatron_core_version

    monkeypatch.setattr(package_info, "__version__", "0.14.0")
    with pytest.raises(RuntimeError, match=r"0\.16\.1 or 0\.19\.x; found megatron-core 0\.14\.0"):
        megatron_core_version()


VALID_FLOW = dict(moe_fp8_flow=True, fp8="e4m3", fp8_recipe="blockwise", num_experts=4, moe_grouped_gemm=True,
                  moe_token_dispatcher_type="alltoall", swiglu=True, add_bias_linear=False, recompute_granularity=None,
                  recompute_modules=None, hidden_size=128, moe_ffn_hidden_size=128, moe_router_topk=2)


@pytest.mark.parametrize("change, message", [
    (dict(moe_fp8_flow="no"), "--moe-fp8-flow must be a bool \\(True or False\\), got 'no'"),
    (dict(moe_fp8_flow_cuda_graph=1), "--moe-fp8-flow-cuda-graph must be a bool \\(True or False\\), got 1"),
    (dict(moe_fp8_flow_gradient_accumulation_fusion="false"),
     "--moe-fp8-flow-gradient-accumulation-fusion must be a bool \\(True or False\\), got 'false'"),
    (dict(moe_fp8_flow_single_grouped_weight=None), "--moe-fp8-flow-single-grouped-weight must be a bool"),
    (dict(moe_router_topk=True), "--moe-router-topk must be a positive int, got True"),
    (dict(num_experts="4"), "--num-experts must be a positive int, got '4'"),
    (dict(num_experts=-4), "--num-experts must be a positive int, got -4"),
    (dict(hidden_size=128.0), "--hidden-size must be a positive int, got 128.0"),
    (dict(hidden_size=0), "--hidden-size must be a positive int, got 0"),
    (dict(recompute_modules="moe_expert"), "--recompute-modules must be a list of module names .* got 'moe_expert'"),
    (dict(moe_fp8_flow_cuda_graph=True, expert_model_parallel_size="2"),
     "--moe-fp8-flow-cuda-graph does not support --expert-model-parallel-size \\(got '2'; expected 1\\)"),
], ids=["flow-str", "graph-int", "fusion-str", "single-none", "topk-bool", "experts-str", "experts-negative",
        "hidden-float", "hidden-0", "modules-str", "graph-ep-str"])
def test_settings_of_the_wrong_type_are_named(change, message):
    """Issue 41's probe: a truthy "no" or 1 once switched a setting on, sizes given as strings failed with Python's
    TypeError naming nothing, a string of modules was read letter by letter (a hand-made namespace, a YAML config)."""
    with pytest.raises(ValueError, match=message):
        validate_fp8_flow_args(argparse.Namespace(**{**VALID_FLOW, **change}))


def test_config_fields_of_the_wrong_type_are_named():
    """The same rules through TransformerConfig; a string of recompute modules once reached Megatron's own check as
    its letters (an AssertionError)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_patches.apply()
    base = dict(num_layers=1, hidden_size=128, num_attention_heads=4, num_moe_experts=4, add_bias_linear=False,
                gated_linear_unit=True, activation_func=torch.nn.functional.silu, moe_fp8_flow=True,
                moe_fp8_flow_format="e4m3", fp8_recipe="blockwise", moe_grouped_gemm=True,
                moe_token_dispatcher_type="alltoall")
    with pytest.raises(ValueError, match="moe_fp8_flow_cuda_graph must be a bool \\(True or False\\), got 1"):
        TransformerConfig(**base, moe_fp8_flow_cuda_graph=1)
    with pytest.raises(ValueError, match="recompute_modules must be a list of module names, got the string"):
        TransformerConfig(**base, recompute_granularity="selective", recompute_modules="moe_expert")


def test_argument_functions_need_the_parsed_namespace():
    """A dict has no attributes: every rule read its defaults and passed; values of the wrong type are
    listed, not Python's TypeError."""
    for function in (validate_fp8_flow_args, size_problems):
        with pytest.raises(TypeError, match="args must be the argparse.Namespace the parser returned, got dict"):
            function(dict(VALID_FLOW))
    assert size_problems(argparse.Namespace(lr="1e-3")) == ["--lr must be a number, got '1e-3'"]


def test_global_batch_must_hold_whole_micro_batches(capsys):
    """Megatron-LM's rule, at parse time (the compact loop found it only when training started)."""
    with pytest.raises(SystemExit):
        parse_args(MODEL + FULL + ["--global-batch-size", "3"])
    assert "--global-batch-size 3 must be a multiple of --micro-batch-size 2" in capsys.readouterr().err
