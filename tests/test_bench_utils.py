"""benchmarks/utils.py's measurement scaffold on the CPU: the aggregation over fresh processes (median, spread,
speedup per process), interleaved rounds, runs in fresh processes, the MoE step's weight-cache flags, results
merged with a stored file, and markdown grouped by a key."""

import json
import os
import subprocess
import sys

import pytest
import torch

import utils


def test_speedup_is_taken_per_process_then_aggregated():
    """The speedup of each process is over its own baseline, then the median: here 1.25x, not the 1.375x of
    the medians' ratio (11 ms / 8 ms), which mixes clocks of different processes."""
    per_process = [{"bf16": 10.0, "fp8": 8.0}, {"bf16": 12.0, "fp8": 8.0}, {"bf16": 11.0, "fp8": 10.0}]
    agg = utils.across_processes(per_process, "bf16")
    fp8 = agg["fp8"]
    assert fp8["speedup_per_process"] == [1.25, 1.5, 1.1] and fp8["speedup"] == 1.25
    assert fp8["speedup_spread"] == pytest.approx((1.5 - 1.1) / 1.25)
    assert fp8["ms"] == 8.0 and fp8["ms_per_process"] == [8.0, 8.0, 10.0] and fp8["ms_spread"] == pytest.approx(0.25)
    assert fp8["processes"] == 3
    assert agg["bf16"]["speedup_per_process"] == [1.0] * 3 and agg["bf16"]["ms_spread"] == pytest.approx(2 / 11)


def test_a_block_some_processes_lack_aggregates_over_the_others_and_the_baseline_is_required():
    agg = utils.across_processes([{"b": 4.0, "x": 2.0}, {"b": 6.0}, {"b": 5.0, "x": 4.0}], "b")
    assert agg["x"]["processes"] == 2 and agg["x"]["speedup_per_process"] == [2.0, 1.25]
    assert agg["x"]["speedup"] == pytest.approx(1.625)  # the median of two: their mean
    with pytest.raises(ValueError, match="baseline 'b'"):
        utils.across_processes([{"b": 1.0}, {"x": 1.0}], "b")
    with pytest.raises(ValueError, match="baseline"):
        utils.across_processes([], "b")


def test_spread():
    assert utils.spread([2.0, 2.0, 2.0]) == 0.0
    assert utils.spread([1.06, 1.27, 1.40, 1.33, 1.45]) == pytest.approx((1.45 - 1.06) / 1.33)


def test_interleaved_rounds_rotate_the_order_and_time_each_step_alike():
    order = []

    def clock(fn, calls):
        for _ in range(calls):
            fn()
        return float(len(order))

    steps = {n: (lambda n=n: order.append(n)) for n in "abc"}
    out = utils.interleaved_ms(steps, rounds=4, calls=2, clock=clock)
    firsts = [order[i] for i in range(0, len(order), 6)]  # each round: 3 steps x 2 calls
    assert firsts == ["a", "b", "c", "a"]
    assert order[:6] == ["a", "a", "b", "b", "c", "c"] and order[6:12] == ["b", "b", "c", "c", "a", "a"]
    assert {n: len(v) for n, v in out.items()} == {"a": 4, "b": 4, "c": 4} and order.count("a") == 8
    assert out["a"][:2] == [2.0, 12.0]  # the clock's reading after each timing of "a"


def test_host_and_wall_ms_are_medians_and_the_wall_includes_the_sync():
    host, wall = utils.host_and_wall_ms(lambda: sum(range(10000)), 3, lambda: None)
    assert 0 < host <= wall


def test_fresh_processes_are_fresh_and_failures_raise(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import json, os, sys\n"
                      "assert sys.argv[1] == '--x'\n"
                      "json.dump({'pid': os.getpid(), 'arg': sys.argv[2]}, open(sys.argv[-1], 'w'))\n")
    out = utils.in_fresh_processes([str(script), "--x", "7"], 3)
    assert [o["arg"] for o in out] == ["7"] * 3
    pids = {o["pid"] for o in out}
    assert len(pids) == 3 and os.getpid() not in pids
    script.write_text("raise SystemExit(3)\n")
    with pytest.raises(subprocess.CalledProcessError):
        utils.in_fresh_processes([str(script)], 2)
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="processes must be a positive int"):
            utils.in_fresh_processes([str(script)], bad)


