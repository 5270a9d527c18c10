"""benchmarks/bench_megatron_pretrain.py on the CPU: the two production-proportioned configurations (their flags,
parameter counts and the layers that fit), the runs' command lines (EP = GPU count, the stand-in and FP8-Flow
variants, TE's path or the local one with the SDPA core, probes in the first run only), Megatron's log and the
entry's ``bench:`` lines parsed into a row, repeats combined with the probe run's fields, the results files, the
``--profile`` runs and their table (from fake profiles), and a run past its time limit killed with its children."""

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_megatron_pretrain as bench  # noqa: E402
import megatron_configs as configs  # noqa: E402
from test_kernel_profile import PROFILES, row_of  # noqa: E402

H100, H200 = 81559 * 2**20, 143771 * 2**20  # nvidia-smi's memory.total, MiB


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def _cmd(config="qwen3_moe_like", variant="fp8_flow", gpus=1, **kw):
    kw.setdefault("layers", 4)
    return bench.command(config, variant, gpus, 3, micro_batch_size=configs.CONFIGS[config].micro_batch_size, **kw)


def test_qwen3_moe_like_is_qwen3_30b_a3b_layer():
    cmd = _cmd("qwen3_moe_like")
    assert (_flag(cmd, "--hidden-size"), _flag(cmd, "--num-attention-heads"), _flag(cmd, "--num-query-groups"),
            _flag(cmd, "--kv-channels")) == ("2048", "32", "4", "128")
    assert (_flag(cmd, "--num-experts"), _flag(cmd, "--moe-ffn-hidden-size"), _flag(cmd, "--moe-router-topk")) == (
        "128", "768", "8")
    assert "--group-query-attention" in cmd and "--multi-latent-attention" not in cmd
    assert _flag(cmd, "--seq-length") == "4096" and _flag(cmd, "--micro-batch-size") == "4"  # 1024 rows per expert
    assert _flag(_cmd("qwen3_moe_like", gpus=4), "--num-experts") == "128"  # the model's 128, split by EP


def test_dsv3_ep8_rank_is_one_expert_parallel_rank_of_deepseek_v3():
    cmd = _cmd("dsv3_ep8_rank", layers=1)
    mla = ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim")
    assert [_flag(cmd, f) for f in mla] == ["1536", "512", "128", "64", "128"] and "--multi-latent-attention" in cmd
    assert (_flag(cmd, "--hidden-size"), _flag(cmd, "--num-attention-heads")) == ("7168", "128")
    assert _flag(cmd, "--moe-shared-expert-intermediate-size") == _flag(cmd, "--moe-ffn-hidden-size") == "2048"
    assert _flag(cmd, "--num-experts") == "32" and _flag(cmd, "--micro-batch-size") == "1"
    assert _flag(_cmd("dsv3_ep8_rank", gpus=8, layers=1), "--num-experts") == "256"  # V3's 256 at EP=8, 32 per GPU
    assert "--group-query-attention" not in cmd


def test_parameter_counts():
    qwen, v3 = configs.CONFIGS["qwen3_moe_like"], configs.CONFIGS["dsv3_ep8_rank"]
    experts = 128 * 3 * 2048 * 768
    attention = 2048 * (32 + 8) * 128 + 32 * 128 * 2048 + 2 * 128
    assert qwen.layer_params(1) == experts + attention + 2 * 2048 + 2048 * 128
    assert qwen.layer_params(4) == qwen.layer_params(1) - 96 * 3 * 2048 * 768  # 32 local experts
    mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168 + 1536 + 512
    assert v3.attention_params() == mla
    assert v3.layer_params(1) == mla + 2 * 7168 + 7168 * 32 + 3 * 7168 * (32 * 2048 + 2048)
    assert v3.layer_params(8) == v3.layer_params(1) + 7168 * (256 - 32)  # only the router grows


@pytest.mark.parametrize("config, gpu, layers", [("qwen3_moe_like", H100, 4), ("qwen3_moe_like", H200, 9),
                                                 ("dsv3_ep8_rank", H100, 1), ("dsv3_ep8_rank", H200, 3)])
