"""Megatron's own ``pretrain`` as the Megatron benchmarks run it (benchmark only): ``examples.pretrain_gpt``'s
``megatron_pretrain`` (megatron-core 0.19, ``megatron.training``) with, chosen by this entry's own flags
(taken off the command line before Megatron parses the rest):

- ``--bench-grouped-mm``: the MoE layers' experts are the BF16 grouped-GEMM stand-in for TE's ``TEGroupedMLP``
  (``megatron_grouped_mm.GroupedMMExperts``) instead of FP8-Flow (``--moe-fp8-flow``) or Megatron's own;
- ``--bench-sdpa-attention``: every self-attention's core is the torch SDPA core (``sdpa_attention``), for
  runs without TransformerEngine (``--transformer-impl local``);
- ``--bench-probe-memory``: the activation probes of ``megatron_memory_probes`` during training;
- ``--bench-max-micro-batch-cap N``: after training, the largest micro-batch size (sequences, at most ``N``)
  whose forward and backward fit the GPU beside the run's parameters, gradients and optimizer state (one GPU
  only: at EP > 1 a rank that runs out of memory would leave the others waiting in their all-to-all).

Megatron's start-up JIT warm-up (``set_jit_fusion_options``: ``torch.compile`` of bias-SwiGLU and
bias-dropout-add fusions) is skipped: where those fusions are on they compile at first use, in the first,
untimed iteration. Rank 0 prints what ran and what was measured as ``bench: {json}`` lines, which
``bench_megatron_pretrain.parse_log`` reads: the optimizer and gradient-accumulation path, the attention core,
TransformerEngine's version, and the probes' values.

    # PYTHONPATH=<repo root>
    torchrun --nproc_per_node N benchmarks/megatron_bench_entry.py [--bench-...] <Megatron args>
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from megatron_memory_probes import ActivationProbe, fits, largest_that_trains


def parse_bench_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This entry's flags out of ``argv``: ``(their values, the Megatron arguments left)``."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--bench-grouped-mm", action="store_true")
    parser.add_argument("--bench-sdpa-attention", action="store_true")
    parser.add_argument("--bench-probe-memory", action="store_true")
    parser.add_argument("--bench-max-micro-batch-cap", type=int, default=0)
    bench, rest = parser.parse_known_args(argv)
    if bench.bench_max_micro_batch_cap < 0:
        raise ValueError(f"--bench-max-micro-batch-cap must be >= 0 (0: no search), "
                         f"got {bench.bench_max_micro_batch_cap}")
    if bench.bench_grouped_mm and "--moe-fp8-flow" in rest:
        raise ValueError("--bench-grouped-mm (the BF16 stand-in's experts) and --moe-fp8-flow exclude each other")
    return bench, rest


def layer_spec(bench: argparse.Namespace):
    """The ``megatron_pretrain`` layer-spec hook: ``(spec, config) ->`` Megatron's spec with the SDPA core
    attention when asked, then the stand-in's experts or FP8-Flow's layers (``fp8_flow_layer_spec``: no change
    without ``--moe-fp8-flow``)."""
    from megatron_grouped_mm import grouped_mm_layer_spec
    from megatron_patches.experts import fp8_flow_layer_spec
    from sdpa_attention import sdpa_layer_spec

    def build(spec, config):
        if bench.bench_sdpa_attention:
            spec = sdpa_layer_spec(spec)
        return grouped_mm_layer_spec(spec, config) if bench.bench_grouped_mm else fp8_flow_layer_spec(spec, config)

    return build


def report(facts: dict) -> None:
    """One ``bench: {json}`` line from rank 0."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print("bench: " + json.dumps(facts), flush=True)


def report_safely(name: str, measure) -> None:
    """``report(measure())``; if it raises, a ``{name}_error`` line instead: the run and its timed iterations
    stand whatever a probe or a fact-finder does after them."""
    try:
        facts = measure()
    except Exception as error:  # noqa: BLE001 (reported, not hidden)
        facts = {f"{name}_error": f"{type(error).__name__}: {error}"}
    report(facts)


def optimizer_description(optimizer) -> str:
    """Which optimizer steps the parameters: the inner optimizer's class (torch's with its foreach / fused mode)
    inside Megatron's wrapper, for each of a ``ChainedOptimizer``'s parts (distinct ones, joined by '; ')."""
    parts = set()
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", wrapper)
        name = f"{type(inner).__module__}.{type(inner).__name__}"
        if name.startswith("torch.optim"):
            fused, foreach = inner.defaults.get("fused"), inner.defaults.get("foreach")
            # torch's default (both None) on CUDA tensors is foreach (torch.optim's _default_to_fused_or_foreach)
            name += " (fused)" if fused else " (foreach)" if foreach or foreach is None else " (for-loop)"
        parts.add(f"{name} in {type(wrapper).__name__}")
    return "; ".join(sorted(parts))


