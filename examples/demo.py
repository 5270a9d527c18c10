"""The main job: a small MoE GPT pretrained through ``python -m examples.pretrain_gpt`` twice
on the same bytes of the Python standard library's source files — stock Megatron BF16 experts, then
FP8-Flow experts with ``--recompute-modules moe_expert`` — and a summary of both: loss curves (PNG),
final loss and their relative deviation, tokens/s, peak memory.

    python -m examples.demo [--train-iters N] [--out DIR] [-- extra pretrain_gpt args]

It runs the compact loop under gloo (world size 1) on the CPU, where the experts run the plain-PyTorch
reference path: its summary says so, and that FP8-Flow's speed is measured on GPUs
(``benchmarks/results/bench_moe_layer.md``, ``bench_megatron_pretrain.md``). On a machine with CUDA it
points to the GPU benchmark instead.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import textwrap
import time

import torch

MODEL = ("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 --num-experts 8 "
         "--moe-ffn-hidden-size 128 --moe-router-topk 2 --micro-batch-size 8 --swiglu --disable-bias-linear "
         "--moe-aux-loss-coeff 1e-2 --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 10 --lr-decay-style cosine "
         "--moe-token-dispatcher-type alltoall --seed 1234 --log-interval 10").split()
FP8_FLOW = ("--fp8-format e4m3 --fp8-recipe blockwise --moe-fp8-flow --moe-grouped-gemm "
            "--recompute-granularity selective --recompute-modules moe_expert").split()
RUNS = {"bf16_experts": [], "fp8_flow_moe_expert": FP8_FLOW}
FINAL_WINDOW = 10  # final loss = mean of the last steps' losses (one step's loss is a noisy sample)


def run(name: str, argv: list[str], out: pathlib.Path) -> dict:
    summary = out / f"{name}.json"
    cmd = [sys.executable, "-m", "examples.pretrain_gpt", *argv, "--summary-json", str(summary)]
    print(f"\n== {name}: {' '.join(cmd[3:])}", flush=True)
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    for line in proc.stdout:  # progress: the loop's step lines; everything else goes to the log file
        log.append(line)
        if line.startswith("step"):
            print(f"  {line.rstrip()}", flush=True)
    (out / f"{name}.log").write_text("".join(log))
    if proc.wait():
        sys.exit(f"{name} failed (exit {proc.returncode}); its output is in {out / (name + '.log')}:\n"
                 + "".join(log[-20:]))
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
GPU_NOTE = (
    "examples.demo is the CPU main job (the compact loop, gloo, the plain-PyTorch reference path). On a GPU "
    "machine run Megatron's pretrain with the kernels instead: benchmarks/bench_megatron_pretrain.py (commands "
    "in docs/megatron.md); its training logs say which GEMM backends the experts used ('experts: FP8-Flow on "
    "cuda:...').")


def report(summary: dict, out: pathlib.Path) -> str:
    """The demo's closing summary: the table, the loss verdict, what ran the experts and what its speed means."""
    runs, final = summary["runs"], summary["final_loss"]
    lines = [f"== summary ({summary['steps']} steps, seed 1234, final loss = mean of the last "
             f"{summary['final_loss_window']})",
             f"{'run':24s} {'final loss':>10s} {'tokens/s':>10s} {'peak MiB':>9s} {'wall s':>7s}"]
    lines += [f"{n:24s} {final[n]:10.4f} {r['tokens_per_s']:10,.0f} {r['peak_memory_bytes'] / 2**20:9.0f} "
              f"{r['wall_s']:7.0f}" for n, r in runs.items()]
    lines.append(f"relative deviation of FP8-Flow's final loss: {100 * summary['relative_deviation']:+.2f}% "
                 f"({'within' if summary['within_1_percent'] else 'NOT within'} 1%)")
    lines += [f"{n}: {r['expert_path']}" for n, r in runs.items()]
    lines += [textwrap.fill(SPEED_NOTE, 110), f"loss curves: {out / 'loss_curves.png'}; summaries and logs: {out}/"]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=120)
    parser.add_argument("--out", default="demo_results", help="directory for logs, summaries and the plot")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more pretrain_gpt arguments")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        sys.exit(GPU_NOTE)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = [a for a in args.extra if a != "--"]
    results = {name: run(name, MODEL + ["--train-iters", str(args.train_iters)] + flags + extra, out)
               for name, flags in RUNS.items()}
    plot(results, out / "loss_curves.png")
    final = {n: sum(r["loss_curve"][-FINAL_WINDOW:]) / len(r["loss_curve"][-FINAL_WINDOW:])
             for n, r in results.items()}
    bf16, fp8 = final["bf16_experts"], final["fp8_flow_moe_expert"]
    deviation = (fp8 - bf16) / bf16
    summary = {"steps": args.train_iters, "final_loss_window": FINAL_WINDOW, "final_loss": final,
               "relative_deviation": deviation, "within_1_percent": abs(deviation) <= 0.01,
               "runs": {n: {k: r[k] for k in ("tokens_per_s", "peak_memory_bytes", "wall_s", "seq_length",
                                               "global_batch_size", "expert_path")} for n, r in results.items()},
               "speed_note": SPEED_NOTE}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n" + report(summary, out))
    return summary


if __name__ == "__main__":
    main()
