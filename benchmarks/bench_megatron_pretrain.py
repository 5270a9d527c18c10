"""Megatron's own ``pretrain`` (megatron-core 0.19.x, ``megatron.training``) on all GPUs of the machine,
expert parallelism = GPU count: BF16 experts against FP8-Flow, on DeepSeek-shaped MoE models.

Configurations (``CONFIGS``; mock data, ``--moe-grouped-gemm``, top-8, every layer MoE, sequence 4096):
- ``deepseek_small``: 4 layers, hidden 2048, 64 experts of ffn 1024 (the issue-16 model);
- ``deepseek_v3_slice``: DeepSeek-V3's MoE shapes, hidden 7168, 256 experts of ffn 2048, as many layers as
  fit (1 up to 4 GPUs, 2 on 8: each rank keeps its experts' Adam state, 18 bytes per parameter); on one GPU
  64 experts, what one rank holds at EP=4 (256 do not fit one GPU), with the same 512 rows per expert.
Runs (``VARIANTS``):
- ``megatron_bf16``: Megatron's BF16 experts; without TransformerEngine these are ``SequentialMLP`` (a
  per-expert loop), with Megatron's all-to-all dispatcher;
- ``bf16_grouped_mm``: the BF16 grouped-GEMM stand-in for TE's ``TEGroupedMLP`` (``megatron_grouped_mm.py``:
  Megatron's MoELayer and dispatcher, experts as two ``torch._grouped_mm`` on stacked weights);
- ``fp8_flow_alltoall`` / ``fp8_flow_deepep``: FP8-Flow with ``--moe-token-dispatcher-type alltoall`` /
  ``flex`` (DeepEP when ``deep_ep`` imports, else all-to-all with a warning: the environment says which);
- ``fp8_flow_alltoall_moe_expert`` / ``fp8_flow_deepep_moe_expert``: the same with ``moe_expert`` recompute;
- ``fp8_flow_alltoall_single_weight`` / ``fp8_flow_deepep_single_weight`` (and ``..._moe_expert``): one weight
  parameter per expert GEMM (``--moe-fp8-flow-single-grouped-weight``) instead of one per expert;
- ``megatron_bf16_seed_control``: ``megatron_bf16`` with the next seed (how far runs land from initialisation).
All runs with one seed start from the same experts (FP8-Flow and the stand-in draw them as Megatron does).

Each iteration is ``MICRO_BATCHES`` micro-batches of one sequence per GPU (gradient accumulation, as a
pretraining step is): with one micro-batch the Adam step over every expert parameter would dominate (39 of
112 ms per iteration of the BF16 grouped run of ``deepseek_small`` on one H200), and the FP8 weights, quantized
on a step's first micro-batch, would never be reused.

Per run: tokens/s per GPU (global batch x sequence / mean iteration time after the warm-up / GPUs), max
allocated memory (Megatron's memory report, MiB), final loss (mean of the last quarter of logged losses),
the log's ``experts:`` line (which GEMM backends ran). ``--repeats R`` runs the variants R times, interleaved
(v1, v2, ..., v1, v2, ...), and each row gives the median tokens/s and iteration time of its runs with their
spread: on one machine the same run varied by +-7% between calls (docs/megatron.md), more than the expert
kernels move these iterations. Each run is one ``torchrun`` bounded by
``--run-timeout`` (killed with its workers, reported as timed out); results accumulate in
``benchmarks/results/bench_megatron_pretrain_ep{N}.json`` / ``.md`` across invocations, written after every
run, so the runs can be spread over several calls:

    python benchmarks/bench_megatron_pretrain.py --config deepseek_small --variants megatron_bf16 fp8_flow_alltoall
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time
from typing import Optional

import torch

import utils

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMON = ("--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion "
          "--no-masked-softmax-fusion --no-bias-dropout-fusion --no-bias-swiglu-fusion --bf16 --swiglu "
          "--disable-bias-linear --moe-grouped-gemm --moe-router-topk 8 --moe-aux-loss-coeff 1e-3 "
          "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --lr 1e-4 --min-lr 1e-5 "
          "--lr-decay-style cosine --lr-warmup-iters 5 --mock-data "
          "--tokenizer-type NullTokenizer --vocab-size 32767 --log-interval 5 --eval-iters 0 "
          "--eval-interval 100000").split()  # NullTokenizer's EOD id is --vocab-size: 32768 embeddings hold it
CONFIGS = {
    "deepseek_small": "--num-layers 4 --hidden-size 2048 --num-attention-heads 16 --num-experts 64 "
                      "--moe-ffn-hidden-size 1024",
    "deepseek_v3_slice": "--hidden-size 7168 --num-attention-heads 56 --moe-ffn-hidden-size 2048",
}
FP8_FLOW = "--fp8-format e4m3 --fp8-recipe blockwise --moe-fp8-flow"
MOE_EXPERT = "--recompute-granularity selective --recompute-modules moe_expert"
SINGLE_WEIGHT = "--moe-fp8-flow-single-grouped-weight"
GROUPED_MM = str(ROOT / "benchmarks" / "megatron_grouped_mm.py")
VARIANTS = {  # name -> (entry: a module for -m or a script path, flags)
    "megatron_bf16": ("examples.pretrain_gpt", "--moe-token-dispatcher-type alltoall"),
    "bf16_grouped_mm": (GROUPED_MM, "--moe-token-dispatcher-type alltoall"),
    "fp8_flow_alltoall": ("examples.pretrain_gpt", f"{FP8_FLOW} --moe-token-dispatcher-type alltoall"),
    "fp8_flow_deepep": ("examples.pretrain_gpt", f"{FP8_FLOW} --moe-token-dispatcher-type flex"),
    "fp8_flow_alltoall_moe_expert": ("examples.pretrain_gpt",
                                     f"{FP8_FLOW} --moe-token-dispatcher-type alltoall {MOE_EXPERT}"),
    "fp8_flow_deepep_moe_expert": ("examples.pretrain_gpt", f"{FP8_FLOW} --moe-token-dispatcher-type flex {MOE_EXPERT}"),
    "fp8_flow_alltoall_single_weight": ("examples.pretrain_gpt",
                                        f"{FP8_FLOW} --moe-token-dispatcher-type alltoall {SINGLE_WEIGHT}"),
    "fp8_flow_deepep_single_weight": ("examples.pretrain_gpt",
                                      f"{FP8_FLOW} --moe-token-dispatcher-type flex {SINGLE_WEIGHT}"),
    "fp8_flow_deepep_single_weight_moe_expert": ("examples.pretrain_gpt", f"{FP8_FLOW} --moe-token-dispatcher-type "
                                                                          f"flex {SINGLE_WEIGHT} {MOE_EXPERT}"),
    "megatron_bf16_seed_control": ("examples.pretrain_gpt", "--moe-token-dispatcher-type alltoall"),
}
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # recorded in a row when set
WARMUP_ITERS = 10  # iterations left out of the timing
MICRO_BATCHES = 8  # per GPU per iteration
ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+) .*lm loss: ([\d.E+-]+)")
MEM = re.compile(r"max allocated: ([\d.]+)")
ALLOCATOR = re.compile(r"allocator \(rank \d+\): retries (\d+), reserved peak ([\d.]+) MiB")  # examples.pretrain_gpt
ERROR = re.compile(r"^\s*(?:\[rank\d+\]: )?[\w.]*(?:Error|Exception): .*$", re.M)  # an exception's message line


def v3_layers(gpus: int) -> int:
    """DeepSeek-V3-slice layers that fit an H200 per rank: 64 local experts of 44M parameters per layer at EP=4."""
    return 2 if gpus >= 8 else 1


def v3_experts(gpus: int) -> int:
    """DeepSeek-V3-slice experts: V3's 256, or on one GPU the 64 one rank holds at EP=4 (with top-8 and 4096
    tokens per rank, 512 rows per expert either way)."""
    return 256 if gpus >= 2 else 64


def command(config: str, variant: str, gpus: int, iters: int, seed: int = 1234) -> list[str]:
    """The ``torchrun`` command of one run on ``gpus`` GPUs (EP = ``gpus``)."""
    if config not in CONFIGS or variant not in VARIANTS:
        raise ValueError(f"config must be one of {list(CONFIGS)} and variant one of {list(VARIANTS)}, "
                         f"got {config!r}, {variant!r}")
    entry, flags = VARIANTS[variant]
    v3 = ["--num-layers", str(v3_layers(gpus)), "--num-experts", str(v3_experts(gpus))]
    model = CONFIGS[config].split() + (v3 if config == "deepseek_v3_slice" else [])
    launch = [entry] if entry.endswith(".py") else ["-m", entry]
    # each run's torchrun rendezvous on its own port: a run killed late cannot hold the next one's
    return ["torchrun", "--nproc_per_node", str(gpus), "--master_port", str(utils.free_port()), *launch, *COMMON,
            *model, *flags.split(), "--expert-model-parallel-size", str(gpus),
            "--global-batch-size", str(gpus * MICRO_BATCHES), "--train-iters", str(iters),
            "--seed", str(seed + 1 if variant == "megatron_bf16_seed_control" else seed)]


def parse_log(text: str, tokens_per_iter: int, gpus: int) -> dict:
    """Megatron's iteration and memory log lines -> the run's row (tokens/s per GPU, max allocated MiB,
    final loss, loss curve), its ``experts:`` line and, when the ranks reported them, the caching allocator's
    retries and reserved peak (the most of any rank; None without reports)."""
    logged = [(int(i), float(ms), float(loss)) for i, ms, loss in ITER.findall(text)]
    if not logged:
        raise ValueError("no 'iteration ... lm loss' lines in the log")
    steady = [ms for i, ms, _ in logged if i > WARMUP_ITERS] or [ms for _, ms, _ in logged]
    tail = logged[-max(1, len(logged) // 4):]
    iter_ms = sum(steady) / len(steady)
    experts = [line.strip() for line in text.splitlines() if line.strip().startswith("experts: ")]
    allocator = [(int(r), float(mib)) for r, mib in ALLOCATOR.findall(text)]
    return dict(alloc_retries=max(r for r, _ in allocator) if allocator else None,
                reserved_peak_mib=max(m for _, m in allocator) if allocator else None,
                tokens_per_s_per_gpu=tokens_per_iter / iter_ms * 1e3 / gpus, iter_ms=iter_ms,
                max_allocated_mib=max((float(m) for m in MEM.findall(text)), default=float("nan")),
                final_loss=sum(loss for *_, loss in tail) / len(tail), curve=[loss for *_, loss in logged],
                curve_iters=[i for i, *_ in logged],
                experts=experts[0] if experts else "")


def outcome(status: str, out: str, tokens_per_iter: int, gpus: int) -> dict:
    """What a run's row records of its ``out``put: ``parse_log``'s fields when it logged iterations, and, when
    the run failed or logged none, the log's tail and its first exception line (``error``: the root cause, where
    the tail is mostly torchrun's report of the workers it stopped). A failed run's loss curve and memory are
    kept; its tokens/s and iteration time are not (they would time the iterations before the failure)."""
    row = {} if status == "ok" else {"log_tail": out[-3000:]}
    try:
        row.update(parse_log(out, tokens_per_iter, gpus))
    except ValueError:
        row["log_tail"] = out[-3000:]
    if status != "ok":
        row.update(tokens_per_s_per_gpu=None, iter_ms=None)
    if "log_tail" in row:
        row["error"] = next((m.group(0) for m in ERROR.finditer(out) if "ChildFailedError" not in m.group(0)), "")
    return row


def combine(runs: list[dict]) -> dict:
    """One row from a variant's runs in this invocation: the last run that finished (else the last run), with
    ``tokens_per_s_per_gpu`` and ``iter_ms`` the medians over the runs that finished (None if none did),
    ``tokens_per_s_runs`` (None for a run that failed), ``repeats`` and ``tokens_per_s_spread`` ((max - min) /
    median over the finished runs)."""
    done = [r for r in runs if r.get("tokens_per_s_per_gpu") is not None]
    row = dict(done[-1] if done else runs[-1], repeats=len(runs),
               tokens_per_s_runs=[r.get("tokens_per_s_per_gpu") for r in runs])
    if done:
        speeds = [r["tokens_per_s_per_gpu"] for r in done]
        median = statistics.median(speeds)
        row.update(tokens_per_s_per_gpu=median, iter_ms=statistics.median(r["iter_ms"] for r in done),
                   tokens_per_s_spread=(max(speeds) - min(speeds)) / median)
    return row


def run(cmd: list[str], timeout: float, extra_env: Optional[dict] = None) -> tuple[str, str]:
    """``(status, output)`` of ``cmd`` from the repository root, ``extra_env`` added to its environment; past
    ``timeout`` seconds the whole process group (torchrun and its workers) is killed: status ``timed out``. The group is also killed when this
    process is interrupted or terminated (``main`` turns SIGTERM into SystemExit), so no worker outlives it."""
    env = dict(os.environ, **(extra_env or {}),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return ("ok" if proc.returncode == 0 else f"exit {proc.returncode}"), out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return "timed out", proc.communicate()[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(CONFIGS), default="deepseek_small")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--train-iters", type=int, default=40)
    parser.add_argument("--run-timeout", type=float, default=540, help="seconds per run, torchrun included")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per variant, interleaved across the variants; rows give the median tokens/s")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # runs run()'s cleanup
    gpus = torch.cuda.device_count()
    env = dict(utils.environment(), gpus=gpus, expert_model_parallel_size=gpus,
               deep_ep="importable" if _importable("deep_ep") else "absent: flex runs all-to-all",
               deep_gemm="importable" if _importable("deep_gemm") else "absent")
    name = f"bench_megatron_pretrain_ep{gpus}"
    stored = utils.RESULTS_DIR / f"{name}.json"
    rows = {(r["config"], r["variant"]): r for r in json.loads(stored.read_text())["results"]} if stored.exists() else {}
    seq = int(COMMON[COMMON.index("--seq-length") + 1])
    runs = {variant: [] for variant in args.variants}
    for variant in [v for _ in range(args.repeats) for v in args.variants]:
        cmd = command(args.config, variant, gpus, args.train_iters)
        began = time.perf_counter()
        status, out = run(cmd, args.run_timeout)
        row = dict(config=args.config, variant=variant, status=status, device=env["device"],
                   wall_s=time.perf_counter() - began,
                   iters=args.train_iters, micro_batches=MICRO_BATCHES,
                   allocator=" ".join(f"{k}={os.environ[k]}" for k in ALLOCATOR_ENV if k in os.environ),
                   command=" ".join(cmd))
        row.update(outcome(status, out, gpus * MICRO_BATCHES * seq, gpus))
        print(variant, status, {k: row.get(k) for k in ("tokens_per_s_per_gpu", "max_allocated_mib", "final_loss")},
              flush=True)
        runs[variant].append(row)
        rows[args.config, variant] = combine(runs[variant])
        path = write(list(rows.values()), env, gpus, seq)  # after every run: a call cut short keeps the runs done
    print(path.read_text())


def write(rows: list[dict], env: dict, gpus: int, seq: int):
    """``rows`` -> ``bench_megatron_pretrain_ep{gpus}`` .json / .md / .png under benchmarks/results; the .md path."""
    columns = ["config", "variant", "device", "status", "micro_batches", "tokens_per_s_per_gpu", "repeats",
               "tokens_per_s_spread", "iter_ms", "max_allocated_mib", "reserved_peak_mib", "alloc_retries",
               "final_loss", "wall_s", "allocator", "experts", "error"]
    notes = (f"EP = {gpus} GPUs, TransformerEngine absent (--transformer-impl local: attention and dense layers BF16), "
             f"mock data, sequence {seq}, `micro_batches` micro-batches of one sequence per GPU per iteration; "
             f"timing excludes the first {WARMUP_ITERS} iterations. `allocator`: the CUDA caching allocator's "
             "settings of the run, when any were set; `alloc_retries` / `reserved_peak_mib`: its retries (each "
             "frees every cached block and synchronizes) and reserved peak at the end, the most of any rank "
             "(empty in rows from before they were recorded). `tokens_per_s_per_gpu`, `iter_ms`: medians over the "
             "row's `repeats` runs (interleaved with the other variants' in one call; empty: one run, before "
             "repeats were recorded), `tokens_per_s_spread`: (max - min) / median. "
             "Rows are kept across runs (one config per run): compare rows of one device and one micro_batches only. "
             "Commands: the `command` field of each row in the JSON; docs/megatron.md.")
    path = utils.write_results(f"bench_megatron_pretrain_ep{gpus}",
                               f"Megatron pretrain at EP={gpus}: BF16 experts vs FP8-Flow", env, {},
                               rows, columns, notes=notes)
    plot(rows, path.with_suffix(".png"), gpus)
    return path


def plot(rows: list[dict], path, gpus: int) -> None:
    """One line of panels per config: the loss curves of its runs, and the tokens/s per GPU of those that did not
    fail (label: variant, device, micro-batches per iteration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(len(configs), 2, figsize=(12, 3.6 * len(configs)), squeeze=False)
    for (loss_ax, speed_ax), config in zip(axes, configs):
        runs = [r for r in rows if r["config"] == config and r.get("curve")]
        for r in runs:  # rows from before curve_iters was recorded: their log lines in order
            loss_ax.plot(r.get("curve_iters") or range(1, len(r["curve"]) + 1), r["curve"], marker=".",
                         label=r["variant"])
        timed = [r for r in runs if r.get("tokens_per_s_per_gpu") is not None]  # not a run that failed
        labels = [f"{r['variant']}\n{r.get('device', '?')}, {r.get('micro_batches', '?')} mb" for r in timed]
        speed_ax.barh(labels, [r["tokens_per_s_per_gpu"] for r in timed])
        loss_ax.set(title=f"{config}: lm loss",
                    xlabel="iteration" if all(r.get("curve_iters") for r in runs) else "log line")
        speed_ax.set(title=f"{config}: tokens/s per GPU (EP={gpus})")
        speed_ax.tick_params(axis="y", labelsize=7)
        loss_ax.legend(fontsize=7)
        for ax in (loss_ax, speed_ax):
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