def run_facts(model: list, optimizer) -> dict:
    """What ran: optimizer, gradient accumulation (Megatron's ``gradient_accumulation_fusion`` and the
    ``main_grad`` dtype), the attention core (class, and the SDPA core's backend), TransformerEngine's version."""
    from megatron.training import get_args

    from sdpa_attention import SDPACoreAttention

    cores = {m.core_attention for m in model[0].modules() if hasattr(m, "core_attention")}
    attention = sorted({f"torch SDPA core: {c.backend}" if isinstance(c, SDPACoreAttention)
                        else f"{type(c).__module__}.{type(c).__name__}" for c in cores})
    main_grads = {str(p.main_grad.dtype) for p in model[0].parameters() if getattr(p, "main_grad", None) is not None}
    fusion = bool(get_args().gradient_accumulation_fusion)
    te = sys.modules.get("transformer_engine")
    dtypes = "/".join(sorted(main_grads))
    return dict(optimizer=optimizer_description(optimizer),
                grad_accumulation=(f"fused: TE's linears and FP8-Flow's experts add wgrads into main_grad ({dtypes}), "
                                   "other parameters' .grad added by DDP's hooks" if fusion else
                                   f"unfused: autograd's .grad added into main_grad ({dtypes}) by DDP's hooks"),
                gradient_accumulation_fusion=fusion, attention="; ".join(attention),
                transformer_engine=getattr(te, "__version__", "installed") if te else "absent")


def _forward_backward(model: list, size: int, seq: int, vocab: int) -> None:
    """One micro-batch of ``size`` random sequences of ``seq`` token ids below ``vocab`` through the model and
    back, as a step's micro-batch (FP8 weights quantized and cached on it); its gradients then go."""
    for chunk in model:
        chunk.set_is_first_microbatch()
    try:
        tokens = torch.randint(vocab, (size, seq), device="cuda")
        positions = torch.arange(seq, device="cuda").expand(size, -1)
        model[0](tokens, positions, None, labels=tokens).sum().backward()
        torch.cuda.synchronize()
    finally:
        for param in model[0].parameters():
            param.grad = None


def max_micro_batch(model: list, cap: int) -> dict:
    """``largest_that_trains`` over micro-batch sizes from the run's own, capped at ``cap``."""
    from megatron.training import get_args

    args = get_args()
    if torch.distributed.get_world_size() > 1:
        return dict(max_micro_batch=None, max_micro_batch_note="not searched at world size > 1")
    size, tries = largest_that_trains(
        lambda b: fits(functools.partial(_forward_backward, model, b, args.seq_length, args.vocab_size)),
        min(args.micro_batch_size, cap), cap)
    for chunk in model:
        chunk.zero_grad_buffer()
    return dict(max_micro_batch=size, max_micro_batch_capped=size == cap, max_micro_batch_tries=tries)


def probed_train(train, bench: argparse.Namespace):
    """Megatron's ``train`` with the probes around it: the facts of the run, the activation probe on the
    second micro-batch of the second iteration (the second of the first when there is one iteration), the
    micro-batch search after it."""

    @functools.wraps(train)
    def wrapped(forward_step_func, model, optimizer, *args, **kwargs):
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.training import get_args

        probe = None
        if bench.bench_probe_memory:
            micro_batches = get_num_microbatches()
            target = micro_batches + 1 if get_args().train_iters >= 2 else 1
            if micro_batches >= 2:
                probe = ActivationProbe(model[0], [m for m in model[0].modules() if isinstance(m, MoELayer)], target)
            else:
                report(dict(activation_probe_note="needs >= 2 micro-batches per iteration"))
        out = train(forward_step_func, model, optimizer, *args, **kwargs)
        report_safely("run_facts", lambda: run_facts(model, optimizer))
        if probe is not None:
            probe.remove()
            report_safely("activation_probe", probe.result)
        if bench.bench_max_micro_batch_cap:
            report_safely("max_micro_batch", lambda: max_micro_batch(model, bench.bench_max_micro_batch_cap))
        return out

    return wrapped


def main(argv: list[str]) -> None:
    bench, sys.argv[1:] = parse_bench_args(argv)
    import megatron_patches

    megatron_patches.apply()  # before megatron.training builds anything from TransformerConfig
    from megatron.training import training

    from examples.pretrain_gpt import megatron_pretrain

    training.set_jit_fusion_options = lambda *args, **kwargs: None  # see the module docstring
    training.train = probed_train(training.train, bench)
    megatron_pretrain(layer_spec=layer_spec(bench))


if __name__ == "__main__":
    main(sys.argv[1:])
