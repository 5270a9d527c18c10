"""Two-step training runs through ``python -m examples.pretrain_gpt`` (compact CPU loop):
world size 1, expert parallelism 2 under gloo (spawned), checkpoint round trip of expert weights."""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

import json
import os

import torch
import torch.multiprocessing as mp

from conftest import TINY_GPT_ARGS, compact_loop_only, free_port
from examples import pretrain_gpt

pytestmark = compact_loop_only

MODEL = TINY_GPT_ARGS + ["--moe-aux-loss-coeff", "1e-2", "--text-max-bytes", "200000"]


def _run_rank(rank, world, port, argv):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    pretrain_gpt.main(argv)


def _summary(path):
    summary = json.loads(path.read_text())
    assert summary["steps"] == len(summary["loss_curve"]) == 2
    assert all(4.0 < loss < 7.0 for loss in summary["loss_curve"])  # ln(256) = 5.55 at start
    assert summary["tokens_per_s"] > 0 and summary["peak_memory_bytes"] > 0
    return summary


def test_two_steps_world_size_1(tmp_path, capsys):
    pretrain_gpt.main(MODEL + ["--summary-json", str(tmp_path / "s.json")])
    summary = _summary(tmp_path / "s.json")
    assert summary["world_size"] == 1 and not summary["moe_fp8_flow"]
    assert "no --data-path or --mock-data given: the Python standard library" in capsys.readouterr().out
    assert summary["expert_path"] == "experts: Megatron's SequentialMLP on cpu (plain torch matmuls)"


def test_two_steps_expert_parallel_2_and_checkpoint_round_trip(tmp_path):
    argv = MODEL + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                    "--summary-json", str(tmp_path / "s.json"), "--save", str(tmp_path / "ckpt")]
    mp.start_processes(_run_rank, args=(2, free_port(), argv), nprocs=2, start_method="spawn")
    summary = _summary(tmp_path / "s.json")
    assert summary["world_size"] == 2 and summary["expert_model_parallel_size"] == 2

    files = sorted((tmp_path / "ckpt" / "iter_0000002").iterdir())
    assert [f.name for f in files] == ["mp_rank_00_000.pt", "mp_rank_00_001.pt"]
    states = [torch.load(f, weights_only=True)["model"] for f in files]
    key = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert not torch.equal(states[0][key], states[1][key])  # each rank holds its own experts

    # Round trip: load at iteration 2 with --train-iters 2 (no step) and save again elsewhere.
    argv = argv[:-2] + ["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "again")]
    mp.start_processes(_run_rank, args=(2, free_port(), argv), nprocs=2, start_method="spawn")
    for saved in files:
        before = torch.load(saved, weights_only=True)
        after = torch.load(tmp_path / "again" / "iter_0000002" / saved.name, weights_only=True)
        assert before["model"].keys() == after["model"].keys()
        for name, tensor in before["model"].items():
            if isinstance(tensor, torch.Tensor):  # (the rest is Megatron's empty _extra_state)
                assert torch.equal(tensor, after["model"][name]), name
        assert before["optimizer"]["state"].keys() == after["optimizer"]["state"].keys()


FP8_FLOW = ("--fp8-format e4m3 --fp8-recipe blockwise --moe-fp8-flow --moe-grouped-gemm --moe-token-dispatcher-type "
            "alltoall --recompute-granularity selective --recompute-modules moe_expert").split()
FP8_MODEL = [a if a != "64" else "128" for a in MODEL] + ["--moe-ffn-hidden-size", "128"]  # 128-multiples


def test_fp8_flow_experts_are_in_use(tmp_path, monkeypatch):
    """Two steps with the full FP8-Flow flag set: the MoE layers are FP8FlowMoELayer with an FP8FlowMoE block,
    and every GroupedLinear call receives a Float8BlockwiseQTensor (fc1 from permute, fc2 from SwiGLU+quant)."""
    from examples import compact_loop
    from megatron_patches.experts import FP8FlowMoELayer
    from transformer_engine_moe import FP8FlowMoE, Float8BlockwiseQTensor, GroupedLinear

    seen, layers = [], []
    forward = GroupedLinear.forward

    def record(self, inp, *args):
        seen.append(type(inp))
        return forward(self, inp, *args)

    monkeypatch.setattr(GroupedLinear, "forward", record)
    build = compact_loop.build_model

    def build_and_record(args, vocab_size):
        model = build(args, vocab_size)
        layers.extend(m for m in model.modules() if isinstance(m, FP8FlowMoELayer))
        return model

    monkeypatch.setattr(compact_loop, "build_model", build_and_record)
    pretrain_gpt.main(FP8_MODEL + FP8_FLOW + ["--summary-json", str(tmp_path / "s.json")])
    summary = _summary(tmp_path / "s.json")
    assert summary["moe_fp8_flow"]
    assert summary["expert_path"].startswith("experts: FP8-Flow on cpu: the plain-PyTorch reference ops")
    assert len(layers) == 2 and all(isinstance(layer.experts, FP8FlowMoE) for layer in layers)
    assert layers[0].experts.recompute == "moe_expert"
    # 2 layers x 2 GEMMs x 2 steps, plus the moe_expert recompute in backward
    # 2 steps x 2 layers x (fc1, fc2, and fc1 again in moe_expert's rerun, which stops at fc2's saved input)
    assert len(seen) == 12 and all(t is Float8BlockwiseQTensor for t in seen)


def test_fp8_flow_two_steps_expert_parallel_2(tmp_path):
    """FP8-Flow experts at EP=2 under gloo: the block's all-to-all dispatcher sends FP8 tokens between the
    two spawned ranks; the expert weights' checkpoint keys are TE's (linear_fc1.weight{i})."""
    argv = FP8_MODEL + FP8_FLOW + ["--expert-model-parallel-size", "2", "--summary-json", str(tmp_path / "s.json"),
                                   "--save", str(tmp_path / "ckpt")]
    mp.start_processes(_run_rank, args=(2, free_port(), argv), nprocs=2, start_method="spawn")
    summary = _summary(tmp_path / "s.json")
    assert summary["moe_fp8_flow"] and summary["expert_model_parallel_size"] == 2
    states = [torch.load(f, weights_only=True)["model"]
              for f in sorted((tmp_path / "ckpt" / "iter_0000002").iterdir())]
    key = "decoder.layers.0.mlp.experts.linear_fc1.weight1"
    assert all(key in s for s in states) and not torch.equal(states[0][key], states[1][key])


def _reduce_grads_rank(rank, world, port, out):
    from examples import compact_loop
    from megatron_patches import apply
    from megatron_patches.cpu_shims import apply_cpu_shims

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args = compact_loop.parse_args(FP8_MODEL + FP8_FLOW + ["--expert-model-parallel-size", "2"])
    apply()
    apply_cpu_shims()
    compact_loop._init_distributed(args)
    torch.manual_seed(args.seed)
    model = compact_loop.build_model(args, 256)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(rank))
    model(tokens, torch.arange(64).expand(2, -1), None, labels=tokens).float().mean().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    compact_loop._reduce_grads(model)
    after = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    flags = {n: p.allreduce for n, p in model.named_parameters() if hasattr(p, "allreduce")}
    torch.save({"before": before, "after": after, "allreduce": flags}, f"{out}/rank{rank}.pt")


