"""Expert parallelism over all GPUs of one host: the MoE block, FP8-Flow vs BF16, and its correctness vs EP=1.

Every visible GPU is one EP rank (EP = GPU count; run on nvidia-h200-x2 for EP=2). DeepSeek-V3-like: hidden
7168, ffn 2048, 256 experts across the EP group, top-8 routing, uniform random router. For each token
dispatcher backend (``alltoall`` over NCCL; ``deepep`` when ``deep_ep`` imports): the expert block
forward+backward at 8192 tokens per rank, FP8-Flow vs the BF16 grouped_mm block
(``baselines.BF16GroupedMMEP``: the same dispatcher with a BF16 payload, ``torch._grouped_mm`` experts) and
the BF16 per-expert loop, same parameters; step time, tokens/s per GPU, peak memory. Dispatch + combine
alone: ``bench_dispatch.py``.

Each run first checks correctness at a small size (hidden 512, 16 experts): every rank's block output and
input gradient against an EP=1 block holding all experts (same parameters), on the same tokens.

Run on a multi-GPU machine: ``python benchmarks/bench_ep_scaling.py [--check-only] [--tokens T]``; ``--cpu
[--world N]`` runs the same script over gloo on CPU processes (the correctness check, and timings at toy sizes
that mean nothing). ``--tokens``: tokens per rank of the block step (rows per local expert = T * 8 / 128 at
EP=2: 16384 gives the 1024 rows per expert that 8192 tokens per rank give at EP=4).
Writes ``bench_ep_scaling_check_ep{N}[_cpu]`` and ``bench_ep_scaling_ep{N}[_cpu][_tokens{T}]``.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

from transformer_engine_moe import FP8FlowMoE

import utils
from baselines import BF16GroupedMMEP, BF16LoopMoE

GPU_SIZES = dict(hidden=7168, ffn=2048, experts=256, topk=8, block_tokens=8192)
CPU_SIZES = dict(hidden=256, ffn=128, experts=16, topk=4, block_tokens=64)
CHECK = dict(hidden=512, ffn=256, experts=16, topk=4, tokens=128)  # correctness check, every run


def block_rows(backend, ep, device, z) -> list[dict]:
    torch.manual_seed(0)
    fp8 = FP8FlowMoE(z["experts"], z["hidden"], z["ffn"], z["topk"], ep_group=dist.group.WORLD, dispatcher=backend,
                     align_size=128, device=device)
    tokens = z["block_tokens"]
    x = torch.randn(tokens, z["hidden"], device=device, dtype=torch.bfloat16, requires_grad=True)
    ids, probs = utils.routing(tokens, z["experts"], z["topk"], device)
    dy = torch.randn(tokens, z["hidden"], device=device, dtype=torch.bfloat16)
    rows = []
    blocks = {"bf16_grouped_mm": BF16GroupedMMEP(fp8), "bf16_loop": BF16LoopMoE.from_block(fp8), "fp8_flow": fp8}
    for name, model in blocks.items():

        def step():
            model.forward_topk(x, ids, probs).backward(dy)
            model.zero_grad(set_to_none=True)

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ms = utils.ep_timed(step, iters=10)
        rows.append(dict(backend=backend, ep=ep, block=name, tokens_per_rank=tokens, ms=ms,
                         tokens_per_s_per_gpu=tokens / ms * 1e3,
                         peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")))
    for r in rows:
        r["speedup_over_bf16_grouped_mm"] = rows[0]["ms"] / r["ms"]
    return rows


def check_rows(backend, ep, rank, device) -> list[dict]:
    """Relative error of this rank's output and input gradient against an EP=1 block with all experts."""
    c = CHECK
    torch.manual_seed(0)
    full = FP8FlowMoE(c["experts"], c["hidden"], c["ffn"], c["topk"], align_size=128, device=device)
    model = FP8FlowMoE(c["experts"], c["hidden"], c["ffn"], c["topk"], ep_group=dist.group.WORLD,
                       dispatcher=backend, align_size=128, device=device)
    local = c["experts"] // ep
    model.load_state_dict({f"{fc}.weight{j}": full.state_dict()[f"{fc}.weight{rank * local + j}"]
                           for fc in ("linear_fc1", "linear_fc2") for j in range(local)})
    torch.manual_seed(100 + rank)
    x = torch.randn(c["tokens"], c["hidden"], device=device, dtype=torch.bfloat16)
    ids, probs = utils.routing(c["tokens"], c["experts"], c["topk"], device)
    dy = torch.randn_like(x)
    out = []
    for m in (model, full):
        xi = x.clone().requires_grad_()
        m.forward_topk(xi, ids, probs).backward(dy)
        out.append((m.forward_topk(x, ids, probs).detach(), xi.grad))
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    return [dict(backend=backend, ep=ep, rank=rank, output_rel_err=rel(out[0][0], out[1][0]),
                 dgrad_rel_err=rel(out[0][1], out[1][1]))]


