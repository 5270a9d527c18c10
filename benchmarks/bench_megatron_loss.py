"""Loss study through Megatron's own ``pretrain`` (megatron-core 0.19.x): does FP8-Flow train like BF16?

Three runs (four with the repeat) of ``bench_megatron_pretrain``'s ``qwen3_moe_like`` model (Qwen3-30B-A3B's layer:
hidden 2048, 32 query heads in 4 KV groups, 128 experts of ffn 768, top-8, sequence 4096) with ``--num-layers``
(default 2), one micro-batch of ``--micro-batch-size`` (default 2: 8192 tokens, 512 rows per expert) per iteration,
on the default data (the Python standard library's bytes, vocabulary 256, windows in a fixed shuffled order: every
seed sees the same batches; ``examples/data.py``), through ``megatron_bench_entry.py`` with the same attention and
Megatron path as the throughput runs (TransformerEngine's where installed, else the torch SDPA core):
- ``bf16_grouped_mm``: the BF16 grouped-GEMM stand-in for TE's ``TEGroupedMLP`` (two ``torch._grouped_mm``;
  Megatron's router and dispatcher), seed ``--seed`` (default 1234): the baseline;
- ``fp8_flow_single_weight_moe_expert``: FP8-Flow (E4M3, one grouped weight per GEMM) with ``moe_expert``
  recompute, the same seed: the same initial model (the stand-in and FP8-Flow draw their experts as Megatron's
  ``SequentialMLP`` does) and data order, so what differs is the expert arithmetic;
- ``bf16_grouped_mm_seed_control``: the stand-in with the next seed: how far two runs land apart from
  initialisation alone;
- ``bf16_grouped_mm_repeat`` (only when ``--runs`` names it): the baseline's command again (same seed, model and
  data): how far two runs land apart from the GPU's run-to-run nondeterminism alone (for one, the unordered
  atomic adds of Megatron's unpermute, ``scatter_add_`` / ``index_add_``), grown over the iterations.
  FP8-Flow's run differs from the baseline in its arithmetic only, so this, not the seed control, is the floor
  under its difference.

The measure is held-out: Megatron's own evaluation (``--eval-iters``, default ``EVAL_ITERS`` = 32 micro-batches,
262,144 tokens at micro-batch 2) every ``train_iters // EVAL_POINTS`` iterations and after training, on the data's
validation and test splits: the samples right after the training ones (``examples/megatron_data.py``), drawn from
the whole corpus like them and never trained on while the stream lasts (about 7,700 windows of 4096 bytes on Python
3.11; past its end the samples wrap onto the training ones). Rows measured on other data (the windows in file
order, before 2026-11-28) are dropped: there the last iterations trained on one stretch of files and the evaluation
read the next, so two BF16 seeds landed 0.9-3.3% apart. Megatron's evaluations read their split in order, each the
next ``eval_iters`` micro-batches, so the k-th evaluation reads the same tokens in every run. ``final_eval_loss``:
the mean of the evaluations of the final model (the loop's at the last iteration, the validation and test ones
after training: three disjoint slices, 786,432 tokens by default); ``eval_vs_bf16``: relative to
``bf16_grouped_mm``'s; the target is within 0.25%. Secondary: ``train_loss``, the mean of the last ``TRAIN_TAIL``
iterations' training losses (every iteration logged), and ``train_vs_bf16``.

The runs go ``--per-gpu`` at a time on each visible GPU (default: as many as the memory model of
``megatron_configs.memory_needed`` fits), so iteration times are shared-GPU times, comparable with each
other only. Each run is bounded by ``--run-timeout``. Writes
``benchmarks/results/bench_megatron_loss_qwen3_moe_like.json`` / ``.md`` / ``.png`` (training-loss curves with
the evaluations, and each run's evaluation loss against the baseline's, per seed); rows of other seeds measured
with evaluations on the same data are kept, so repeats with other seeds build one table; the notes give each
run's mean ``eval_vs_bf16`` over the base seeds with its standard deviation and range.

    python benchmarks/bench_megatron_loss.py [--train-iters 500] [--seed 1234 [1236 ...]] [--eval-iters 32]
        [--runs RUN ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import statistics
import time

import torch

import bench_megatron_pretrain as pretrain
import megatron_configs
import utils

CONFIG = "qwen3_moe_like"
SCHEDULE = "--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20"
BYTES_VOCAB = 256  # the default data's vocabulary (examples.pretrain_gpt without data arguments)
RUNS = {  # name -> (seed offset, bench_megatron_pretrain variant)
    "bf16_grouped_mm": (0, "bf16_grouped_mm"),
    "fp8_flow_single_weight_moe_expert": (0, "fp8_flow_single_weight_moe_expert"),
    "bf16_grouped_mm_seed_control": (1, "bf16_grouped_mm"),
    "bf16_grouped_mm_repeat": (0, "bf16_grouped_mm"),  # only when --runs names it
}
REPEAT = "bf16_grouped_mm_repeat"
DEFAULT_RUNS = [run for run in RUNS if run != REPEAT]
SETTINGS = ("iters", "layers", "micro_batch_size", "eval_iters")  # rows of one base seed share these
BASELINE = "bf16_grouped_mm"
DATA = "stdlib_shuffled"  # the default data as examples/data.py reads it (rows of other data are dropped)
TARGET = 0.0025  # final evaluation loss within 0.25% of the baseline's
EVAL_ITERS = 32  # micro-batches per evaluation
EVAL_POINTS = 5  # evaluations in the loop (the last at the final iteration where 5 divides it); two more after it
TRAIN_TAIL = 100  # iterations averaged into train_loss
# megatron/training/training.py, evaluate_and_print_results: " validation loss at {prefix} | lm loss value: {:.6E} |
# lm loss PPL: ..." with prefix "iteration N" (the loop), "iteration N on validation set" / "on test set" (after)
EVAL = re.compile(r"validation loss at iteration (\d+)(?: on (?:validation|test) set)? \| lm loss value: ([\d.E+-]+)")


def eval_interval(iters: int) -> int:
    """Iterations between the training loop's evaluations: ``EVAL_POINTS`` of them, the last at ``iters`` where
    ``EVAL_POINTS`` divides it (else ``final_evals`` counts only the two after training)."""
    return max(1, iters // EVAL_POINTS)


def command(run: str, iters: int, layers: int, micro_batch_size: int, seed: int = 1234, te: bool = False,
            eval_iters: int = EVAL_ITERS) -> list[str]:
    """The one-GPU ``torchrun`` command of ``run`` (a key of ``RUNS``) in the study of base ``seed``: every
    iteration logged, ``eval_iters`` micro-batches per evaluation (flags after ``bench_megatron_pretrain``'s
    ``--eval-iters 0``: Megatron's parser takes the last)."""
    if run not in RUNS:
        raise ValueError(f"run must be one of {list(RUNS)}, got {run!r}")
    if eval_iters < 1:
        raise ValueError(f"eval_iters must be >= 1 (micro-batches per evaluation), got {eval_iters}")
    offset, variant = RUNS[run]
    return pretrain.command(CONFIG, variant, 1, iters, layers, micro_batch_size, micro_batches=1, seed=seed + offset,
                            te=te, data="", schedule=SCHEDULE, log_interval=1) + [
        "--eval-iters", str(eval_iters), "--eval-interval", str(eval_interval(iters))]


def visible_devices(gpus: int) -> list[str]:
    """The ids that put a child process on each of this process's ``gpus`` GPUs: the entries of its own
    ``CUDA_VISIBLE_DEVICES`` where set (run with ``CUDA_VISIBLE_DEVICES=3`` the runs must land on GPU 3, not on
    the machine's GPU 0, which a plain ``"0"`` names), else ``0 .. gpus-1``."""
    own = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return own[:gpus] if own else [str(i) for i in range(gpus)]


def runs_per_gpu(layers: int, micro_batch_size: int, gpu_bytes: float) -> int:
    """How many runs share one GPU: as many as ``megatron_configs.memory_needed`` (at the bytes' vocabulary) fits, 1 to
    ``len(RUNS)``."""
    config = dataclasses.replace(megatron_configs.CONFIGS[CONFIG], vocab=BYTES_VOCAB)
    need = max(megatron_configs.memory_needed(config, layers, 1, micro_batch_size))
    return max(1, min(len(RUNS), int(megatron_configs.MEMORY_FRACTION * gpu_bytes // need)))


def evaluations(text: str, iters: int) -> dict:
    """A run's log -> ``eval_curve_iters`` / ``eval_curve`` (per evaluated iteration, the mean of its
    evaluations' lm loss; all of equal size), ``final_evals`` (how many evaluated the model of iteration
    ``iters``) and ``final_eval_loss`` (their mean; None when the run did not get there)."""
    at = {}
    for i, loss in EVAL.findall(text):
        at.setdefault(int(i), []).append(float(loss))
    final = at.get(iters, [])
    return dict(eval_curve_iters=list(at), eval_curve=[statistics.fmean(v) for v in at.values()],
                final_evals=len(final), final_eval_loss=statistics.fmean(final) if final else None)


def train_loss(curve_iters: list[int], curve: list[float], iters: int) -> float | None:
    """The mean training loss of the iterations after ``iters - TRAIN_TAIL`` (None if none was logged)."""
    tail = [loss for i, loss in zip(curve_iters, curve) if i > iters - TRAIN_TAIL]
    return statistics.fmean(tail) if tail else None


def deviation(curve: list[float], base: list[float]) -> list[float]:
    """Per point, ``curve``'s relative difference from ``base`` (as long as the shorter)."""
    return [(c - b) / b for c, b in zip(curve, base)]


def compare(rows: dict) -> None:
    """Each row of one base seed (``rows``: run -> row) against the baseline's: ``eval_vs_bf16`` and
    ``within_target`` (|eval_vs_bf16| <= ``TARGET``) from ``final_eval_loss``, ``train_vs_bf16`` from
    ``train_loss``; each absent where a loss it needs is."""
    base = rows[BASELINE]
    for row in rows.values():
        for field, vs in (("final_eval_loss", "eval_vs_bf16"), ("train_loss", "train_vs_bf16")):
            if base.get(field) and row.get(field) is not None:
                row[vs] = (row[field] - base[field]) / base[field]
        if "eval_vs_bf16" in row:
            row["within_target"] = abs(row["eval_vs_bf16"]) <= TARGET


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=500)
    parser.add_argument("--seed", type=int, nargs="+", default=[1234],
                        help="base seeds (the baseline's; the control takes the next), their runs sharing the GPUs")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences of 4096 per iteration")
    parser.add_argument("--eval-iters", type=int, default=EVAL_ITERS, help="micro-batches per evaluation")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=DEFAULT_RUNS,
                        help=f"which runs of each seed (default {DEFAULT_RUNS}); the stored rows of the others are "
                             f"kept, e.g. --runs {REPEAT} adds the nondeterminism floor to measured seeds")
    parser.add_argument("--per-gpu", type=int, default=None, help="runs at a time on one GPU (default: what fits)")
    parser.add_argument("--run-timeout", type=float, default=420, help="seconds per run, torchrun included")
    args = parser.parse_args(argv)
    if args.train_iters <= TRAIN_TAIL:
        parser.error(f"--train-iters must be > {TRAIN_TAIL} (train_loss averages the last {TRAIN_TAIL}), "
                     f"got {args.train_iters}")
    gpus, gpu, te = max(1, torch.cuda.device_count()), pretrain.gpu_facts(), pretrain.transformer_engine_version()
    per_gpu = args.per_gpu or runs_per_gpu(args.num_layers, args.micro_batch_size, gpu["gpu_memory_mib"] * 2**20)
    cmds = {(seed, run): command(run, args.train_iters, args.num_layers, args.micro_batch_size, seed, te is not None,
                                 args.eval_iters)
            for seed in args.seed for run in args.runs}
    stored = utils.RESULTS_DIR / f"bench_megatron_loss_{CONFIG}.json"
    kept = json.loads(stored.read_text())["results"] if stored.exists() else []
    # rows on the same data (and with evaluations), except those this call measures again
    kept = [r for r in kept if r.get("data") == DATA and (r["base_seed"], r["run"]) not in cmds]
    settings = (args.train_iters, args.num_layers, args.micro_batch_size, args.eval_iters)
    for r in kept:
        if r["base_seed"] in args.seed and tuple(r[k] for k in SETTINGS) != settings:
            parser.error(f"the stored {r['run']} row of seed {r['base_seed']} was measured with {SETTINGS} = "
                         f"{tuple(r[k] for k in SETTINGS)}, this call runs {settings}: give the same settings or "
                         "rerun every run of that seed")

    devices = visible_devices(gpus)

    def launch(i: int, key: tuple[int, str]):
        began = time.perf_counter()
        status, out = pretrain.run(cmds[key], args.run_timeout, {"CUDA_VISIBLE_DEVICES": devices[i % gpus]})
        return status, out, time.perf_counter() - began

    env = dict(utils.environment(gpu), gpus=gpus, runs_per_gpu=per_gpu, transformer_engine=te or "absent")
    new = []
    with concurrent.futures.ThreadPoolExecutor(gpus * per_gpu) as pool:
        futures = {key: pool.submit(launch, i, key) for i, key in enumerate(cmds)}
        for (seed, run), future in futures.items():
            status, out, wall = future.result()
            row = dict(run=run, base_seed=seed, seed=seed + RUNS[run][0], status=status, data=DATA,
                       device=gpu["device"], iters=args.train_iters, layers=args.num_layers,
                       micro_batch_size=args.micro_batch_size,
                       eval_iters=args.eval_iters, eval_interval=eval_interval(args.train_iters), wall_s=wall,
                       command=" ".join(cmds[seed, run]))
            row.update(pretrain.outcome(status, out, args.micro_batch_size * megatron_configs.SEQ, 1))
            row.pop("final_loss", None)  # bench_megatron_pretrain's (the last quarter of the logs): train_loss here
            row.update(evaluations(out, args.train_iters),
                       train_loss=train_loss(row.get("curve_iters", []), row.get("curve", []), args.train_iters))
            new.append(row)
            print(seed, run, status, row["final_eval_loss"], flush=True)
    rows = sorted(kept + new, key=lambda r: (r["base_seed"], list(RUNS).index(r["run"])))
    for seed in dict.fromkeys(r["base_seed"] for r in rows):
        seed_rows = {r["run"]: r for r in rows if r["base_seed"] == seed}
        if BASELINE in seed_rows:
            compare(seed_rows)
    print(write(rows, env).read_text())


def summary(rows: list[dict]) -> str:
    """Per run other than the baseline: the mean of its ``eval_vs_bf16`` over the base seeds, with their standard
    deviation (where two or more) and range."""
    parts = []
    for run in RUNS:
        devs = [r["eval_vs_bf16"] for r in rows if r["run"] == run and r.get("eval_vs_bf16") is not None]
        if run != BASELINE and devs:
            sd = f"sd {statistics.stdev(devs):.2%}, " if len(devs) > 1 else ""
            parts.append(f"{run} {statistics.fmean(devs):+.2%} ({sd}range {min(devs):+.2%} to {max(devs):+.2%}, "
                         f"{len(devs)} seeds)")
    return "Mean eval_vs_bf16 over base seeds: " + ("; ".join(parts) or "none measured") + ". "


def write(rows: list[dict], env: dict):
    """``rows`` -> ``bench_megatron_loss_qwen3_moe_like`` .json / .md / .png under benchmarks/results; the .md."""
    shapes = sorted({f"{r['iters']} iterations, {r['layers']} layers, micro-batch {r['micro_batch_size']}, "
                     f"{r['eval_iters']} micro-batches per evaluation every {r['eval_interval']} iterations"
                     for r in rows})
    notes = (summary(rows) + f"{'; '.join(shapes)}: `{CONFIG}` (bench_megatron_pretrain.py) on the standard "
             "library's bytes in a fixed shuffled window order (every seed the same batches), sequence "
             f"{megatron_configs.SEQ}, one micro-batch per iteration. The runs of a call shared its GPUs, as many at a "
             "time as the memory model fits (`runs_per_gpu` above: the latest call's): iteration times are shared-GPU "
             "times. final_eval_loss: the final model's loss on held-out data (Megatron's evaluations at the last "
             "iteration: the loop's and, after training, the validation and test splits': `final_evals` disjoint "
             "slices of the samples after the training ones, the same tokens "
             f"in every run); eval_vs_bf16: relative to the `{BASELINE}` run of the same base seed (the BF16 "
             f"grouped stand-in); within_target: |eval_vs_bf16| <= {TARGET:.2%}; the seed control's eval_vs_bf16 "
             f"is how far two BF16 runs land apart from initialisation alone, the repeat's (`{REPEAT}`, where run) "
             "how far the same run lands from itself (nondeterminism). train_loss: mean training loss of the "
             f"last {TRAIN_TAIL} iterations (the data those batches hold weighs on it); train_vs_bf16 likewise. "
             "Commands: the `command` field of each row in the JSON; docs/megatron.md.")
    columns = ["base_seed", "run", "seed", "status", "final_eval_loss", "eval_vs_bf16", "within_target", "final_evals",
               "train_loss", "train_vs_bf16", "device", "iter_ms", "max_allocated_mib", "wall_s", "attention",
               "experts", "error"]
    path = utils.write_results(f"bench_megatron_loss_{CONFIG}", "Megatron pretrain loss: BF16 stand-in vs FP8-Flow",
                               env, {}, rows, columns, notes=notes,
                               formats={"final_eval_loss": ".4f", "eval_vs_bf16": "+.2%", "train_loss": ".4f",
                                        "train_vs_bf16": "+.2%"})
    plot(rows, path.with_suffix(".png"))
    return path


def plot(rows: list[dict], path) -> None:
    """Per base seed, two panels: every run's training loss per iteration with its evaluations (dots), and
    each run's evaluation loss relative to that seed's baseline per evaluated iteration (the target band
    shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = list(dict.fromkeys(r["base_seed"] for r in rows))
    fig, axes = plt.subplots(len(seeds), 2, figsize=(12, 4 * len(seeds)), squeeze=False)
    for (loss_ax, dev_ax), seed in zip(axes, seeds):
        runs = [r for r in rows if r["base_seed"] == seed]
        base = next((r for r in runs if r["run"] == BASELINE and r.get("eval_curve")), None)
        for r in runs:  # one colour per run in both panels
            color = f"C{list(RUNS).index(r['run'])}"
            if r.get("curve"):
                loss_ax.plot(r["curve_iters"], r["curve"], label=r["run"], color=color, linewidth=0.6, alpha=0.7)
            if r.get("eval_curve"):
                loss_ax.plot(r["eval_curve_iters"], r["eval_curve"], label=f"{r['run']} (eval)", color=color,
                             marker="o", linestyle="none")
                if base is not None and r is not base:
                    dev = deviation(r["eval_curve"], base["eval_curve"])
                    dev_ax.plot(r["eval_curve_iters"][:len(dev)], [100 * d for d in dev], label=r["run"],
                                color=color, marker="o")
        dev_ax.axhspan(-100 * TARGET, 100 * TARGET, color="0.85", label="target")
        loss_ax.set(title=f"lm loss: training, evaluation (seed {seed})", xlabel="iteration", yscale="log")
        dev_ax.set(title=f"evaluation loss vs {BASELINE} (%, seed {seed})", xlabel="iteration")
        for ax in (loss_ax, dev_ax):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
