"""benchmarks/baselines.py: the blocks every speedup is measured against. The BF16 grouped_mm block computes
the same block as the BF16 per-expert block (same parameters), with and without slots routed elsewhere; the
blockwise-casts block is within FP8 tolerance of it; both FP8FlowMoE subclasses share the block they are made
from and keep their tokens BF16 (no quantize phase). TransformerEngine's GroupedLinear block: the reason
without TE, its wiring against a stand-in of TE's API on the CPU (BF16 and under the blockwise recipe), and the
real TE on a GPU where it is installed."""

import contextlib
import sys
import types

import pytest
import torch

from baselines import (BF16GroupedMMBlock, BF16LoopMoE, BlockwiseCastsMoE, TEGroupedLinearBlock, float8_block_scaling,
                       transformer_engine)
from conftest import relerr
from transformer_engine_moe import FP8FlowMoE, Float8BlockwiseQTensor


def routed(t=96, e=4, elsewhere=False):
    x = torch.randn(t, 256, dtype=torch.bfloat16)
    logits = torch.randn(t, e)
    logits[:, 2] += 4  # expert 2 crowded, the others ragged
    probs, ids = torch.softmax(logits, -1).topk(2)
    if elsewhere:
        ids[::3, 1] = -1  # routed to another rank (after an EP dispatch)
    return x, ids, probs


@pytest.mark.parametrize("elsewhere", [False, True], ids=["all_local", "some_slots_elsewhere"])
def test_bf16_grouped_mm_block_matches_the_bf16_reference_block(elsewhere):
    torch.manual_seed(0)
    ref = BF16LoopMoE(4, 256, 128, 2)
    base = BF16GroupedMMBlock.from_block(ref)
    x, ids, probs = routed(elsewhere=elsewhere)
    dy = torch.randn_like(x)
    num_routed = int((ids >= 0).sum()) if elsewhere else None
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [ref.forward_topk(xs[0], ids, probs), base.forward_topk(xs[1], ids, probs, num_routed=num_routed)]
    for y in outs:
        y.backward(dy)
    assert relerr(outs[1], outs[0]) < 1e-2 and relerr(xs[1].grad, xs[0].grad) < 1e-2
    fc1 = torch.stack([w.grad for w in ref.linear_fc1.weights])
    fc2 = torch.stack([w.grad for w in ref.linear_fc2.weights])
    assert relerr(base.fc1.grad, fc1) < 1e-2 and relerr(base.fc2.grad, fc2) < 1e-2
    if elsewhere:  # without the count, rows past grouped_mm's last offset would be undefined: refused
        with pytest.raises(RuntimeError, match="pass num_routed"):
            base.forward_topk(x, ids, probs)


def test_blockwise_casts_block_is_close_to_the_bf16_block():
    """Within FP8 tolerance (each GEMM quantizes its operands, as FP8-Flow; test_moe.py's bound), and not
    the BF16 block itself."""
    torch.manual_seed(0)
    fp8 = FP8FlowMoE(4, 256, 128, 2)
    x, ids, probs = routed()
    outs = [cls.from_block(fp8).forward_topk(x, ids, probs) for cls in (BlockwiseCastsMoE, BF16LoopMoE)]
    assert 0 < relerr(outs[0], outs[1]) < 0.1


@pytest.mark.parametrize("cls", [BF16LoopMoE, BlockwiseCastsMoE])
def test_from_block_shares_the_experts_and_keeps_tokens_bf16(cls):
    fp8 = FP8FlowMoE(4, 256, 128, 2, recompute="moe_expert")
    twin = cls.from_block(fp8)
    assert isinstance(twin, FP8FlowMoE) and twin.linear_fc1 is fp8.linear_fc1 and twin.dispatcher is fp8.dispatcher
    assert twin.recompute is None and fp8.recompute == "moe_expert"
    x, ids, probs = routed()
    assert twin.quantize(x) is x and isinstance(fp8.quantize(x), Float8BlockwiseQTensor)
    built = cls(4, 256, 128, 2)  # the same block built and loaded: bitwise the same output
    built.load_state_dict(fp8.state_dict())
    assert torch.equal(twin.forward_topk(x, ids, probs), built.forward_topk(x, ids, probs))


