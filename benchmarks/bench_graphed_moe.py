"""Host time against GPU time of one FP8-Flow MoE layer step, eager and replayed from CUDA graphs
(``GraphedFP8FlowMoE``, Megatron's ``--moe-fp8-flow-cuda-graph``), on the GPU.

Shapes ``--config`` of ``bench_host_time.CONFIGS``, default ``qwen3_moe_like`` (issue 37): 128 experts, hidden
2048, ffn 768, top-8, 16384 and 4096 tokens per micro-batch (``--tokens`` for others); ``dsv3_ep8_rank`` (32
experts of DeepSeek-V3's, 4096 rows each) with ``--fuse-wgrad-accumulation`` is where the captured wgrads' backend
matters most (DeepGEMM's into ``main_grad`` on device splits, issue 39). The block is called as
Megatron calls it, with the router's ``probs [T, E]`` and ``routing_map [T, E]``. Step: forward + backward of
a micro-batch after a step's first (FP8 weights cached: ``utils.FP8_WEIGHTS["cached"]``), the weights under
Megatron DDP's gradient contract (a float32 ``main_grad`` and DDP's hook, ``utils.ddp_main_grad_hooks``; without
wgrad fusion, as the Megatron runs of this repository, or with ``--fuse-wgrad-accumulation``). Blocks
(``VARIANTS``):

- ``fp8_flow_single_weight``: the eager block as Megatron runs it without the flag (host counts);
- ``fp8_flow_device_splits_single_weight``: eager with device splits, the path the graphs replay;
- ``fp8_flow_graph_single_weight``: that block through ``GraphedFP8FlowMoE``;
- ``fp8_flow_graph``: the same with one weight per expert (autograd and DDP's hook still run per parameter);
- ``fp8_flow_graph_single_weight_no_deepgemm``: the third as on a machine without DeepGEMM (issue 39's user:
  Gluon fprop/dgrad, Triton wgrads; ``utils.without_deepgemm``);
- ``fp8_flow_single_weight_moe_expert`` / ``fp8_flow_graph_single_weight_moe_expert``: the first and the third with
  ``recompute="moe_expert"`` (the graphs capture the checkpoint, the backward's rerun included);
- ``bf16_grouped_mm`` (``BASELINE``): the strongest BF16 block (``baselines.BF16GroupedMMBlock``, eager, no host
  sync) over the same experts and routing (its ``forward_topk`` takes the ids the router's map was made from),
  under the same gradient contract.

Columns as ``bench_host_time.py`` (its timing functions): ``host_ms`` until ``backward()`` returns from an idle
GPU, ``wall_ms`` until the GPU is done, ``gpu_ms`` kernel time per step (torch profiler), ``launches`` kernel
launches by the host per step (a graphed step's kernels come from its two graph launches, not counted);
``vs_bf16_grouped_mm``: the baseline's ``wall_ms`` over the row's, where this call measured the baseline.

Results (``results_tail``): ``bench_graphed_moe`` (``qwen3_moe_like``) or ``bench_graphed_moe_<config>``, then
``--suffix`` (e.g. ``_unfused`` beside a fused run). Run on a GPU:
``python benchmarks/bench_graphed_moe.py [--config dsv3_ep8_rank] [--experts 32 64] [--tokens 4096]
[--fuse-wgrad-accumulation] [--suffix _unfused]``. Each (experts, tokens) point runs in a fresh process
(``utils.in_fresh_processes``): its allocator and compiled kernels its own, as ``bench_moe_layer``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from transformer_engine_moe import FP8FlowMoE, GraphedFP8FlowMoE, topk_to_routing_map

import utils
from baselines import BF16GroupedMMBlock
from bench_host_time import CONFIGS, gpu_ms_and_launches, make_inputs

VARIANTS = {  # name -> (device splits, replayed from CUDA graphs, single grouped weight, recompute)
    "fp8_flow_single_weight": (False, False, True, None),
    "fp8_flow_device_splits_single_weight": (True, False, True, None),
    "fp8_flow_graph_single_weight": (True, True, True, None),
    "fp8_flow_graph": (True, True, False, None),
    "fp8_flow_single_weight_moe_expert": (False, False, True, "moe_expert"),
    "fp8_flow_graph_single_weight_moe_expert": (True, True, True, "moe_expert"),
}
# variants measured as on a machine without DeepGEMM (``utils.without_deepgemm``): name -> the variant it runs
NO_DEEPGEMM = {"fp8_flow_graph_single_weight_no_deepgemm": "fp8_flow_graph_single_weight"}
BASELINE = "bf16_grouped_mm"


def make_step(name: str, experts: int, hidden: int, ffn: int, topk: int, tokens: int, fuse: bool, device):
    """``(step, block)``: one micro-batch of variant ``name`` per ``step()`` (the first says
    ``is_first_microbatch=True``, the others False), router output and gradients fixed. ``BASELINE``: the BF16
    block over the same experts (those of the single-weight block), stepped through ``forward_topk``."""
    device_splits, graphed, single, recompute = VARIANTS[
        "fp8_flow_single_weight" if name == BASELINE else NO_DEEPGEMM.get(name, name)]
    torch.manual_seed(0)
    block = FP8FlowMoE(experts, hidden, ffn, topk, device=device, device_splits=device_splits,
                       single_grouped_weight=single, fuse_wgrad_accumulation=fuse, recompute=recompute,
                       accumulate_into_main_grad=True)  # as Megatron builds it (megatron_patches/experts.py)
    if name == BASELINE:
        block = BF16GroupedMMBlock.from_block(block)
    utils.ddp_main_grad_hooks(block)
    run = GraphedFP8FlowMoE(block, accumulate_into_main_grad=True) if graphed else block
    x, ids, topk_probs, dy = make_inputs(tokens, hidden, experts, topk, device)
    routing_map, probs = topk_to_routing_map(ids, topk_probs, experts)
    probs.requires_grad_()
    topk_probs.requires_grad_()  # the baseline's router gradient, as the FP8-Flow blocks' through probs
    flags = utils.FP8_WEIGHTS["cached"]()

    def step():
        x.grad = probs.grad = topk_probs.grad = None
        if name == BASELINE:
            block.forward_topk(x, ids, topk_probs).backward(dy)
        else:
            run(x, probs, routing_map, is_first_microbatch=next(flags)).backward(dy)

    return step, block


def measure_point(config: str, experts: int, tokens: int, variants, steps: int, fuse: bool) -> list[dict]:
    """One row per variant in ``variants`` at one (experts, tokens) point of ``config``, with its
    ``vs_bf16_grouped_mm`` where the baseline is among them."""
    c = CONFIGS[config]
    shape = dict(config=config, experts=experts, hidden=c["hidden"], ffn=c["ffn"], topk=c["topk"])
    rows = []
    for name in variants:
        with utils.without_deepgemm() if name in NO_DEEPGEMM else contextlib.nullcontext():
            step, block = make_step(name, experts, c["hidden"], c["ffn"], c["topk"], tokens, fuse, "cuda")
            for _ in range(3):  # the graphs' capture, kernels compiled
                step()
            host, wall = utils.host_and_wall_ms(step, steps, torch.cuda.synchronize)
            gpu, launches = gpu_ms_and_launches(step, 5)
        rows.append(dict(shape, block=name, tokens=tokens, host_ms=host, wall_ms=wall, gpu_ms=gpu,
                         launches=launches, host_over_gpu=host / gpu))
        print(rows[-1], flush=True)
        del step, block
        torch.cuda.empty_cache()
    base = next((r["wall_ms"] for r in rows if r["block"] == BASELINE), None)
    for r in rows:
        if base:
            r["vs_bf16_grouped_mm"] = base / r["wall_ms"]
    return rows


def results_tail(config: str, suffix: str = "") -> str:
    """What follows ``bench_graphed_moe`` in the results' name: nothing at ``qwen3_moe_like``, else ``_<config>``;
    then ``suffix``."""
    return f"{'' if config == 'qwen3_moe_like' else '_' + config}{suffix}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(CONFIGS), default="qwen3_moe_like",
                        help="the layer's shapes (bench_host_time.CONFIGS)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per step instead of the config's")
    parser.add_argument("--experts", type=int, nargs="+", default=None,
                        help="local expert counts instead of the config's (the tokens shared out: rows per expert)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block (medians)")
    parser.add_argument("--fuse-wgrad-accumulation", action="store_true",
                        help="wgrad GEMMs add into main_grad (Megatron's --gradient-accumulation-fusion, with TE)")
    parser.add_argument("--variants", nargs="+", choices=[BASELINE, *VARIANTS, *NO_DEEPGEMM],
                        default=[BASELINE, *VARIANTS, *NO_DEEPGEMM])
    parser.add_argument("--suffix", default="", help="appended to the results' name (results_tail)")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # one (experts, tokens) point: its rows' JSON here
    args = parser.parse_args()
    c = CONFIGS[args.config]
    points = [(e, t) for e in args.experts or [c["experts"]] for t in args.tokens or c["tokens"]]
    if args.worker_out:
        (experts, tokens), = points
        rows = measure_point(args.config, experts, tokens, args.variants, args.steps, args.fuse_wgrad_accumulation)
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)
        return
    rows = []
    for experts, tokens in points:  # a fresh process each: its own allocator and compiled kernels
        argv = [__file__, "--config", args.config, "--experts", str(experts), "--tokens", str(tokens), "--steps",
                str(args.steps), "--variants", *args.variants]
        if args.fuse_wgrad_accumulation:
            argv.append("--fuse-wgrad-accumulation")
        rows += utils.in_fresh_processes(argv, 1)[0]
    path = utils.write_results(
        f"bench_graphed_moe{results_tail(args.config, args.suffix)}",
        "Host time vs GPU time of one FP8-Flow MoE layer step, eager and from CUDA graphs",
        {**utils.environment(), "fuse_wgrad_accumulation": args.fuse_wgrad_accumulation}, {}, rows,
        ["config", "experts", "hidden", "ffn", "topk", "tokens", "block", "host_ms", "wall_ms", "gpu_ms", "launches",
         "host_over_gpu", "vs_bf16_grouped_mm"],
        notes="host_ms: until backward() returns, from an idle GPU; wall_ms: until the GPU is done; gpu_ms: kernel "
              "time per step (torch profiler); medians over --steps steps. Local dispatcher, FP8 weights cached (a "
              "step's later micro-batches), Megatron DDP's main_grad and hook on every weight. launches: kernels "
              "launched by the host (a graphed step's come from its two graph launches). vs_bf16_grouped_mm: the "
              "eager BF16 grouped_mm block's wall_ms over the row's, same process and tokens. Each (experts, "
              "tokens) point runs in a fresh process.")
    print(path.read_text())


if __name__ == "__main__":
    main()
