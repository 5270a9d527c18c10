"""benchmarks/bench_moe_layer.py on the CPU: the shape table, its command line's checks and defaults, the rows
aggregated over processes (speedup per process, spread, skipped blocks), the blocks of those rows built and
stepped at toy size (TransformerEngine's skipped with the reason where it is absent)."""

import pytest
import torch

import bench_moe_layer as bench
from transformer_engine_moe import FP8FlowMoE


def test_shapes():
    q = bench.SHAPES["qwen3_moe_like"]
    assert (q.tokens, q.hidden, q.ffn, q.topk, q.experts) == (16384, 2048, 768, 8, (128,))
    assert q.rows_per_expert(128) == 1024 and q.processes >= 3
    d = bench.SHAPES["deepseek_v3"]
    assert (d.tokens, d.hidden, d.ffn, d.topk, d.experts) == (16384, 7168, 2048, 8, (8, 32, 64, 128))
    assert d.processes == 0 and d.rows_per_expert(8) == 16384


def test_arguments_default_to_the_shape():
    q = bench.parse_args(["--shape", "qwen3_moe_like"])
    assert (q.experts, q.processes, q.profile, q.priming_processes) == ([128], 3, [], 1)
    d = bench.parse_args([])
    assert (d.shape, d.experts, d.processes) == ("deepseek_v3", [8, 32, 64, 128], 0)
    alone = bench.parse_args(["--shape", "qwen3_moe_like", "--experts", "--profile"])  # the profile alone
    assert (alone.experts, alone.profile) == ([], [128])
    assert bench.parse_args(["--profile", "64", "--processes", "4"]).profile == [64]


@pytest.mark.parametrize("argv, message", [
    (["--shape", "qwen3"], "invalid choice"), (["--experts", "4"], "top-8"), (["--profile", "2"], "top-8"),
    (["--processes", "-1"], "--processes must be >= 0"), (["--rounds", "0"], "--rounds must be >= 1"),
    (["--priming-processes", "-1"], "--priming-processes must be >= 0, got -1"),
    (["--calls", "0"], "--calls must be >= 1"), (["--warmup", "0"], "--warmup must be >= 1")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def _process(ms: dict, skipped=None, rounds=None):
    return {"experts": {"128": dict(ms=ms, rounds_ms=rounds or {n: [v, v] for n, v in ms.items()},
                                    host_ms={n: 1.0 for n in ms}, skipped=skipped or {})}, "gpu_state": [{}, {}],
            "host_load": [{}, {}]}


def test_priming_processes_are_left_out_of_the_rows():
    """The priming processes' speedups per block, kept apart (``main`` passes the rest to ``process_rows``)."""
    priming = [_process({"bf16_grouped_mm": 15.0, "fp8_flow": 12.0})]
    assert bench.priming_speedups("qwen3_moe_like", priming) == {
        "128": {"bf16_grouped_mm": [1.0], "fp8_flow": [1.25]}}
    assert bench.priming_speedups("qwen3_moe_like", []) == {}


def test_rows_over_processes():
    why = {"te_bf16": "ImportError: no TE", "te_blockwise": "ImportError: no TE"}
    per_process = [_process({"bf16_grouped_mm": 15.0, "fp8_flow": 10.0}, why,
                            rounds={"bf16_grouped_mm": [15.0, 15.0], "fp8_flow": [9.0, 10.0, 11.0]}),
                   _process({"bf16_grouped_mm": 16.0, "fp8_flow": 8.0}, why),
                   _process({"bf16_grouped_mm": 15.6, "fp8_flow": 12.0}, why)]
    rows = {r["block"]: r for r in bench.process_rows("qwen3_moe_like", per_process, list(bench.VARIANTS))}
    fp8 = rows["fp8_flow"]
    assert fp8["shape"] == "qwen3_moe_like" and fp8["experts"] == 128 and fp8["rows_per_expert"] == 1024
    assert fp8["fp8_weights"] == "cached" and fp8["processes"] == 3
    assert fp8["speedup_per_process"] == pytest.approx([1.5, 2.0, 1.3]) and fp8["speedup_over_bf16_grouped_mm"] == 1.5
    assert fp8["speedup_spread"] == pytest.approx(0.7 / 1.5) and fp8["ms"] == 10.0
    assert fp8["within_process_spread"] == 0.0  # the median of 0.2, 0, 0
    assert rows["bf16_grouped_mm"]["fp8_weights"] == "" and rows["bf16_grouped_mm"]["speedup_over_bf16_grouped_mm"] == 1
    assert rows["te_blockwise"] == dict(shape="qwen3_moe_like", experts=128, rows_per_expert=1024,
                                        block="te_blockwise", fp8_weights="cached", skipped="ImportError: no TE")
    assert "fp8_flow_requant" not in rows  # neither measured nor skipped: no row


def test_weights_modes_of_the_rows():
    assert {n: w for n, (w, _) in bench.VARIANTS.items()} == {
        "bf16_grouped_mm": "uncached", "fp8_flow": "cached", "fp8_flow_requant": "requantized",
        "fp8_flow+moe_expert": "cached", "fp8_flow_per_expert": "cached", "te_bf16": "uncached", "te_blockwise": "cached"}
    assert set(bench.OPTIONAL) == {"te_bf16", "te_blockwise"}


def test_the_blocks_of_the_rows_build_and_step_at_toy_size():
    """Each block of the rows over one FP8-Flow block's parameters, stepped in its timed mode: the same
    experts (outputs of the FP8 blocks within FP8 tolerance of the BF16 block's, the twins bitwise the
    block's with fresh caches), and TE's blocks skipped with the reason: on CPU tensors they are refused before
    TE is touched (on a GPU runner with TE installed, trying them on these CPU tensors was followed by an illegal
    memory access that failed every later CUDA test of the process)."""
    torch.manual_seed(0)
    block = FP8FlowMoE(4, 128, 128, 2, single_grouped_weight=True)  # the rows' layout
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    probs, ids = torch.softmax(torch.randn(32, 4), -1).topk(2)
    data = (x, ids, probs, torch.randn(32, 128, dtype=torch.bfloat16))
    steps, skipped = bench.build_variants(list(bench.VARIANTS), block, data, warmup=2, sync=lambda: None)
    assert set(steps) | set(skipped) == set(bench.VARIANTS)
    assert set(skipped) == set(bench.OPTIONAL)
    assert all(r.startswith("ValueError") and "need CUDA weights" in r and r.endswith("got cpu")
               for r in skipped.values())
    outs = {}
    for name, (_, make) in bench.VARIANTS.items():
        if name in steps:
            model = make(block)
            outs[name] = model.forward_topk(x, ids, probs, is_first_microbatch=None).float()
            assert all(p.device.type == "cpu" for p in model.parameters())
    ref = outs["bf16_grouped_mm"]
    for name in ("fp8_flow", "fp8_flow_requant", "fp8_flow+moe_expert"):
        assert 0 < ((outs[name] - ref).norm() / ref.norm()).item() < 0.1, name
    assert torch.equal(outs["fp8_flow_requant"], outs["fp8_flow"])
    assert torch.equal(outs["fp8_flow_per_expert"], outs["fp8_flow"])  # the other layout: same arithmetic
    with pytest.raises(RuntimeError):  # a failure of a block that is not optional is not skipped
        bench.build_variants(["fp8_flow"], block, (x, ids, probs, torch.ones(3)), warmup=1, sync=lambda: None)
