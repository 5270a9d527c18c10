"""A compact GPT-MoE pretraining loop on ``megatron.core`` alone (megatron-core 0.16.1, CPU, gloo).

Takes Megatron-LM's argument names for the subset it implements (``build_parser``) and rejects
any other flag by name. One process per rank (``torchrun`` or spawned with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT; a lone process needs none). Tensor and pipeline parallelism are 1;
expert parallelism splits the experts over ``--expert-model-parallel-size`` ranks (gloo
all-to-all / all-gather), data parallelism spans the world. Data: Megatron's data arguments
(``megatron_data``: indexed datasets, mock data, tokenizers), else the standard library's bytes. Optimizer: ``torch.optim.AdamW`` on FP32 parameters, gradients
averaged over the data-parallel group (experts: over the expert-data-parallel group).
Checkpoints: ``torch.save`` of model and optimizer state per expert-parallel rank. ``train`` applies
``megatron_patches`` and, on a machine without CUDA, installs ``megatron_patches.cpu_shims``.
"""

import argparse
import json
import math
import os
import pathlib
import resource
import socket
import time
import warnings

import torch
import torch.distributed as dist

from megatron_patches import apply
from megatron_patches.arguments import (add_fp8_flow_args, resolve_fp8_flow_format, validate_fp8_flow_args,
                                        validate_size_args)
from megatron_patches.cpu_shims import apply_cpu_shims
from megatron_patches.settings import fp8_flow_fields

from .data import TEXT_MAX_BYTES
from .expert_path import expert_path
from .megatron_data import add_data_args, data_source, train_valid_test_datasets


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's flags for what the compact loop implements (data and tokenizer flags:
    ``megatron_data.add_data_args``), plus FP8-Flow's and two of its own (``--summary-json``,
    ``--text-max-bytes``)."""
    p = argparse.ArgumentParser(prog="python -m examples.pretrain_gpt",
                                description="Compact GPT-MoE pretraining on megatron.core (CPU)",
                                allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default="learned_absolute")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, required=True)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=("aux_loss", "seq_aux_loss", "none"))
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-token-dispatcher-type", default="allgather",
                   choices=("allgather", "alltoall", "flex"))
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, choices=(1,))
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, choices=(1,))
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", default="gloo", choices=("gloo",))
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--fp8-format", dest="fp8", choices=("e4m3", "hybrid"), default=None)
    g.add_argument("--fp8-recipe", choices=("delayed", "tensorwise", "mxfp8", "blockwise"),
                   default="delayed")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-modules", nargs="*", default=None)
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--summary-json", default=None,
                   help="write final loss, loss curve, tokens/s and peak memory here (rank 0)")
    g.add_argument("--text-max-bytes", type=int, default=TEXT_MAX_BYTES,
                   help="bytes of standard-library source to train on without data arguments (default 8 MiB)")
    return add_fp8_flow_args(add_data_args(p))


def parse_args(argv) -> argparse.Namespace:
    """Parse and validate ``argv`` before anything is built; SystemExit naming any Megatron flag the compact loop
    does not implement, any zero, negative or inconsistent size (``validate_size_args``), any flag that would do
    nothing (FP8-Flow's without --moe-fp8-flow, data flags the chosen data ignores: ``data_source``) and whatever
    megatron-core's ``TransformerConfig`` refuses."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    flags = [a for a in unknown if a.startswith("-")]
    if unknown:
        parser.error("the compact CPU loop (megatron-core without megatron.training) does not "
                     f"support {' '.join(flags or unknown)}; use Megatron-LM / megatron-core "
                     ">= 0.19 for those, or see --help for what it supports")
    try:
        validate_size_args(args)
    except ValueError as error:
        parser.error(str(error))
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.moe_grouped_gemm and not args.moe_fp8_flow:
        parser.error("--moe-grouped-gemm without --moe-fp8-flow needs TransformerEngine's "
                     "grouped experts, which the CPU loop lacks; drop it (SequentialMLP experts)")
    if args.moe_fp8_flow_cuda_graph:
        parser.error("--moe-fp8-flow-cuda-graph replays CUDA graphs: the compact loop is the CPU path (on a GPU, "
                     "Megatron's pretrain runs it: megatron-core 0.19)")
    if args.moe_fp8_flow_gradient_accumulation_fusion:
        parser.error("--moe-fp8-flow-gradient-accumulation-fusion adds the experts' weight gradients into Megatron "
                     "DDP's main_grad: the compact loop has no DDP (autograd's .grad, averaged by its own all-reduce; "
                     "Megatron's pretrain runs it: megatron-core 0.19)")
    evaluated = [f"--{s}-data-path" for s in ("valid", "test") if getattr(args, f"{s}_data_path") is not None]
    if evaluated:
        parser.error(f"{', '.join(evaluated)}: the compact loop trains without evaluating, so it would read only "
                     "--train-data-path (Megatron's pretrain evaluates: megatron-core 0.19)")
    try:
        validate_fp8_flow_args(args)
        resolve_fp8_flow_format(args)
        data_source(args)
        apply()  # the FP8-Flow fields of TransformerConfig
        with warnings.catch_warnings():  # build_model says them
            warnings.simplefilter("ignore")
            transformer_config(args)  # megatron-core's own checks, before anything is built
    except ValueError as error:
        parser.error(str(error))
    return args


def _init_distributed(args) -> None:
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    else:
        dist.init_process_group("gloo")
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if world % args.expert_model_parallel_size:
        raise ValueError(f"--expert-model-parallel-size {args.expert_model_parallel_size} must "
                         f"divide the world size {world}")
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=args.expert_model_parallel_size)