class _Recorder(torch.nn.Module):
    """An MoE block stand-in: records ``is_first_microbatch`` and makes a weight gradient."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.flags = []

    def forward_topk(self, x, ids, probs, is_first_microbatch=None):
        self.flags.append(is_first_microbatch)
        return x * self.w


@pytest.mark.parametrize("mode, flags", [("cached", [True, False, False]), ("requantized", [True, True, True]),
                                         ("uncached", [None, None, None])])
def test_moe_step_passes_the_weight_cache_flags_and_clears_gradients(mode, flags):
    block, x = _Recorder(), torch.ones(2, 3, requires_grad=True)
    step = utils.moe_step(block, x, None, None, torch.ones(2, 3), fp8_weights=mode)
    for _ in range(3):
        step()
    assert block.flags == flags
    assert torch.equal(block.w.grad, torch.full((3,), 2.0)) and torch.equal(x.grad, torch.ones(2, 3))  # not summed


def test_moe_step_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="fp8_weights must be one of"):
        utils.moe_step(_Recorder(), None, None, None, None, fp8_weights="cache")


def test_merge_stored_replaces_the_measured_values_and_keeps_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(utils, "RESULTS_DIR", tmp_path)
    old_env = {"device": "H100", "date": "2026-11-25"}
    stored = [{"block": "a", "ms": 1.0}, {"shape": "qwen3_moe_like", "block": "a", "ms": 2.0}]
    (tmp_path / "b.json").write_text(json.dumps({"environment": old_env, "results": stored}))
    new = [{"shape": "qwen3_moe_like", "block": "a", "ms": 3.0}]
    rows, env = utils.merge_stored("b", "shape", new, {"device": "H200", "date": "2026-11-26"}, "deepseek_v3")
    assert rows == [{"block": "a", "ms": 1.0, "shape": "deepseek_v3"}, new[0]]
    assert env["runs"] == {"deepseek_v3": "H100, 2026-11-25", "qwen3_moe_like": "H200, 2026-11-26"}
    (tmp_path / "b.json").write_text(json.dumps({"environment": env, "results": rows}))
    rows, env = utils.merge_stored("b", "shape", [dict(new[0], shape="x")], {"device": "B", "date": "d"}, "-")
    assert [r["shape"] for r in rows] == ["deepseek_v3", "qwen3_moe_like", "x"]
    assert env["runs"] == {"deepseek_v3": "H100, 2026-11-25", "qwen3_moe_like": "H200, 2026-11-26", "x": "B, d"}
    assert "run_settings" not in env  # no run said more than the one that measured "x"
    assert utils.merge_stored("none", "shape", new, {"device": "B", "date": "d"}, "-")[0] == new


def test_merge_stored_keeps_what_a_kept_run_said_about_itself(tmp_path, monkeypatch):
    """A rows run (processes, GPU states) stored, then a sweep of another shape: the stored rows keep their run's
    settings under ``run_settings``, carried on through later merges; the machine facts both share are not."""
    monkeypatch.setattr(utils, "RESULTS_DIR", tmp_path)
    rows_env = {"device": "H200", "date": "13:20", "torch": "2.11", "processes": 3, "gpu_state": [1, 2]}
    qwen = [{"shape": "qwen3_moe_like", "ms": 7.0}]
    (tmp_path / "b.json").write_text(json.dumps({"environment": rows_env, "results": qwen}))
    v3 = [{"shape": "deepseek_v3", "ms": 40.0}]
    rows, env = utils.merge_stored("b", "shape", v3, {"device": "H200", "date": "14:48", "torch": "2.11"}, "-")
    assert rows == qwen + v3 and env["run_settings"] == {"qwen3_moe_like": {"processes": 3, "gpu_state": [1, 2]}}
    (tmp_path / "b.json").write_text(json.dumps({"environment": env, "results": rows}))
    rows, env = utils.merge_stored("b", "shape", v3, {"device": "H100", "date": "15:00", "torch": "2.11"}, "-")
    assert env["run_settings"] == {"qwen3_moe_like": {"processes": 3, "gpu_state": [1, 2]}}
    assert env["runs"] == {"qwen3_moe_like": "H200, 13:20", "deepseek_v3": "H100, 15:00"}


def test_markdown_grouped_by_a_key_has_a_table_per_value_with_its_columns(tmp_path, monkeypatch):
    monkeypatch.setattr(utils, "RESULTS_DIR", tmp_path)
    rows = [{"shape": "s1", "ms": 1.0, "peak": 2.0}, {"shape": "s2", "ms": 1.23456, "per": [1.0, 1.5]}]
    md = utils.write_results("r", "T", {"device": "d"}, {}, rows, ["shape", "ms", "peak", "per"],
                             group_by="shape").read_text()
    s1, s2 = md.split("## shape: s1")[1].split("## shape: s2")
    assert "| shape | ms | peak |" in s1 and "per" not in s1
    assert "| shape | ms | per |" in s2 and "| s2 | 1.23 | 1 / 1.5 |" in s2 and "peak" not in s2
    assert json.loads((tmp_path / "r.json").read_text())["results"] == rows


def test_host_load_reports_the_load_and_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.setattr(utils.os, "getloadavg", lambda: (3.456, 1.0, 0.5))
    monkeypatch.setattr(utils.os, "sched_getaffinity", lambda pid: set(range(16, 32)))
    monkeypatch.setattr(utils.os, "cpu_count", lambda: 32)
    assert utils.host_load() == dict(load_1min=3.46, cpus=16, host_cpus=32)


def test_gpu_state_counts_the_processes_sharing_the_gpu_and_warns(monkeypatch, capsys):
    """The state recorded around timed runs says how many processes compute on the GPU; more than this one is
    warned of (a shared GPU's timings are not the block's)."""
    import types

    for name, value in (("clock_rate", 1980), ("temperature", 60), ("power_draw", 550_000),
                        ("_get_nvml_device_index", 3)):
        monkeypatch.setattr(utils.torch.cuda, name, lambda *a, _v=value: _v)
    processes = {3: ["this one"]}
    nvml = types.SimpleNamespace(nvmlDeviceGetHandleByIndex=lambda index: index,
                                 nvmlDeviceGetComputeRunningProcesses=lambda handle: processes[handle])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert utils.gpu_state() == dict(sm_clock_mhz=1980, temperature_c=60, power_w=550.0, processes=1)
    assert "warning" not in capsys.readouterr().err
    processes[3] = ["this one", "a loss study"]
    assert utils.gpu_state()["processes"] == 2
    assert "2 processes compute on this GPU" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: the run goes on without the state
    assert set(utils.gpu_state()) == {"unavailable"}


def test_ddp_hooks_add_into_main_grad_record_names_and_let_the_module_go():
    """DDP's contract: ``.grad`` added into ``main_grad`` and dropped, each firing's parameter name recorded,
    ``grad_added_to_main_grad`` honoured. Once a hook held its own parameter (a cycle through autograd that gc does
    not free): every benchmarked block's weights then stayed to the process's end."""
    import gc
    import weakref

    module = torch.nn.Linear(4, 3)
    fired = utils.ddp_main_grad_hooks(module)
    module.bias.grad_added_to_main_grad = True  # a fused wgrad wrote there: the hook only drops .grad
    x = torch.randn(5, 4)
    module(x).sum().backward()
    assert sorted(fired) == ["bias", "weight"]
    assert torch.equal(module.weight.main_grad, torch.ones(5, 3).t() @ x)
    assert (module.bias.main_grad == 0).all() and module.weight.grad is None and module.bias.grad is None
    alive = weakref.ref(module.weight)
    del module
    gc.collect()
    assert alive() is None


def test_without_deepgemm_is_a_machine_without_it_and_restores_it():
    """Issue 39's ``fp8_flow_no_deepgemm``: inside, the package's DeepGEMM lookup finds no module, as where it is
    not installed (``available`` is then False on any GPU, and ``auto`` passes DeepGEMM by); afterwards, and after
    an error inside, the lookup is what it was."""
    from transformer_engine_moe.kernels import grouped_gemm_deepgemm as dg

    found = dg._module
    with utils.without_deepgemm():
        assert dg._module() is None and dg._module is not found
    assert dg._module is found
    with pytest.raises(RuntimeError, match="inside"), utils.without_deepgemm():
        raise RuntimeError("inside")
    assert dg._module is found
