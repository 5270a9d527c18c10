"""The FP8-Flow MoE expert block vs the BF16 block and today's blockwise FP8 with casts, EP=1, on the GPU.

DeepSeek-V3-like experts: hidden 7168, ffn 2048, top-8 routing over 8 or 32 local experts, 16384 tokens
(131072 routed rows). Step time (forward + backward of the block, router outside; FP8 weights quantized
once per step, as on a step's first micro-batch, and reused by the moe_expert rerun), peak memory, and the
activation bytes autograd keeps for backward, with and without ``moe_expert`` recompute, for the same
parameters in every block. BF16 block: per-expert cuBLAS BF16 GEMMs, float32 SwiGLU, the same
permute/unpermute. Blockwise with casts: BF16 between ops, each GEMM quantizing its BF16 input (as
TransformerEngine's Float8BlockScaling with Megatron). Writes a PNG next to the tables.

Run on a GPU: ``python benchmarks/bench_moe_layer.py``.
"""

from __future__ import annotations

import torch

from transformer_engine_moe.module import FP8FlowMoE, saved_activation_bytes

import utils

TOKENS, HIDDEN, FFN, TOPK = 16384, 7168, 2048, 8


def measure(model, x, ids, probs, dy) -> dict:
    def fwd_bwd():  # one micro-batch per step: the FP8 weights are quantized once per step
        y = model.forward_topk(x, ids, probs, is_first_microbatch=True)
        y.backward(dy)

    ms = utils.time_ms(fwd_bwd, 100, 1000)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    saved, y = saved_activation_bytes(lambda: model.forward_topk(x, ids, probs, is_first_microbatch=True))
    y.backward(dy)
    peak = torch.cuda.max_memory_allocated() - base
    return dict(ms=ms, saved_gib=saved / 2**30, peak_gib=peak / 2**30)


def main():
    _, env, ceilings, _ = utils.start(__doc__.splitlines()[0])
    rows = []
    for experts in (8, 32):
        torch.manual_seed(0)
        block = FP8FlowMoE(experts, HIDDEN, FFN, TOPK, device="cuda")
        x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        probs, ids = torch.softmax(torch.randn(TOKENS, experts, device="cuda"), -1).topk(TOPK)
        dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
        res = {}
        for name, precision, recompute in (("bf16", "bf16", None), ("blockwise_casts", "blockwise_casts", None),
                                           ("fp8_flow", "fp8_flow", None),
                                           ("fp8_flow+moe_expert", "fp8_flow", "moe_expert")):
            block.precision, block.recompute = precision, recompute
            res[name] = measure(block, x, ids, probs, dy)
        for name, r in res.items():
            rows.append(dict(experts=experts, block=name, **r, speedup_over_bf16=res["bf16"]["ms"] / r["ms"],
                             speedup_over_casts=res["blockwise_casts"]["ms"] / r["ms"],
                             saved_vs_bf16=r["saved_gib"] / res["bf16"]["saved_gib"]))
        del block, x
        torch.cuda.empty_cache()
    path = utils.write_results(
        "bench_moe_layer", "MoE expert block forward+backward, EP=1", env, ceilings, rows,
        ["experts", "block", "ms", "speedup_over_bf16", "speedup_over_casts", "saved_gib", "saved_vs_bf16",
         "peak_gib"],
        notes=(f"{TOKENS} tokens, hidden {HIDDEN}, ffn {FFN}, top-{TOPK}, experts' rows padded to 512. saved_gib: "
               "distinct storages autograd keeps for backward (saved_tensors_hooks), parameters excluded. "
               "peak_gib: peak allocation above the inputs during one forward+backward."),
    )
    print(path.read_text())
    plot(rows, path.with_suffix(".png"))


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = list(dict.fromkeys(r["block"] for r in rows))
    experts = list(dict.fromkeys(r["experts"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(blocks)
    for i, b in enumerate(blocks):
        for ax, key in zip(axes, ("ms", "saved_gib")):
            vals = [next(r[key] for r in rows if r["block"] == b and r["experts"] == e) for e in experts]
            ax.bar([j + i * width for j in range(len(experts))], vals, width, label=b)
    for ax, title in zip(axes, ("forward+backward step (ms)", "activations kept for backward (GiB)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(experts))], [f"{e} experts" for e in experts])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"MoE expert block, EP=1, {TOKENS} tokens, hidden {HIDDEN}, ffn {FFN}, top-{TOPK}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