def test_layers_that_fit(config, gpu, layers):
    c = configs.CONFIGS[config]
    assert configs.layers_that_fit(c, gpu, 1, c.micro_batch_size) == layers
    assert max(configs.memory_needed(c, layers, 1, c.micro_batch_size)) <= configs.MEMORY_FRACTION * gpu or \
        layers == c.min_layers
    assert max(configs.memory_needed(c, layers + 1, 1, c.micro_batch_size)) > configs.MEMORY_FRACTION * gpu


def test_memory_model():
    c = configs.CONFIGS["dsv3_ep8_rank"]
    one, two = configs.memory_needed(c, 1, 1, 1), configs.memory_needed(c, 2, 1, 1)
    params = c.layer_params(1)
    assert two[1] - one[1] == (configs.PARAM_BYTES + configs.STEP_TEMP_BYTES) * params  # 22 bytes per parameter
    assert two[0] - one[0] == 19 * params + 4096 * c.activation_bytes_per_token()
    assert configs.memory_needed(c, 1, 1, 2)[0] - one[0] == 4096 * (c.activation_bytes_per_token() + 10 * 32768)
    assert configs.layers_that_fit(configs.CONFIGS["qwen3_moe_like"], 1e9, 1, 4) == 4  # never below the minimum


def test_variants_and_paths(monkeypatch):
    monkeypatch.setattr(bench, "apex_wgrad_fusion", lambda: False)
    cmd = _cmd(variant="bf16_grouped_mm")
    assert cmd[:4] == ["torchrun", "--nproc_per_node", "1", "--master_port"] and 0 < int(cmd[4]) < 65536
    assert cmd[5].endswith("benchmarks/megatron_bench_entry.py")
    assert cmd[6:8] == ["--bench-grouped-mm", "--bench-sdpa-attention"] and "--moe-fp8-flow" not in cmd
    assert _flag(cmd, "--transformer-impl") == "local" and "--no-gradient-accumulation-fusion" in cmd
    flow = _cmd(variant="fp8_flow_single_weight_moe_expert")
    assert "--bench-grouped-mm" not in flow and "--bench-sdpa-attention" in flow
    assert {"--moe-fp8-flow", "--moe-fp8-flow-single-grouped-weight"} <= set(flow)
    assert _flag(flow, "--moe-fp8-flow-format") == "e4m3" and "--fp8-format" not in flow  # dense layers BF16
    assert _flag(flow, "--recompute-modules") == "moe_expert"
    assert _flag(flow, "--moe-token-dispatcher-type") == "alltoall"
    te = _cmd(variant="fp8_flow_single_weight_te_blockwise", te=True)
    assert _flag(te, "--transformer-impl") == "transformer_engine" and "--bench-sdpa-attention" not in te
    assert _flag(te, "--fp8-format") == "e4m3" and "--moe-fp8-flow" in te  # TE's FP8 for the dense layers
    assert "--no-gradient-accumulation-fusion" in te and "--no-masked-softmax-fusion" not in te
    monkeypatch.setattr(bench, "apex_wgrad_fusion", lambda: True)  # Megatron's output layer can then fuse too
    assert "--no-gradient-accumulation-fusion" not in _cmd(variant="te_bf16", te=True)
    assert (_flag(_cmd(variant="te_blockwise", te=True), "--fp8-recipe"), "--moe-fp8-flow" in _cmd(
        variant="te_blockwise", te=True)) == ("blockwise", False)
    with pytest.raises(ValueError, match="TE is not installed"):
        _cmd(variant="te_bf16")
    with pytest.raises(ValueError, match="variant one of"):
        _cmd(variant="fp8")


