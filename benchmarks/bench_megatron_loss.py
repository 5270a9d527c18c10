"""Loss study through Megatron's own ``pretrain`` (megatron-core 0.19.x): does FP8-Flow train like BF16?

Three runs of ``bench_megatron_pretrain``'s ``qwen3_moe_like`` model (Qwen3-30B-A3B's layer: hidden 2048, 32
query heads in 4 KV groups, 128 experts of ffn 768, top-8, sequence 4096) with ``--num-layers`` (default 2),
one micro-batch of ``--micro-batch-size`` (default 2: 8192 tokens, 512 rows per expert) per iteration, on the
default data (the Python standard library's bytes, vocabulary 256), through ``megatron_bench_entry.py`` with the
same attention and Megatron path as the throughput runs (TransformerEngine's where installed, else the torch
SDPA core):
- ``bf16_grouped_mm``: the BF16 grouped-GEMM stand-in for TE's ``TEGroupedMLP`` (two ``torch._grouped_mm``;
  Megatron's router and dispatcher), seed ``--seed`` (default 1234): the baseline;
- ``fp8_flow_single_weight_moe_expert``: FP8-Flow (E4M3, one grouped weight per GEMM) with ``moe_expert``
  recompute, the same seed: the same initial model (the stand-in and FP8-Flow draw their experts as Megatron's
  ``SequentialMLP`` does) and data order, so what differs is the expert arithmetic;
- ``bf16_grouped_mm_seed_control``: the stand-in with the next seed: how far two runs land apart from
  initialisation alone.

The runs go ``--per-gpu`` at a time on each visible GPU (default: as many as the memory model of
``megatron_configs.memory_needed`` fits), so iteration times are shared-GPU times, comparable with each
other only. Final loss: the mean of the last quarter of Megatron's logged losses (every ``LOG_INTERVAL``
iterations); ``vs_bf16``: relative to ``bf16_grouped_mm``'s; the target is within 0.25%. Each run is bounded by
``--run-timeout``. Writes ``benchmarks/results/bench_megatron_loss_qwen3_moe_like.json`` / ``.md`` / ``.png``
(loss curves and each run's deviation from the baseline per logged iteration, per seed); rows of other seeds
already there are kept, so repeats with other seeds build one table.

    python benchmarks/bench_megatron_loss.py [--train-iters 500] [--seed 1234]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import time

import torch

import bench_megatron_pretrain as pretrain
import megatron_configs
import utils

CONFIG = "qwen3_moe_like"
LOG_INTERVAL = 10
SCHEDULE = "--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20"
BYTES_VOCAB = 256  # the default data's vocabulary (examples.pretrain_gpt without data arguments)
RUNS = {  # name -> (seed offset, bench_megatron_pretrain variant)
    "bf16_grouped_mm": (0, "bf16_grouped_mm"),
    "fp8_flow_single_weight_moe_expert": (0, "fp8_flow_single_weight_moe_expert"),
    "bf16_grouped_mm_seed_control": (1, "bf16_grouped_mm"),
}
BASELINE = "bf16_grouped_mm"
TARGET = 0.0025  # final loss within 0.25% of the baseline's


def command(run: str, iters: int, layers: int, micro_batch_size: int, seed: int = 1234, te: bool = False) -> list[str]:
    """The one-GPU ``torchrun`` command of ``run`` (a key of ``RUNS``) in the study of base ``seed``."""
    if run not in RUNS:
        raise ValueError(f"run must be one of {list(RUNS)}, got {run!r}")
    offset, variant = RUNS[run]
    return pretrain.command(CONFIG, variant, 1, iters, layers, micro_batch_size, micro_batches=1, seed=seed + offset,
                            te=te, data="", schedule=SCHEDULE, log_interval=LOG_INTERVAL)


def runs_per_gpu(layers: int, micro_batch_size: int, gpu_bytes: float) -> int:
    """How many runs share one GPU: as many as ``megatron_configs.memory_needed`` (at the bytes' vocabulary) fits, 1 to
    ``len(RUNS)``."""
    config = dataclasses.replace(megatron_configs.CONFIGS[CONFIG], vocab=BYTES_VOCAB)
    need = max(megatron_configs.memory_needed(config, layers, 1, micro_batch_size))
    return max(1, min(len(RUNS), int(megatron_configs.MEMORY_FRACTION * gpu_bytes // need)))


def deviation(curve: list[float], base: list[float]) -> list[float]:
    """Per logged iteration, ``curve``'s relative difference from ``base`` (as long as the shorter)."""
    return [(c - b) / b for c, b in zip(curve, base)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1234, help="the baseline's seed; the control takes the next")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences of 4096 per iteration")
    parser.add_argument("--per-gpu", type=int, default=None, help="runs at a time on one GPU (default: what fits)")
    parser.add_argument("--run-timeout", type=float, default=420, help="seconds per run, torchrun included")
    args = parser.parse_args(argv)
    gpus, gpu, te = max(1, torch.cuda.device_count()), pretrain.gpu_facts(), pretrain.transformer_engine_version()
    per_gpu = args.per_gpu or runs_per_gpu(args.num_layers, args.micro_batch_size, gpu["gpu_memory_mib"] * 2**20)
    cmds = {run: command(run, args.train_iters, args.num_layers, args.micro_batch_size, args.seed, te is not None)
            for run in RUNS}

    def launch(i: int, run: str):
        began = time.perf_counter()
        status, out = pretrain.run(cmds[run], args.run_timeout, {"CUDA_VISIBLE_DEVICES": str(i % gpus)})
        return status, out, time.perf_counter() - began

    env = dict(utils.environment(gpu), gpus=gpus, runs_per_gpu=per_gpu, transformer_engine=te or "absent")
    stored = utils.RESULTS_DIR / f"bench_megatron_loss_{CONFIG}.json"
    kept = json.loads(stored.read_text())["results"] if stored.exists() else []
    kept = [r for r in kept if r["base_seed"] != args.seed]
    rows = {}
    with concurrent.futures.ThreadPoolExecutor(gpus * per_gpu) as pool:
        futures = {run: pool.submit(launch, i, run) for i, run in enumerate(RUNS)}
        for run, future in futures.items():
            status, out, wall = future.result()
            row = dict(run=run, base_seed=args.seed, seed=args.seed + RUNS[run][0], status=status,
                       iters=args.train_iters, layers=args.num_layers, micro_batch_size=args.micro_batch_size,
                       wall_s=wall, command=" ".join(cmds[run]))
            row.update(pretrain.outcome(status, out, args.micro_batch_size * megatron_configs.SEQ, 1))
            rows[run] = row
            print(run, status, row.get("final_loss"), flush=True)
    base = rows[BASELINE].get("final_loss")
    for row in rows.values():
        if base and "final_loss" in row:
            row["vs_bf16"] = (row["final_loss"] - base) / base
            row["within_target"] = abs(row["vs_bf16"]) <= TARGET
    print(write(kept + list(rows.values()), env).read_text())


def write(rows: list[dict], env: dict):
    """``rows`` -> ``bench_megatron_loss_qwen3_moe_like`` .json / .md / .png under benchmarks/results; the .md."""
    shapes = sorted({f"{r['iters']} iterations, {r.get('layers')} layers, micro-batch {r.get('micro_batch_size')}"
                     for r in rows})
    notes = (f"{'; '.join(shapes)}: `{CONFIG}` (bench_megatron_pretrain.py) on the standard library's bytes, sequence "
             f"{megatron_configs.SEQ}, one micro-batch per iteration. The runs of one base seed shared the machine's "
             "GPUs "
             f"({env.get('runs_per_gpu')} at a time per GPU): iteration times are shared-GPU times. Final loss: mean "
             f"of the last quarter of the logged losses (every {LOG_INTERVAL} iterations); vs_bf16: relative to the "
             f"`{BASELINE}` run of the same base seed (the BF16 grouped stand-in); within_target: |vs_bf16| <= "
             f"{TARGET:.2%}. Commands: the `command` field of each row in the JSON; docs/megatron.md.")
    path = utils.write_results(f"bench_megatron_loss_{CONFIG}", "Megatron pretrain loss: BF16 stand-in vs FP8-Flow",
                               env, {}, rows, ["base_seed", "run", "seed", "status", "final_loss", "vs_bf16",
                                               "within_target", "iter_ms", "max_allocated_mib", "wall_s", "attention",
                                               "experts", "error"], notes=notes,
                               formats={"final_loss": ".4f", "vs_bf16": "+.2%"})
    plot(rows, path.with_suffix(".png"))
    return path


def plot(rows: list[dict], path) -> None:
    """Per base seed, two panels: every run's loss curve, and each run's relative deviation from that seed's
    baseline per logged iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = list(dict.fromkeys(r["base_seed"] for r in rows))
    fig, axes = plt.subplots(len(seeds), 2, figsize=(12, 4 * len(seeds)), squeeze=False)
    for (loss_ax, dev_ax), seed in zip(axes, seeds):
        runs = [r for r in rows if r["base_seed"] == seed and r.get("curve")]
        base = next((r for r in runs if r["run"] == BASELINE), None)
        for r in runs:  # one colour per run in both panels
            color = f"C{list(RUNS).index(r['run'])}"
            loss_ax.plot(r["curve_iters"], r["curve"], label=r["run"], color=color)
            if base is not None and r is not base:
                dev = deviation(r["curve"], base["curve"])
                dev_ax.plot(r["curve_iters"][:len(dev)], [100 * d for d in dev], label=r["run"], color=color)
        loss_ax.set(title=f"lm loss (seed {seed})", xlabel="iteration", yscale="log")
        dev_ax.set(title=f"loss vs {BASELINE} (%, seed {seed})", xlabel="iteration", ylim=(-3, 3))
        for ax in (loss_ax, dev_ax):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