def transformer_config(args):
    """megatron-core's ``TransformerConfig`` of the model (its ``__post_init__`` checks the settings)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        normalization=args.normalization, gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=args.add_bias_linear, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm,
        expert_model_parallel_size=args.expert_model_parallel_size,
        fp8=args.fp8, fp8_recipe=args.fp8_recipe,
        recompute_granularity=args.recompute_granularity,
        recompute_modules=args.recompute_modules,
        **fp8_flow_fields(args), use_cpu_initialization=True, params_dtype=torch.float32,
    )


def build_model(args, vocab_size: int):
    """GPTModel with MoE in every layer (local spec; FP8-Flow block when ``--moe-fp8-flow``) over a
    vocabulary of ``vocab_size``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_patches.experts import fp8_flow_layer_spec

    config = transformer_config(args)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False,
                                    normalization=args.normalization)
    spec = fp8_flow_layer_spec(spec, config)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    position_embedding_type=args.position_embedding_type,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def _lr(args, step: int) -> float:
    """Learning rate of 0-based ``step``: linear warmup, then the decay style to ``--min-lr``."""
    if step < args.lr_warmup_iters:
        return args.lr * (step + 1) / args.lr_warmup_iters
    span = max(1, args.train_iters - args.lr_warmup_iters)
    done = (step - args.lr_warmup_iters) / span
    if args.lr_decay_style == "constant":
        return args.lr
    if args.lr_decay_style == "linear":
        return args.min_lr + (args.lr - args.min_lr) * (1 - done)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * done))


def _reduce_grads(model) -> float:
    """Average gradients over data parallelism (experts: expert data parallelism); returns the
    global gradient norm."""
    from megatron.core import parallel_state

    groups = {
        True: parallel_state.get_data_parallel_group(),
        False: parallel_state.get_expert_data_parallel_group(),
    }
    norm_sq = {True: torch.zeros(()), False: torch.zeros(())}
    for dense, group in groups.items():
        grads = [p.grad for p in model.parameters()
                 if p.grad is not None and getattr(p, "allreduce", True) == dense]
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        norm_sq[dense] = flat.float().square().sum()
    # Expert gradients differ across expert-parallel ranks: their squares add up over that group.
    dist.all_reduce(norm_sq[False], group=parallel_state.get_expert_model_parallel_group())
    return float((norm_sq[True] + norm_sq[False]).sqrt())


def _checkpoint_file(root: str, iteration: int) -> pathlib.Path:
    from megatron.core import parallel_state

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    return pathlib.Path(root) / f"iter_{iteration:07d}" / f"mp_rank_00_{ep_rank:03d}.pt"