def test_global_batch_accumulates_micro_batches_and_probes_go_to_one_run():
    cmd = _cmd(gpus=2, micro_batches=32)
    assert (_flag(cmd, "--global-batch-size"), _flag(cmd, "--expert-model-parallel-size")) == (str(2 * 4 * 32), "2")
    assert (_flag(cmd, "--train-iters"), _flag(cmd, "--log-interval")) == ("3", "1")
    assert not any(a.startswith("--bench-probe") or a.startswith("--bench-max") for a in cmd)
    probed = _cmd(variant="fp8_flow_single_weight", probe=True, search_cap=16)
    assert "--bench-probe-memory" in probed and _flag(probed, "--bench-max-micro-batch-cap") == "16"
    per_expert = _cmd(variant="fp8_flow", probe=True)  # activation probe, no search
    assert "--bench-probe-memory" in per_expert and "--bench-max-micro-batch-cap" not in per_expert
    assert not any(a.startswith("--bench-profile") for a in cmd + probed)
    profiled = _cmd(profile_out="/tmp/p.json")  # the last of the run's 3 iterations
    assert (_flag(profiled, "--bench-profile-iteration"), _flag(profiled, "--bench-profile-out")) == (
        "3", "/tmp/p.json")


@pytest.mark.parametrize("config", configs.CONFIGS)
@pytest.mark.parametrize("variant", [v for v in bench.VARIANTS if v.startswith("fp8_flow")])
def test_fp8_flow_runs_pass_fp8_flow_validation(config, variant):
    pytest.importorskip("megatron.core", reason="the compact loop's parser needs megatron-core")
    from examples.compact_loop import build_parser
    from megatron_patches.arguments import validate_fp8_flow_args

    gpus = 1 if "--moe-fp8-flow-cuda-graph" in bench.VARIANTS[variant].flags else 4  # the graphs: EP=1 only
    cmd = _cmd(config, variant, gpus=gpus, te=bench.VARIANTS[variant].te)
    args, _ = build_parser().parse_known_args(cmd[6:])
    validate_fp8_flow_args(args)
    assert args.moe_fp8_flow and args.hidden_size % 128 == 0 and args.moe_ffn_hidden_size % 128 == 0


@pytest.mark.parametrize("config", configs.CONFIGS)
def test_commands_pass_megatrons_own_validation(config):
    """Where megatron.training (megatron-core 0.19, Python 3.12) imports: every command parses and validates
    with Megatron's own argument code and builds its TransformerConfig."""
    pytest.importorskip("megatron.training", reason="megatron.training (megatron-core >= 0.19, Python 3.12) absent")
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_args, validate_args

    import megatron_bench_entry
    import megatron_patches
    from megatron_patches.arguments import add_fp8_flow_args, resolve_fp8_flow_format

    megatron_patches.apply()
    te = bench.transformer_engine_version() is not None
    for variant in [v for v, spec in bench.VARIANTS.items() if te or not spec.te]:
        _, rest = megatron_bench_entry.parse_bench_args(_cmd(config, variant, probe=True, te=te)[6:])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "argv", ["pretrain", *rest])
            args = parse_args(add_fp8_flow_args)
        validate_args(args, {"tokenizer_type": "NullTokenizer", "vocab_size": 256})
        resolve_fp8_flow_format(args)
        assert gpt_config_from_args(args).transformer.num_layers == 4


LOG = """\
experts: FP8-Flow on cuda:0: Triton kernels; grouped GEMMs 'auto', per call the first that can run it: fprop/dgrad DeepGEMM
 [2026-11-26 10:00:00] iteration        1/       3 | consumed samples: 128 | elapsed time per iteration (ms): 9000.0 | lm loss: 1.050000E+01 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 9000.0 | max allocated: 14100.5 | reserved: 15000.0
 [2026-11-26 10:00:05] iteration        2/       3 | consumed samples: 256 | elapsed time per iteration (ms): 4000.0 | lm loss: 9.000000E+00 |
 [2026-11-26 10:00:09] iteration        3/       3 | consumed samples: 384 | elapsed time per iteration (ms): 4200.0 | lm loss: 8.000000E+00 |
bench: {"optimizer": "torch.optim.adamw.AdamW (foreach) in Float16OptimizerWithFloat16Params", "gradient_accumulation_fusion": false, "attention": "torch SDPA core: flash"}
bench: {"activation_mib_per_moe_layer": 812.5, "activation_mib_moe_layers": [812.0, 813.0], "step_activation_peak_mib": 9100.0, "probed_micro_batch": 33}
bench: {"max_micro_batch": 11, "max_micro_batch_capped": false, "max_micro_batch_tries": [[4, true], [8, true], [16, false], [12, false], [10, true], [11, true]]}
bench: {not json
allocator (rank 0): retries 0, reserved peak 70000.0 MiB
"""


