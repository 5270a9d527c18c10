"""Megatron's own ``pretrain`` (megatron-core 0.19.x) at production proportions: the BF16 grouped-GEMM stand-in
against FP8-Flow, tokens/s and memory, on every GPU of the machine (expert parallelism = GPU count).

Configurations (``megatron_configs.CONFIGS``; mock data, sequence 4096, every layer MoE, top-8, RMSNorm, RoPE,
QK layernorm, no dropout, tied embeddings of a 32768 vocabulary, router in FP32):
- ``qwen3_moe_like``: Qwen3-30B-A3B's layer: hidden 2048, 32 query heads in 4 KV groups of 128 channels,
  128 experts of ffn 768; micro-batch 4 sequences (16384 tokens: 1024 rows per expert at EP=1, the block
  benchmark's shape);
- ``dsv3_ep8_rank``: what one rank of DeepSeek-V3 at EP=8 holds: hidden 7168, multi-latent attention with V3's
  ranks (q_lora 1536, kv_lora 512, 128 heads, qk 128 + rope 64, v 128), one shared expert of ffn 2048 and 32
  routed experts of ffn 2048 per GPU (256 at EP=8); micro-batch 1 sequence (4096 tokens: 1024 rows per expert,
  what an EP=8 rank of the 256-expert model receives).
Layers: as many as fit the GPU (``megatron_configs.layers_that_fit``, at least the config's minimum;
``--num-layers`` overrides).

Runs (``VARIANTS``; ``MAIN_VARIANTS`` by default):
- ``bf16_grouped_mm``: the stand-in for TE's ``TEGroupedMLP``: Megatron's MoELayer, router and all-to-all
  dispatcher with experts as two ``torch._grouped_mm`` (``megatron_grouped_mm.py``);
- ``fp8_flow`` (per-expert weights), ``fp8_flow_single_weight`` (one ``[E, N, K]`` weight per GEMM), each also
  with ``moe_expert`` recompute (``..._moe_expert``): FP8-Flow experts, the rest of the model BF16, the experts'
  wgrads added into ``main_grad`` by their own GEMMs (``--moe-fp8-flow-gradient-accumulation-fusion``: without
  Apex Megatron's own linears cannot fuse, and the stand-in's ``torch._grouped_mm`` cannot either);
  ``fp8_flow_graph_single_weight``: ``fp8_flow_single_weight`` with the expert path in CUDA graphs (EP=1);
  ``fp8_flow_single_weight_moe_expert_no_cache``: without the FP8 weight cache (``disable_parameter_transpose_cache``,
  set by ``megatron_bench_entry.py --bench-no-fp8-weight-cache``): weights quantized on every micro-batch;
- with TransformerEngine installed: ``te_bf16`` (Megatron's ``TEGroupedMLP``), ``te_blockwise`` (TE's blockwise
  FP8 everywhere, ``--fp8-format e4m3 --fp8-recipe blockwise``) and ``fp8_flow_single_weight_te_blockwise``
  (FP8-Flow experts, TE's blockwise FP8 for the dense layers).
Attention: with TransformerEngine every run is ``--transformer-impl transformer_engine`` (TE's attention, norms
and linears); without it every run is ``--transformer-impl local`` with the torch SDPA core
(``sdpa_attention.py``) in place of Megatron's unfused one. At EP=1 ``--moe-token-dispatcher-type alltoall``
is Megatron's dispatcher permuting locally for the stand-in, and FP8-Flow runs its local dispatcher (no
collectives); the flag is FP8-Flow's required one.

Each iteration accumulates ``--micro-batches`` (32) micro-batches per GPU before one optimizer step, as
pretraining does; ``--train-iters`` (4) iterations, the first ``--warmup-iters`` (2) untimed (``WARMUP_ITERS``),
every iteration logged. Per run, from
Megatron's log and the ``bench:`` lines of ``megatron_bench_entry.py``: tokens/s per GPU, max allocated memory,
which optimizer, gradient-accumulation path and attention ran, TransformerEngine's version. The first run of
each variant also probes memory (``megatron_memory_probes``: ``activation_mib_per_moe_layer``,
``step_activation_peak_mib``) and, for the variants marked ``search``, ``max_micro_batch`` after its timed
iterations; the other repeats run without probes. ``--repeats`` (3) runs the variants interleaved; each row
gives the median tokens/s with its spread. Each run is one ``torchrun`` bounded by ``--run-timeout``;
``--time-budget`` stops starting runs when the next might not finish in it. Results go to
``benchmarks/results/bench_megatron_pretrain_{config}_ep{GPUs}.json`` / ``.md`` / ``.png`` after every run
(``..._te`` where TransformerEngine ran the model's path: a table of its own). A table holds one device and one
layer count: a call on another GPU (or with other ``--num-layers``) than its stored rows' stops before any run
unless ``--results-tag TAG`` gives it a table of its own (``..._ep{GPUs}[_te]_{TAG}``).

``--profile``: after the timed repeats, one more run per variant (no probes) with its last iteration under
torch.profiler (``megatron_bench_entry.py --bench-profile-iteration``: every micro-batch's forward and backward
and the optimizer step, rank 0's kernels): where the iteration's GPU time goes, per variant, by group of
kernels (``kernel_profile.GROUPS``: attention core, dense GEMMs, expert GEMMs, FP8-Flow's own non-GEMM kernels,
other elementwise / norm / index kernels, gradient accumulation, optimizer, communication), by category
(``kernel_profile.site_category``) and its largest kernels, each against the stand-in's
(``kernel_profile.iteration_rows``), to ``..._ep{GPUs}[_te]_profile.json`` / ``.md`` (the variants this call
profiled; ``--run-timeout`` bounds these runs too):

    python benchmarks/bench_megatron_pretrain.py --config qwen3_moe_like --repeats 3 --time-budget 530
    python benchmarks/bench_megatron_pretrain.py --config dsv3_ep8_rank --variants bf16_grouped_mm \
        fp8_flow_single_weight --repeats 1 --profile
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

import kernel_profile
import utils
from megatron_configs import CONFIGS, SEQ, layers_that_fit

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples/ runs from the checkout (not installed)
from examples import megatron_log  # noqa: E402  (Megatron's log lines, parsed)

ENTRY = str(ROOT / "benchmarks" / "megatron_bench_entry.py")
COMMON = ("--bf16 --swiglu --disable-bias-linear --moe-grouped-gemm --moe-router-topk 8 --moe-aux-loss-coeff 1e-3 "
          "--moe-router-dtype fp32 "
          "--moe-token-dispatcher-type alltoall --normalization RMSNorm --position-embedding-type rope "
          f"--qk-layernorm --attention-dropout 0 --hidden-dropout 0 --seq-length {SEQ} --max-position-embeddings "
          f"{SEQ} --eval-iters 0 --eval-interval 100000 --no-bias-dropout-fusion --no-bias-swiglu-fusion")
# (the two fusions off: torch.compile'd by Megatron, not TransformerEngine's; with no bias and no dropout they
# fuse little, and their compilation would add to every run's start)
MOCK_DATA = "--mock-data --tokenizer-type NullTokenizer --vocab-size 32767"  # EOD id 32767: 32768 embeddings
SCHEDULE = "--lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 1"
LOCAL = ("--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion "
         "--no-masked-softmax-fusion --no-rope-fusion")  # what Megatron needs without TE or Apex
TE = "--transformer-impl transformer_engine"
# experts FP8, the rest BF16; the experts add their wgrads into main_grad themselves (no Apex here for Megatron's)
FP8_FLOW = ("--moe-fp8-flow --moe-fp8-flow-format e4m3 --fp8-recipe blockwise "
            "--moe-fp8-flow-gradient-accumulation-fusion")
MOE_EXPERT = "--recompute-granularity selective --recompute-modules moe_expert"
SINGLE_WEIGHT = "--moe-fp8-flow-single-grouped-weight"


@dataclasses.dataclass(frozen=True)
class Variant:
    """A run's Megatron ``flags``; ``grouped_mm``: the stand-in's experts; ``search``: its probe run also
    searches the largest micro-batch; ``te``: needs TransformerEngine."""

    flags: str
    grouped_mm: bool = False
    search: bool = False
    te: bool = False


VARIANTS = {
    "bf16_grouped_mm": Variant("", grouped_mm=True, search=True),
    "fp8_flow": Variant(FP8_FLOW),
    "fp8_flow_single_weight": Variant(f"{FP8_FLOW} {SINGLE_WEIGHT}", search=True),
    "fp8_flow_single_weight_moe_expert": Variant(f"{FP8_FLOW} {SINGLE_WEIGHT} {MOE_EXPERT}", search=True),
    # no FP8 weight cache: weights quantized on every micro-batch (and again by moe_expert's recompute)
    "fp8_flow_single_weight_moe_expert_no_cache": Variant(
        f"{FP8_FLOW} {SINGLE_WEIGHT} {MOE_EXPERT} --bench-no-fp8-weight-cache", search=True),
    "fp8_flow_moe_expert": Variant(f"{FP8_FLOW} {MOE_EXPERT}", search=True),
    # the expert path captured in CUDA graphs (EP=1 only); graphs hold one token count: no micro-batch search
    "fp8_flow_graph_single_weight": Variant(f"{FP8_FLOW} {SINGLE_WEIGHT} --moe-fp8-flow-cuda-graph"),
    "te_bf16": Variant("", search=True, te=True),
    "te_blockwise": Variant("--fp8-format e4m3 --fp8-recipe blockwise", search=True, te=True),
    "fp8_flow_single_weight_te_blockwise": Variant(f"{FP8_FLOW} {SINGLE_WEIGHT} --fp8-format e4m3", search=True,
                                                   te=True),
}
MAIN_VARIANTS = ["bf16_grouped_mm", "fp8_flow", "fp8_flow_single_weight", "fp8_flow_single_weight_moe_expert"]


def apex_wgrad_fusion() -> bool:
    """Whether Apex's ``fused_weight_gradient_mlp_cuda`` imports: Megatron's own output layer needs it for
    ``--gradient-accumulation-fusion`` (TransformerEngine fuses its own linears only)."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def command(config: str, variant: str, gpus: int, iters: int, layers: int, micro_batch_size: int,
            micro_batches: int = 32, seed: int = 1234, probe: bool = False, te: bool = False,
            data: str = MOCK_DATA, schedule: str = SCHEDULE, log_interval: int = 1, search_cap: int = 64,
            profile_out: Optional[str] = None) -> list[str]:
    """The ``torchrun`` command of one run on ``gpus`` GPUs (EP = ``gpus``) through ``megatron_bench_entry.py``:
    ``te`` runs TransformerEngine's path, else the local one with the SDPA core; ``probe`` adds the memory
    probes (and, for a ``search`` variant, the micro-batch search up to ``search_cap``); ``profile_out``: the
    last iteration profiled, its kernels written there."""
    if config not in CONFIGS or variant not in VARIANTS:
        raise ValueError(f"config must be one of {list(CONFIGS)} and variant one of {list(VARIANTS)}, "
                         f"got {config!r}, {variant!r}")
    spec = VARIANTS[variant]
    if spec.te and not te:
        raise ValueError(f"variant {variant!r} runs TransformerEngine's path (te=True); TE is not installed")
    bench = (["--bench-grouped-mm"] if spec.grouped_mm else []) + ([] if te else ["--bench-sdpa-attention"])
    if probe:
        bench += ["--bench-probe-memory"] + (["--bench-max-micro-batch-cap", str(search_cap)] if spec.search else [])
    if profile_out:
        bench += ["--bench-profile-iteration", str(iters), "--bench-profile-out", profile_out]
    path = (TE + ("" if apex_wgrad_fusion() else " --no-gradient-accumulation-fusion")) if te else LOCAL
    return ["torchrun", "--nproc_per_node", str(gpus), "--master_port", str(utils.free_port()), ENTRY, *bench,
            *COMMON.split(), *path.split(), *data.split(), *schedule.split(), *CONFIGS[config].flags(gpus),
            *spec.flags.split(), "--num-layers", str(layers), "--micro-batch-size", str(micro_batch_size),
            "--global-batch-size", str(gpus * micro_batch_size * micro_batches), "--train-iters", str(iters),
            "--log-interval", str(log_interval), "--expert-model-parallel-size", str(gpus), "--seed", str(seed)]


