"""``python -m examples.pretrain_gpt <Megatron args>``: GPT-MoE pretraining with FP8-Flow.

Where ``megatron.training`` is importable (megatron-core >= 0.19, or a Megatron-LM checkout of
that API), the patches are applied and Megatron's own ``pretrain`` runs with our
``extra_args_provider``, a layer spec passed through ``fp8_flow_layer_spec``, and the data Megatron's
arguments name (``megatron_data``: ``--data-path`` / ``--mock-data`` and ``--tokenizer-type``;
without them the standard library's sources as byte tokens, ``--tokenizer-type NullTokenizer
--vocab-size 256`` being the defaults). Otherwise (megatron-core 0.16.1) ``compact_loop`` trains on
the CPU with the same argument names for the subset it implements.
"""

import functools
import importlib.util
import inspect
import sys

import torch

from megatron_patches import apply
from megatron_patches.arguments import (add_fp8_flow_args, resolve_fp8_flow_format, validate_fp8_flow_args,
                                        validate_size_args)
from megatron_patches.experts import fp8_flow_layer_spec

from .data import VOCAB_SIZE
from .expert_path import expert_path
from .megatron_data import data_source, train_valid_test_datasets
from .multi_tensor import install as install_multi_tensor

STDLIB_TEXT_BYTES = 64 << 20  # the standard library's bytes used without data arguments


def _datasets_provider(num_samples, vp_stage=None):
    """Megatron's train / valid / test datasets from its data arguments (``megatron_data``; None for a
    split of 0 samples: Megatron builds no loader for it); rank 0 logs which data it is."""
    from megatron.training import get_args
    from megatron.training.utils import print_rank_0

    datasets, _, described = train_valid_test_datasets(get_args(), num_samples, STDLIB_TEXT_BYTES)
    print_rank_0(described)
    return datasets


def _loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron's three-value loss contract: (summed loss, token count, report)."""
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    total = (losses * mask).sum()
    count = mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), mask.sum()])}


def _forward_step(data_iterator, model):
    if not hasattr(model, "_expert_path"):  # said once per model chunk: which code runs the experts
        from megatron.training.utils import print_rank_0

        model._expert_path = expert_path(model)
        print_rank_0(model._expert_path)
    sample = next(data_iterator)
    batch = {k: sample[k].cuda(non_blocking=True) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_loss, batch["loss_mask"])


def _spec_builder(base, layer_spec):
    """A ``GPTModelConfig.transformer_layer_spec`` callable: Megatron's spec (``base``: None for
    the default, a spec, or a callable), then ``layer_spec(spec, transformer_config)``."""
    from megatron.training.models.gpt import default_layer_spec

    def build(model_config, vp_stage=None):
        spec = base
        if spec is None:
            spec = default_layer_spec(model_config, vp_stage)
        elif callable(spec) and not hasattr(spec, "submodules"):
            takes_vp = "vp_stage" in inspect.signature(spec).parameters
            spec = spec(model_config, vp_stage=vp_stage) if takes_vp else spec(model_config)
        return layer_spec(spec, model_config.transformer)

    return build


def _use_prebuilt_dataset_helpers() -> None:
    """megatron-core wheels ship ``helpers_cpp`` compiled, without the Makefile Megatron's initialisation
    runs ``make`` with (it then exits): skip the compilation when the compiled module is there."""
    from megatron.core.datasets import utils

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        utils.compile_helpers = lambda: None


def megatron_pretrain(layer_spec=fp8_flow_layer_spec) -> None:
    """Megatron's own ``pretrain`` (megatron-core 0.19 API) with the FP8-Flow patches; the layer spec is
    Megatron's passed through ``layer_spec(spec, config)`` (default ``fp8_flow_layer_spec``: FP8-Flow
    layers when ``--moe-fp8-flow``; benchmarks swap in other experts)."""
    apply()
    _use_prebuilt_dataset_helpers()
    install_multi_tensor()  # only where Megatron fell back to its per-tensor, host-synchronising versions
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import (gpt_config_from_args,
                                                  pretrain_cfg_container_from_args)
    from megatron.training.arguments import parse_and_validate_args, parse_args

    # zero, negative and inconsistent sizes named by flag before Megatron's validation divides by them
    validate_size_args(parse_args(add_fp8_flow_args))
    args = parse_and_validate_args(
        extra_args_provider=add_fp8_flow_args,
        args_defaults={"tokenizer_type": "NullTokenizer", "vocab_size": VOCAB_SIZE})
    validate_fp8_flow_args(args)
    resolve_fp8_flow_format(args)
    data_source(args)  # clashing, ignored or missing data arguments fail before the model is built
    model_config = gpt_config_from_args(args)
    model_config.transformer_layer_spec = _spec_builder(model_config.transformer_layer_spec, layer_spec)
    _datasets_provider.is_distributed = True
    pretrain(pretrain_cfg_container_from_args(args, model_config), _datasets_provider,
             ModelType.encoder_or_decoder, _forward_step)
    print(allocator_report(), flush=True)


def allocator_report() -> str:
    """One line on the CUDA caching allocator of this rank after training (``torch.cuda.memory_stats``):
    its retries (each frees every cached block and synchronizes: a run at the memory edge slows down by
    them while max allocated looks fine) and reserved peak; empty without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ""
    stats = torch.cuda.memory_stats()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return (f"allocator (rank {rank}): retries {stats.get('num_alloc_retries', 0)}, reserved peak "
            f"{stats.get('reserved_bytes.all.peak', 0) / 2**20:.1f} MiB")


def main(argv=None) -> None:
    """Megatron's ``pretrain`` where ``megatron.training`` exists, else the compact CPU loop."""
    if importlib.util.find_spec("megatron.training") is not None:
        megatron_pretrain()
        return
    from .compact_loop import parse_args, train

    train(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