def test_parse_log_reads_megatrons_lines_and_the_entrys_facts():
    row = bench.parse_log(LOG, tokens_per_iter=32 * 4 * 4096, gpus=1, warmup=1)
    assert row["iter_ms"] == 4100.0 and row["timed_iters"] == 2  # iterations 2 and 3: after the first
    assert row["iter_ms_each"] == [9000.0, 4000.0, 4200.0]
    assert bench.parse_log(LOG, 32 * 4 * 4096, 1)["timed_iters"] == 1  # by default the first two are untimed
    assert row["tokens_per_s_per_gpu"] == pytest.approx(32 * 4 * 4096 / 4.1)
    assert row["max_allocated_mib"] == 14100.5 and row["curve_iters"] == [1, 2, 3]
    assert row["optimizer"].startswith("torch.optim.adamw.AdamW (foreach)")
    assert row["attention"] == "torch SDPA core: flash"
    assert (row["activation_mib_per_moe_layer"], row["step_activation_peak_mib"], row["max_micro_batch"]) == (
        812.5, 9100.0, 11)
    assert row["max_micro_batch_tries"][2] == [16, False] and row["alloc_retries"] == 0
    # the activation probe reset the peak counter: the peak it kept before counts when it is higher
    kept = 'bench: {"peak_before_probe_mib": %s, "peak_before_optimizer_mib": 13000.0}\n'
    assert bench.parse_log(LOG + kept % 15000.25, 1, 1)["max_allocated_mib"] == 15000.25
    assert bench.parse_log(LOG + kept % 12000.0, 1, 1)["max_allocated_mib"] == 14100.5
    with pytest.raises(ValueError, match="no 'iteration"):
        bench.parse_log("Traceback ...", 1, 1)