def worker(rank: int, world: int, cpu: bool, check_only: bool, tokens) -> tuple[list[dict], list[dict], dict]:
    """Every rank's correctness rows (gathered) and this rank's block rows (``tokens`` per rank, None: the
    sizes' default)."""
    device, z = utils.ep_device(rank, cpu), dict(CPU_SIZES if cpu else GPU_SIZES)
    z["block_tokens"] = tokens or z["block_tokens"]
    backends = ["alltoall"] + (["deepep"] if not cpu and importlib.util.find_spec("deep_ep") else [])
    c_rows, b_rows = [], []
    for backend in backends:
        c_rows += check_rows(backend, world, rank, device)
        if not check_only:
            b_rows += block_rows(backend, world, device, z)
    gathered = [None] * world
    dist.all_gather_object(gathered, c_rows)
    return [r for rows in gathered for r in rows], b_rows, z


def main():
    parser = utils.ep_parser(__doc__.splitlines()[0])
    parser.add_argument("--check-only", action="store_true", help="only the correctness check against EP=1")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per rank of the block step (default: 8192 on GPUs, 64 with --cpu)")
    args = parser.parse_args()
    if args.tokens is not None and args.tokens <= 0:
        parser.error(f"--tokens must be a positive number of tokens per rank, got {args.tokens}")
    (c_rows, b_rows, z), env, ceilings, world, suffix = utils.ep_run(worker, args, args.check_only, args.tokens)
    worst = max(max(r["output_rel_err"], r["dgrad_rel_err"]) for r in c_rows)
    if worst > 1e-2:
        raise SystemExit(f"EP={world} differs from EP=1 by {worst:.3g} (> 1e-2): {c_rows}")
    where = "gloo on CPU processes: toy sizes, timings meaningless" if args.cpu else "NCCL_NVLS_ENABLE=0"
    notes = (f"hidden {z['hidden']}, {z['experts']} experts over EP={world}, top-{z['topk']}; {where}. Correctness "
             f"vs EP=1 (hidden {CHECK['hidden']}, {CHECK['experts']} experts, every rank): worst relative error "
             f"{worst:.2e} (bound 1e-2: BF16 rounding of the per-rank partial sums combine adds).")
    print(utils.write_results(f"bench_ep_scaling_check_ep{world}{suffix}", f"EP={world} vs EP=1", env, ceilings,
                              c_rows, list(c_rows[-1]), notes=notes).read_text())
    if b_rows:  # not with --check-only
        tokens = f"_tokens{args.tokens}" if args.tokens else ""
        print(utils.write_results(f"bench_ep_scaling_ep{world}{suffix}{tokens}",
                                  f"MoE block forward+backward, EP={world}", env, ceilings, b_rows, list(b_rows[-1]),
                                  notes=notes).read_text())


if __name__ == "__main__":
    main()
