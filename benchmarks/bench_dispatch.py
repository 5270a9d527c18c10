"""Token dispatch + combine over all GPUs of one host: FP8 payload vs BF16, per dispatcher backend.

Every visible GPU is one EP rank (EP = GPU count; run on nvidia-h200-x2 for EP=2). DeepSeek-V3-like: hidden
7168, 256 experts across the EP group, top-8 routing, uniform random router, 4096 and 16384 tokens per rank.
For each backend (``alltoall`` over NCCL; ``deepep`` when ``deep_ep`` imports): wall time per dispatch and
per combine (barrier-aligned, median), the FP8 payload (1x128 quantization included in the FP8 time) against
BF16, bytes sent, and host syncs per dispatch (CUDA sync-debug warnings counted). The block over the same
dispatchers: ``bench_ep_scaling.py``.

Run on a multi-GPU machine: ``python benchmarks/bench_dispatch.py``; ``--cpu [--world N]`` runs it over gloo
on CPU processes (toy sizes, timings meaningless). Writes ``bench_dispatch_ep{N}[_cpu]``.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch
import torch.distributed as dist

from transformer_engine_moe import get_dispatcher, quantize_blockwise

import utils

GPU_SIZES = dict(hidden=7168, experts=256, topk=8, tokens=(4096, 16384))
CPU_SIZES = dict(hidden=256, experts=16, topk=4, tokens=(64,))


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


def payload_times(d, x, ids, probs, payload: str) -> dict:
    """Dispatch and combine times (ms), bytes sent and host syncs of one payload (``"bf16"`` or ``"fp8"``)."""
    send = (lambda: quantize_blockwise(x)) if payload == "fp8" else (lambda: x)
    out = d.dispatch(send(), ids, probs)
    t_dispatch = utils.ep_timed(lambda: d.dispatch(send(), ids, probs))
    y = torch.randn(out.hidden.shape, device=x.device, dtype=torch.bfloat16)
    t_combine = utils.ep_timed(lambda: d.combine(y, out.handle))
    return dict(dispatch_ms=t_dispatch, combine_ms=t_combine, bytes=d.last_dispatch_bytes,
                syncs=host_syncs(lambda: d.dispatch(send(), ids, probs)))


def dispatch_rows(backend: str, ep: int, device, z: dict) -> list[dict]:
    d = get_dispatcher(backend, dist.group.WORLD, num_experts=z["experts"])
    rows = []
    for tokens in z["tokens"]:
        x = torch.randn(tokens, z["hidden"], device=device, dtype=torch.bfloat16)
        ids, probs = utils.routing(tokens, z["experts"], z["topk"], device)
        bf16, fp8 = (payload_times(d, x, ids, probs, p) for p in ("bf16", "fp8"))
        rows.append(dict(backend=backend, ep=ep, tokens_per_rank=tokens,
                         bf16_dispatch_us=1e3 * bf16["dispatch_ms"], fp8_dispatch_us=1e3 * fp8["dispatch_ms"],
                         fp8_over_bf16_time=fp8["dispatch_ms"] / bf16["dispatch_ms"],
                         fp8_over_bf16_bytes=fp8["bytes"] / bf16["bytes"],
                         combine_us=1e3 * bf16["combine_ms"], host_syncs_per_dispatch=fp8["syncs"]))
    return rows


def worker(rank: int, world: int, cpu: bool) -> tuple[list[dict], dict]:
    z = CPU_SIZES if cpu else GPU_SIZES
    backends = ["alltoall"] + (["deepep"] if not cpu and importlib.util.find_spec("deep_ep") else [])
    return [r for b in backends for r in dispatch_rows(b, world, utils.ep_device(rank, cpu), z)], z


def main():
    args = utils.ep_parser(__doc__.splitlines()[0]).parse_args()
    (rows, z), env, ceilings, world, suffix = utils.ep_run(worker, args)
    where = "gloo on CPU processes: toy sizes, timings meaningless" if args.cpu else "NCCL_NVLS_ENABLE=0"
    notes = (f"hidden {z['hidden']}, {z['experts']} experts over EP={world}, top-{z['topk']}; FP8 time includes the "
             f"1x128 quantization; {where}. Rank 0's timings.")
    print(utils.write_results(f"bench_dispatch_ep{world}{suffix}", f"Dispatch + combine, EP={world}", env, ceilings,
                              rows, list(rows[-1]), notes=notes).read_text())


if __name__ == "__main__":
    main()