# Iterations left out of the timing by default: the first fills the JIT caches (Triton's kernels, DeepGEMM's one
# layout per GEMM shape: kernels/grouped_gemm_deepgemm.MIN_ROWS), the second what the first left (a wgrad backend
# first met, e.g. DeepGEMM's k-grouped kernel on a rank whose rows fall below cuBLAS's threshold).
WARMUP_ITERS = 2
ERROR = re.compile(r"^\s*(?:\[rank\d+\]: )?[\w.]*(?:Error|Exception): .*$", re.M)  # an exception's message line
RERUN = re.compile(r"Unexpected result .*$", re.M)  # megatron.core.rerun_state_machine's
PROBE_FIELDS = ("activation_mib_per_moe_layer", "activation_mib_moe_layers", "step_activation_peak_mib",
                "probed_micro_batch", "activation_probe_note", "max_micro_batch", "max_micro_batch_capped",
                "max_micro_batch_tries", "max_micro_batch_note", "activation_probe_error", "max_micro_batch_error",
                "graph_pool_allocated_mib", "graph_pool_reserved_mib", "graph_pool_mib_per_moe_layer",
                "graph_pool_error", "peak_before_probe_mib", "peak_before_optimizer_mib", "peak_after_optimizer_mib",
                "peaks_step", "step_peaks_error")


