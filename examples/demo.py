"""The main job (``make demo``): a MoE GPT pretrained twice, BF16 experts against FP8-Flow, and a summary.

Both runs go through ``python -m examples.pretrain_gpt`` on the same bytes of the Python standard library's source
files — Megatron's BF16 experts, then FP8-Flow experts with ``--recompute-modules moe_expert`` — and the summary
compares them: loss curves (PNG), final loss and their relative deviation, tokens/s, peak memory.

    python -m examples.demo [--train-iters N] [--out DIR] [-- extra pretrain_gpt args]

Where it runs decides what runs (``plan``):
- CUDA and ``megatron.training`` (megatron-core >= 0.19): Megatron's ``pretrain`` on one GPU (``torchrun``,
  NCCL) of ``GPU_MODEL`` (4 layers of hidden 1024, 8 experts of ffn 1024, top-2, sequence 1024, 8 sequences
  per iteration, 500 iterations, BF16). The first run's experts are Megatron's BF16 grouped experts
  (``--moe-grouped-gemm``: ``TEGroupedMLP`` where TransformerEngine imports, else Megatron falls back to its
  local ``SequentialMLP``; the run's ``experts:`` line says which), the second's FP8-Flow's kernels (E4M3;
  attention and dense layers BF16 in both). From Megatron's log: every iteration's loss, tokens/s over the
  iterations after the first ``GPU_WARMUP_ITERS``, max allocated memory and the allocator's reserved peak. The
  summary adds the GPU, the path and the experts' GEMM backends, and says what a model this small can tell
  of speed (``benchmarks/results/bench_megatron_pretrain_*.md`` has production proportions).
- otherwise the compact loop under gloo (world size 1) on the CPU, where the experts run the plain-PyTorch
  reference path: its summary says so, and that FP8-Flow's speed is measured on GPUs
  (``benchmarks/results/bench_moe_layer.md``, ``bench_megatron_pretrain.md``). With CUDA but without
  ``megatron.training`` (``make demo`` installs megatron-core 0.16.1) that CPU program runs with the GPU hidden
  from it, and the summary names the GPU and what the GPU runs need.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time
from typing import Callable

import torch

from . import megatron_log

MODEL = ("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 --num-experts 8 "
         "--moe-ffn-hidden-size 128 --moe-router-topk 2 --micro-batch-size 8 --swiglu --disable-bias-linear "
         "--moe-aux-loss-coeff 1e-2 --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 10 --lr-decay-style cosine "
         "--moe-token-dispatcher-type alltoall --seed 1234 --log-interval 10").split()
FP8_FLOW = ("--fp8-format e4m3 --fp8-recipe blockwise --moe-fp8-flow --moe-grouped-gemm "
            "--recompute-granularity selective --recompute-modules moe_expert").split()
RUNS = {"bf16_experts": [], "fp8_flow_moe_expert": FP8_FLOW}
FINAL_WINDOW = 10  # final loss = mean of the last steps' losses (one step's loss is a noisy sample)

# the model of docs/megatron.md's first GPU loss study (Megatron's pretrain, 1000 iterations: E4M3 + moe_expert
# +0.14% / +0.05% of BF16's final loss over two seeds)
GPU_MODEL = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 "
             "--max-position-embeddings 1024 --num-experts 8 --moe-ffn-hidden-size 1024 --moe-router-topk 2 "
             "--micro-batch-size 8 --global-batch-size 8 --swiglu --disable-bias-linear --bf16 "
             "--moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall --lr 3e-4 --min-lr 3e-5 "
             "--lr-warmup-iters 20 --lr-decay-style cosine --seed 1234 --log-interval 1 --eval-iters 0 "
             "--eval-interval 100000 --no-bias-dropout-fusion --no-bias-swiglu-fusion").split()
# Megatron's path without TransformerEngine and Apex (its fused kernels need them)
LOCAL = ("--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion "
         "--no-masked-softmax-fusion").split()
# FP8-Flow's own format flag, not --fp8-format: with TransformerEngine that would make attention and the dense
# layers FP8 too, and the two runs would differ in more than the experts. Its experts add their wgrads into
# DDP's main_grad themselves (no Apex needed), as a user without Apex would run them.
GPU_FP8_FLOW = ("--moe-fp8-flow --moe-fp8-flow-format e4m3 --fp8-recipe blockwise --moe-grouped-gemm "
                "--recompute-granularity selective --recompute-modules moe_expert "
                "--moe-fp8-flow-gradient-accumulation-fusion").split()
GPU_WARMUP_ITERS = 20  # untimed: Triton's (and DeepGEMM's) JIT compilation, the allocator's first growth
GPU_PROGRESS_EVERY = 25  # iterations between the progress lines printed (the log keeps every one)
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "examples.pretrain_gpt")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the demo runs here: ``launch`` (the command up to the module's arguments), ``model`` (the arguments
    both runs share, ``--train-iters`` after them), ``runs`` (run name -> its own arguments), ``env`` (added to
    the runs' environment), ``gpu`` (Megatron's pretrain on a GPU, read from its log; else the compact loop,
    read from ``--summary-json``), ``path`` (what ran, for the summary; None on a machine without CUDA)."""

    launch: tuple
    model: list
    runs: dict
    train_iters: int
    env: dict
    gpu: bool
    path: str | None


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def plan(cuda: bool, importable: Callable[[str], bool] = _importable) -> Plan:
    """The GPU plan with CUDA where ``megatron.training`` imports (TransformerEngine's path where
    ``transformer_engine`` imports, with Megatron's wgrad fusion only where Apex's kernel imports), else the
    compact loop's (with CUDA: the GPU hidden, ``CUDA_VISIBLE_DEVICES=""``)."""
    if cuda and importable("megatron.training"):
        te = importable("transformer_engine")
        fusion = [] if importable("fused_weight_gradient_mlp_cuda") else ["--no-gradient-accumulation-fusion"]
        impl = ["--transformer-impl", "transformer_engine", *fusion] if te else LOCAL
        path = ("Megatron's pretrain (megatron.training) on one GPU, "
                + ("TransformerEngine's attention and dense layers" if te else
                   "--transformer-impl local (no TransformerEngine): Megatron's unfused attention"))
        return Plan((sys.executable, *TORCHRUN), GPU_MODEL + impl,
                    {"bf16_experts": ["--moe-grouped-gemm"], "fp8_flow_moe_expert": GPU_FP8_FLOW},
                    500, {}, True, path)
    path = ("the compact loop on the CPU (GPU hidden): megatron.training is not importable here (megatron-core < "
            "0.19, e.g. the 0.16.1 that make demo installs), and the compact loop is the CPU path. For the GPU "
            "runs with FP8-Flow's kernels install megatron-core >= 0.19 (Python >= 3.12) and run this again"
            if cuda else None)
    return Plan((sys.executable, "-m", "examples.pretrain_gpt"), MODEL, RUNS, 120,
                {"CUDA_VISIBLE_DEVICES": ""} if cuda else {}, False, path)


