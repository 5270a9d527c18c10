"""FP8FlowMoE: EP=1 vs the BF16 reference block (``benchmarks/baselines.py``), recompute bitwise, FP8 weight
reuse, saved-activation bytes, routing corner cases, bad input, and EP=2 / EP=4 over gloo (spawned) against
EP=1 on the same global batch."""

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from baselines import BF16LoopMoE
from conftest import assert_no_host_sync, free_port, requires_cuda
from transformer_engine_moe import quantize_blockwise
from transformer_engine_moe.module import FP8FlowMoE
import utils
from utils import saved_activation_bytes

T, H, FFN, E, K = 96, 256, 128, 4, 2


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def batch(seed, t=T, one_expert=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16()
    probs, ids = torch.softmax(torch.randn(t, E, generator=g), -1).topk(K)
    if one_expert:
        ids = torch.stack([torch.zeros(t, dtype=torch.long), torch.ones(t, dtype=torch.long)], 1)
        ids[:, 1] = -1  # every token on expert 0 only
    return x, ids, probs


def step(model, x, ids, probs, seed=0, grad_scale=1.0):
    """Forward + backward with a fixed output gradient: (out, dx, dprobs, [fc1 grads], [fc2 grads], saved bytes)."""
    for p in model.parameters():
        p.grad = None
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    nbytes, y = saved_activation_bytes(lambda: model.forward_topk(xi, ids, pi))
    dy = (torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1)) * grad_scale).bfloat16()
    y.backward(dy)
    return y.detach(), xi.grad, pi.grad, weight_grads(model.linear_fc1), weight_grads(model.linear_fc2), nbytes


def weight_grads(lin):
    """Per-expert weight gradients (zeros where none), whichever parameter layout ``lin`` has."""
    if lin.single_grouped_weight:
        return list((lin.weight.grad if lin.weight.grad is not None else torch.zeros_like(lin.weight)).unbind(0))
    return [w.grad.clone() if w.grad is not None else torch.zeros_like(w) for w in lin.weights]


def pair(**kw):
    torch.manual_seed(0)
    fp8 = FP8FlowMoE(E, H, FFN, K, align_size=128, **kw)
    return fp8, BF16LoopMoE.from_block(fp8)


@pytest.mark.parametrize("grad_scale", [1.0, 1e-6], ids=["unit", "small-gradients"])
def test_close_to_the_bf16_block_and_saves_less(grad_scale):
    """Within FP8 tolerance of the BF16 block with the same parameters: E4M3 quantizes every GEMM operand
    (inputs, weights, SwiGLU output, gradients) with ~3.6% rms relative error each; through two layers the
    output and gradients land at 5-8% relative error here, so the bound is 0.1 (a wrong expert, prob or
    row mapping gives O(1)). Gradients of ~1e-6, as in training, with every expert padded to 128 rows:
    the same bound (zero padding rows once flushed such gradients to zero in the weight gradients)."""
    fp8, ref = pair()
    a, b = step(fp8, *batch(1), grad_scale=grad_scale), step(ref, *batch(1), grad_scale=grad_scale)
    for u, v in zip(a[:3], b[:3]):
        assert rel(u, v) < 0.1
    for us, vs in zip(a[3:5], b[3:5]):
        assert all(rel(u, v) < 0.1 for u, v in zip(us, vs))
    assert a[5] <= 0.6 * b[5]


