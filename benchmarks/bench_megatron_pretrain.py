"""Megatron's own ``pretrain`` (megatron-core 0.19.x, ``megatron.training``) through
``python -m examples.pretrain_gpt``: BF16 experts (Megatron's) vs FP8-Flow experts with
``moe_expert`` recompute, E4M3 and HYBRID (E5M2 gradients), same seed and data (Python standard-library
bytes), on one GPU. The FP8-Flow block draws its initial weights as Megatron's experts do, so all runs
with one seed start from the same model and see the same dropout masks: what differs is the expert
arithmetic. A BF16 run with another seed is the control: how far runs land apart from initialisation
alone.

Runs ``torchrun --nproc_per_node 1`` once per configuration, parses Megatron's iteration log lines, and
writes final loss (mean of the last quarter of logged losses), relative deviation, iteration time and
tokens/s, and peak memory. Needs megatron-core 0.19.x importable (the README says how on the GPU machines).

    python benchmarks/bench_megatron_pretrain.py [--train-iters N]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import utils

MODEL = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings "
         "1024 --micro-batch-size 8 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine "
         "--lr-warmup-iters 20 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 1024 --moe-grouped-gemm "
         "--bf16 --moe-token-dispatcher-type alltoall --swiglu --disable-bias-linear --transformer-impl local "
         "--log-interval 10 --eval-iters 0 --eval-interval 100000 --no-persist-layer-norm "
         "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
         "--no-bias-swiglu-fusion").split()
FP8_FLOW = ("--fp8-recipe blockwise --moe-fp8-flow --recompute-granularity selective "
            "--recompute-modules moe_expert").split()
ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+) .*lm loss: ([\d.E+-]+)")
MEM = re.compile(r"max allocated: ([\d.]+)")


def run(flags, iters) -> dict:
    cmd = ["torchrun", "--nproc_per_node", "1", "-m", "examples.pretrain_gpt", *MODEL,
           "--train-iters", str(iters), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stdout[-3000:] + out.stderr[-3000:])
    logged = [(int(i), float(ms), float(loss)) for i, ms, loss in ITER.findall(out.stdout)]
    tail = logged[-max(1, len(logged) // 4):]
    steady = [ms for i, ms, _ in logged if i > 20]
    return dict(final_loss=sum(loss for *_, loss in tail) / len(tail), iter_ms=sum(steady) / len(steady),
                peak_mib=max(float(m) for m in MEM.findall(out.stdout)), curve=[loss for *_, loss in logged])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=1000)
    iters = parser.parse_args().train_iters
    env = utils.environment()
    tokens = 8 * 1024
    seed = ["--seed", "1234"]
    res = {"bf16_experts": run(seed, iters),
           "fp8_flow_e4m3_moe_expert": run(seed + FP8_FLOW + ["--fp8-format", "e4m3"], iters),
           "fp8_flow_hybrid_moe_expert": run(seed + FP8_FLOW + ["--fp8-format", "hybrid"], iters),
           "bf16_experts_seed_1235 (control)": run(["--seed", "1235"], iters)}
    base = res["bf16_experts"]["final_loss"]
    rows = [dict(run=n, final_loss=r["final_loss"], relative_deviation=(r["final_loss"] - base) / base,
                 iter_ms=r["iter_ms"], tokens_per_s=tokens / r["iter_ms"] * 1e3, peak_mib=r["peak_mib"])
            for n, r in res.items()]
    notes = (f"{iters} iterations, 4 layers, hidden 1024, 8 experts (ffn 1024), top-2, seq 1024, batch 8, seed 1234, "
             "TransformerEngine absent (--transformer-impl local: dense layers BF16). Final loss: mean of the last "
             "quarter of Megatron's logged losses (every 10 iterations). Loss curves (logged every 10): "
             + "; ".join(f"{n}: " + ", ".join(f"{x:.3f}" for x in r["curve"]) for n, r in res.items()))
    print(utils.write_results("bench_megatron_pretrain", "Megatron pretrain (megatron-core 0.19): BF16 vs FP8-Flow "
                              "experts", env, {}, rows, list(rows[0]), notes=notes).read_text())


if __name__ == "__main__":
    main()
