"""Expert parallelism over all GPUs of one host: dispatch+combine and the MoE block, FP8-Flow vs BF16.

Every visible GPU is one EP rank (EP = GPU count; run on nvidia-h200-x2 for EP=2). DeepSeek-V3-like: hidden
7168, ffn 2048, 256 experts across the EP group, top-8 routing, uniform random router. For each token
dispatcher backend (``alltoall`` over NCCL; ``deepep`` when ``deep_ep`` imports):

- dispatch + combine: wall time per call (CUDA events, barrier-aligned, median), FP8 payload (1x128
  quantization included in the FP8 time) vs BF16, bytes sent, host syncs per dispatch (CUDA sync-debug
  warnings counted);
- the expert block forward+backward at 8192 tokens per rank: FP8-Flow vs the BF16 grouped_mm block
  (``baselines.BF16GroupedMMEP``: the same dispatcher with a BF16 payload, ``torch._grouped_mm`` experts)
  and the BF16 per-expert loop, same parameters; step time, tokens/s per GPU, peak memory.

Each run first checks correctness at a small size (hidden 512, 16 experts): every rank's block output and
input gradient against an EP=1 block holding all experts (same parameters), on the same tokens.

Run on a multi-GPU machine: ``python benchmarks/bench_ep_scaling.py [--check-only]``; ``--cpu [--world N]`` runs
the same script over gloo on CPU processes (the correctness check, and timings at toy sizes that mean nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from transformer_engine_moe import FP8FlowMoE, get_dispatcher, quantize_blockwise

import utils
from baselines import BF16GroupedMMEP, BF16LoopMoE

GPU_SIZES = dict(hidden=7168, ffn=2048, experts=256, topk=8, dispatch_tokens=(4096, 16384), block_tokens=8192)
CPU_SIZES = dict(hidden=256, ffn=128, experts=16, topk=4, dispatch_tokens=(64,), block_tokens=64)
CHECK = dict(hidden=512, ffn=256, experts=16, topk=4, tokens=128)  # correctness check, every run


def timed(fn, iters=20, warmup=3) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` barrier-aligned calls."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def routing(tokens, experts, topk, device):
    probs, ids = torch.softmax(torch.randn(tokens, experts, device=device), -1).topk(topk)
    return ids, probs / probs.sum(1, keepdim=True)


def host_syncs(fn) -> int:
    """CUDA host syncs in one ``fn()`` (sync-debug warnings); -1 on CPU."""
    if not torch.cuda.is_available():
        return -1
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def dispatch_rows(backend, ep, device, z) -> list[dict]:
    d = get_dispatcher(backend, dist.group.WORLD, num_experts=z["experts"])
    rows = []
    for tokens in z["dispatch_tokens"]:
        x = torch.randn(tokens, z["hidden"], device=device, dtype=torch.bfloat16)
        ids, probs = routing(tokens, z["experts"], z["topk"], device)
        res = {}
        for payload in ("bf16", "fp8"):
            send = (lambda: quantize_blockwise(x)) if payload == "fp8" else (lambda: x)
            out = d.dispatch(send(), ids, probs)
            t_dispatch = timed(lambda: d.dispatch(send(), ids, probs))
            y = torch.randn(out.hidden.shape, device=device, dtype=torch.bfloat16)
            t_combine = timed(lambda: d.combine(y, out.handle))
            res[payload] = dict(dispatch_ms=t_dispatch, combine_ms=t_combine, bytes=d.last_dispatch_bytes,
                                syncs=host_syncs(lambda: d.dispatch(send(), ids, probs)))
        rows.append(dict(backend=backend, ep=ep, tokens_per_rank=tokens,
                         bf16_dispatch_us=1e3 * res["bf16"]["dispatch_ms"],
                         fp8_dispatch_us=1e3 * res["fp8"]["dispatch_ms"],
                         fp8_over_bf16_time=res["fp8"]["dispatch_ms"] / res["bf16"]["dispatch_ms"],
                         fp8_over_bf16_bytes=res["fp8"]["bytes"] / res["bf16"]["bytes"],
                         combine_us=1e3 * res["bf16"]["combine_ms"], host_syncs_per_dispatch=res["fp8"]["syncs"]))
    return rows


def block_rows(backend, ep, device, z) -> list[dict]:
    torch.manual_seed(0)
    fp8 = FP8FlowMoE(z["experts"], z["hidden"], z["ffn"], z["topk"], ep_group=dist.group.WORLD, dispatcher=backend,
                     align_size=128, device=device)
    tokens = z["block_tokens"]
    x = torch.randn(tokens, z["hidden"], device=device, dtype=torch.bfloat16, requires_grad=True)
    ids, probs = routing(tokens, z["experts"], z["topk"], device)
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
        ms = timed(step, iters=10)
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
    ids, probs = routing(c["tokens"], c["experts"], c["topk"], device)
    dy = torch.randn_like(x)
    out = []
    for m in (model, full):
        xi = x.clone().requires_grad_()
        m.forward_topk(xi, ids, probs).backward(dy)
        out.append((m.forward_topk(x, ids, probs).detach(), xi.grad))
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    return [dict(backend=backend, ep=ep, rank=rank, output_rel_err=rel(out[0][0], out[1][0]),
                 dgrad_rel_err=rel(out[0][1], out[1][1]))]


def worker(rank, world, port, queue, cpu, check_only=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cpu:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        device, z = torch.device("cpu"), CPU_SIZES
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        device, z = torch.device("cuda", rank), GPU_SIZES
    backends = ["alltoall"] + (["deepep"] if not cpu and importlib.util.find_spec("deep_ep") else [])
    c_rows, d_rows, b_rows = [], [], []
    for backend in backends:
        c_rows += check_rows(backend, world, rank, device)
        if not check_only:
            d_rows += dispatch_rows(backend, world, device, z)
            b_rows += block_rows(backend, world, device, z)
    gathered = [None] * world
    dist.all_gather_object(gathered, c_rows)
    if rank == 0:
        queue.put(([r for rows in gathered for r in rows], d_rows, b_rows, z))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU processes (toy sizes)")
    parser.add_argument("--world", type=int, default=4, help="with --cpu: the EP size")
    parser.add_argument("--check-only", action="store_true", help="only the correctness check against EP=1")
    args = parser.parse_args()
    if args.cpu:
        env, ceilings = {"device": "CPU (gloo)", "torch": torch.__version__}, {}
        world = args.world
    else:
        _, env, ceilings, _ = utils.start(__doc__.splitlines()[0])
        world = torch.cuda.device_count()
    env["ep_size"] = world
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(worker, args=(world, port, queue, args.cpu, args.check_only), nprocs=world, join=True)
    c_rows, d_rows, b_rows, z = queue.get()
    worst = max(max(r["output_rel_err"], r["dgrad_rel_err"]) for r in c_rows)
    if worst > 1e-2:
        raise SystemExit(f"EP={world} differs from EP=1 by {worst:.3g} (> 1e-2): {c_rows}")
    suffix = "_cpu" if args.cpu else ""
    notes = (f"hidden {z['hidden']}, {z['experts']} experts over EP={world}, top-{z['topk']}; FP8 time includes the "
             f"1x128 quantization; {'gloo on CPU processes: toy sizes, timings meaningless' if args.cpu else 'NCCL_NVLS_ENABLE=0'}. Correctness vs EP=1 (hidden {CHECK['hidden']}, "
             f"{CHECK['experts']} experts, every rank): worst relative error {worst:.2e} (bound 1e-2: BF16 "
             "rounding of the per-rank partial sums combine adds).")
    for name, title, rows in ((f"bench_ep_check_ep{world}{suffix}", f"EP={world} vs EP=1", c_rows),
                              (f"bench_dispatch_ep{world}{suffix}", f"Dispatch + combine, EP={world}", d_rows),
                              (f"bench_ep_scaling_ep{world}{suffix}", f"MoE block forward+backward, EP={world}",
                               b_rows)):
        if rows:
            print(utils.write_results(name, title, env, ceilings, rows, list(rows[-1]), notes=notes).read_text())


if __name__ == "__main__":
    main()