def test_expert_gradients_stay_on_their_expert_parallel_rank(tmp_path):
    """EP=2 on 2 ranks (data-parallel 2, expert data-parallel 1): the FP8-Flow block's parameters carry
    Megatron's ``allreduce=False``, so the gradient reduction averages dense gradients over both ranks and
    leaves each rank's expert gradients alone (averaging them would mix different experts)."""
    mp.start_processes(_reduce_grads_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    expert = [n for n in ranks[0]["before"] if ".mlp.experts." in n]
    dense = [n for n in ranks[0]["before"] if ".mlp.experts." not in n]
    assert len(expert) == 8 and dense
    assert all(ranks[0]["allreduce"][n] is False for n in expert)
    assert all(ranks[0]["allreduce"].get(n, True) for n in dense)
    for r in ranks:
        for n in expert:
            assert torch.equal(r["after"][n], r["before"][n]), n
    for n in dense:
        mean = (ranks[0]["before"][n] + ranks[1]["before"][n]) / 2
        assert torch.allclose(ranks[0]["after"][n], mean, rtol=1e-5, atol=1e-7), n


@pytest.mark.parametrize("extra, message", [
    (["--moe-fp8-flow-format", "hybrid"], "--moe-fp8-flow-format hybrid sets the FP8-Flow experts' format: it "
                                          "requires --moe-fp8-flow"),
    (["--hidden-size", "0"], "--hidden-size must be >= 1, got 0"),
    (["--max-position-embeddings", "32"], "--max-position-embeddings 32 must be >= --seq-length 64"),
    (["--data-path", "/nonexistent/corpus"], "--data-path: no indexed dataset at prefix '/nonexistent/corpus'"),
], ids=["format-without-fp8-flow", "hidden-0", "positions", "missing-data"])
def test_entry_point_refuses_before_building_anything(monkeypatch, capsys, extra, message):
    """``python -m examples.pretrain_gpt`` with a flag that would do nothing, a zero size, too few positions or a
    missing dataset exits naming the flag; training (process group, data, model) never starts."""
    from examples import compact_loop

    monkeypatch.setattr(compact_loop, "train", lambda args: pytest.fail("training started"))
    with pytest.raises(SystemExit):
        pretrain_gpt.main(TINY_GPT_ARGS + extra)
    assert message in capsys.readouterr().err
