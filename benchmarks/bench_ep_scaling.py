"""Expert parallelism over all GPUs of one host: dispatch+combine and the MoE block, FP8-Flow vs BF16.

Every visible GPU is one EP rank (EP = GPU count; run on nvidia-h200-x2 for EP=2). DeepSeek-V3-like: hidden
7168, ffn 2048, 256 experts across the EP group, top-8 routing, uniform random router. For each token
dispatcher backend (``alltoall`` over NCCL; ``deepep`` when ``deep_ep`` imports):

- dispatch + combine: wall time per call (CUDA events, barrier-aligned, median), FP8 payload (1x128
  quantization included in the FP8 time) vs BF16, bytes sent, host syncs per dispatch (CUDA sync-debug
  warnings counted);
- the expert block forward+backward at 8192 tokens per rank: FP8-Flow vs the BF16 block (same
  parameters), step time, tokens/s per GPU, peak memory.

Run on a multi-GPU machine: ``python benchmarks/bench_ep_scaling.py``.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import statistics
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from transformer_engine_moe import FP8FlowMoE, get_dispatcher, quantize_blockwise

import utils

HIDDEN, FFN, EXPERTS, TOPK = 7168, 2048, 256, 8
DISPATCH_TOKENS = (4096, 16384)
BLOCK_TOKENS = 8192


def timed(fn, iters=20, warmup=3) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` barrier-aligned calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def routing(tokens, device):
    probs, ids = torch.softmax(torch.randn(tokens, EXPERTS, device=device), -1).topk(TOPK)
    return ids, probs / probs.sum(1, keepdim=True)


def host_syncs(fn) -> int:
    """CUDA host syncs in one ``fn()`` (sync-debug warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def dispatch_rows(backend, ep, device) -> list[dict]:
    d = get_dispatcher(backend, dist.group.WORLD, num_experts=EXPERTS)
    rows = []
    for tokens in DISPATCH_TOKENS:
        x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        ids, probs = routing(tokens, device)
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


def block_rows(backend, ep, device) -> list[dict]:
    torch.manual_seed(0)
    fp8 = FP8FlowMoE(EXPERTS, HIDDEN, FFN, TOPK, ep_group=dist.group.WORLD, dispatcher=backend, align_size=128,
                     device=device)
    x = torch.randn(BLOCK_TOKENS, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    ids, probs = routing(BLOCK_TOKENS, device)
    dy = torch.randn(BLOCK_TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
    rows = []
    for precision in ("bf16", "fp8_flow"):
        fp8.precision = precision

        def step():
            fp8.forward_topk(x, ids, probs).backward(dy)
            fp8.zero_grad(set_to_none=True)

        torch.cuda.reset_peak_memory_stats()
        ms = timed(step, iters=10)
        rows.append(dict(backend=backend, ep=ep, block=precision, tokens_per_rank=BLOCK_TOKENS, ms=ms,
                         tokens_per_s_per_gpu=BLOCK_TOKENS / ms * 1e3,
                         peak_gib=torch.cuda.max_memory_allocated() / 2**30))
    rows[1]["speedup_over_bf16"] = rows[0]["ms"] / rows[1]["ms"]
    rows[0]["speedup_over_bf16"] = 1.0
    return rows


def worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    device = torch.device("cuda", rank)
    backends = ["alltoall"] + (["deepep"] if importlib.util.find_spec("deep_ep") else [])
    d_rows, b_rows = [], []
    for backend in backends:
        d_rows += dispatch_rows(backend, world, device)
        b_rows += block_rows(backend, world, device)
    if rank == 0:
        queue.put((d_rows, b_rows))
    dist.barrier()
    dist.destroy_process_group()


def main():
    _, env, ceilings, _ = utils.start(__doc__.splitlines()[0])
    world = torch.cuda.device_count()
    env["ep_size"] = world
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(worker, args=(world, port, queue), nprocs=world, join=True)
    d_rows, b_rows = queue.get()
    notes = (f"hidden {HIDDEN}, {EXPERTS} experts over EP={world}, top-{TOPK}; FP8 time includes the 1x128 "
             "quantization; NCCL_NVLS_ENABLE=0.")
    print(utils.write_results(f"bench_dispatch_ep{world}", f"Dispatch + combine, EP={world}", env, ceilings, d_rows,
                              list(d_rows[0]), notes=notes).read_text())
    print(utils.write_results(f"bench_ep_scaling_ep{world}", f"MoE block forward+backward, EP={world}", env,
                              ceilings, b_rows, list(b_rows[1]), notes=notes + " Experts' rows padded to 128.")
          .read_text())


if __name__ == "__main__":
    main()
