"""benchmarks/: each ``bench_<name>.py`` writes only ``bench_<name>*`` results, and every results file belongs to
one script (found by name)."""

import ast
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("bench_*.py"))


def _result_names(script: Path) -> list[str]:
    """The leading literal of the name each ``write_results(...)`` call of ``script`` writes."""
    names = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "write_results":
            arg = node.args[0]
            if isinstance(arg, ast.JoinedStr):
                arg = arg.values[0]
            names.append(arg.value if isinstance(arg, ast.Constant) else "")
    return names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_each_benchmark_writes_its_own_results(script):
    names = _result_names(script)
    assert names, f"{script.name} writes no results"
    assert all(name.startswith(script.stem) for name in names), (script.name, names)


def test_every_results_file_has_its_script():
    stems = [s.stem for s in SCRIPTS]
    for path in (BENCHMARKS / "results").iterdir():
        assert any(path.name.startswith(stem) for stem in stems), path.name
    assert {"bench_dispatch", "bench_grouped_linear", "bench_grouped_gemm"} <= set(stems)


def test_bench_grouped_gemm_names_the_backend_auto_picks(monkeypatch):
    """bench_grouped_gemm marks auto's pick by the implementation's name (on the CPU: the reference)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_grouped_gemm as bench

    o = bench.operands(2, 256, 128, 128, device="cpu")
    ops = ("fprop", "dgrad", "wgrad", "wgrad_fp32", "wgrad_main_grad", "wgrad_main_grad_reversed",
           "wgrad_main_grad_rounded")
    assert [bench.auto_backend(o, op, 128, 128, on_device) for op in ops for on_device in (False, True)] == (
        ["reference"] * 14)
    assert set(bench.calls(o, "reference", False)) == set(bench.bf16_calls(o)) == set(ops)
    from transformer_engine_moe.kernels import grouped_gemm_deepgemm as dg

    device_wgrad = [("deepgemm", True)] if dg._module() is not None and dg.device_splits_wgrad() else []
    assert bench.splits_per_backend(("deepgemm", "cublas", "triton", "bf16")) == [
        ("deepgemm", False), *device_wgrad, ("cublas", False), ("triton", True), ("bf16", False)]
    bench.calls(o, "reference", False)["wgrad_main_grad_reversed"]()  # Megatron's DDP layout: group g in slot G-1-g
    want = bench.grouped_gemm_wgrad(o["dyt"], o["xt"], o["splits"], backend="reference")
    assert want.abs().sum() > 0 and torch.equal(o["acc"].flip(0), want)
    refs = bench.references(o, ("wgrad_fp32",))
    assert set(refs) == {"wgrad", "wgrad_fp32"} and refs["wgrad"] is refs["wgrad_fp32"]


def test_clock_while_gives_medians_of_its_samples_or_none(monkeypatch):
    """clock_while samples NVML's SM clock and power in a thread and hands back their medians on exit; where NVML
    cannot answer (no pynvml, a CPU machine) it gives an empty dict and the timed code runs as without it."""
    import threading

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import utils

    readings, taken, done = [(1980, 300_000), (1680, 700_000), (1700, 690_000)], [], threading.Event()

    def clock_rate(*a):
        if not readings:
            done.set()
            raise RuntimeError("NVML: no more readings")
        taken.append(readings.pop(0))
        return taken[-1][0]

    monkeypatch.setattr(torch.cuda, "clock_rate", clock_rate)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda *a: taken[-1][1])
    with utils.clock_while(period_s=0.0) as clock:
        assert done.wait(10)  # the timed code runs while the thread samples
    assert clock == {"sm_clock_mhz": 1700, "power_w": 690}
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda *a: (_ for _ in ()).throw(ModuleNotFoundError("pynvml")))
    with utils.clock_while() as clock:
        pass
    assert clock == {}


def test_ep_run_on_gpus_leaves_the_command_line_to_the_script(monkeypatch):
    """On GPUs ``ep_run`` measures the machine without parsing ``sys.argv`` again: it once re-parsed it with a
    bare parser, so a script's own flags (``bench_ep_scaling.py --tokens``) stopped it there."""
    import argparse
    import sys

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import utils

    monkeypatch.setattr(sys, "argv", ["bench_ep_scaling.py", "--tokens", "16384"])
    monkeypatch.setattr(utils, "measure_machine", lambda: ({"device": "stub"}, {}, 0.0))
    monkeypatch.setattr(utils.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(utils.mp, "spawn", lambda fn, args, nprocs, join: args[2].put((nprocs, args[5])))
    out, env, _, world, suffix = utils.ep_run(lambda *a: None, argparse.Namespace(cpu=False, world=4), "extra")
    assert out == (2, ("extra",)) and world == env["ep_size"] == 2 and suffix == ""