def _progress(line: str, gpu: bool) -> str | None:
    """What of a run's output line is shown while it runs: the compact loop's step lines; of Megatron's iteration
    lines the first and every ``GPU_PROGRESS_EVERY``-th, shortened."""
    if not gpu:
        return line.rstrip() if line.startswith("step") else None
    it = next(iter(_iterations(line)), None)
    if it is None or (it.iteration % GPU_PROGRESS_EVERY and it.iteration != 1):
        return None
    return f"iteration {it.iteration:5d} | {it.ms:8.1f} ms | lm loss {it.loss:.4f}"


def _iterations(log: str) -> list[megatron_log.Iteration]:
    """The log's iteration lines that give the global batch size (Megatron's all do)."""
    return [it for it in megatron_log.iterations(log) if it.global_batch_size is not None]


def megatron_result(log: str, seq_length: int, warmup: int = GPU_WARMUP_ITERS) -> dict:
    """A Megatron pretrain run's log (``--log-interval 1``) -> the compact loop's summary fields the demo reads:
    ``loss_curve`` (every iteration's lm loss), ``tokens_per_s`` (global batch x ``seq_length`` over the mean
    iteration time after the first ``warmup`` iterations; all of them if there are no more),
    ``peak_memory_bytes`` (max allocated, Megatron's report after iteration 1), ``expert_path``, plus
    ``seconds_per_step``, ``timed_iters`` and ``reserved_peak_bytes`` (the caching allocator's, whole run)."""
    logged = _iterations(log)
    if not logged:
        raise ValueError("no 'iteration ... lm loss' lines in the Megatron log")
    timed = [(ms, gbs) for i, ms, gbs, _ in logged if i > warmup] or [(ms, gbs) for _, ms, gbs, _ in logged]
    seconds = sum(ms for ms, _ in timed) / 1e3
    allocated = megatron_log.max_allocated_mib(log)
    reserved = [r.reserved_peak_mib for r in megatron_log.allocator_reports(log) if r.rank == 0]
    return {"loss_curve": [loss for *_, loss in logged], "global_batch_size": logged[-1][2],
            "seq_length": seq_length, "tokens_per_s": sum(gbs for _, gbs in timed) * seq_length / seconds,
            "seconds_per_step": seconds / len(timed), "timed_iters": len(timed),
            "peak_memory_bytes": int(allocated * 2**20) if allocated is not None else None,
            "reserved_peak_bytes": int(reserved[-1] * 2**20) if reserved else None,
            "expert_path": megatron_log.experts_line(log) or "experts: (no 'experts:' line in the log)"}