TORCHRUN_REPORT = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
benchmarks/megatron_bench_entry.py FAILED
"""


def test_outcome_keeps_a_failed_runs_log_tail_and_root_cause_with_what_it_logged():
    ok = bench.outcome("ok", LOG, 128 * 4096, 1, warmup=1)
    assert "log_tail" not in ok and "error" not in ok and ok["iter_ms"] == 4100.0
    oom = "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.00 GiB"
    failed = bench.outcome("exit 1", LOG + "Traceback (most recent call last):\n" + oom + "\n" + TORCHRUN_REPORT,
                           128 * 4096, 1)
    assert failed["final_loss"] == 8.0 and failed["log_tail"].endswith("FAILED\n")
    assert failed["error"] == oom and failed["tokens_per_s_per_gpu"] is None and failed["iter_ms"] is None
    assert bench.outcome("ok", "no iterations", 1, 1) == {"log_tail": "no iterations", "error": ""}
    # NaN gradients: Megatron's rerun state machine reports them, then asks for a checkpoint (TypeError without
    # --save); the row names the NaN, not the TypeError (the graph variant's H200 run, 2026-11-27)
    nan = ("ERROR:megatron.core.rerun_state_machine:Unexpected result nan on rank 0 at iteration #3 invocation #1 "
           "(message='found NaN in local grad norm for bucket #0 in backward pass before data-parallel "
           "communication collective')")
    stopped = bench.outcome("exit 1", LOG + nan + "\n[rank0]: TypeError: expected str, bytes or os.PathLike "
                            "object, not NoneType\n" + TORCHRUN_REPORT, 128 * 4096, 1)
    assert stopped["error"].startswith("Unexpected result nan on rank 0") and "found NaN" in stopped["error"]


def test_combine_takes_the_median_and_the_probe_runs_fields():
    probe = dict(tokens_per_s_per_gpu=90.0, iter_ms=11.1, activation_mib_per_moe_layer=800.0, max_micro_batch=11)
    runs = [probe, dict(tokens_per_s_per_gpu=None, status="timed out"), dict(tokens_per_s_per_gpu=130.0, iter_ms=7.7)]
    row = bench.combine(runs)
    assert (row["tokens_per_s_per_gpu"], row["repeats"], row["tokens_per_s_runs"]) == (110.0, 3, [90.0, None, 130.0])
    assert row["tokens_per_s_spread"] == pytest.approx(40 / 110) and row["iter_ms"] == pytest.approx((11.1 + 7.7) / 2)
    assert (row["activation_mib_per_moe_layer"], row["max_micro_batch"]) == (800.0, 11)
    assert "activation_mib_per_moe_layer" not in bench.combine(runs[1:])
    assert bench.combine([dict(tokens_per_s_per_gpu=None, status="timed out")]) == dict(
        tokens_per_s_per_gpu=None, status="timed out", repeats=1, tokens_per_s_runs=[None])


def _fake_machine(monkeypatch, tmp_path, speeds, te=None):
    """``main`` with fake runs (``speeds[variant]``: tokens/s per run in order, None = failed) on a fake H100;
    the list of ``(variant, probed)`` in the order they ran."""
    order = []

    def fake_run(cmd, timeout):  # ``speeds`` holds the stand-in and at most one other variant
        variant = next(v for v in speeds if ("--bench-grouped-mm" in cmd) == bench.VARIANTS[v].grouped_mm)
        order.append((variant, "--bench-probe-memory" in cmd))
        speed = speeds[variant][len([v for v, _ in order if v == variant]) - 1]
        return ("ok" if speed else "exit 1"), speed

    def fake_outcome(status, speed, tokens_per_iter, gpus, warmup):
        return dict(tokens_per_s_per_gpu=speed, iter_ms=1e3 / speed if speed else None, final_loss=1.0)

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "outcome", fake_outcome)
    monkeypatch.setattr(bench, "gpu_facts", lambda: {"device": "NVIDIA H100 80GB HBM3", "gpu_memory_mib": 81559})
    monkeypatch.setattr(bench, "transformer_engine_version", lambda: te)
    monkeypatch.setattr(bench.utils, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench.utils, "environment", lambda device: dict(device))
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench, "plot", lambda rows, path: path.write_bytes(b"png"))
    return order


def test_repeats_interleave_the_variants_probe_the_first_and_write_after_every_run(tmp_path, monkeypatch):
    speeds = {"bf16_grouped_mm": [100.0, 120.0, 110.0], "fp8_flow_single_weight": [90.0, None, 130.0]}
    order = _fake_machine(monkeypatch, tmp_path, speeds)
    bench.main(["--variants", "bf16_grouped_mm", "fp8_flow_single_weight", "--repeats", "3"])
    assert order == [("bf16_grouped_mm", True), ("fp8_flow_single_weight", True)] + [
        ("bf16_grouped_mm", False), ("fp8_flow_single_weight", False)] * 2
    results = json.loads((tmp_path / "bench_megatron_pretrain_qwen3_moe_like_ep1.json").read_text())
    bf16, fp8 = results["results"]
    assert (bf16["tokens_per_s_per_gpu"], bf16["layers"], bf16["micro_batches"], bf16["micro_batch_size"]) == (
        110.0, 4, 32, 4)
    assert fp8["tokens_per_s_per_gpu"] == 110.0 and fp8["vs_bf16_grouped_mm"] == pytest.approx(1.0)
    assert results["environment"]["transformer_engine"] == "absent"
    md = (tmp_path / "bench_megatron_pretrain_qwen3_moe_like_ep1.md").read_text()
    assert "| qwen3_moe_like | fp8_flow_single_weight | ok | 4 | 4 | 32 | 110 | 1.000 |" in md
    assert (tmp_path / "bench_megatron_pretrain_qwen3_moe_like_ep1.png").exists()


def test_transformer_engines_path_writes_a_table_of_its_own(tmp_path, monkeypatch):
    """With TE importable every run takes TE's path (its attention, optimizer and linears): its rows go to
    ``..._te``, so a call with TE never mixes its rows into the local path's table (nor replaces them)."""
    (tmp_path / "bench_megatron_pretrain_qwen3_moe_like_ep1.json").write_text(json.dumps({"results": [
        dict(config="qwen3_moe_like", variant="bf16_grouped_mm", tokens_per_s_per_gpu=50.0)]}))
    _fake_machine(monkeypatch, tmp_path, {"bf16_grouped_mm": [100.0]}, te="2.20.0")
    bench.main(["--variants", "bf16_grouped_mm", "--repeats", "1"])
    te_rows = json.loads((tmp_path / "bench_megatron_pretrain_qwen3_moe_like_ep1_te.json").read_text())
    assert [r["tokens_per_s_per_gpu"] for r in te_rows["results"]] == [100.0]
    assert te_rows["environment"]["transformer_engine"] == "2.20.0"
    local = json.loads((tmp_path / "bench_megatron_pretrain_qwen3_moe_like_ep1.json").read_text())
    assert [r["tokens_per_s_per_gpu"] for r in local["results"]] == [50.0]


