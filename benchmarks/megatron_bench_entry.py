"""Megatron's own ``pretrain`` as the Megatron benchmarks run it (benchmark only): ``examples.pretrain_gpt``'s
``megatron_pretrain`` (megatron-core 0.19, ``megatron.training``) with, chosen by this entry's own flags
(taken off the command line before Megatron parses the rest):

- ``--bench-grouped-mm``: the MoE layers' experts are the BF16 grouped-GEMM stand-in for TE's ``TEGroupedMLP``
  (``megatron_grouped_mm.GroupedMMExperts``) instead of FP8-Flow (``--moe-fp8-flow``) or Megatron's own;
- ``--bench-sdpa-attention``: every self-attention's core is the torch SDPA core (``sdpa_attention``), for
  runs without TransformerEngine (``--transformer-impl local``);
- ``--bench-probe-memory``: the activation probes of ``megatron_memory_probes`` during training and where the
  second iteration's memory peak falls (``StepPeaks``);
- ``--bench-no-fp8-weight-cache``: the config's ``disable_parameter_transpose_cache`` set (Megatron has no flag
  for it): FP8-Flow quantizes its weights on every micro-batch instead of caching them for the step;
- ``--bench-max-micro-batch-cap N``: after training, the largest micro-batch size (sequences, at most ``N``)
  whose forward and backward fit the GPU beside the run's parameters, gradients and optimizer state (one GPU
  only: at EP > 1 a rank that runs out of memory would leave the others waiting in their all-to-all);
- ``--bench-profile-iteration N --bench-profile-out PATH``: iteration ``N`` (counted from 1, as Megatron logs
  them) under torch.profiler on rank 0: its forward and backward of every micro-batch and its optimizer step
  (Megatron's ``train_step``), the step inside a ``kernel_profile.OPTIMIZER_SCOPE`` range. Rank 0 writes that
  iteration's CUDA kernel time to ``PATH`` as JSON (``profile_json``).

Megatron's start-up JIT warm-up (``set_jit_fusion_options``: ``torch.compile`` of bias-SwiGLU and
bias-dropout-add fusions) is skipped: where those fusions are on they compile at first use, in the first,
untimed iteration. Rank 0 prints what ran and what was measured as ``bench: {json}`` lines, which
``bench_megatron_pretrain.parse_log`` reads: the optimizer and gradient-accumulation path, the attention core,
TransformerEngine's version, the probes' values, and where the profile went (``profile_iteration``,
``profile_out``, ``profile_wall_ms``; ``profile_error`` if it could not be written).

    # PYTHONPATH=<repo root>
    torchrun --nproc_per_node N benchmarks/megatron_bench_entry.py [--bench-...] <Megatron args>
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import sys
import time

import torch

import kernel_profile
from megatron_memory_probes import ActivationProbe, StepPeaks, fits, graph_pool_mib, largest_that_trains


def parse_bench_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This entry's flags out of ``argv``: ``(their values, the Megatron arguments left)``."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--bench-grouped-mm", action="store_true")
    parser.add_argument("--bench-sdpa-attention", action="store_true")
    parser.add_argument("--bench-probe-memory", action="store_true")
    parser.add_argument("--bench-no-fp8-weight-cache", action="store_true")
    parser.add_argument("--bench-max-micro-batch-cap", type=int, default=0)
    parser.add_argument("--bench-profile-iteration", type=int, default=0)
    parser.add_argument("--bench-profile-out", default="")
    bench, rest = parser.parse_known_args(argv)
    for flag, value in (("max-micro-batch-cap", bench.bench_max_micro_batch_cap),
                        ("profile-iteration", bench.bench_profile_iteration)):
        if value < 0:
            raise ValueError(f"--bench-{flag} must be >= 0 (0: none), got {value}")
    if bool(bench.bench_profile_iteration) != bool(bench.bench_profile_out):
        raise ValueError("--bench-profile-iteration N and --bench-profile-out PATH go together, got "
                         f"{bench.bench_profile_iteration} and {bench.bench_profile_out!r}")
    if bench.bench_grouped_mm and "--moe-fp8-flow" in rest:
        raise ValueError("--bench-grouped-mm (the BF16 stand-in's experts) and --moe-fp8-flow exclude each other")
    return bench, rest


def layer_spec(bench: argparse.Namespace):
    """The ``megatron_pretrain`` layer-spec hook: ``(spec, config) ->`` Megatron's spec with the SDPA core
    attention when asked, then the stand-in's experts or FP8-Flow's layers (``fp8_flow_layer_spec``: no change
    without ``--moe-fp8-flow``); ``config.disable_parameter_transpose_cache`` set with
    ``--bench-no-fp8-weight-cache`` (the model's layers share this config)."""
    from megatron_grouped_mm import grouped_mm_layer_spec
    from megatron_patches.experts import fp8_flow_layer_spec
    from sdpa_attention import sdpa_layer_spec

    def build(spec, config):
        if bench.bench_no_fp8_weight_cache:
            config.disable_parameter_transpose_cache = True
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
    args = get_args()
    fusion = bool(args.gradient_accumulation_fusion)
    experts_fused = fusion or bool(getattr(args, "moe_fp8_flow_gradient_accumulation_fusion", False))
    te = sys.modules.get("transformer_engine")
    dtypes = "/".join(sorted(main_grads))
    return dict(optimizer=optimizer_description(optimizer),
                grad_accumulation=(f"fused: TE's linears and FP8-Flow's experts add wgrads into main_grad ({dtypes}), "
                                   "other parameters' .grad added by DDP's hooks" if fusion else
                                   f"experts fused: FP8-Flow's experts add wgrads into main_grad ({dtypes}), the "
                                   "other parameters' .grad added by DDP's hooks" if experts_fused else
                                   f"unfused: autograd's .grad added into main_grad ({dtypes}) by DDP's hooks"),
                gradient_accumulation_fusion=fusion, moe_fp8_flow_gradient_accumulation_fusion=experts_fused,
                attention="; ".join(attention),
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

        probe, peaks = None, StepPeaks(optimizer) if bench.bench_probe_memory else None
        moe_layers = [m for m in model[0].modules() if isinstance(m, MoELayer)]
        graphed = bool(getattr(get_args(), "moe_fp8_flow_cuda_graph", False))
        if bench.bench_probe_memory and not graphed:
            micro_batches = get_num_microbatches()
            target = micro_batches + 1 if get_args().train_iters >= 2 else 1
            if micro_batches >= 2:
                probe = ActivationProbe(model[0], moe_layers, target)
            else:
                report(dict(activation_probe_note="needs >= 2 micro-batches per iteration"))
        out = train(forward_step_func, model, optimizer, *args, **kwargs)
        report_safely("run_facts", lambda: run_facts(model, optimizer))
        if peaks is not None:
            peaks.remove()
            report_safely("step_peaks", peaks.result)
        if probe is not None:
            probe.remove()
            report_safely("activation_probe", probe.result)
        if bench.bench_probe_memory and graphed:  # activations live in the graphs' pools, allocated at capture
            report(dict(activation_probe_note="expert path in CUDA graphs: its activations are held in the graphs' "
                                              "memory pools for the run (graph_pool_mib_per_moe_layer)"))
            report_safely("graph_pool", lambda: graph_pool_mib(torch.cuda.memory_snapshot(), len(moe_layers)))
        if bench.bench_max_micro_batch_cap:
            report_safely("max_micro_batch", lambda: max_micro_batch(model, bench.bench_max_micro_batch_cap))
        return out

    return wrapped


@contextlib.contextmanager
def optimizer_scope(optimizer):
    """Inside the block, ``optimizer.step`` runs in a ``kernel_profile.OPTIMIZER_SCOPE`` profiler range (Megatron's
    whole step: gradient norm and clipping, the inner optimizer, the copies to the model's parameters)."""
    step, own = optimizer.step, "step" in vars(optimizer)

    def scoped(*args, **kwargs):
        with torch.profiler.record_function(kernel_profile.OPTIMIZER_SCOPE):
            return step(*args, **kwargs)

    optimizer.step = scoped
    try:
        yield
    finally:
        if own:
            optimizer.step = step
        else:
            del optimizer.step


def profile_json(events, wall_ms: float, iteration: int, out: str) -> dict:
    """Write one iteration's profiler ``events`` to ``out``: ``{"iteration", "wall_ms", "kernels": [{"kernel",
    "launched_by", "ms", "launches"}, ...]}`` (``kernel_profile.kernel_sites``, per iteration, largest first);
    the ``bench:`` facts saying so."""
    _, sites = kernel_profile.kernel_sites(events, steps=1)
    kernels = [dict(kernel=kernel, launched_by=site, ms=ms, launches=n)
               for (kernel, site), (ms, n) in sorted(sites.items(), key=lambda kv: -kv[1][0])]
    with open(out, "w") as f:
        json.dump(dict(iteration=iteration, wall_ms=wall_ms, kernels=kernels), f, indent=1)
    return dict(profile_iteration=iteration, profile_out=out, profile_wall_ms=wall_ms, profile_kernels=len(kernels))


def profiled_train_step(train_step, iteration: int, out: str):
    """Megatron's ``train_step`` with its ``iteration``-th call (from 1) under torch.profiler (CPU and CUDA
    activities) on rank 0, between two device synchronisations; ``profile_json`` then writes it to ``out``."""
    calls = itertools.count(1)

    @functools.wraps(train_step)
    def wrapped(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        step = functools.partial(train_step, forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        if next(calls) != iteration or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
            return step()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        torch.cuda.synchronize()
        with optimizer_scope(optimizer), torch.profiler.profile(activities=activities) as prof:
            began = time.perf_counter()
            result = step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - began) * 1e3
        report_safely("profile", lambda: profile_json(prof.events(), wall_ms, iteration, out))
        return result

    return wrapped


def main(argv: list[str]) -> None:
    bench, sys.argv[1:] = parse_bench_args(argv)
    import megatron_patches

    megatron_patches.apply()  # before megatron.training builds anything from TransformerConfig
    from megatron.training import training

    from examples.pretrain_gpt import megatron_pretrain

    training.set_jit_fusion_options = lambda *args, **kwargs: None  # see the module docstring
    training.train = probed_train(training.train, bench)
    if bench.bench_profile_iteration:
        training.train_step = profiled_train_step(training.train_step, bench.bench_profile_iteration,
                                                  bench.bench_profile_out)
    megatron_pretrain(layer_spec=layer_spec(bench))


if __name__ == "__main__":
    main(sys.argv[1:])
