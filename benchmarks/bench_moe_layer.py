"""The FP8-Flow MoE expert block vs the BF16 block (same parameters), EP=1, forward+backward, on the GPU.

DeepSeek-V3-like experts: hidden 7168, ffn 2048, top-8 routing over 8 or 32 local experts, 16384 tokens
(131072 routed rows). Step time (forward + backward of the block, router outside), peak memory, and the
activation bytes autograd keeps for backward, with and without ``moe_expert`` recompute. BF16 block:
per-expert cuBLAS BF16 GEMMs, float32 SwiGLU, the same permute/unpermute.

Run on a GPU: ``python benchmarks/bench_moe_layer.py``.
"""

from __future__ import annotations

import torch

from transformer_engine_moe.module import FP8FlowMoE, saved_activation_bytes

import utils

TOKENS, HIDDEN, FFN, TOPK = 16384, 7168, 2048, 8


def measure(model, x, ids, probs, dy) -> dict:
    def fwd_bwd():
        y = model.forward_topk(x, ids, probs)
        y.backward(dy)

    ms = utils.time_ms(fwd_bwd, 100, 1000)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    saved, y = saved_activation_bytes(lambda: model.forward_topk(x, ids, probs))
    y.backward(dy)
    peak = torch.cuda.max_memory_allocated() - base
    return dict(ms=ms, saved_gib=saved / 2**30, peak_gib=peak / 2**30)


def main():
    _, env, ceilings, _ = utils.start(__doc__.splitlines()[0])
    rows = []
    for experts in (8, 32):
        torch.manual_seed(0)
        fp8 = FP8FlowMoE(experts, HIDDEN, FFN, TOPK, device="cuda")
        bf16 = FP8FlowMoE(experts, HIDDEN, FFN, TOPK, device="cuda", precision="bf16")
        bf16.load_state_dict(fp8.state_dict())
        x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        probs, ids = torch.softmax(torch.randn(TOKENS, experts, device="cuda"), -1).topk(TOPK)
        dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
        res = {"bf16": measure(bf16, x, ids, probs, dy), "fp8_flow": measure(fp8, x, ids, probs, dy)}
        fp8.recompute = "moe_expert"
        res["fp8_flow+moe_expert"] = measure(fp8, x, ids, probs, dy)
        for name, r in res.items():
            rows.append(dict(experts=experts, block=name, **r, speedup_over_bf16=res["bf16"]["ms"] / r["ms"],
                             saved_vs_bf16=r["saved_gib"] / res["bf16"]["saved_gib"]))
        del fp8, bf16, x
        torch.cuda.empty_cache()
    path = utils.write_results(
        "bench_moe_layer", "MoE expert block forward+backward, EP=1", env, ceilings, rows,
        ["experts", "block", "ms", "speedup_over_bf16", "saved_gib", "saved_vs_bf16", "peak_gib"],
        notes=(f"{TOKENS} tokens, hidden {HIDDEN}, ffn {FFN}, top-{TOPK}, experts' rows padded to 512. saved_gib: "
               "distinct storages autograd keeps for backward (saved_tensors_hooks), parameters excluded. "
               "peak_gib: peak allocation above the inputs during one forward+backward."),
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