def test_a_table_holds_one_device_and_layer_count(tmp_path, monkeypatch):
    """Stored rows of another GPU (an H200's 3 layers) stop an H100 call before it runs anything; --results-tag
    writes the call's rows to a table of their own and leaves the stored one as it was."""
    stored = tmp_path / "bench_megatron_pretrain_qwen3_moe_like_ep1.json"
    stored.write_text(json.dumps({"results": [dict(config="qwen3_moe_like", variant="bf16_grouped_mm", layers=3,
                                                   device="NVIDIA H200", tokens_per_s_per_gpu=50.0)]}))
    order = _fake_machine(monkeypatch, tmp_path, {"bf16_grouped_mm": [100.0]})
    with pytest.raises(SystemExit, match=r"holds rows of \(device, layers\) \[\('NVIDIA H200', 3\)\].*--results-tag"):
        bench.main(["--variants", "bf16_grouped_mm", "--repeats", "1"])
    assert order == []
    bench.main(["--variants", "bf16_grouped_mm", "--repeats", "1", "--results-tag", "h100"])
    tagged = json.loads((tmp_path / "bench_megatron_pretrain_qwen3_moe_like_ep1_h100.json").read_text())
    assert [(r["device"], r["tokens_per_s_per_gpu"]) for r in tagged["results"]] == [("NVIDIA H100 80GB HBM3", 100.0)]
    assert json.loads(stored.read_text())["results"][0]["tokens_per_s_per_gpu"] == 50.0
    with pytest.raises(SystemExit):
        bench.main(["--variants", "bf16_grouped_mm", "--results-tag", "../x"])


def test_time_budget_stops_starting_runs(tmp_path, monkeypatch):
    order = _fake_machine(monkeypatch, tmp_path, {"bf16_grouped_mm": [100.0] * 3})
    now, fake_run = [0.0], bench.run

    def run_100_s(cmd, timeout):
        now[0] += 100
        return fake_run(cmd, timeout)

    monkeypatch.setattr(bench, "run", run_100_s)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    bench.main(["--variants", "bf16_grouped_mm", "--repeats", "3", "--time-budget", "250"])
    assert len(order) == 2  # a third would end past 250 s


def test_te_variants_need_transformer_engine(tmp_path, monkeypatch):
    _fake_machine(monkeypatch, tmp_path, {"te_bf16": [1.0]})
    with pytest.raises(SystemExit, match="need TransformerEngine"):
        bench.main(["--variants", "te_bf16"])
    with pytest.raises(SystemExit):
        bench.main(["--train-iters", "2"])  # nothing left to time after the two untimed


