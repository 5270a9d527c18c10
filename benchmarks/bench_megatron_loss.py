"""Loss study through Megatron's own ``pretrain`` (megatron-core 0.19.x): does FP8-Flow train like BF16?

Four runs of ``python -m examples.pretrain_gpt`` (``RUNS``), the same small MoE model (``MODEL``: 4 layers,
hidden 1024, 8 experts of ffn 1024, top-2, sequence 1024, 8 sequences per iteration) on the default data
(the Python standard library's bytes), one GPU each:
- ``bf16``: Megatron's BF16 experts, seed ``--seed`` (default 1234; the baseline);
- ``fp8_flow_e4m3_moe_expert`` / ``fp8_flow_hybrid_moe_expert``: FP8-Flow with ``moe_expert`` recompute,
  E4M3 everywhere / E5M2 gradients, the same seed: the same initial model and data order as ``bf16`` (the
  block draws its experts as Megatron does), so what differs is the expert arithmetic;
- ``bf16_seed_control``: BF16 with the next seed: how far two runs land apart from initialisation alone.

The runs are independent and host-bound at this size, so they run at the same time, round-robin over the
visible GPUs (all four on one GPU on a one-GPU machine): their iteration times are then shared-GPU times,
comparable with each other only. Final loss: the mean of the last quarter of Megatron's logged losses
(every ``LOG_INTERVAL`` iterations); deviation: relative to ``bf16``. Issue 16's criterion: within 0.25%.
Each run is bounded by ``--run-timeout`` (killed with its workers past it).
Writes ``benchmarks/results/bench_megatron_loss.json`` / ``.md`` / ``.png`` (loss curves and each run's
deviation from ``bf16`` per logged iteration, per seed); rows of other seeds already there are kept, so
repeats with other seeds build one table.

    python benchmarks/bench_megatron_loss.py [--train-iters 1000] [--seed 1234]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

import torch

import bench_megatron_pretrain as pretrain
import utils

LOG_INTERVAL = 10
MODEL = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
         "--micro-batch-size 8 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine "
         "--lr-warmup-iters 20 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 1024 --moe-grouped-gemm "
         f"--bf16 --moe-token-dispatcher-type alltoall --swiglu --disable-bias-linear --log-interval {LOG_INTERVAL} "
         "--eval-iters 0 --eval-interval 100000 --transformer-impl local --no-persist-layer-norm "
         "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
         "--no-bias-swiglu-fusion")
FP8_FLOW = f"--fp8-recipe blockwise --moe-fp8-flow {pretrain.MOE_EXPERT}"
RUNS = {  # name -> (seed offset, flags)
    "bf16": (0, ""),
    "fp8_flow_e4m3_moe_expert": (0, f"{FP8_FLOW} --fp8-format e4m3"),
    "fp8_flow_hybrid_moe_expert": (0, f"{FP8_FLOW} --fp8-format hybrid"),
    "bf16_seed_control": (1, ""),
}
TOKENS_PER_ITER = 8 * 1024


def command(run: str, iters: int, port: int, seed: int = 1234) -> list[str]:
    """The one-GPU ``torchrun`` command of ``run`` (a key of ``RUNS``) in the study of base ``seed``,
    rendezvous on ``port``."""
    if run not in RUNS:
        raise ValueError(f"run must be one of {list(RUNS)}, got {run!r}")
    offset, flags = RUNS[run]
    return ["torchrun", "--nproc_per_node", "1", "--master_port", str(port), "-m", "examples.pretrain_gpt",
            *MODEL.split(), *flags.split(), "--train-iters", str(iters), "--seed", str(seed + offset)]


def deviation(curve: list[float], base: list[float]) -> list[float]:
    """Per logged iteration, ``curve``'s relative difference from ``base`` (as long as the shorter)."""
    return [(c - b) / b for c, b in zip(curve, base)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1234, help="the baseline's seed; the control takes the next")
    parser.add_argument("--run-timeout", type=float, default=540, help="seconds per run, torchrun included")
    args = parser.parse_args()
    gpus = max(1, torch.cuda.device_count())
    ports = set()
    while len(ports) < len(RUNS):
        ports.add(utils.free_port())
    cmds = {run: command(run, args.train_iters, port, args.seed) for run, port in zip(RUNS, sorted(ports))}

    def launch(i: int, run: str):
        began = time.perf_counter()
        status, out = pretrain.run(cmds[run], args.run_timeout,
                                   {"CUDA_VISIBLE_DEVICES": str(i % gpus)} if gpus > 1 else None)
        return status, out, time.perf_counter() - began

    env = dict(utils.environment(), gpus=gpus, concurrent_runs=len(RUNS))
    stored = utils.RESULTS_DIR / "bench_megatron_loss.json"
    kept = [r for r in json.loads(stored.read_text())["results"] if r["base_seed"] != args.seed] if stored.exists() else []
    rows = {}
    with concurrent.futures.ThreadPoolExecutor(len(RUNS)) as pool:
        futures = {run: pool.submit(launch, i, run) for i, run in enumerate(RUNS)}
        for run, future in futures.items():
            status, out, wall = future.result()
            row = dict(run=run, base_seed=args.seed, seed=args.seed + RUNS[run][0], status=status,
                       iters=args.train_iters, wall_s=wall, command=" ".join(cmds[run]))
            row.update(pretrain.outcome(status, out, TOKENS_PER_ITER, 1))
            rows[run] = row
            print(run, status, row.get("final_loss"), flush=True)
    base = rows["bf16"].get("final_loss")
    for row in rows.values():
        if base and "final_loss" in row:
            row["vs_bf16"] = (row["final_loss"] - base) / base
    print(write(kept + list(rows.values()), env).read_text())


