"""custom_ops.py: every launcher of the table is a torch.library custom op whose fake matches the real outputs
(``torch.library.opcheck``), in both CPU columns (the reference, and the Triton kernels in the interpreter),
with splits as a host list and as a tensor and with optional outputs absent; outputs never alias inputs;
eager calls skip the dispatcher."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import interpreter_only
from transformer_engine_moe import backend
from transformer_engine_moe.reference import permute as rp, quantize as rq

E4M3 = torch.float8_e4m3fn
# opcheck's schema test multiplies every input, which torch cannot do for FP8 on the CPU
NO_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _samples() -> dict:
    """Launcher -> argument tuples as its op takes them (``m_splits`` as a host list and as a tensor)."""
    torch.manual_seed(0)
    x = torch.randn(128, 256)
    ms, ms_t = [64, 64], torch.tensor([64, 64])
    q, s = rq.quantize_1x128(x, E4M3)
    qt, st = rq.quantize_128x1(x, E4M3, True, 0.0, ms)
    w = torch.randn(2, 128, 256)  # N = 128: the transposed [G, 1, 2] scales are contiguous already
    wq, ws, _, _ = rq.quantize_grouped_weight(list(w), E4M3)
    rm = torch.zeros(16, 4, dtype=torch.bool)
    rm[torch.arange(16), torch.randint(0, 4, (16,))] = True
    rm[:, 1] = True
    rmap, _, pad, padded = rp.routing_layout(rm, 4)
    cap, probs = int(padded.sum()), torch.rand(16, 4)
    h, y = torch.randn(16, 128, dtype=torch.bfloat16), torch.randn(cap, 128, dtype=torch.bfloat16)
    return {
        "quantize_1x128": [(x, E4M3, True, 0.0)],
        "quantize_128x1": [(x, E4M3, True, 0.0, ms, None), (x, E4M3, True, 0.0, None, ms_t),
                           (x, E4M3, False, 0.0, None, None)],
        "quantize_128x128": [(x, E4M3, True, 0.0)],
        "quantize_grouped_weight": [(list(w), E4M3, True, 0.0, True), (list(w), E4M3, True, 0.0, False)],
        "dequantize_1x128": [(q, s, torch.bfloat16)],
        "dequantize_128x1": [(qt, st, torch.float32, ms, None)],
        "dequantize_128x128": [(wq[0], ws[0], torch.float32)],
        "scaling_aware_transpose": [(q, s, ms, None), (q, s, None, ms_t)],
        "transpose_128x128": [(wq, ws)],
        "topk_routing": [(torch.tensor([[0, 3], [2, -1], [1, 2]]), torch.rand(3, 2), 4)],
        "routing_layout": [(rm, 4), (rm, 1)],
        "permute": [(h, rmap, cap, pad, probs, torch.rand(16, 1)), (h, rmap, cap, None, None, None)],
        "unpermute": [(y, rmap, probs, pad)],
        "unpermute_backward": [(h, y, rmap, probs, cap, pad)],
        "weighted_swiglu_quant": [(torch.randn(16, 256), torch.rand(16), E4M3, True),
                                  (torch.randn(16, 256), None, E4M3, True)],
        "weighted_swiglu_backward": [(torch.randn(16, 128), torch.randn(16, 256), torch.rand(16), E4M3, True),
                                     (torch.randn(16, 128), torch.randn(16, 256), None, None, True)],
        "grouped_gemm": [(q, s, rq.quantize_128x128(torch.randn(256, 256), E4M3)[0].view(2, 128, 256),
                          torch.ones(2, 1, 2), ms, None, torch.bfloat16)],
        "grouped_gemm_wgrad": [(qt, st, qt, st, ms, None, None, False, torch.float32)],
        "grouped_gemm_wgrad_into": [(qt, st, qt, st, ms, None, torch.zeros(2, 256, 256), True, torch.float32)],
        "grouped_gemm_wgrad_into_list": [(qt, st, qt, st, ms, None, [torch.zeros(256, 256), torch.ones(256, 256)],
                                          True, torch.float32)],
    }


SAMPLES = _samples()
LAUNCHERS = [f.name for f in dataclasses.fields(backend.Implementation)][1:]


def _op(name: str, column: str):
    """``te_moe::<name>_<column>``, or the reference's where the column shares its launcher."""
    return getattr(torch.ops.te_moe, f"{name}_{column}", None) or getattr(torch.ops.te_moe, f"{name}_reference")


def test_every_launcher_of_every_column_is_an_op():
    """Each column's launcher calls its op under torch.compile: ``te_moe::<launcher>_<column>``, the column it
    shares the launcher with (cuBLAS, DeepGEMM and Gluon: Triton's but for the GEMMs; no dequantize kernels but
    1x128), or ``..._into_..`` / ``..._into_list_..`` for a wgrad into ``out`` (a tensor
    / a list)."""
    for column, impl in backend.IMPLEMENTATIONS.items():
        for name in LAUNCHERS:
            owner = next(c for c, i in backend.IMPLEMENTATIONS.items() if getattr(i, name) is getattr(impl, name))
            assert getattr(impl, name).op is getattr(torch.ops.te_moe, f"{name}_{owner}"), (name, column)
            assert owner == column or name not in ("grouped_gemm", "grouped_gemm_wgrad"), (name, column, owner)
    assert hasattr(torch.ops.te_moe, "grouped_gemm_wgrad_into_triton")
    assert hasattr(torch.ops.te_moe, "grouped_gemm_wgrad_into_list_triton")
    assert set(SAMPLES) == set(LAUNCHERS) | {"grouped_gemm_wgrad_into", "grouped_gemm_wgrad_into_list"}


@pytest.mark.parametrize("column", ["reference", pytest.param("triton", marks=interpreter_only)])
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_opcheck(name, column):
    """Fake against real (shapes, dtypes, devices), registration, and AOT dispatch with dynamic shapes;
    the real op also refuses outputs aliasing inputs (``transpose_128x128``'s N = 128 case)."""
    for args in SAMPLES[name]:
        fp8 = any(isinstance(a, torch.Tensor) and a.dtype in (E4M3, torch.float8_e5m2) for a in args)
        torch.library.opcheck(_op(name, column), args,
                              test_utils=NO_SCHEMA if fp8 else torch.library._OPCHECK_DEFAULT_UTILS)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_skip_the_dispatcher():
    """The table's functions call the launcher itself outside torch.compile (no ~20 us op call); the op
    itself goes through the dispatcher."""
    x = torch.randn(4, 128)
    with _Recorder() as eager:
        backend.REFERENCE.quantize_1x128(x, E4M3)
    with _Recorder() as op:
        torch.ops.te_moe.quantize_1x128_reference(x, E4M3, True, 0.0)
    assert eager.ops and not any(o.startswith("te_moe.") for o in eager.ops)
    assert "te_moe.quantize_1x128_reference.default" in op.ops
    assert backend.REFERENCE.quantize_1x128.__wrapped__ is rq.quantize_1x128