def test_gpu_facts_read_nvidia_smi(monkeypatch):
    class Done:
        stdout = "NVIDIA H100 80GB HBM3, 81559\nNVIDIA H100 80GB HBM3, 81559\n"

    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: Done())
    assert bench.gpu_facts() == {"device": "NVIDIA H100 80GB HBM3", "gpu_memory_mib": 81559}

    class Props:
        name, total_memory = "NVIDIA H200", 143771 * 2**20

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(bench.subprocess, "run", missing)
    monkeypatch.setattr(bench.torch.cuda, "get_device_properties", lambda i: Props())
    facts = bench.gpu_facts()
    assert (facts["device"], facts["gpu_memory_mib"]) == ("NVIDIA H200", 143771) and "CUDA context" in facts["gpu_facts"]


def test_plot_draws_speed_activation_and_micro_batch_panels(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    bars = []
    monkeypatch.setattr(matplotlib.axes.Axes, "barh", lambda self, labels, widths, **kw: bars.append(
        (list(labels), list(widths), kw.get("xerr"))))
    rows = [dict(config="qwen3_moe_like", variant="bf16_grouped_mm", tokens_per_s_per_gpu=100.0,
                 tokens_per_s_runs=[90.0, 100.0, 120.0], activation_mib_per_moe_layer=800.0, max_micro_batch=8),
            dict(config="qwen3_moe_like", variant="fp8_flow", tokens_per_s_per_gpu=None, tokens_per_s_runs=[None],
                 status="timed out"),
            dict(config="qwen3_moe_like", variant="fp8_flow_single_weight", tokens_per_s_per_gpu=110.0,
                 tokens_per_s_runs=[None, 110.0], activation_mib_per_moe_layer=700.0)]
    bench.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    speed, act, mb = bars
    assert speed[:2] == (["bf16_grouped_mm", "fp8_flow_single_weight"], [100.0, 110.0])
    assert speed[2] == [[10.0, 0.0], [20.0, 0.0]]  # the bar's line spans the runs that finished
    assert act[:2] == (["bf16_grouped_mm", "fp8_flow_single_weight"], [800.0, 700.0])
    assert mb[:2] == (["bf16_grouped_mm"], [8])


def test_a_run_past_its_time_limit_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "child_alive"
    began = time.perf_counter()
    status, _ = bench.run(["bash", "-c", f"(sleep 3; touch {marker}) & sleep 30"], timeout=1)
    assert status == "timed out" and time.perf_counter() - began < 10
    time.sleep(3)
    assert not marker.exists()  # the background child went with the group
    assert bench.run([sys.executable, "-c", "print('iteration')"], timeout=30) == ("ok", "iteration\n")
    assert bench.run([sys.executable, "-c", "raise SystemExit(3)"], timeout=30)[0] == "exit 3"


def test_an_interrupted_benchmark_kills_the_running_group(tmp_path, monkeypatch):
    """SIGTERM (an outer ``timeout``) becomes SystemExit in ``main``; ``run`` then kills torchrun's group, so no
    worker keeps the rendezvous port for the next run."""
    marker = tmp_path / "child_alive"

    def interrupted(self, timeout=None):
        raise SystemExit(143)

    monkeypatch.setattr(bench.subprocess.Popen, "communicate", interrupted)
    with pytest.raises(SystemExit):
        bench.run(["bash", "-c", f"(sleep 2; touch {marker}) & sleep 30"], timeout=60)
    time.sleep(3)
    assert not marker.exists()



def test_profile_runs_follow_the_repeats_and_write_their_own_table(tmp_path, monkeypatch):
    speeds = {"bf16_grouped_mm": [100.0], "fp8_flow_single_weight": [120.0]}
    order, fake_run = _fake_machine(monkeypatch, tmp_path, speeds), bench.run
    profiled = []

    def run(cmd, timeout):
        if "--bench-profile-out" not in cmd:
            return fake_run(cmd, timeout)
        variant = next(v for v in speeds if ("--bench-grouped-mm" in cmd) == bench.VARIANTS[v].grouped_mm)
        profiled.append((variant, cmd[cmd.index("--bench-profile-iteration") + 1], "--bench-probe-memory" in cmd))
        if variant == "fp8_flow_single_weight":
            return "exit 1", "[rank0]: torch.OutOfMemoryError: CUDA out of memory\n"
        Path(cmd[cmd.index("--bench-profile-out") + 1]).write_text(json.dumps(PROFILES[variant]))
        return "ok", ""

    monkeypatch.setattr(bench, "run", run)
    bench.main(["--variants", "bf16_grouped_mm", "fp8_flow_single_weight", "--repeats", "1", "--profile"])
    assert order == [("bf16_grouped_mm", True), ("fp8_flow_single_weight", True)]  # the timed runs first
    assert profiled == [("bf16_grouped_mm", "4", False), ("fp8_flow_single_weight", "4", False)]
    stem = tmp_path / "bench_megatron_pretrain_qwen3_moe_like_ep1_profile"
    rows = json.loads(stem.with_suffix(".json").read_text())["results"]
    assert row_of(rows, "by group", "fp8_flow_single_weight", group="no profile")["error"] == (
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory")
    assert row_of(rows, "by group", "bf16_grouped_mm", group=bench.kernel_profile.TIMED)["ms"] == 10.0  # iter_ms
    md = stem.with_suffix(".md").read_text()
    assert "## part: by group" in md and "## part: top kernels: bf16_grouped_mm" in md
    assert "| bf16_grouped_mm | expert GEMMs | 400 | 40.0% |" in md


def test_without_profile_no_profile_runs(tmp_path, monkeypatch):
    order = _fake_machine(monkeypatch, tmp_path, {"bf16_grouped_mm": [100.0]})
    bench.main(["--variants", "bf16_grouped_mm", "--repeats", "1"])
    assert order == [("bf16_grouped_mm", True)]
    assert not list(tmp_path.glob("*_profile*"))


def test_a_rows_ratio_is_against_the_stand_in_of_its_own_call(tmp_path, monkeypatch):
    """A later call keeps the rows of the variants it did not run, with the ratio to the stand-in their own call
    measured, not to the new one; a call that runs no stand-in gives its rows no ratio."""
    (tmp_path / "bench_megatron_pretrain_qwen3_moe_like_ep1.json").write_text(json.dumps({"results": [
        dict(config="qwen3_moe_like", variant="bf16_grouped_mm", call="earlier", tokens_per_s_per_gpu=50.0,
             vs_bf16_grouped_mm=1.0, device="NVIDIA H100 80GB HBM3", layers=4),
        dict(config="qwen3_moe_like", variant="fp8_flow", call="earlier", tokens_per_s_per_gpu=60.0,
             vs_bf16_grouped_mm=1.2, device="NVIDIA H100 80GB HBM3", layers=4)]}))
    _fake_machine(monkeypatch, tmp_path, {"bf16_grouped_mm": [100.0], "fp8_flow_single_weight": [130.0]})
    monkeypatch.setattr(bench, "call_stamp", lambda: "second")
    bench.main(["--variants", "bf16_grouped_mm", "fp8_flow_single_weight", "--repeats", "1"])
    path = tmp_path / "bench_megatron_pretrain_qwen3_moe_like_ep1.json"
    rows = {r["variant"]: r for r in json.loads(path.read_text())["results"]}
    assert rows["fp8_flow"]["call"] == "earlier" and rows["fp8_flow"]["vs_bf16_grouped_mm"] == pytest.approx(1.2)
    assert rows["fp8_flow_single_weight"]["call"] == rows["bf16_grouped_mm"]["call"] == "second"
    assert rows["fp8_flow_single_weight"]["vs_bf16_grouped_mm"] == pytest.approx(1.3)
    _fake_machine(monkeypatch, tmp_path, {"bf16_grouped_mm": [100.0], "fp8_flow_single_weight": [90.0]})
    monkeypatch.setattr(bench, "call_stamp", lambda: "third")
    bench.main(["--variants", "fp8_flow_single_weight", "--repeats", "1"])
    rows = {r["variant"]: r for r in json.loads(path.read_text())["results"]}
    third = rows["fp8_flow_single_weight"]
    assert third["call"] == "third" and third["vs_bf16_grouped_mm"] is None
    assert rows["fp8_flow"]["vs_bf16_grouped_mm"] == pytest.approx(1.2)