def write(rows: list[dict], env: dict):
    """``rows`` -> ``bench_megatron_loss`` .json / .md / .png under benchmarks/results; the .md path."""
    iters = sorted({r["iters"] for r in rows})
    notes = (f"{'/'.join(map(str, iters))} iterations; model: `{MODEL}`. The runs of one base seed ran at the same "
             "time on the machine's GPUs (`gpus`): iteration times are shared-GPU times. Final loss: mean of the last "
             f"quarter of the logged losses (every {LOG_INTERVAL} iterations); vs_bf16: relative to the `bf16` run of "
             "the same base seed. Commands: the `command` field of each row in the JSON; docs/megatron.md.")
    path = utils.write_results("bench_megatron_loss", "Megatron pretrain loss: BF16 experts vs FP8-Flow", env, {}, rows,
                               ["base_seed", "run", "seed", "status", "final_loss", "vs_bf16", "iter_ms",
                                "max_allocated_mib", "wall_s", "experts"], notes=notes,
                               formats={"final_loss": ".4f", "vs_bf16": "+.2%"})
    plot(rows, path.with_suffix(".png"))
    return path


def plot(rows: list[dict], path) -> None:
    """Per base seed, two panels: every run's loss curve, and each run's relative deviation from that seed's
    ``bf16`` per logged iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = list(dict.fromkeys(r["base_seed"] for r in rows))
    fig, axes = plt.subplots(len(seeds), 2, figsize=(12, 4 * len(seeds)), squeeze=False)
    for (loss_ax, dev_ax), seed in zip(axes, seeds):
        runs = [r for r in rows if r["base_seed"] == seed and r.get("curve")]
        base = next((r for r in runs if r["run"] == "bf16"), None)
        for r in runs:  # one colour per run in both panels
            color = f"C{list(RUNS).index(r['run'])}"
            loss_ax.plot(r["curve_iters"], r["curve"], label=r["run"], color=color)
            if base is not None and r is not base:
                dev = deviation(r["curve"], base["curve"])
                dev_ax.plot(r["curve_iters"][:len(dev)], [100 * d for d in dev], label=r["run"], color=color)
        loss_ax.set(title=f"lm loss (seed {seed})", xlabel="iteration", yscale="log")
        dev_ax.set(title=f"loss vs bf16 (%, seed {seed})", xlabel="iteration", ylim=(-3, 3))
        for ax in (loss_ax, dev_ax):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
