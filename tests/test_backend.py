"""backend.py: the one table of raw-tensor launchers (same signatures per column), its resolution (once per
call, kept on the autograd Function's ctx for backward), the layering it allows (dispatchers pick no kernels,
the tensor imports no ops), the naming rule, and the one interpreter flag of the launchers."""

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

from conftest import KERNEL_DEVICE, interpreter_only
from transformer_engine_moe import backend, weighted_swiglu_quant
from transformer_engine_moe.kernels.casts import use_software_cast

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "transformer_engine_moe"
LAUNCHERS = [f.name for f in dataclasses.fields(backend.Implementation)][1:]


def _params(fn):
    return list(inspect.signature(fn).parameters.values())


@pytest.mark.parametrize("column", ["triton", "cublas", "deepgemm", "gluon"])
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_column_has_the_reference_signature(column, launcher):
    """A kernel takes the reference's parameters, in order, with the same defaults; extra ones (``config``,
    ``software_cast``) have defaults, so one call works on either."""
    ref, other = _params(getattr(backend.REFERENCE, launcher)), _params(getattr(backend.IMPLEMENTATIONS[column],
                                                                                launcher))
    assert [(p.name, p.default) for p in other[:len(ref)]] == [(p.name, p.default) for p in ref]
    assert all(p.default is not inspect.Parameter.empty for p in other[len(ref):])


def test_each_launcher_lives_in_its_op_module():
    """The field's op names the modules (reference/<op>.py, kernels/<op>.py) that define it."""
    for f in dataclasses.fields(backend.Implementation)[1:]:
        assert backend.REFERENCE.__getattribute__(f.name).__module__.endswith(f"reference.{f.metadata['op']}")
    kernel = {f.name for f in dataclasses.fields(backend.Implementation)[1:]
              if getattr(backend.TRITON, f.name).__module__.endswith(f"kernels.{f.metadata['op']}")}
    assert set(LAUNCHERS) - kernel == {"dequantize_128x1", "dequantize_128x128"}  # no kernel: the reference


def test_naming_rule_holds_for_every_op():
    """Each op of the table: ops/X.py, kernels/X.py, reference/X.py, tests/ops/test_X.py, benchmarks/bench_X.py."""
    ops = {f.metadata["op"] for f in dataclasses.fields(backend.Implementation)[1:]}
    assert ops == {"quantize", "dequantize", "transpose", "permute", "swiglu", "grouped_gemm"}
    for op in ops:
        for path in (f"transformer_engine_moe/ops/{op}.py", f"transformer_engine_moe/kernels/{op}.py",
                     f"transformer_engine_moe/reference/{op}.py", f"tests/ops/test_{op}.py",
                     f"benchmarks/bench_{op}.py"):
            assert (ROOT / path).is_file(), path


@interpreter_only
def test_resolution(monkeypatch):
    x = torch.zeros(2, 128)
    assert backend.implementation("auto", x, "op") is backend.REFERENCE
    assert backend.implementation("reference", x, "op") is backend.REFERENCE
    assert backend.implementation("triton", x, "op") is backend.TRITON  # the interpreter (conftest)
    with pytest.raises(ValueError, match=r"op: backend must be one of \('auto', 'triton', 'reference'\), got 'x'"):
        backend.implementation("x", x, "op")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="op: backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1"):
        backend.implementation("triton", x, "op")


def test_the_forward_implementation_is_kept_for_backward(monkeypatch):
    """Resolved once, in forward: a backward run after the table changed still uses the forward's column."""
    calls = []

    def spy(name):
        fn = getattr(backend.REFERENCE, name)
        return lambda *a, **k: calls.append(name) or fn(*a, **k)

    spied = dataclasses.replace(backend.REFERENCE, name="spied", weighted_swiglu_quant=spy("weighted_swiglu_quant"),
                                weighted_swiglu_backward=spy("weighted_swiglu_backward"))
    monkeypatch.setattr(backend, "TRITON", spied)
    x = torch.randn(4, 256, device=KERNEL_DEVICE, requires_grad=True)
    y = weighted_swiglu_quant(x, backend="triton")
    monkeypatch.setattr(backend, "TRITON", backend.REFERENCE)
    y.dequantize().sum().backward()
    assert calls == ["weighted_swiglu_quant", "weighted_swiglu_backward"]


def _imports(path: Path) -> set[str]:
    """The package-relative modules and names ``path`` imports (``from ..ops.permute import x``: ``ops.permute``
    and ``ops.permute.x``)."""
    names = set()
    here = path.parent.relative_to(PACKAGE).parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            module = ".".join((*here[:len(here) - node.level + 1], node.module or "")).strip(".")
            names |= {module} | {f"{module}.{a.name}" for a in node.names}
    return names


def test_dispatchers_pick_no_kernels():
    """The dispatchers move rows with ops (``ops.permute``'s raw-row helpers), never with the table or the
    launchers."""
    for path in (PACKAGE / "dispatch").glob("*.py"):
        imported = _imports(path)
        assert not {m for m in imported if m.split(".")[0] in ("backend", "kernels", "reference")}, path
        assert not {m for m in imported if m.rsplit(".", 1)[-1] in ("implementation", "use_triton")}, path


def test_the_tensor_imports_no_ops():
    """tensor/ sits below ops/: it reaches its launchers (dequantize, scaling-aware transpose) through the table."""
    for path in (PACKAGE / "tensor").glob("*.py"):
        assert not {m for m in _imports(path) if m.split(".")[0] in ("ops", "module", "dispatch")}, path


def test_one_interpreter_flag():
    """Every launcher sets SOFTWARE_CAST through ``use_software_cast``; no other spelling of the flag."""
    for path in (PACKAGE / "kernels").glob("*.py"):
        text = path.read_text()
        assert "INTERPRET" not in text and (path.name == "casts.py" or not re.search(r"not \w+\.is_cuda", text)), path
        assert text.count("SOFTWARE_CAST=") == text.count("SOFTWARE_CAST=use_software_cast("), path
    assert use_software_cast(torch.zeros(1)) and not use_software_cast(torch.zeros(1), forced=False)