def test_moe_expert_recompute_is_bitwise_and_keeps_only_the_fp8_input():
    fp8, ref = pair()
    a = step(fp8, *batch(2))
    fp8.recompute = "moe_expert"
    c = step(fp8, *batch(2))
    for u, v in zip(a[:3], c[:3]):
        assert torch.equal(u, v)
    for us, vs in zip(a[3:5], c[3:5]):
        assert all(torch.equal(u, v) for u, v in zip(us, vs))
    bf16 = step(ref, *batch(2))[5]
    assert c[5] <= 0.3 * bf16
    # FP8 rows + scales, top-k ids (int64) + probs (fp32) twice (dispatch's and the checkpoint's), unpermute's
    # row_id_map [T, 2E+1] int32 + pad_offsets [E] int32; small extras
    assert c[5] <= T * (H + 4 * H // 128) + 2 * T * K * (8 + 4) + 4 * T * (2 * E + 1) + 4 * E + 1024


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-rerun"])
@pytest.mark.parametrize("flag", [None, True], ids=["no-cache", "cache"])
def test_moe_expert_rerun_skips_fc2s_gemm_and_weights(monkeypatch, flag, early_stop):
    """The rerun in backward regenerates fc1's and SwiGLU's saved tensors and fc2's input transpose alone: five
    grouped GEMMs per step (fc1 and fc2 forward, fc1 rerun, two dgrads) against four without recompute, and no
    quantization of fc2's weights in the rerun. With checkpoint's early stop turned off the rerun ends after
    fc2's saved input all the same. Output and gradients bit for bit the step without recompute."""
    import torch.utils.checkpoint as checkpoint
    import transformer_engine_moe.module.grouped_linear as grouped_linear

    fp8, _ = pair()
    x, ids, probs = batch(4)
    plain = step(fp8, x, ids, probs)
    fp8.recompute = "moe_expert"
    gemms, weights = [], []
    real_gemm, real_q = grouped_linear.grouped_gemm, grouped_linear.quantize_grouped_weight
    monkeypatch.setattr(grouped_linear, "grouped_gemm",
                        lambda *a, **kw: gemms.append(tuple(a[1].shape[1:])) or real_gemm(*a, **kw))
    monkeypatch.setattr(grouped_linear, "quantize_grouped_weight",
                        lambda ws, *a, **kw: weights.append(tuple(ws[0].shape)) or real_q(ws, *a, **kw))
    monkeypatch.setattr(fp8, "forward_topk", lambda *a, first=fp8.forward_topk: first(*a, is_first_microbatch=flag))
    with checkpoint.set_checkpoint_early_stop(early_stop):
        recomputed = step(fp8, x, ids, probs)
    fc1, fc2 = (2 * FFN, H), (H, FFN)  # [N, K] of each forward GEMM's weight; dgrads take [K, N]
    assert sorted(gemms) == sorted([fc1, fc2, fc1, fc2[::-1], fc1[::-1]])
    assert weights == [fc1, fc2] + ([fc1] if flag is None else [])
    for u, v in zip(plain[:3], recomputed[:3]):
        assert torch.equal(u, v)
    for us, vs in zip(plain[3:5], recomputed[3:5]):
        assert all(torch.equal(u, v) for u, v in zip(us, vs))


@pytest.mark.parametrize("recompute,hybrid", [(None, False), ("moe_expert", True)], ids=["e4m3", "moe_expert-hybrid"])
def test_expert_gemms_take_their_output_gradients_quantized_bitwise(monkeypatch, recompute, hybrid):
    """unpermute's backward quantizes each token's output gradient once and permutes the FP8 rows to fc2, and
    SwiGLU's backward quantizes fc1's in its own pass; both GEMMs take them as they come (no BF16 [M, H] or
    [M, 2F] gradient written and read again), and the output and every gradient are bit for bit the block's that
    hands them BF16 gradients to quantize."""
    import transformer_engine_moe.module.moe as moe
    from transformer_engine_moe import FP8FlowRecipe, Float8BlockwiseQTensor, Format, moe_unpermute
    import transformer_engine_moe.module.grouped_linear as grouped_linear

    torch.manual_seed(0)
    fp8 = FP8FlowMoE(E, H, FFN, K, align_size=128, recompute=recompute,
                     recipe=FP8FlowRecipe(Format.HYBRID) if hybrid else None)
    x, ids, probs = batch(6)
    arrived, real = [], grouped_linear._quantized_grad
    monkeypatch.setattr(grouped_linear, "_quantized_grad",
                        lambda g, args: arrived.append(isinstance(g, Float8BlockwiseQTensor)) or real(g, args))
    per_token = step(fp8, x, ids, probs)
    assert arrived == [True, True]  # fc2, then fc1
    monkeypatch.setattr(FP8FlowMoE, "_unpermute", lambda self, y, m, pad: moe_unpermute(y, m, pad_offsets=pad))
    real_swiglu = moe.weighted_swiglu_quant
    monkeypatch.setattr(moe, "weighted_swiglu_quant", lambda h, p, r, quantize_grad: real_swiglu(h, p, r))
    arrived.clear()
    permuted_bf16 = step(fp8, x, ids, probs)
    assert arrived == [False, False]
    for u, v in zip(per_token[:3], permuted_bf16[:3]):
        assert torch.equal(u, v)
    for us, vs in zip(per_token[3:5], permuted_bf16[3:5]):
        assert all(torch.equal(u, v) for u, v in zip(us, vs))


@pytest.mark.parametrize("recompute", [None, "moe_expert"])
def test_single_grouped_weight_block_is_bitwise_the_per_expert_block(recompute):
    """single_grouped_weight (one [E, N, K] parameter per GroupedLinear) loads the per-expert block's state
    dict and computes the same output and gradients bit for bit."""
    per, _ = pair(recompute=recompute)
    one = FP8FlowMoE(E, H, FFN, K, align_size=128, recompute=recompute, single_grouped_weight=True)
    one.load_state_dict(per.state_dict())
    assert sorted(n for n, _ in one.named_parameters()) == ["linear_fc1.weight", "linear_fc2.weight"]
    a, b = step(per, *batch(3)), step(one, *batch(3))
    for u, v in zip(a[:3], b[:3]):
        assert torch.equal(u, v)
    for us, vs in zip(a[3:5], b[3:5]):
        assert all(torch.equal(u, v) for u, v in zip(us, vs))


@pytest.mark.parametrize("recompute", [None, "moe_expert"])
def test_weight_work_per_step_follows_is_first_microbatch_and_recompute(monkeypatch, recompute):
    """TE's ``is_first_microbatch``: True quantizes fc1's and fc2's weights once, False quantizes nothing, None
    quantizes every call. Without recompute each quantization also writes W^T, which backward takes as is (a
    reused cache transposes W^T into W in the forward). Under ``moe_expert`` with a cache fc1 keeps W alone,
    which the rerun reads (backward transposes it); with None no FP8 weight outlives the forward: fc1 and fc2
    quantize W alone, the rerun fc1's W again, and each backward W and W^T for its dgrad
    (``requantize_in_backward``). fc2's weights are not rerun."""
    import gc
    import weakref

    import transformer_engine_moe.module.grouped_linear as grouped_linear

    fp8, _ = pair(recompute=recompute)
    calls, made = [], []
    real_q, real_t = grouped_linear.quantize_grouped_weight, grouped_linear.transpose_grouped_weight

    def quantize(ws, *a, **kw):
        calls.append("W+W^T" if kw["transpose"] else "W")
        out = real_q(ws, *a, **kw)
        made.extend(weakref.ref(t) for t in out if t is not None)
        return out

    monkeypatch.setattr(grouped_linear, "quantize_grouped_weight", quantize)
    monkeypatch.setattr(grouped_linear, "transpose_grouped_weight", lambda *a, **kw: calls.append("T") or real_t(*a, **kw))
    x, ids, probs = batch(3)

    def fwd_bwd(**kw):
        calls.clear(), made.clear()
        out = fp8.forward_topk(x.clone().requires_grad_(), ids, probs, **kw)
        gc.collect()
        alive = sum(r() is not None for r in made)
        out.float().sum().backward()
        return sorted(calls), alive

    if recompute is None:
        assert fwd_bwd(is_first_microbatch=True) == (["W+W^T"] * 2, 2)  # the cache: fc1's and fc2's W^T
        assert fwd_bwd(is_first_microbatch=False) == (["T"] * 2, 0)
        assert fwd_bwd() == (["W+W^T"] * 2, 2)  # W^T kept for backward
    else:
        assert fwd_bwd(is_first_microbatch=True) == (["T", "W", "W+W^T"], 2)  # fc1's W, fc2's W^T cached
        assert fwd_bwd(is_first_microbatch=False) == (["T"] * 2, 0)
        assert fwd_bwd() == (["W"] * 3 + ["W+W^T"] * 2, 0)


@pytest.mark.parametrize("flag", [True, None])
@pytest.mark.parametrize("dispatcher", ["local", "local-device-splits"])
def test_weights_are_quantized_during_dispatch(monkeypatch, dispatcher, flag):
    """``is_first_microbatch`` True or None: both weights are quantized inside dispatch (its ``before_host_wait``,
    while the host waits for the counts), once; ``experts`` takes them; output and gradients bit for bit those
    of a block whose fc1 and fc2 quantize their own weights (a direct ``experts`` call)."""
    import transformer_engine_moe.module.grouped_linear as grouped_linear

    torch.manual_seed(0)
    block = FP8FlowMoE(E, H, FFN, K, align_size=128, device_splits=dispatcher == "local-device-splits")
    x, ids, probs = batch(5)
    monkeypatch.setattr(block, "prefetch_fp8_weights", lambda *a: None)
    reference = step(block, x, ids, probs)
    monkeypatch.undo()
    quantized, seen = [], []
    real_quantize, real_dispatch, real_experts = grouped_linear.quantize_grouped_weight, block.dispatch, block.experts
    monkeypatch.setattr(grouped_linear, "quantize_grouped_weight",
                        lambda ws, *a, **kw: quantized.append("dispatch" if seen == ["dispatch"] else "elsewhere")
                        or real_quantize(ws, *a, **kw))
    monkeypatch.setattr(block, "dispatch", lambda *a: seen.append("dispatch") or real_dispatch(*a))
    # experts(hidden, topk_ids, topk_probs, tokens_per_expert, is_first_microbatch, routing=): the forward's path
    monkeypatch.setattr(block, "experts", lambda *a, **kw: seen.append(a[4]) or real_experts(*a, **kw))
    monkeypatch.setattr(block, "forward_topk", lambda *a, first=block.forward_topk: first(*a, is_first_microbatch=flag))
    first = step(block, x, ids, probs)
    assert quantized == ["dispatch", "dispatch"] and seen == ["dispatch", flag]
    for u, v in zip(reference[:3], first[:3]):
        assert torch.equal(u, v)
    for us, vs in zip(reference[3:5], first[3:5]):
        assert all(torch.equal(u, v) for u, v in zip(us, vs))


def test_permute_makes_the_padded_splits_once_as_host_splits():
    """With host counts the permute's padded splits are a ``HostSplits`` (checked once; every op after reads its
    cached total); the forward's results are bit for bit those of the same splits as a plain list."""
    from transformer_engine_moe.layout import HostSplits

    block, _ = pair()
    x, ids, probs = batch(12)
    res = block.dispatch(block.quantize(x), ids, probs)
    out = block._permute(res.hidden, res.topk_ids, res.topk_probs, res.tokens_per_expert, res.routing)
    padded = out[4]
    assert type(padded) is HostSplits and padded == [-(-c // 128) * 128 for c in res.tokens_per_expert]
    h = block.linear_fc1(out[0], padded)
    assert torch.equal(h, block.linear_fc1(out[0], list(padded)))


@pytest.mark.parametrize("recompute", [None, "moe_expert"])
def test_the_ids_are_converted_to_a_routing_map_once(monkeypatch, recompute):
    """A forward converts the top-k ids to a routing map once, in the local dispatcher, where the same kernel checks
    them; the permute takes that map and its layout (``DispatchResult.routing``). ``moe_expert``'s region takes
    them too in its first pass, and its rerun permutes on the same map and layout with the probs made again from
    the ids, unchecked (``checked_topk_probs``: no second map, layout or check). Results bit for bit those of a
    block that converts in its permute (a direct ``experts`` call)."""
    import transformer_engine_moe.module.moe as moe
    import transformer_engine_moe.ops.permute as permute

    calls, layouts, maps, reprobs = [], [], [], []
    real, real_permute, real_probs = permute._TopkRouting.apply, moe.moe_permute_and_pad_with_probs, \
        moe.checked_topk_probs
    monkeypatch.setattr(permute._TopkRouting, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(moe, "checked_topk_probs", lambda *a: reprobs.append(1) or real_probs(*a))
    monkeypatch.setattr(moe, "moe_permute_and_pad_with_probs",
                        lambda x, p, m, *a, **kw: layouts.append(kw["layout"]) or maps.append(m)
                        or real_permute(x, p, m, *a, **kw))
    block, _ = pair(recompute=recompute)
    x, ids, probs = batch(11)
    got = step(block, x, ids, probs)
    assert len(calls) == 1 and len(reprobs) == (0 if recompute is None else 1)
    # the permute takes the layout the dispatcher queued before its host wait, moe_expert's rerun the same one
    assert len(layouts) == (1 if recompute is None else 2) and layouts[0] is not None
    assert all(lay is layouts[0] for lay in layouts) and all(m is layouts[0].routing_map for m in maps)
    reference = block.experts  # the phases without the dispatch's map: permute converts the ids
    monkeypatch.setattr(block, "routed_experts", lambda h, i, p, n, f, routing: reference(h, i, p, n, f))
    want = step(block, x, ids, probs)
    for u, v in zip(want[:3], got[:3]):
        assert torch.equal(u, v)
    for us, vs in zip(want[3:5], got[3:5]):
        assert all(torch.equal(u, v) for u, v in zip(us, vs))


def test_moe_expert_lets_the_dispatchs_probs_go_after_its_first_pass(monkeypatch):
    """``moe_expert``'s first pass permutes on the dispatch's routing map and probs ([T, E] each) and keeps the
    probs not until backward (the region keeps the [T, k] ids and probs; the rerun makes the [T, E] probs again):
    they are freed when the forward returns; the map (bool, with its layout, whose row map unpermute keeps) lives
    to the rerun, which permutes on it, and is freed after the backward."""
    import gc
    import weakref

    import transformer_engine_moe.module.moe as moe

    seen, real_permute = [], moe.moe_permute_and_pad_with_probs
    monkeypatch.setattr(moe, "moe_permute_and_pad_with_probs",
                        lambda x, probs, routing_map, *a, **kw: seen.append((weakref.ref(probs),
                                                                            weakref.ref(routing_map)))
                        or real_permute(x, probs, routing_map, *a, **kw))
    block, _ = pair(recompute="moe_expert")
    x, ids, probs = batch(12)
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y = block.forward_topk(xi, ids, pi)
    gc.collect()
    assert len(seen) == 1 and seen[0][0]() is None and seen[0][1]() is not None
    y.float().sum().backward()
    del y
    gc.collect()
    assert len(seen) == 2 and seen[1][1]() is seen[0][1]() is None and xi.grad is not None and pi.grad is not None


@pytest.mark.parametrize("recompute", [None, "moe_expert"])
def test_cached_weights_are_transposed_during_dispatch(monkeypatch, recompute):
    """Reusing the cache (``is_first_microbatch=False``): the forward's W comes from the cached W^T by a byte
    transpose, queued inside dispatch (its ``before_host_wait``) as a first micro-batch's quantization is: fc1's
    and fc2's, or fc2's alone under ``moe_expert`` (fc1's cache holds W; its backward transposes). Output and
    gradients are bit for bit the caching step's."""
    import transformer_engine_moe.module.grouped_linear as grouped_linear

    block, _ = pair(recompute=recompute)
    x, ids, probs = batch(5)
    flags, real_forward = [True, False], block.forward_topk
    monkeypatch.setattr(block, "forward_topk", lambda *a: real_forward(*a, is_first_microbatch=flags.pop(0)))
    first = step(block, x, ids, probs)
    in_dispatch, where = [False], []
    real_t, real_dispatch = grouped_linear.transpose_grouped_weight, block.dispatch

    def dispatch(*a):
        in_dispatch[0] = True
        try:
            return real_dispatch(*a)
        finally:
            in_dispatch[0] = False

    monkeypatch.setattr(grouped_linear, "transpose_grouped_weight",
                        lambda *a, **kw: where.append("dispatch" if in_dispatch[0] else "after") or real_t(*a, **kw))
    monkeypatch.setattr(block, "dispatch", dispatch)
    reused = step(block, x, ids, probs)
    assert where == (["dispatch", "dispatch"] if recompute is None else ["dispatch", "after"])
    for u, v in zip(first[:3], reused[:3]):
        assert torch.equal(u, v)
    for us, vs in zip(first[3:5], reused[3:5]):
        assert all(torch.equal(u, v) for u, v in zip(us, vs))


@pytest.mark.parametrize("phase", ["dispatch", "experts"])
def test_weights_prefetched_by_a_forward_that_raised_are_dropped(monkeypatch, phase):
    """A forward that fails after the weights were prefetched (in dispatch's host wait, or in the experts
    phase) leaves nothing behind: a later forward of the linears quantizes the weights as they are then."""
    block, _ = pair()
    x, ids, probs = batch(7)
    if phase == "dispatch":
        monkeypatch.setattr(block.dispatcher, "dispatch", lambda *a: a[-1]() or 1 / 0)
    else:
        monkeypatch.setattr(block, "experts", lambda *a, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        block.forward_topk(x, ids, probs)
    h = torch.randn(128, H).bfloat16()
    with torch.no_grad():
        before = block.linear_fc1(h, [128, 0, 0, 0])
        block.linear_fc1.weight0.mul_(2)
        assert torch.equal(block.linear_fc1(h, [128, 0, 0, 0]), 2 * before)


@pytest.mark.parametrize("case", ["one-expert", "no-tokens"])
def test_routing_corner_cases(case):
    fp8, ref = pair()
    x, ids, probs = batch(3, t=0) if case == "no-tokens" else batch(3, one_expert=True)
    a, b = step(fp8, x, ids, probs), step(ref, x, ids, probs)
    assert a[0].shape == (x.shape[0], H)
    if case == "one-expert":
        assert rel(a[0], b[0]) < 0.1 and all((g == 0).all() for g in a[3][1:])


@pytest.mark.parametrize(
    "kw,call,exc,match",
    [
        (dict(precision="bf16"), None, TypeError, "unexpected keyword argument 'precision'"),
        (dict(recompute="moe_mlp"), None, ValueError, "recompute must be None or 'moe_expert'"),
        ({}, lambda m: m.forward_topk(torch.randn(4, 128).bfloat16(), *batch(0, t=4)[1:]), ValueError,
         r"hidden must have shape \[T, H=256\], got \[4, 128\]"),
        ({}, lambda m: m.forward_topk(torch.randn(4, H).bfloat16(), torch.zeros(4, 3, dtype=torch.long), torch.rand(4, 3)),
         ValueError, r"topk_ids must have shape \[T=4, topk=2\], got \[4, 3\]"),
        (dict(align_size=0), None, ValueError, "align_size must be a positive int"),
        (dict(align_size=128.0), None, ValueError, "align_size must be a positive int"),
        (dict(gemm_backend="bogus"), None, ValueError, "backend must be one of"),
        ({}, lambda m: m.forward_topk(torch.randn(4, H, device="meta").bfloat16(), *batch(0, t=4)[1:]), ValueError,
         "hidden is on meta, the block's parameters on cpu"),
        # the hostile-input probe: the experts phase without counts (once "'NoneType' object is not iterable"), a
        # cache flag "yes" (once cached as True)
        ({}, lambda m: m.experts(quantize_blockwise(torch.randn(4, H)), *batch(0, t=4)[1:], None), TypeError,
         "tokens_per_expert must be the dispatch's host list of 4 ints or its \\[4\\] device tensor, got NoneType"),
        ({}, lambda m: m.prefetch_fp8_weights("yes"), TypeError, "is_first_microbatch must be None or a bool"),
    ],
    ids=["no-precision-modes", "recompute", "hidden", "topk", "align-0", "align-float", "gemm-backend", "device",
         "experts-no-counts", "prefetch-flag-str"],
)
def test_bad_input(kw, call, exc, match):
    with pytest.raises(exc, match=match):
        m = FP8FlowMoE(E, H, FFN, K, **kw)
        call(m)


def _router(t=4, e=E):
    """Megatron's router output for ``t`` tokens over ``e`` experts: ``(hidden, probs [t, e], routing_map [t, e])``,
    each token on its first K experts."""
    routing_map = torch.zeros(t, e, dtype=torch.bool)
    routing_map[:, :K] = True
    return torch.randn(t, H).bfloat16(), torch.where(routing_map, 0.5, 0.0), routing_map


def _with(index, value, t=4, e=E):
    args = list(_router(t, e))
    args[index] = value
    return args


BAD_CALLS = {  # every argument of forward (Megatron's router format) and forward_topk: (call, exception, match)
    "map-fewer-experts": (lambda m: m(*_router(e=E - 1)), ValueError,
                          r"routing_map must have shape \[T=4, num_experts=4\], got \[4, 3\]"),
    "map-fewer-tokens": (lambda m: m(*_with(2, _router(t=3)[2])), ValueError,
                         r"routing_map must have shape \[T=4, num_experts=4\], got \[3, 4\]"),
    "map-int": (lambda m: m(*_with(2, _router()[2].int())), TypeError,
                r"routing_map must be a tensor \[T=4, num_experts=4\] of dtype bool, got Tensor of dtype torch.int32"),
    "map-list": (lambda m: m(*_with(2, [[True] * E] * 4)), TypeError,
                 "routing_map must be a tensor .* of dtype bool, got list"),
    "map-device": (lambda m: m(*_with(2, _router()[2].to("meta"))), ValueError,
                   "routing_map is on meta, the block's parameters on cpu"),
    "probs-fewer-experts": (lambda m: m(*_with(1, torch.rand(4, E - 1))), ValueError,
                            r"probs must have shape \[T=4, num_experts=4\], got \[4, 3\]"),
    "probs-int": (lambda m: m(*_with(1, torch.ones(4, E, dtype=torch.long))), TypeError,
                  "probs must be a tensor .* of dtype bfloat16/float16/float32/float64, got .* torch.int64"),
    "probs-fp8": (lambda m: m(*_with(1, quantize_blockwise(torch.rand(4, 128)))), TypeError,
                  "probs must be .* got Float8BlockwiseQTensor"),
    "hidden-fp16": (lambda m: m(*_with(0, torch.randn(4, H).half())), TypeError,
                    r"hidden must be a tensor \[T, H=256\] of dtype bfloat16/float32, got .* torch.float16"),
    "hidden-fp8": (lambda m: m(*_with(0, quantize_blockwise(torch.randn(4, H)))), TypeError,
                   "hidden must be a tensor .* got Float8BlockwiseQTensor"),
    "hidden-3d": (lambda m: m(*_with(0, torch.randn(1, 4, H).bfloat16())), ValueError,
                  r"hidden must have shape \[T, H=256\], got \[1, 4, 256\]"),
    "first-microbatch": (lambda m: m(*_router(), is_first_microbatch=1), TypeError,
                         "is_first_microbatch must be None or a bool, got 1"),
    "ids-int32": (lambda m: m.forward_topk(torch.randn(4, H).bfloat16(), torch.zeros(4, K, dtype=torch.int32),
                                           torch.rand(4, K)), TypeError,
                  r"topk_ids must be a tensor \[T=4, topk=2\] of dtype int64, got Tensor of dtype torch.int32"),
    "ids-rows": (lambda m: m.forward_topk(torch.randn(4, H).bfloat16(), torch.zeros(3, K, dtype=torch.long),
                                          torch.rand(3, K)), ValueError,
                 r"topk_ids must have shape \[T=4, topk=2\], got \[3, 2\]"),
    "probs-shape": (lambda m: m.forward_topk(torch.randn(4, H).bfloat16(), torch.zeros(4, K, dtype=torch.long),
                                             torch.rand(4, 1)), ValueError,
                    r"topk_probs must have shape \[T=4, topk=2\], got \[4, 1\]"),
    "probs-device": (lambda m: m.forward_topk(torch.randn(4, H).bfloat16(), torch.zeros(4, K, dtype=torch.long),
                                              torch.rand(4, K, device="meta")), ValueError,
                     "topk_probs is on meta, the block's parameters on cpu"),
    "topk-first-microbatch": (lambda m: m.forward_topk(*batch(0, t=4), is_first_microbatch="yes"), TypeError,
                              "is_first_microbatch must be None or a bool, got 'yes'"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_forward_arguments_are_named(case):
    """forward / forward_topk check every argument's type, dtype, shape and device at entry (host-side: no sync),
    naming it, what it got and what was expected; a routing map over fewer experts than the block's was once
    taken silently."""
    call, exc, match = BAD_CALLS[case]
    block = FP8FlowMoE(E, H, FFN, K)
    with pytest.raises(exc, match=match):
        call(block)


@pytest.mark.parametrize("single", [False, True], ids=["per-expert", "single-weight"])
def test_accumulate_into_main_grad_adds_what_ddps_hook_adds(single):
    """``accumulate_into_main_grad`` under Megatron DDP's contract (``utils.ddp_main_grad_hooks``: a float32
    ``main_grad`` and the hook adding ``.grad``): the wgrad GEMMs add each gradient rounded to BF16 into
    ``main_grad`` and the hook adds nothing, the same bits over micro-batches as the unflagged block whose BF16
    ``.grad`` the hook adds, ``main_grad`` starting with NaN, infinities, signed zeros and subnormals. Evaluation and
    weights without a ``main_grad`` leave the linears' flag unset: ``.grad`` as without the flag."""
    kw = dict(align_size=128, single_grouped_weight=single)
    torch.manual_seed(0)
    hooked, flagged = FP8FlowMoE(E, H, FFN, K, **kw), FP8FlowMoE(E, H, FFN, K, accumulate_into_main_grad=True, **kw)
    flagged.load_state_dict(hooked.state_dict())
    plain, want = step(flagged, *batch(1)), step(hooked, *batch(1))  # no main_grad: .grad, as unflagged
    assert not flagged.linear_fc1.add_wgrad_into_main_grad
    assert all(torch.equal(u, v) for u, v in zip(plain[3] + plain[4], want[3] + want[4]))
    for model in (hooked, flagged):
        utils.ddp_main_grad_hooks(model)
        for p in model.parameters():
            p.main_grad.view(-1)[:5] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, -float("inf")])
    for seed in (2, 3):  # two micro-batches
        a, b = step(hooked, *batch(seed), seed=seed), step(flagged, *batch(seed), seed=seed)
        assert all(torch.equal(u, v) for u, v in zip(a[:3], b[:3]))
    assert flagged.linear_fc1.add_wgrad_into_main_grad and flagged.linear_fc2.add_wgrad_into_main_grad
    assert all(p.grad_added_to_main_grad and p.grad is None for p in flagged.parameters())
    for p, q in zip(hooked.parameters(), flagged.parameters()):
        assert torch.equal(p.main_grad.view(torch.int32), q.main_grad.view(torch.int32))
    fresh = FP8FlowMoE(E, H, FFN, K, accumulate_into_main_grad=True, **kw).eval()
    utils.ddp_main_grad_hooks(fresh)
    fresh.forward_topk(*batch(4))
    assert not fresh.linear_fc1.add_wgrad_into_main_grad  # not a training forward: undecided


@pytest.mark.parametrize("kw, exc, match", [
    (dict(ep_group="world"), TypeError, "ep_group must be None or a torch.distributed.ProcessGroup .* got str"),
    (dict(init_method=0.02), TypeError, "init_method must be None or a callable .* got 0.02"),
    (dict(output_init_method=0.02), TypeError, "output_init_method must be None or a callable .* got 0.02"),
    (dict(num_experts=0), ValueError, "num_experts must be a positive int, got 0"),
    (dict(topk=True), ValueError, r"topk must be an int in \[1, num_experts=4\], got True"),
    (dict(accumulate_into_main_grad=1), TypeError, r"accumulate_into_main_grad must be a bool \(True or False\), "
                                                   "got 1"),
], ids=["ep-group", "init-method", "output-init-method", "num-experts", "topk-bool", "accumulate-into-main-grad"])
def test_bad_construction_arguments_are_named(kw, exc, match):
    args = dict(num_experts=E, hidden_size=H, ffn_hidden_size=FFN, topk=K) | kw
    with pytest.raises(exc, match=match):
        FP8FlowMoE(**args)


# ---------------------------------------------------------------- expert parallelism over gloo
def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    out = {}
    for ep, group in ((2, pairs[rank // 2]), (world, dist.group.WORLD)):
        me = dist.get_rank(group)
        torch.manual_seed(0)
        full = FP8FlowMoE(E, H, FFN, K, align_size=128)
        model = FP8FlowMoE(E, H, FFN, K, ep_group=group, align_size=128)
        el = E // ep
        state = {f"{fc}.weight{j}": full.state_dict()[f"{fc}.weight{me * el + j}"] for fc in ("linear_fc1", "linear_fc2")
                 for j in range(el)}
        model.load_state_dict(state)
        x, ids, probs = batch(10 + ep)
        rows = slice(me * T // ep, (me + 1) * T // ep)
        if me == 0:  # rank 0 of each group sends nothing: a zero-token rank
            rows = slice(0, 0)
        elif me == 1:
            rows = slice(0, (2 * T) // ep)
        y, dx, dp, *_ = step(model, x[rows], ids[rows], probs[rows], seed=rows.start or 0)
        out[str(ep)] = dict(rows=[rows.start, rows.stop], y=y.float().tolist(), dx=dx.float().tolist(),
                            dp=dp.tolist())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def test_expert_parallel_matches_ep1(tmp_path):
    """EP=2 (two groups at once) and EP=4, with a rank sending no tokens: each rank's outputs and input and
    prob gradients match EP=1 on the same tokens. Tolerance: BF16 roundings of the per-rank partial sums
    that combine adds (EP=1 sums all experts before its one rounding)."""
    world = 4
    port = free_port()
    mp.spawn(_worker, args=(world, port, str(tmp_path)), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    torch.manual_seed(0)
    full = FP8FlowMoE(E, H, FFN, K, align_size=128)
    for ep in (2, 4):
        for r in range(world):
            res = results[r][str(ep)]
            lo, hi = res["rows"]
            if hi == lo:
                continue
            x, ids, probs = batch(10 + ep)
            y, dx, dp, *_ = step(full, x[lo:hi], ids[lo:hi], probs[lo:hi], seed=lo)
            assert rel(torch.tensor(res["y"]), y) < 1e-2
            assert rel(torch.tensor(res["dx"]), dx) < 1e-2
            assert rel(torch.tensor(res["dp"]), dp) < 1e-2


def test_megatron_router_format_equals_topk_format():
    """forward(hidden, probs [T, E], routing_map [T, E]) (Megatron's router) == forward_topk (DeepEP's)."""
    fp8, _ = pair()
    x, ids, probs = batch(5)
    dense = torch.zeros(T, E).scatter(1, ids, probs)
    a = fp8(x, dense, dense > 0)
    b = fp8.forward_topk(x, ids, probs)
    assert torch.equal(a, b)


@requires_cuda
def test_gpu_experts_phase_has_no_host_sync():
    """After the dispatch (which holds the host splits), permute -> fc1 -> SwiGLU -> fc2 -> unpermute and
    their backward run without a host sync on the backends ``auto`` picks (DeepGEMM and cuBLAS where
    installed, with the dispatcher's host splits; Triton otherwise). H 512, ffn 128, 4 experts: the shapes
    tests/kernels compiles DeepGEMM for, so little is compiled here."""
    torch.manual_seed(0)
    block = FP8FlowMoE(4, 512, 128, 2, device="cuda")
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    probs, ids = torch.softmax(torch.randn(1024, 4, device="cuda"), -1).topk(2)
    res = block.dispatch(block.quantize(x), ids, probs)
    dy = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)

    def experts_fwd_bwd():
        p = res.topk_probs.detach().requires_grad_()
        block.experts(res.hidden, res.topk_ids, p, res.tokens_per_expert, is_first_microbatch=True).backward(dy)

    assert_no_host_sync(experts_fwd_bwd)


@pytest.mark.parametrize("where", ["token", "output_grad", "weight"])
def test_non_finite_values_stay_non_finite(where):
    """An inf in a token, in the output gradient or in a weight reaches the output / the gradients as
    non-finite values, as in the BF16 block (Megatron's NaN/inf checks rely on it): the quantizers give a
    block holding inf a NaN scale_inv instead of saturating it to a finite +-fp8_max."""
    fp8, _ = pair()
    x, ids, probs = batch(5)
    x = x.clone()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    if where == "token":
        x[3, 5] = float("inf")
    elif where == "output_grad":
        dy[2, 9] = float("inf")
    else:
        with torch.no_grad():
            fp8.linear_fc1.weight0.fill_(float("inf"))
    x.requires_grad_()
    y = fp8.forward_topk(x, ids, probs)
    y.backward(dy)
    wgrads = [w.grad for w in fp8.linear_fc1.weights + fp8.linear_fc2.weights if w.grad is not None]
    if where == "output_grad":
        assert torch.isfinite(y).all()
        assert not torch.isfinite(x.grad).all() and not all(torch.isfinite(g).all() for g in wgrads)
    else:
        assert not torch.isfinite(y).all() and not torch.isfinite(x.grad).all()
