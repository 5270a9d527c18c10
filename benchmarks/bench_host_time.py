"""Host time against GPU time of one MoE layer step: FP8-Flow vs the BF16 grouped block, on the GPU.

Default: the MoE layer of Megatron's ``deepseek_small`` (``bench_megatron_pretrain.py``): 64 experts, hidden
2048, ffn 1024, 4096 tokens, top-8 (about 512 rows per expert), where the FP8-Flow iteration was bound by its
host (docs/megatron.md). Step: forward + backward with the local dispatcher, the FP8 weights cached as on a
step's later micro-batches (``is_first_microbatch=False``), gradients set to None first. Blocks, same
parameters and routing:

- ``bf16_grouped_mm``: the strongest BF16 block (``baselines.BF16GroupedMMBlock``);
- ``fp8_flow_single_weight``: FP8-Flow with one ``[E, N, K]`` weight per GEMM;
- ``fp8_flow``: FP8-Flow with one weight per expert (TE's layout; autograd and hooks per parameter).

Per block: ``host_ms`` (median over steps of the time until ``backward()`` returns, the GPU idle at the
start: what the CPU spends issuing the step), ``wall_ms`` (until the GPU is done), ``gpu_ms`` (kernel time
per step, torch profiler) and ``launches`` per step. ``host_ms`` above ``gpu_ms`` means the step waits on
its host; the host figures move with the machine's CPU.

Run on a GPU: ``python benchmarks/bench_host_time.py [--experts 64 --hidden 2048 --ffn 1024 --tokens 4096]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from transformer_engine_moe import FP8FlowMoE

import utils
from baselines import BF16GroupedMMBlock

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cuLaunchKernel")


def make_blocks(experts: int, hidden: int, ffn: int, topk: int, device) -> dict:
    """name -> block, the two FP8-Flow layouts and the BF16 block over the same expert weights."""
    torch.manual_seed(0)
    single = FP8FlowMoE(experts, hidden, ffn, topk, device=device, single_grouped_weight=True)
    torch.manual_seed(0)
    per_expert = FP8FlowMoE(experts, hidden, ffn, topk, device=device)
    return {"bf16_grouped_mm": BF16GroupedMMBlock.from_block(single), "fp8_flow_single_weight": single,
            "fp8_flow": per_expert}


def make_inputs(tokens: int, hidden: int, experts: int, topk: int, device):
    """``(x [T, H] bf16, topk_ids [T, k] distinct experts, topk_probs [T, k], output gradient [T, H])``."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.rand(tokens, experts, generator=gen).argsort(1)[:, :topk].to(device)
    probs = torch.rand(tokens, topk, generator=gen).softmax(-1).to(device)
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    return x, ids, probs, dy


def step_fn(block, x, ids, probs, dy):
    """One forward + backward of ``block`` (FP8 weights from the cache after the first call)."""
    first = [True]

    def step():
        for p in block.parameters():
            p.grad = None
        xi = x.clone().requires_grad_()
        block.forward_topk(xi, ids, probs, is_first_microbatch=first[0]).backward(dy)
        first[0] = False

    return step


def host_and_wall_ms(step, steps: int, sync) -> tuple[float, float]:
    """Medians over ``steps`` of (ms until ``step()`` returns, ms until ``sync()`` returns), each from an idle
    device (``sync`` before)."""
    host, wall = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        sync()
        host.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(host), statistics.median(wall)


def gpu_ms_and_launches(step, steps: int) -> tuple[float, float]:
    """(kernel time, kernel launches) per step, from the torch profiler over ``steps`` steps."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return gpu_us / steps / 1e3, sum(e.count for e in events if e.key in LAUNCHES) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    env = utils.environment()
    shape = dict(experts=args.experts, hidden=args.hidden, ffn=args.ffn, tokens=args.tokens, topk=args.topk)
    inputs = make_inputs(args.tokens, args.hidden, args.experts, args.topk, "cuda")
    rows = []
    for name, block in make_blocks(args.experts, args.hidden, args.ffn, args.topk, "cuda").items():
        step = step_fn(block, *inputs)
        for _ in range(3):
            step()
        host, wall = host_and_wall_ms(step, args.steps, torch.cuda.synchronize)
        gpu, launches = gpu_ms_and_launches(step, 5)
        rows.append(dict(block=name, host_ms=host, wall_ms=wall, gpu_ms=gpu, launches=launches,
                         host_over_gpu=host / gpu))
    path = utils.write_results(
        "bench_host_time", "Host time vs GPU time of one MoE layer step", {**env, **shape}, {}, rows,
        ["block", "host_ms", "wall_ms", "gpu_ms", "launches", "host_over_gpu"],
        notes="host_ms: until backward() returns, from an idle GPU; wall_ms: until the GPU is done; gpu_ms: "
              "kernel time per step (torch profiler); medians over --steps steps. Local dispatcher, FP8 weights "
              "cached (a step's later micro-batches), gradients set to None before each step.")
    print(path.read_text())


if __name__ == "__main__":
    main()