def _last_value(argv: list[str], flag: str) -> str:
    """The value of ``flag``'s last occurrence in ``argv`` (argparse keeps the last)."""
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


def run(name: str, plan: Plan, argv: list[str], out: pathlib.Path) -> dict:
    summary = out / f"{name}.json"
    cmd = [*plan.launch, *argv] + ([] if plan.gpu else ["--summary-json", str(summary)])
    print(f"\n== {name}: {' '.join(cmd[len(plan.launch):])}", flush=True)
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **plan.env})
    log = []
    for line in proc.stdout:  # progress: the step / iteration lines; everything goes to the log file
        log.append(line)
        shown = _progress(line, plan.gpu)
        if shown is not None:
            print(f"  {shown}", flush=True)
    (out / f"{name}.log").write_text("".join(log))
    if proc.wait():
        sys.exit(f"{name} failed (exit {proc.returncode}); its output is in {out / (name + '.log')}:\n"
                 + "".join(log[-20:]))
    if plan.gpu:  # Megatron's pretrain writes no summary: the demo writes it from the log
        summary.write_text(json.dumps(megatron_result("".join(log), int(_last_value(argv, "--seq-length"))),
                                      indent=1))
    result = json.loads(summary.read_text())
    result["wall_s"] = time.perf_counter() - began
    return result


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot(range(1, len(r["loss_curve"]) + 1), r["loss_curve"], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("LM loss (nats/byte)")
    ax.set_title("MoE GPT on Python stdlib bytes: BF16 experts vs FP8-Flow")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SPEED_NOTE = (
    "What the speed column is: this demo runs on the CPU, where the FP8-Flow experts run the plain-PyTorch "
    "reference path (the ops Triton's interpreter checks the kernels against, grouped GEMMs in float32, plus "
    "the moe_expert recompute) and Megatron's experts run plain FP32 matmuls: its tokens/s compare two CPU "
    "programs, not FP8 against BF16. What it checks is the loss. FP8-Flow's speed is measured on GPUs with "
    "its kernels: benchmarks/results/bench_moe_layer.md (the MoE block against BF16 grouped_mm experts) and "
    "benchmarks/results/bench_megatron_pretrain.md (Megatron's pretrain); docs/megatron.md has the commands.")
GPU_SPEED_NOTE = (
    "What the speed column is: tokens/s of one GPU through Megatron's pretrain, the mean over the iterations "
    f"after the first {GPU_WARMUP_ITERS} (JIT compilation), same model, data and seed in both runs; peak MiB: "
    "max allocated after the first iteration (Megatron's report). A model this small (hidden 1024, 8 experts "
    "of ffn 1024, 8,192 tokens an iteration) keeps the GPU waiting on the host (Megatron's Python and every "
    "layer's kernel launches) more than on the expert GEMMs that FP8 speeds up (docs/megatron.md, the loss "
    "study at this size): its speed ratio is not FP8-Flow's at scale. That is measured at production "
    "proportions (Qwen3-30B-A3B's and DeepSeek-V3's layers, against a BF16 grouped GEMM) in "
    "benchmarks/results/bench_megatron_pretrain_*.md, the MoE block alone in "
    "benchmarks/results/bench_moe_layer.md; docs/megatron.md has the commands.")
SEQUENTIAL_NOTE = (
    "The BF16 run's experts are Megatron's SequentialMLP: without TransformerEngine --moe-grouped-gemm falls "
    "back to one matmul per expert in a loop, a slower baseline than a grouped GEMM.")


def report(summary: dict, out: pathlib.Path) -> str:
    """The demo's closing summary: the table, the loss verdict, where it ran (with CUDA: the device and the
    path), what ran the experts and what its speed means."""
    runs, final = summary["runs"], summary["final_loss"]
    lines = [f"== summary ({summary['steps']} steps, seed 1234, final loss = mean of the last "
             f"{summary['final_loss_window']})",
             f"{'run':24s} {'final loss':>10s} {'tokens/s':>10s} {'peak MiB':>9s} {'wall s':>7s}"]
    lines += [f"{n:24s} {final[n]:10.4f} {r['tokens_per_s']:10,.0f} {r['peak_memory_bytes'] / 2**20:9.0f} "
              f"{r['wall_s']:7.0f}" for n, r in runs.items()]
    lines.append(f"relative deviation of FP8-Flow's final loss: {100 * summary['relative_deviation']:+.2f}% "
                 f"({'within' if summary['within_1_percent'] else 'NOT within'} 1%)")
    if "device" in summary:
        lines.append(f"device: {summary['device']}; path: {summary['path']}")
    lines += [f"{n}: {r['expert_path']}" for n, r in runs.items()]
    lines += [f"{n}: caching allocator's reserved peak {r['reserved_peak_bytes'] / 2**20:,.0f} MiB"
              for n, r in runs.items() if r.get("reserved_peak_bytes") is not None]
    lines += [textwrap.fill(summary["speed_note"], 110),
              f"loss curves: {out / 'loss_curves.png'}; summaries and logs: {out}/"]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=None,
                        help="default: 500 on a GPU (Megatron's pretrain), 120 on the CPU (the compact loop)")
    parser.add_argument("--out", default="demo_results", help="directory for logs, summaries and the plot")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more pretrain_gpt arguments")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    here = plan(cuda)
    steps = args.train_iters or here.train_iters
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = [a for a in args.extra if a != "--"]
    results = {name: run(name, here, here.model + ["--train-iters", str(steps)] + flags + extra, out)
               for name, flags in here.runs.items()}
    plot(results, out / "loss_curves.png")
    final = {n: sum(r["loss_curve"][-FINAL_WINDOW:]) / len(r["loss_curve"][-FINAL_WINDOW:])
             for n, r in results.items()}
    bf16, fp8 = final["bf16_experts"], final["fp8_flow_moe_expert"]
    deviation = (fp8 - bf16) / bf16
    fields = ("tokens_per_s", "peak_memory_bytes", "wall_s", "seq_length", "global_batch_size", "expert_path")
    fields += ("seconds_per_step", "timed_iters", "reserved_peak_bytes") if here.gpu else ()
    note = SPEED_NOTE
    if here.gpu:
        sequential = "SequentialMLP" in results["bf16_experts"]["expert_path"]
        note = GPU_SPEED_NOTE + (" " + SEQUENTIAL_NOTE if sequential else "")
    summary = {"steps": steps, "final_loss_window": FINAL_WINDOW, "final_loss": final,
               "relative_deviation": deviation, "within_1_percent": abs(deviation) <= 0.01,
               "runs": {n: {k: r[k] for k in fields} for n, r in results.items()}, "speed_note": note}
    if cuda:  # asked after the runs: a CUDA context here would sit on their GPU
        name = torch.cuda.get_device_name(0)
        summary.update(device=name if here.gpu else f"cpu (this machine's {name} hidden from the runs)",
                       path=here.path)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n" + report(summary, out))
    return summary


if __name__ == "__main__":
    main()