# ------------------------------------------------------------------ TransformerEngine's GroupedLinear as the experts
def _fake_te(monkeypatch, autocast_name="autocast"):
    """A stand-in for the parts of TransformerEngine ``TEGroupedLinearBlock`` calls, with their signatures as in TE
    2.8-2.20 (``GroupedLinear(num_gemms, in_features, out_features, bias, params_dtype, device)`` with ``weight{i}``
    and ``forward(inp, m_splits, is_first_microbatch)``, ``Fp8Padding``/``Fp8Unpadding(num_gemms)``, ``autocast(enabled,
    recipe)`` or 2.8's ``fp8_autocast(enabled, fp8_recipe)``): BF16 GEMMs, TE's padding to 16 rows, and a log
    of the calls. Checks the block's wiring on the CPU; the GPU test below runs real TE."""
    log, active = [], []

    class GroupedLinear(torch.nn.Module):
        def __init__(self, num_gemms, in_features, out_features, bias=True, params_dtype=None, device="cuda"):
            super().__init__()
            assert bias is False
            for i in range(num_gemms):
                self.register_parameter(f"weight{i}", torch.nn.Parameter(
                    torch.full((out_features, in_features), float("nan"), dtype=params_dtype, device=device)))
            self.num_gemms = num_gemms

        def forward(self, inp, m_splits, is_first_microbatch=None):
            assert len(m_splits) == self.num_gemms and sum(m_splits) == inp.shape[0], (m_splits, inp.shape)
            log.append(("gemm", list(m_splits), active[-1] if active else None, is_first_microbatch))
            ws = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
            return torch.cat([torch.nn.functional.linear(x, w) for x, w in zip(inp.split(list(m_splits)), ws)])

    def padded(m_splits):
        return [-(-m // 16) * 16 for m in m_splits]

    class Fp8Padding(torch.nn.Module):
        def __init__(self, num_gemms, align_size=None):
            super().__init__()

        def forward(self, inp, m_splits):
            assert active, "TE's padding reads its alignment from the active recipe"
            log.append(("pad", inp.shape[1], inp.dtype))
            pads = padded(m_splits)
            return torch.cat([torch.nn.functional.pad(x, (0, 0, 0, p - m))
                              for x, m, p in zip(inp.split(m_splits), m_splits, pads)]), pads

    class Fp8Unpadding(Fp8Padding):
        def forward(self, inp, m_splits):
            log.append(("unpad", inp.shape[1]))
            return torch.cat([x[:m] for x, m in zip(inp.split(padded(m_splits)), m_splits)])

    @contextlib.contextmanager
    def autocast(enabled=True, recipe=None):
        active.append(recipe)
        yield
        active.pop()

    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.GroupedLinear, pytorch.Fp8Padding, pytorch.Fp8Unpadding = GroupedLinear, Fp8Padding, Fp8Unpadding
    if autocast_name == "autocast":
        pytorch.autocast = autocast
    else:
        pytorch.fp8_autocast = lambda enabled=True, fp8_recipe=None: autocast(enabled, fp8_recipe)
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Float8BlockScaling = type("Float8BlockScaling", (), {})
    te, common = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.common")
    te.pytorch, te.common, common.recipe = pytorch, common, recipe
    for name, mod in (("transformer_engine", te), ("transformer_engine.pytorch", pytorch),
                      ("transformer_engine.common", common), ("transformer_engine.common.recipe", recipe)):
        monkeypatch.setitem(sys.modules, name, mod)
    return log


def _te_inputs():
    torch.manual_seed(0)
    fp8 = FP8FlowMoE(5, 256, 128, 2)
    x, ids, probs = routed(t=96, e=5)
    ids[ids == 4] = 3  # expert 4 gets no rows
    return fp8, x, ids, probs, torch.randn(96, 256, dtype=torch.bfloat16)


def _run(block, x, ids, probs, dy, is_first_microbatch=None):
    x = x.clone().requires_grad_()
    y = block.forward_topk(x, ids, probs, is_first_microbatch=is_first_microbatch)
    y.backward(dy)
    return y, x.grad


def _te_weight_grads(block):
    return [torch.stack([getattr(lin, f"weight{i}").grad for i in range(5)])
            for lin in (block.linear_fc1, block.linear_fc2)]


@pytest.mark.skipif(transformer_engine()[0] is not None, reason="TransformerEngine is installed here")
def test_te_blocks_say_why_without_transformer_engine():
    te, why = transformer_engine()
    assert te is None and "not installed" in why
    fp8 = FP8FlowMoE(2, 128, 128, 1)
    with pytest.raises(ImportError, match="not installed"):
        TEGroupedLinearBlock.from_block(fp8)
    with pytest.raises(ImportError, match="not installed"):
        float8_block_scaling()


def test_te_block_in_bf16_is_the_bf16_grouped_block(monkeypatch):
    """Same routing and experts as the BF16 grouped block (TE's weights copied from the FP8-Flow block's):
    output, input and weight gradients equal to BF16 rounding; host splits, no autocast, no padding."""
    log = _fake_te(monkeypatch)
    fp8, x, ids, probs, dy = _te_inputs()
    te_block, base = TEGroupedLinearBlock.from_block(fp8), BF16GroupedMMBlock.from_block(fp8)
    (y, dx), (y_ref, dx_ref) = _run(te_block, x, ids, probs, dy, True), _run(base, x, ids, probs, dy)
    assert relerr(y, y_ref) < 1e-2 and relerr(dx, dx_ref) < 1e-2
    for g, ref in zip(_te_weight_grads(te_block), (base.fc1.grad, base.fc2.grad)):
        assert relerr(g, ref) < 1e-2
    assert [e[0] for e in log] == ["gemm", "gemm"] and log[0][2] is None and log[0][3] is True
    assert log[0][1][4] == 0 and sum(log[0][1]) == 96 * 2 and log[0][1] == log[1][1]


@pytest.mark.parametrize("autocast_name", ["autocast", "fp8_autocast"])
def test_te_blockwise_block_runs_under_the_recipe_with_padded_experts(monkeypatch, autocast_name):
    """Under TE's recipe (autocast, or 2.8's fp8_autocast): both GEMMs see it and take each expert's rows padded
    to 16 (the tokens and their probs padded by Fp8Padding, the output unpadded): the same block as BF16's."""
    log = _fake_te(monkeypatch, autocast_name)
    fp8, x, ids, probs, dy = _te_inputs()
    recipe = float8_block_scaling()
    te_block, base = TEGroupedLinearBlock.from_block(fp8, recipe), BF16GroupedMMBlock.from_block(fp8)
    (y, dx), (y_ref, dx_ref) = _run(te_block, x, ids, probs, dy, False), _run(base, x, ids, probs, dy)
    assert relerr(y, y_ref) < 1e-2 and relerr(dx, dx_ref) < 1e-2
    for g, ref in zip(_te_weight_grads(te_block), (base.fc1.grad, base.fc2.grad)):
        assert relerr(g, ref) < 1e-2
    assert [e[0] for e in log] == ["pad", "pad", "gemm", "gemm", "unpad"]
    assert log[0][1:] == (256, torch.bfloat16) and log[1][1:] == (1, torch.float32)  # tokens, then probs [M, 1]
    splits = log[2][1]
    assert all(m % 16 == 0 for m in splits) and sum(splits) > 96 * 2 and splits == log[3][1]
    assert log[2][2] is recipe and log[3][2] is recipe and log[2][3] is False


def test_te_block_checks_its_weights(monkeypatch):
    _fake_te(monkeypatch)
    w = [torch.zeros(256, 128)] * 2
    with pytest.raises(ValueError, match="one weight per expert, got 2 and 1"):
        TEGroupedLinearBlock(w, w[:1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_te_blocks_on_the_gpu():
    """Real TransformerEngine: TE's BF16 block within BF16 rounding of the BF16 grouped block, its blockwise FP8
    block within FP8 tolerance (test_moe.py's bound), both with weight gradients, weights cached on a second call."""
    pytest.importorskip("transformer_engine.pytorch", reason="TransformerEngine not installed")
    torch.manual_seed(0)
    fp8 = FP8FlowMoE(8, 1024, 512, 2, device="cuda")
    x = torch.randn(1000, 1024, dtype=torch.bfloat16, device="cuda")
    probs, ids = torch.softmax(torch.randn(1000, 8, device="cuda"), -1).topk(2)
    dy = torch.randn_like(x)
    y_ref, dx_ref = _run(BF16GroupedMMBlock.from_block(fp8), x, ids, probs, dy)
    for recipe, tol in ((None, 1e-2), (float8_block_scaling(), 0.1)):
        block = TEGroupedLinearBlock.from_block(fp8, recipe)
        for first in (True, False):
            block.zero_grad(set_to_none=True)
            y, dx = _run(block, x, ids, probs, dy, first)
            assert relerr(y, y_ref) < tol and relerr(dx, dx_ref) < tol, (recipe, first)
            assert all(p.grad is not None and p.grad.isfinite().all() for p in block.parameters())