def bench_lines(text: str) -> dict:
    """The ``bench: {json}`` lines of ``megatron_bench_entry.py``, merged (a line that is not JSON is skipped)."""
    facts = {}
    for line in text.splitlines():
        if line.strip().startswith("bench: "):
            try:
                facts.update(json.loads(line.strip()[len("bench: "):]))
            except json.JSONDecodeError:
                continue
    return facts


def parse_log(text: str, tokens_per_iter: int, gpus: int, warmup: int = WARMUP_ITERS) -> dict:
    """Megatron's iteration and memory log lines -> the run's row (tokens/s per GPU over the iterations after
    the first ``warmup``, ``iter_ms_each``: every logged iteration's, max allocated MiB, final loss, loss
    curve), its ``experts:`` line, the caching allocator's retries and reserved peak (the most of any rank; None
    without reports) and the entry's ``bench:`` facts and probe values."""
    logged = [(it.iteration, it.ms, it.loss) for it in megatron_log.iterations(text)]
    if not logged:
        raise ValueError("no 'iteration ... lm loss' lines in the log")
    steady = [ms for i, ms, _ in logged if i > warmup] or [ms for _, ms, _ in logged]
    tail = logged[-max(1, len(logged) // 4):]
    iter_ms = sum(steady) / len(steady)
    allocator = megatron_log.allocator_reports(text)
    facts = bench_lines(text)
    # the activation probe resets the peak counter: the peak it kept counts too
    reports = (megatron_log.max_allocated_mib(text), facts.get("peak_before_probe_mib"))
    max_allocated = max((r for r in reports if r is not None), default=None)
    return dict(alloc_retries=max(r.retries for r in allocator) if allocator else None,
                reserved_peak_mib=max(r.reserved_peak_mib for r in allocator) if allocator else None,
                tokens_per_s_per_gpu=tokens_per_iter / iter_ms * 1e3 / gpus, iter_ms=iter_ms,
                iter_ms_each=[ms for _, ms, _ in logged],
                timed_iters=len(steady),
                max_allocated_mib=float("nan") if max_allocated is None else max_allocated,
                final_loss=sum(loss for *_, loss in tail) / len(tail), curve=[loss for *_, loss in logged],
                curve_iters=[i for i, *_ in logged],
                experts=megatron_log.experts_line(text) or "", **facts)


def outcome(status: str, out: str, tokens_per_iter: int, gpus: int, warmup: int = WARMUP_ITERS) -> dict:
    """What a run's row records of its ``out``put: ``parse_log``'s fields when it logged iterations, and, when
    the run failed or logged none, the log's tail and its first exception line (``error``: the root cause, where
    the tail is mostly torchrun's report of the workers it stopped). A failed run's loss curve and memory are
    kept; its tokens/s and iteration time are not (they would time the iterations before the failure)."""
    row = {} if status == "ok" else {"log_tail": out[-3000:]}
    try:
        row.update(parse_log(out, tokens_per_iter, gpus, warmup))
    except ValueError:
        row["log_tail"] = out[-3000:]
    if status != "ok":
        row.update(tokens_per_s_per_gpu=None, iter_ms=None)
    if "log_tail" in row:
        row["error"] = root_cause(out)
    return row


def root_cause(out: str) -> str:
    """Megatron's rerun state machine's report of an unexpected result (a NaN in the loss or the gradients: it
    then stops the run, with a TypeError when it asks for a checkpoint without --save), else the first exception
    line of a run's ``out``put that is not torchrun's report of the workers it stopped."""
    unexpected = RERUN.search(out)
    if unexpected:
        return unexpected.group(0).strip()
    return next((m.group(0) for m in ERROR.finditer(out) if "ChildFailedError" not in m.group(0)), "")


def combine(runs: list[dict]) -> dict:
    """One row from a variant's runs in this invocation: the last run that finished (else the last run), with
    ``tokens_per_s_per_gpu`` and ``iter_ms`` the medians over the runs that finished (None if none did),
    ``tokens_per_s_runs`` (None for a run that failed), ``repeats``, ``tokens_per_s_spread`` ((max - min) /
    median over the finished runs) and the probe fields of the run that probed."""
    done = [r for r in runs if r.get("tokens_per_s_per_gpu") is not None]
    row = dict(done[-1] if done else runs[-1], repeats=len(runs),
               tokens_per_s_runs=[r.get("tokens_per_s_per_gpu") for r in runs])
    probed = next((r for r in runs if any(field in r for field in PROBE_FIELDS)), {})
    for field in PROBE_FIELDS:
        row.pop(field, None)
        if field in probed:
            row[field] = probed[field]
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


def gpu_facts() -> dict:
    """GPU 0's name and memory from ``nvidia-smi``: this process launches the runs and should hold no CUDA context
    (hundreds of MiB) on their GPU, which torch's device queries create. Without ``nvidia-smi``, torch's (the
    context then stays; ``gpu_facts`` says so)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits", "-i",
                              "0"], capture_output=True, text=True, check=True).stdout
        name, mib = out.strip().splitlines()[0].rsplit(",", 1)
        return {"device": name.strip(), "gpu_memory_mib": int(mib)}
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        props = torch.cuda.get_device_properties(0)
        return {"device": props.name, "gpu_memory_mib": props.total_memory // 2**20,
                "gpu_facts": "from torch: nvidia-smi failed; this process holds a CUDA context beside the runs"}


def transformer_engine_version() -> Optional[str]:
    """TransformerEngine's installed version (None when it is not importable)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed (version unknown)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(CONFIGS), default="qwen3_moe_like")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=MAIN_VARIANTS)
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved; rows give the median")
    parser.add_argument("--train-iters", type=int, default=4, help="iterations per run")
    parser.add_argument("--warmup-iters", type=int, default=WARMUP_ITERS, help="the first iterations, untimed")
    parser.add_argument("--micro-batches", type=int, default=32, help="micro-batches per GPU per iteration")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences per micro-batch (config's)")
    parser.add_argument("--num-layers", type=int, default=None, help="default: as many as fit (layers_that_fit)")
    parser.add_argument("--max-micro-batch-cap", type=int, default=64, help="the micro-batch search's largest size")
    parser.add_argument("--run-timeout", type=float, default=180, help="seconds per run, torchrun included")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole call: no run starts that might end past it")
    parser.add_argument("--profile", action="store_true",
                        help="after the repeats, one run per variant with its last iteration profiled")
    parser.add_argument("--results-tag", default=None,
                        help="a table of its own: ..._ep{GPUs}[_te]_{TAG} (another device or layer count)")
    args = parser.parse_args(argv)
    if args.results_tag is not None and not re.fullmatch(r"[A-Za-z0-9]+", args.results_tag):
        parser.error(f"--results-tag must be letters and digits (a file name part), got {args.results_tag!r}")
    for name in ("repeats", "micro_batches", "max_micro_batch_cap"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_iters < 0 or args.train_iters <= args.warmup_iters:
        parser.error(f"--train-iters must be > --warmup-iters >= 0 (the untimed first), got {args.train_iters} and "
                     f"{args.warmup_iters}")
    return args


def main(argv=None):
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # runs run()'s cleanup
    gpus, gpu, te = torch.cuda.device_count(), gpu_facts(), transformer_engine_version()
    needs_te = [v for v in args.variants if VARIANTS[v].te]
    if needs_te and te is None:
        raise SystemExit(f"variants {needs_te} need TransformerEngine, which is not importable here")
    config = CONFIGS[args.config]
    mbs = args.micro_batch_size or config.micro_batch_size
    layers = args.num_layers or layers_that_fit(config, gpu["gpu_memory_mib"] * 2**20, gpus, mbs)
    env = dict(utils.environment(gpu), gpus=gpus, expert_model_parallel_size=gpus, transformer_engine=te or "absent",
               path="TransformerEngine (--transformer-impl transformer_engine)" if te else
               "local (--transformer-impl local) with the torch SDPA core attention",
               warmup_iters=args.warmup_iters, apex_wgrad_fusion=apex_wgrad_fusion(),
               deep_gemm="importable" if _importable("deep_gemm") else "absent")
    table = f"{args.config}_ep{gpus}" + ("_te" if te else "") + (f"_{args.results_tag}" if args.results_tag else "")
    stored = utils.RESULTS_DIR / f"bench_megatron_pretrain_{table}.json"
    kept = json.loads(stored.read_text())["results"] if stored.exists() else []
    others = {(r.get("device"), r.get("layers")) for r in kept} - {(gpu["device"], layers)}
    if others:
        raise SystemExit(f"{stored.name} holds rows of (device, layers) {sorted(others, key=str)}; this call measures "
                         f"({gpu['device']!r}, {layers}): give --results-tag for a table of its own")
    rows = {(r["config"], r["variant"]): r for r in kept}
    runs, profiles = {variant: [] for variant in args.variants}, {}
    began_call, longest, path, profile_path = time.perf_counter(), 0.0, None, None
    call = call_stamp()  # the rows this call measures, and their stand-in
    plan = [(v, False) for _ in range(args.repeats) for v in args.variants]
    for variant, profiling in plan + [(v, True) for v in args.variants if args.profile]:
        if args.time_budget and time.perf_counter() - began_call + longest > args.time_budget:
            print(f"time budget: {args.time_budget:.0f} s would be passed by the next run; stopping", flush=True)
            break
        cmd = functools.partial(command, args.config, variant, gpus, args.train_iters, layers, mbs,
                                args.micro_batches, te=te is not None)
        began = time.perf_counter()
        if profiling:
            profiles[variant] = profile_run(cmd, args.run_timeout)
            print(variant, "profile", {k: profiles[variant].get(k) for k in ("wall_ms", "error")}, flush=True)
            timed = {v: r.get("iter_ms") for (c, v), r in rows.items() if c == args.config}
            profile_path = write_profile(table, profiles, timed, env)
            longest = max(longest, time.perf_counter() - began)
            continue
        cmd = cmd(probe=not runs[variant], search_cap=args.max_micro_batch_cap)
        status, out = run(cmd, args.run_timeout)
        wall = time.perf_counter() - began
        longest = max(longest, wall)
        row = dict(config=args.config, variant=variant, status=status, call=call, device=gpu["device"], wall_s=wall,
                   layers=layers, micro_batch_size=mbs, micro_batches=args.micro_batches, iters=args.train_iters,
                   num_experts=config.num_experts(gpus),
                   allocator=" ".join(f"{k}={os.environ[k]}" for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
                                      if k in os.environ), command=" ".join(cmd))
        row.update(outcome(status, out, gpus * mbs * args.micro_batches * SEQ, gpus, args.warmup_iters))
        print(variant, status, {k: row.get(k) for k in ("tokens_per_s_per_gpu", "activation_mib_per_moe_layer",
                                                         "max_micro_batch", "error")}, flush=True)
        runs[variant].append(row)
        rows[args.config, variant] = combine(runs[variant])
        path = write(table, list(rows.values()), env)  # after every run: a call cut short keeps the runs done
    print(path.read_text() if path else "no run started")
    if profile_path:
        print(profile_path.read_text())


def call_stamp() -> str:
    """When this call began (UTC, to the second): the ``call`` of the rows it measures."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def write(table: str, rows: list[dict], env: dict) -> pathlib.Path:
    """``rows`` -> ``bench_megatron_pretrain_{table}`` .json / .md / .png under benchmarks/results,
    each row with its tokens/s against the stand-in's of its config measured by the same call
    (``vs_bf16_grouped_mm``; a row kept from a call whose stand-in a later call replaced keeps the ratio its call
    gave it; None where its call ran no stand-in); the .md path."""
    stand_in = {(r["config"], r.get("call")): r.get("tokens_per_s_per_gpu") for r in rows
                if r["variant"] == "bf16_grouped_mm"}
    for r in rows:
        base = stand_in.get((r["config"], r.get("call")))
        if base:  # else the ratio its own call gave it (None where that call measured no stand-in)
            r["vs_bf16_grouped_mm"] = r["tokens_per_s_per_gpu"] / base if r.get("tokens_per_s_per_gpu") else None
        r.setdefault("vs_bf16_grouped_mm", None)
    columns = ["config", "variant", "status", "layers", "micro_batch_size", "micro_batches", "tokens_per_s_per_gpu",
               "vs_bf16_grouped_mm", "tokens_per_s_spread", "repeats", "call", "iter_ms", "max_allocated_mib",
               "peak_before_optimizer_mib", "activation_mib_per_moe_layer", "graph_pool_mib_per_moe_layer",
               "step_activation_peak_mib",
               "max_micro_batch", "alloc_retries",
               "wall_s", "attention", "optimizer", "grad_accumulation", "experts", "error"]
    notes = (
        f"EP = {env['gpus']} GPUs; {env['path']}; mock data, sequence {SEQ}. Each iteration: `micro_batches` "
        f"micro-batches of `micro_batch_size` sequences per GPU, then one optimizer step; the first "
        f"{env['warmup_iters']} iterations untimed (`iter_ms_each`: every iteration's time). "
        "`tokens_per_s_per_gpu`, `iter_ms`: medians over the row's `repeats` runs (the variants interleaved in one "
        "call); `tokens_per_s_spread`: (max - min) / median; `call`: when the call that measured the row began (a "
        "later call keeps the rows of the variants it did not run); `vs_bf16_grouped_mm`: against the median of the"
        " stand-in that call measured. `max_allocated_mib`: the most of Megatron's reports after the first and "
        "second iterations (the second's micro-batches run beside the optimizer state the first step made) and "
        "of the probe's `peak_before_probe_mib`; first run only: `peak_before_optimizer_mib`: the peak in the "
        "second iteration's micro-batches, just before its optimizer step (`peak_after_optimizer_mib`: just "
        "after it): where it equals `max_allocated_mib` the micro-batches set the peak. Measured inside "
        "Megatron's step in each variant's first run only (the other repeats run without probes): "
        "`activation_mib_per_moe_layer`: on the second micro-batch of the second iteration, per MoE layer, memory "
        "allocated when its forward returned minus when it started, less its "
        "output's bytes (what the layer keeps for backward), averaged over the MoE layers (with the expert path in"
        " CUDA graphs it keeps them in the graphs' pools instead, allocated at capture: "
        "`graph_pool_mib_per_moe_layer`, the pools' allocated MiB after the run over the MoE layers); "
        "`step_activation_peak_mib`: the most allocated during that micro-batch's forward and backward minus what "
        "was allocated before it; `max_micro_batch`: after the timed iterations (parameters, main grads and "
        "optimizer state held), the largest micro-batch size (sequences) whose forward and backward ran without "
        "running out of memory, by doubling from `micro_batch_size` then bisection, capped "
        "(`max_micro_batch_capped`: the cap trained). `attention`, `optimizer`, `grad_accumulation`: what the run "
        "reported it ran. Commands: the `command` field of each row in the JSON; docs/megatron.md.")
    path = utils.write_results(f"bench_megatron_pretrain_{table}",
                               f"Megatron pretrain at EP={env['gpus']}: BF16 grouped stand-in vs FP8-Flow",
                               env, {}, rows, columns, notes=notes,
                               formats={"vs_bf16_grouped_mm": ".3f", "tokens_per_s_spread": ".1%"})
    plot(rows, path.with_suffix(".png"))
    return path


def plot(rows: list[dict], path) -> None:
    """Per config, three panels over its variants: tokens/s per GPU (median, the bar's line spans the runs),
    activation MiB per MoE layer, and the largest micro-batch that trained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(len(configs), 3, figsize=(15, 3.6 * len(configs)), squeeze=False)
    for (speed_ax, act_ax, mb_ax), config in zip(axes, configs):
        mine = [r for r in rows if r["config"] == config]
        timed = [r for r in mine if r.get("tokens_per_s_per_gpu") is not None]
        speeds = [r["tokens_per_s_per_gpu"] for r in timed]
        ranges = [[s - min(filter(None, r["tokens_per_s_runs"])) for s, r in zip(speeds, timed)],
                  [max(filter(None, r["tokens_per_s_runs"])) - s for s, r in zip(speeds, timed)]]
        speed_ax.barh([r["variant"] for r in timed], speeds, xerr=ranges)
        probed = [r for r in mine if r.get("activation_mib_per_moe_layer") is not None]
        act_ax.barh([r["variant"] for r in probed], [r["activation_mib_per_moe_layer"] for r in probed])
        searched = [r for r in mine if r.get("max_micro_batch") is not None]
        mb_ax.barh([r["variant"] for r in searched], [r["max_micro_batch"] for r in searched])
        for ax, title in ((speed_ax, "tokens/s per GPU"), (act_ax, "activation MiB per MoE layer"),
                          (mb_ax, "largest micro-batch that trains")):
            ax.set(title=f"{config}: {title}")
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def profile_run(cmd, timeout: float) -> dict:
    """One run of ``cmd(profile_out=PATH)`` (``command`` with its last iteration profiled): the entry's profile
    of that iteration (``iteration``, ``wall_ms``, ``kernels``: ``[{kernel, launched_by, ms, launches}]``), else
    ``{"error": why none was written}``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "profile.json"
        status, out = run(cmd(profile_out=str(path)), timeout)
        if path.exists():
            return json.loads(path.read_text())
    return dict(error=bench_lines(out).get("profile_error") or root_cause(out) or f"{status}: no profile written")


def write_profile(table: str, profiles: dict[str, dict], timed_ms: dict, env: dict) -> pathlib.Path:
    """The variants' ``profiles`` (``profile_run``) against the stand-in's, with the timed runs' ``timed_ms``
    (``kernel_profile.iteration_rows``) -> ``bench_megatron_pretrain_{table}_profile`` .json / .md under
    benchmarks/results, one table per ``part``; the .md path."""
    rows = kernel_profile.iteration_rows(profiles, "bf16_grouped_mm", timed_ms)
    notes = (
        "One run per variant after the timed repeats, its last iteration (every micro-batch's forward and backward, "
        "then the optimizer step) under torch.profiler on rank 0: `ms` is that iteration's CUDA kernel time, summed "
        "over kernels (kernels on concurrent streams both count), `share` its fraction of the iteration's wall time "
        "as profiled (two synchronisations around Megatron's train_step; the profiler's host overhead included: "
        f"compare `{kernel_profile.TIMED}`), `vs_bf16_grouped_mm_ms` the difference to the stand-in's. Categories: "
        "kernel_profile.site_category, by kernel name and the op that launched it: expert GEMMs are those of "
        "grouped ops (torch._grouped_mm and its backward, FP8-Flow's grouped linear), every other GEMM dense "
        "(attention projections, shared expert, router, output layer); `optimizer`: every kernel inside the "
        "optimizer's step (gradient norm, clipping, Adam, copies to the BF16 parameters); `gradient accumulation`: "
        "DDP's hooks adding .grad into main_grad. The stand-in permutes with Megatron's torch ops (in "
        f"`{kernel_profile.OTHER}`), FP8-Flow with its own kernels (in `FP8-Flow non-GEMM`). launched_by: the op "
        "the profiler tied the kernel to, < the nearest enclosing op outside aten; launches: per iteration.")
    return utils.write_results(f"bench_megatron_pretrain_{table}_profile",
                               f"Megatron pretrain at EP={env['gpus']}: one iteration's GPU time by kernel",
                               env, {}, rows, ["variant", "group", "category", "kernel", "launched_by", "ms", "share",
                                               "vs_bf16_grouped_mm_ms", "launches", "error"],
                               notes=notes, formats={"share": ".1%"}, group_by="part")


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