def save_checkpoint(root: str, iteration: int, model, optimizer) -> None:
    """``{root}/iter_{iteration:07d}/mp_rank_00_{ep_rank:03d}.pt`` (model + optimizer state),
    written by expert-data-parallel rank 0 of each expert-parallel rank; rank 0 also writes
    ``latest_checkpointed_iteration.txt``."""
    from megatron.core import parallel_state

    path = _checkpoint_file(root, iteration)
    if parallel_state.get_expert_data_parallel_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"iteration": iteration, "model": model.state_dict(),
                    "optimizer": optimizer.state_dict()}, path)
    dist.barrier()
    if dist.get_rank() == 0:
        (pathlib.Path(root) / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def load_checkpoint(root: str, model, optimizer) -> int:
    """Load the latest checkpoint under ``root`` into ``model`` / ``optimizer``; its iteration."""
    latest = pathlib.Path(root) / "latest_checkpointed_iteration.txt"
    if not latest.exists():
        raise FileNotFoundError(f"--load {root}: no latest_checkpointed_iteration.txt")
    state = torch.load(_checkpoint_file(root, int(latest.read_text())), weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["iteration"]


def _peak_memory_bytes() -> int:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _batch(dataset, first: int, count: int) -> dict:
    """Samples ``first .. first+count-1`` stacked: ``{tokens, labels, position_ids: int64 [count, S],
    loss_mask: float32 [count, S]}``."""
    samples = [dataset[i] for i in range(first, first + count)]
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
            for key in ("tokens", "labels", "position_ids", "loss_mask")}


def train(args) -> dict:
    """Run ``args.train_iters`` steps; returns the summary (also written to --summary-json)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    apply()
    apply_cpu_shims()
    _init_distributed(args)
    try:
        dp_size = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        gbs = args.global_batch_size or args.micro_batch_size * dp_size
        if gbs % (args.micro_batch_size * dp_size):
            raise ValueError(f"--global-batch-size {gbs} must be a multiple of --micro-batch-size "
                             f"x data-parallel size = {args.micro_batch_size * dp_size}")
        (dataset, *_), vocab_size, described = train_valid_test_datasets(
            args, [args.train_iters * gbs, 0, 0], args.text_max_bytes)
        if dist.get_rank() == 0:
            print(described, flush=True)
        torch.manual_seed(args.seed)
        model = build_model(args, vocab_size)
        experts = expert_path(model)
        if dist.get_rank() == 0:
            print(experts, flush=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                      betas=(args.adam_beta1, args.adam_beta2),
                                      eps=args.adam_eps, weight_decay=args.weight_decay)
        start = load_checkpoint(args.load, model, optimizer) if args.load else 0
        accumulation = gbs // (args.micro_batch_size * dp_size)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / accumulation))
        tokens_per_step = gbs * args.seq_length
        curve, times = [], []
        model.train()
        for step in range(start, args.train_iters):
            began = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = _lr(args, step)
            optimizer.zero_grad(set_to_none=True)
            total = torch.zeros(())
            model.set_is_first_microbatch()  # FP8-Flow layers requantize their weights once per step
            for micro in range(accumulation):
                first = step * gbs + (micro * dp_size + dp_rank) * args.micro_batch_size
                batch = _batch(dataset, first, args.micro_batch_size)
                losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                loss = (losses.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
                (loss / accumulation).backward()
                total += loss.detach() / accumulation
            grad_norm = _reduce_grads(model)
            if args.clip_grad > 0 and grad_norm > args.clip_grad:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(args.clip_grad / (grad_norm + 1e-6))
            optimizer.step()
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
            curve.append(float(total) / dp_size)
            times.append(time.perf_counter() - began)
            if dist.get_rank() == 0 and ((step + 1) % args.log_interval == 0
                                         or step + 1 == args.train_iters):
                print(f"step {step + 1:5d}/{args.train_iters} | loss {curve[-1]:.4f} | "
                      f"grad norm {grad_norm:.3f} | lr {_lr(args, step):.2e} | "
                      f"{tokens_per_step / times[-1]:,.0f} tokens/s", flush=True)
        if args.save:
            save_checkpoint(args.save, args.train_iters, model, optimizer)
        peak = torch.tensor(_peak_memory_bytes(), dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        timed = times[1:] or times
        summary = {
            "final_loss": curve[-1] if curve else None,
            "loss_curve": curve,
            "tokens_per_s": tokens_per_step * len(timed) / sum(timed) if timed else None,
            "seconds_per_step": sum(timed) / len(timed) if timed else None,
            "peak_memory_bytes": int(peak),
            "steps": len(curve),
            "first_step": start,
            "world_size": dist.get_world_size(),
            "expert_model_parallel_size": args.expert_model_parallel_size,
            "global_batch_size": gbs,
            "seq_length": args.seq_length,
            "moe_fp8_flow": args.moe_fp8_flow,
            "seed": args.seed,
            "data": described,
            "expert_path": experts,
        }
        if args.summary_json and dist.get_rank() == 0:
            pathlib.Path(args.summary_json).write_text(json.dumps(summary, indent=1))
        return summary
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
