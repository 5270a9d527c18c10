"""MoE permute / unpermute: Triton kernels vs reference (bitwise), explicit loop formulas, FP8 payloads,
padding, both routing formats, gradients, bad input, and (GPU) full-size equality and no host sync."""

import pytest
import torch

from conftest import CUDA, KERNEL_DEVICE, assert_no_host_sync, interpreter_only, requires_cuda, survives
from transformer_engine_moe import (
    Float8BlockwiseQTensor,
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_unpermute,
    quantize_blockwise,
    routing_map_to_topk,
    topk_to_routing_map,
)
from transformer_engine_moe.kernels import permute as kp
from transformer_engine_moe.ops import PermuteLayout, permute_layout
from transformer_engine_moe.reference import permute as ref

BACKENDS = ["triton", "reference"]


def routing(t, e, k, device=KERNEL_DEVICE, case="random"):
    """(routing_map [t, e] bool, probs [t, e] float32) for top-k routing. ``case``: "plain";
    "random" (a token routed nowhere, an expert with no tokens); "one_expert" (all on expert 2)."""
    logits = torch.randn(t, e)
    if case == "one_expert":
        logits[:, 2] += 100.0
    idx = logits.topk(k, dim=1).indices
    rm = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx, True)
    if case == "one_expert":
        rm[:] = False
        rm[:, 2] = True
    if case == "random" and t > 4:
        rm[1] = False  # a token routed to no expert
        rm[:, e - 1] = False  # an expert with no tokens
    return rm.to(device), torch.softmax(logits, -1).to(device)


def loop_permute(x, rm, probs):
    """Explicit formula: expert-major, token order within an expert. (rows, probs, (token, expert) list)."""
    rows, ps, pairs = [], [], []
    for e in range(rm.shape[1]):
        for t in range(rm.shape[0]):
            if rm[t, e]:
                rows.append(x[t]), ps.append(probs[t, e]), pairs.append((t, e))
    return rows, ps, pairs


def loop_unpermute(y, rm, probs, first_row):
    """out[t] = sum over t's experts in ascending order of p * y[row], float32, one rounding each."""
    out = torch.zeros(rm.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    for t in range(rm.shape[0]):
        for e in range(rm.shape[1]):
            if rm[t, e]:
                term = y[first_row[(t, e)]].float()
                if probs is not None:
                    term = term * probs[t, e].float()
                out[t] = out[t] + term
    return out.to(y.dtype)


def _same(a, b):
    if isinstance(a, Float8BlockwiseQTensor):
        return (torch.equal(a.rowwise_data.view(torch.uint8), b.rowwise_data.view(torch.uint8))
                and torch.equal(a.rowwise_scale_inv, b.rowwise_scale_inv))
    return torch.equal(a, b)


@pytest.mark.parametrize("case", ["random", "one_expert"])
@pytest.mark.parametrize("t", [0, 1, 37])
def test_routing_layout_kernel_matches_reference(case, t):
    rm, _ = routing(t, 6, 2, case=case)
    for align in (1, 16):
        got, want = kp.routing_layout(rm, align), ref.routing_layout(rm, align)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_layout_and_merge_equal_the_loop_formulas(backend, dtype):
    t, e, k = 29, 5, 3
    rm, probs = routing(t, e, k)
    x = torch.randn(t, 200, device=KERNEL_DEVICE).to(dtype)
    out, pprobs, rmap = moe_permute_with_probs(x, probs, rm, t * k, backend=backend)
    rows, ps, pairs = loop_permute(x, rm, probs)
    n = len(rows)
    assert out.shape == (t * k, 200) and pprobs.shape == (t * k,) and rmap.shape == (t, 2 * e + 1)
    assert torch.equal(out[:n], torch.stack(rows)) and torch.equal(pprobs[:n], torch.stack(ps))
    assert (out[n:] == 0).all() and (pprobs[n:] == 0).all()  # slack rows: zero, never garbage
    y = torch.randn(t * k, 200, device=KERNEL_DEVICE).to(dtype)  # "expert outputs"
    first_row = {pair: i for i, pair in enumerate(pairs)}
    assert torch.equal(moe_unpermute(y, rmap, probs, backend=backend), loop_unpermute(y, rm, probs, first_row))
    assert torch.equal(moe_unpermute(y, rmap, backend=backend), loop_unpermute(y, rm, None, first_row))


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_is_exact_for_top1(backend):
    rm, _ = routing(40, 4, 1, case="plain")  # every token routed once
    x = torch.randn(40, 256, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    ones = torch.ones(40, 4, device=KERNEL_DEVICE)
    out, _, rmap = moe_permute_with_probs(x, ones, rm, 40, backend=backend)
    assert torch.equal(moe_unpermute(out, rmap, ones, backend=backend), x)
    out, _, rmap, pad, _ = moe_permute_and_pad_with_probs(x, ones, rm, rm.sum(0), 16, 40, backend=backend)
    assert torch.equal(moe_unpermute(out, rmap, ones, pad_offsets=pad, backend=backend), x)


@pytest.mark.parametrize("align", [1, 16, 128])
@pytest.mark.parametrize("case", ["random", "one_expert"])
@pytest.mark.parametrize("t", [0, 33])
def test_fp8_permute_and_pad_matches_reference_and_keeps_bytes(align, case, t):
    e, k, h = 6, 2, 384
    rm, probs = routing(t, e, k, case=case)
    x = torch.randn(t, h, device=KERNEL_DEVICE) * torch.logspace(-3, 3, max(t, 1), device=KERNEL_DEVICE)[:t, None]
    q = quantize_blockwise(x.to(torch.bfloat16))
    tpe = rm.sum(0)
    got = moe_permute_and_pad_with_probs(q, probs, rm, tpe, align, t * k, backend="triton")
    want = moe_permute_and_pad_with_probs(q, probs, rm, tpe, align, t * k, backend="reference")
    assert all(_same(a, b) for a, b in zip(got, want))
    out, pprobs, rmap, pad, padded = got
    assert isinstance(out, Float8BlockwiseQTensor) and out.force_pow_2_scales
    assert out.shape[0] == t * k + (e * (align - 1) if align > 1 else 0)
    if align > 1:
        assert ((padded % align) == 0).all() and (padded >= tpe).all() and (padded - tpe < align).all()
    # every pair's FP8 bytes and scale row are those of its token; every other row is 0 with scale 1
    starts = torch.cumsum(padded, 0) - padded
    occupied = torch.zeros(out.shape[0], dtype=torch.bool, device=rm.device)
    for ex in range(e):
        tokens = rm[:, ex].nonzero().flatten()
        rows = starts[ex] + torch.arange(len(tokens), device=rm.device)
        occupied[rows] = True
        assert torch.equal(out.rowwise_data.view(torch.uint8)[rows], q.rowwise_data.view(torch.uint8)[tokens])
        assert torch.equal(out.rowwise_scale_inv[rows], q.rowwise_scale_inv[tokens])
        assert torch.equal(pprobs[rows], probs[tokens, ex])
    assert (out.rowwise_data.view(torch.uint8)[~occupied] == 0).all()
    assert (out.rowwise_scale_inv[~occupied] == 1).all() and (pprobs[~occupied] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["random", "one_expert"])
def test_host_tokens_per_expert_gives_the_exact_padded_size(backend, case):
    """With the counts as a host list (what a dispatcher holds) the output has exactly the padded rows, as
    TransformerEngine's; they equal the worst-case output's first rows."""
    e, k, t, align = 6, 2, 33, 16
    rm, probs = routing(t, e, k, case=case)
    q = quantize_blockwise(torch.randn(t, 256, device=KERNEL_DEVICE).bfloat16())
    counts = rm.sum(0).tolist()
    exact = moe_permute_and_pad_with_probs(q, probs, rm, counts, align, backend=backend)
    worst = moe_permute_and_pad_with_probs(q, probs, rm, rm.sum(0), align, t * k, backend=backend)
    rows = sum(-(-c // align) * align for c in counts)
    assert exact[0].shape == (rows, 256) and worst[0].shape[0] > rows
    assert torch.equal(exact[0].rowwise_data.view(torch.uint8), worst[0].rowwise_data.view(torch.uint8)[:rows])
    assert torch.equal(exact[0].rowwise_scale_inv, worst[0].rowwise_scale_inv[:rows])
    assert torch.equal(exact[1], worst[1][:rows])
    assert all(torch.equal(a, b) for a, b in zip(exact[2:], worst[2:]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["random", "one_expert"])
@pytest.mark.parametrize("host_counts", [True, False], ids=["host-counts", "device-counts"])
def test_a_layout_made_ahead_gives_the_same_permute(backend, case, host_counts):
    """``permute_layout`` made ahead (the local dispatcher queues it before its host wait) and passed as
    ``layout``: the padded permute's outputs bit for bit those it computes itself, and its gradients."""
    e, k, t, align = 6, 2, 33, 16
    rm, probs = routing(t, e, k, case=case)
    x = torch.randn(t, 256, device=KERNEL_DEVICE).bfloat16()
    counts = rm.sum(0).tolist() if host_counts else rm.sum(0)
    layout = permute_layout(rm, align, backend=backend)
    assert isinstance(layout, PermuteLayout) and layout.routing_map is rm and layout.align_size == align
    assert torch.equal(layout.counts, rm.sum(0)) and layout.counts.dtype == torch.int64
    outs, grads = [], []
    for given in (None, layout):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out = moe_permute_and_pad_with_probs(xi, pi, rm, counts, align, None if host_counts else t * k,
                                             backend=backend, layout=given)
        (out[0].float().square().sum() + out[1].sum()).backward()
        outs.append(out)
        grads.append((xi.grad, pi.grad))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_layout_host_counts_are_taken_without_a_device_check(monkeypatch):
    """``layout_host_counts``: the layout's counts on the host, a read-only ``HostSplits``; the permute given these
    very counts with the layout skips its device check of host counts against the map (4 launches after the host
    wait); equal counts from elsewhere are checked, and wrong ones refused."""
    import transformer_engine_moe.ops.permute as permute_ops
    from transformer_engine_moe.layout import HostSplits
    from transformer_engine_moe.ops import layout_host_counts

    align = 16
    rm, probs = routing(33, 6, 2, device="cpu")  # on the CPU: the wrong counts raise, not a device-side assert
    x = torch.randn(33, 256).bfloat16()
    checks = []
    monkeypatch.setattr(permute_ops, "check_on_device",
                        lambda cond, msg, real=permute_ops.check_on_device: checks.append(msg) or real(cond, msg))
    layout = permute_layout(rm, align)
    counts = layout_host_counts(layout)
    assert isinstance(counts, HostSplits) and counts == rm.sum(0).tolist()
    with pytest.raises(TypeError, match="read-only"):
        counts[0] = 0
    moe_permute_and_pad_with_probs(x, probs, rm, counts, align, layout=layout)
    assert not [m for m in checks if "tokens_per_expert differs" in m]
    moe_permute_and_pad_with_probs(x, probs, rm, list(counts), align, layout=layout)
    assert [m for m in checks if "tokens_per_expert differs" in m]
    wrong = list(counts)
    wrong[0] += 1
    with pytest.raises(ValueError, match="tokens_per_expert differs from routing_map.sum"):
        moe_permute_and_pad_with_probs(x, probs, rm, wrong, align, layout=layout)
    with pytest.raises(TypeError, match="layout_host_counts: layout must be None or a PermuteLayout"):
        layout_host_counts(tuple(layout))
    layout.counts.add_(0)
    with pytest.raises(ValueError, match="layout's routing_map or tensors were written since"):
        layout_host_counts(layout)


def test_a_layout_of_another_map_or_not_permute_layouts_is_refused():
    """A layout passed with a map it was not made from, for another padding, built or edited outside
    ``permute_layout`` (a forged row map or counts would size and index the output), or written since: ValueError
    naming the argument; not a layout: TypeError; ``permute_layout``'s own arguments."""
    e, k, t, align = 6, 2, 33, 16
    rm, probs = routing(t, e, k)
    x = torch.randn(t, 256, device=KERNEL_DEVICE).bfloat16()
    counts = rm.sum(0).tolist()
    layout = permute_layout(rm, align)
    call = lambda m, lay, a=align: moe_permute_and_pad_with_probs(x, probs, m, counts, a, layout=lay)  # noqa: E731
    with pytest.raises(ValueError, match="layout was made from another routing_map"):
        call(rm.clone(), layout)
    with pytest.raises(ValueError, match=r"layout was made for align_size=16, this call pads to 32"):
        call(rm, layout, 32)
    with pytest.raises(TypeError, match="layout must be None or a PermuteLayout .* got tuple"):
        call(rm, tuple(layout))
    forged = [layout._replace(counts=layout.counts - 1), layout._replace(align_size=32),
              PermuteLayout(rm, align, layout.row_id_map.clone(), *layout[3:])]
    for bad in forged:
        with pytest.raises(ValueError, match="layout must be one permute_layout made, as it made it"):
            call(rm, bad, bad.align_size)
    written = permute_layout(rm, align)
    written.pad_offsets.add_(0)  # a write bumps the version: the tensor may no longer be what was made
    with pytest.raises(ValueError, match="layout's routing_map or tensors were written since"):
        call(rm, written)
    rm[0] = rm[0]
    with pytest.raises(ValueError, match="layout's routing_map or tensors were written since"):
        call(rm, layout)
    with pytest.raises(TypeError, match=r"routing_map must be a bool \[num_tokens, num_experts >= 1\] tensor, got "
                                        r"torch.int64"):
        permute_layout(rm.long(), align)
    with pytest.raises(ValueError, match=r"routing_map must be \[num_tokens, num_experts >= 1\], got shape \[33, 0\]"):
        permute_layout(rm[:, :0], align)
    with pytest.raises(ValueError, match="align_size must be a positive int .* got 0"):
        permute_layout(rm, 0)


def test_megatron_router_format_round_trips_through_topk():
    """routing_map_to_topk (Megatron's [T, E] probs + mask -> DeepEP's top-k) inverts topk_to_routing_map,
    fewer than k experts on a token (dropped or padded) included, and carries the probs' gradient."""
    t, e, k = 23, 8, 3
    logits = torch.randn(t, e)
    rm = torch.zeros(t, e, dtype=torch.bool).scatter_(1, logits.topk(k, 1).indices, True)
    rm[5] = False  # a token routed nowhere
    rm[6, rm[6].nonzero()[0]] = False  # a token with k-1 experts
    probs = (torch.softmax(logits, 1) * rm).requires_grad_()
    idx, w = routing_map_to_topk(probs, rm, k)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == (t, k)
    assert (idx[5] == -1).all() and (idx[6] == -1).sum() == 1 and (w[idx == -1] == 0).all()
    rm2, probs2 = topk_to_routing_map(idx, w, e)
    assert torch.equal(rm2, rm) and torch.equal(probs2, probs.detach())
    w.sum().backward()
    assert torch.equal(probs.grad, rm.float())


def _topk_case(case: str, t: int, e: int, k: int, dtype=torch.float32):
    """``(topk_idx [t, k] int64, topk_weights [t, k])`` of one routing ``case``, on KERNEL_DEVICE."""
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(t, k).to(dtype)
    if case == "unused_slots" and t:
        idx[::3, -1] = -1
        idx[t // 2] = -1  # a token routed nowhere
    if case == "one_expert" and t:
        idx[:, 1:], idx[:, 0] = -1, e - 1
    if case == "special_values" and t:
        w[t // 2], w[0, 0], w[-1, -1], w[-1, 0] = 0.0, float("nan"), float("inf"), -0.0
    return idx.to(KERNEL_DEVICE), w.to(KERNEL_DEVICE)


@pytest.mark.parametrize("case", ["random", "unused_slots", "one_expert", "special_values"])
@pytest.mark.parametrize("t, e, k", [(0, 8, 2), (1, 8, 1), (37, 8, 3), (19, 200, 8), (33, 6, 5)])
def test_topk_routing_kernel_matches_reference(case, t, e, k):
    """The kernel's map, probs (bitwise, NaN/inf weights kept where a slot names them) and error counts are the
    reference's; experts over several blocks (E=200), k not a power of two, int32 ids and BF16 weights."""
    for dtype, int32 in ((torch.float32, False), (torch.bfloat16, True)):
        idx, w = _topk_case(case, t, e, k, dtype)
        idx = idx.int() if int32 else idx
        got, want = kp.topk_routing(idx, w, e), ref.topk_routing(idx, w, e)
        assert got[0].dtype == torch.bool and got[1].dtype == dtype and got[2].tolist() == [0, 0]
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # bitwise (-0.0 too), NaN payloads aside
        nan = want[1].isnan()
        assert torch.equal(got[1].isnan(), nan) and torch.equal(got[1].view(bits)[~nan], want[1].view(bits)[~nan])
        if case == "special_values" and t > 1:
            assert got[1][0, idx[0, 0]].isnan() and got[1][t - 1, idx[-1, -1]].isinf()


def test_topk_routing_counts_bad_ids():
    """``errors``: ids outside [-1, E) and (token, expert) pairs named twice, counted by kernel and reference
    alike (several per token; ids far out of range clamp nowhere)."""
    idx = torch.tensor([[0, 1, 2], [3, 3, -1], [-2, 9, 1], [2, 2, 2], [2 ** 40, 0, 0]], device=KERNEL_DEVICE)
    w = torch.rand(5, 3, device=KERNEL_DEVICE)
    for impl in (kp, ref):
        assert impl.topk_routing(idx, w, 4)[2].tolist() == [3, 3], impl


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["random", "unused_slots", "one_expert", "special_values"])
def test_checked_topk_probs_are_the_checked_conversions_bit_for_bit(backend, case):
    """``checked_topk_probs`` (the moe_expert rerun's probs of ids the dispatch checked) gives the probs of
    ``topk_to_routing_map`` bit for bit (-0.0, NaN and inf weights too), outside autograd; it checks nothing: bad
    ids raise no error and no write lands outside the [T, E] output (the kernel's stores are masked)."""
    from transformer_engine_moe.ops.permute import checked_topk_probs

    idx, w = _topk_case(case, 37, 8, 3, torch.float32)
    leaf = w.clone().requires_grad_()
    got, want = checked_topk_probs(idx, leaf, 8, backend), topk_to_routing_map(idx, w, 8, backend=backend)[1]
    assert not got.requires_grad and got.shape == (37, 8) and got.dtype == torch.float32
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])
    bad = torch.tensor([[0, 9], [-2, 1], [3, 3]], device=KERNEL_DEVICE)
    probs = checked_topk_probs(bad, torch.ones(3, 2, device=KERNEL_DEVICE), 4, backend)
    assert probs.shape == (3, 4) and probs[0, 0] == 1 and probs[1, 1] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_deepep_topk_format_equals_the_mask(backend):
    t, e, k = 31, 8, 3
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    idx[4, 1] = -1  # a slot not selected (an expert on another rank)
    w = torch.rand(t, k)
    w_leaf = w.to(KERNEL_DEVICE).requires_grad_()
    rm, probs = topk_to_routing_map(idx.to(KERNEL_DEVICE), w_leaf, e, backend=backend)
    grad = torch.arange(t * e, dtype=torch.float32).view(t, e)
    probs.backward(grad.to(KERNEL_DEVICE))  # each used slot gets its expert's gradient, an unused one 0
    assert torch.equal(w_leaf.grad.cpu(), torch.where(idx >= 0, grad.gather(1, idx.clamp(min=0)), 0.0))
    probs = probs.detach()
    mask = torch.zeros(t, e, dtype=torch.bool)
    dense = torch.zeros(t, e)
    for i in range(t):
        for j in range(k):
            if idx[i, j] >= 0:
                mask[i, idx[i, j]] = True
                dense[i, idx[i, j]] = w[i, j]
    assert torch.equal(rm.cpu(), mask) and torch.equal(probs.cpu(), dense)
    x = torch.randn(t, 128, device=KERNEL_DEVICE)
    a = moe_permute_with_probs(x, probs, rm, t * k, backend=backend)
    b = moe_permute_with_probs(x, dense.to(KERNEL_DEVICE), mask.to(KERNEL_DEVICE), t * k, backend=backend)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_autograd_of_the_loop_formulas(backend):
    t, e, k, h = 23, 5, 2, 160
    rm, probs0 = routing(t, e, k)
    x = torch.randn(t, h, device=KERNEL_DEVICE, requires_grad=True)
    probs = probs0.clone().requires_grad_()
    out, pprobs, rmap, pad, _ = moe_permute_and_pad_with_probs(x, probs, rm, rm.sum(0), 8, t * k, backend=backend)
    merge = torch.rand(t, e, device=KERNEL_DEVICE, requires_grad=True)
    w_out = torch.randn(out.shape, device=KERNEL_DEVICE)
    w_probs = torch.randn(pprobs.shape, device=KERNEL_DEVICE)
    y = moe_unpermute(out * 1.5, rmap, merge, pad_offsets=pad, backend=backend)
    w_y = torch.randn(y.shape, device=KERNEL_DEVICE)
    ((out * w_out).sum() + (pprobs * w_probs).sum() + (y * w_y).sum()).backward()

    # the same function written with loops, differentiated by autograd
    xr = x.detach().clone().requires_grad_()
    pr = probs0.clone().requires_grad_()
    mr = merge.detach().clone().requires_grad_()
    padded = ref.padding(rm.sum(0), 8)[1]
    starts = (torch.cumsum(padded, 0) - padded).tolist()
    row_of, loss = {}, 0.0
    count = [0] * e
    for ex in range(e):
        for tok in range(t):
            if rm[tok, ex]:
                row = starts[ex] + count[ex]
                count[ex] += 1
                row_of[(tok, ex)] = row
                loss = loss + (xr[tok] * w_out[row]).sum() + pr[tok, ex] * w_probs[row]
    yr = torch.zeros(t, h, device=KERNEL_DEVICE)
    for tok in range(t):
        for ex in range(e):
            if rm[tok, ex]:
                yr[tok] = yr[tok] + xr[tok] * 1.5 * mr[tok, ex]
    ((yr * w_y).sum() + loss).backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs.grad, pr.grad, rtol=0, atol=0)
    torch.testing.assert_close(merge.grad, mr.grad, rtol=1e-5, atol=1e-5)


def test_unpermute_backward_kernel_matches_reference():
    t, e, k, h = 19, 4, 2, 300
    rm, probs = routing(t, e, k)
    rmap = ref.make_row_id_map(rm)
    pad, _ = ref.padding(rm.sum(0), 16)
    cap = t * k + e * 15
    x = torch.randn(cap, h, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    g = torch.randn(t, h, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    dx, dp = kp.unpermute_backward(g, x, rmap, probs, cap, pad)
    rdx, rdp = ref.unpermute_backward(g, x, rmap, probs, cap, pad)
    assert torch.equal(dx, rdx)
    torch.testing.assert_close(dp, rdp, rtol=1e-5, atol=1e-5)  # float32 dot products, other order


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda x, rm, p: moe_permute_with_probs(x.int(), p, rm, 8), TypeError, "bf16/fp16/fp32"),
        (lambda x, rm, p: moe_permute_with_probs(x[0], p, rm, 8), ValueError, r"2-D \[num_tokens, hidden\]"),
        (lambda x, rm, p: moe_permute_with_probs(x, p, rm[:3], 8), ValueError, r"routing_map must be \[num_tokens=4"),
        (lambda x, rm, p: moe_permute_with_probs(x, p, rm.float(), 8), TypeError, "bool or integer"),
        (lambda x, rm, p: moe_permute_with_probs(x, p[:, :2], rm, 8), ValueError, r"probs must have shape \[4, 3\]"),
        (lambda x, rm, p: moe_permute_with_probs(x, p, rm, 1), ValueError, "more than num_out_tokens=1"),
        (lambda x, rm, p: moe_permute_with_probs(x, p, rm, -1), ValueError, "non-negative int"),
        (lambda x, rm, p: moe_permute_and_pad_with_probs(x, p, rm, rm.sum(0), -2), ValueError, "align_size"),
        (lambda x, rm, p: moe_permute_and_pad_with_probs(x, p, rm, rm.sum(0), 0), ValueError,
         r"align_size must be a positive int \(1: no padding\), got 0"),
        (lambda x, rm, p: moe_permute_and_pad_with_probs(x, p, rm, None, 16), ValueError,
         "tokens_per_expert must be given"),
        (lambda x, rm, p: moe_permute(x, rm, 8, map_type="index"), ValueError, "map_type='index'.*not supported"),
        (lambda x, rm, p: moe_permute(x, rm, 8, map_type="bogus"), ValueError, "map_type must be 'mask' or 'index'"),
        (lambda x, rm, p: moe_permute(x, rm, 8, max_token_num=None), TypeError, "max_token_num must be an int"),
        (lambda x, rm, p: moe_unpermute(x, torch.zeros(4, 7, dtype=torch.int32), map_type="index"), ValueError,
         "moe_unpermute: map_type='index'"),
        (lambda x, rm, p: moe_unpermute(x, torch.zeros(4, 7, dtype=torch.int32), p, probs=p), ValueError,
         "both merging_probs and its deprecated name probs"),
        (lambda x, rm, p: moe_permute_and_pad_with_probs(x, p, rm, torch.zeros(3, dtype=torch.long), 16, 8),
         ValueError, "tokens_per_expert differs"),
        (lambda x, rm, p: moe_permute_and_pad_with_probs(x, p, rm, [2, 2, 0], 16), ValueError,
         "tokens_per_expert differs"),
        (lambda x, rm, p: moe_permute_and_pad_with_probs(x, p, rm, [2, 2], 16), ValueError,
         "num_experts=3 ints"),
        (lambda x, rm, p: moe_permute_and_pad_with_probs(x, p, rm, torch.zeros(2), 16), ValueError,
         r"\[num_experts=3\] tensor or a host list"),
        (lambda x, rm, p: moe_unpermute(quantize_blockwise(torch.randn(8, 128)), torch.zeros(4, 7, dtype=torch.int32)),
         TypeError, "dequantize the FP8 tensor first"),
        (lambda x, rm, p: moe_unpermute(x, torch.zeros(4, 7)), TypeError, "row_id_map must be the int32"),
        (lambda x, rm, p: moe_unpermute(x, torch.zeros(4, 7, dtype=torch.int32), p[:, :2]), ValueError,
         r"merging_probs must have shape \[4, 3\]"),
        (lambda x, rm, p: moe_unpermute(x, torch.zeros(4, 7, dtype=torch.int32), restore_shape=(2, 128)),
         ValueError, "restore_shape"),
        (lambda x, rm, p: moe_unpermute(x, torch.zeros(4, 7, dtype=torch.int32), pad_offsets=torch.zeros(3)),
         ValueError, r"pad_offsets must be the int64 \[num_experts=3\] tensor .*, got torch.float32 of shape \[3\]"),
        (lambda x, rm, p: topk_to_routing_map(torch.tensor([[0, 3]]), torch.ones(1, 2), 3), ValueError,
         r"topk_idx holds expert ids outside \[-1, num_experts=3\)"),
        (lambda x, rm, p: topk_to_routing_map(torch.tensor([[1, 1]]), torch.ones(1, 2), 3), ValueError,
         "topk_idx names an expert twice for one token"),
        (lambda x, rm, p: topk_to_routing_map(torch.tensor([[1.0]]), torch.ones(1, 1), 3), TypeError,
         "int32/int64"),
        (lambda x, rm, p: routing_map_to_topk(p, rm.int(), 2), TypeError,
         r"routing_map must be a 2-D bool tensor \[T, E\], got torch.int32 of shape \[4, 3\]"),
        (lambda x, rm, p: routing_map_to_topk(p, rm[None], 2), TypeError, r"got torch.bool of shape \[1, 4, 3\]"),
        (lambda x, rm, p: routing_map_to_topk(p, rm, 4), ValueError, r"topk must be an int in \[1, E=3\]"),
        (lambda x, rm, p: routing_map_to_topk(p, rm, 1), ValueError, "selects more than topk=1"),
        (lambda x, rm, p: routing_map_to_topk(p[:, :2], rm, 2), ValueError, r"probs must have shape \[4, 3\]"),
        # the hostile-input probe: an integer map's 2 or -1 (once routed silently), no experts (once a
        # ZeroDivisionError in the Triton launcher), float counts (once truncated), counts on the meta device, bools
        # for ints
        (lambda x, rm, p: moe_permute(x, rm.int() * 2, 8), ValueError, "must hold only 0 and 1"),
        (lambda x, rm, p: moe_permute(x, rm.int() - 1, 12), ValueError, "must hold only 0 and 1"),
        (lambda x, rm, p: moe_permute(x, rm[:, :0], 8, backend="triton"), ValueError, "at least one expert column"),
        (lambda x, rm, p: moe_permute_and_pad_with_probs(x, p, rm, rm.sum(0).float(), 16), TypeError,
         "tokens_per_expert must be an int32/int64 tensor, got torch.float32"),
        (lambda x, rm, p: moe_permute_and_pad_with_probs(x, p, rm, rm.sum(0).to("meta"), 16), ValueError,
         "tokens_per_expert is on meta"),
        (lambda x, rm, p: moe_unpermute(x, torch.zeros(4, 7, dtype=torch.int32), restore_shape="ab"), TypeError,
         "restore_shape must be a sequence of ints"),
        (lambda x, rm, p: routing_map_to_topk(p, rm, True), ValueError, "topk must be an int .* got True"),
        (lambda x, rm, p: topk_to_routing_map(torch.tensor([[0]]), torch.ones(1, 1), True), ValueError,
         "num_experts must be a positive int, got True"),
        (lambda x, rm, p: moe_permute(x.to("meta"), rm.to("meta"), 8), ValueError,
         "moe_permute: got a tensor on the meta"),
    ],
    ids=["int-inp", "1d-inp", "map-rows", "map-float", "probs-shape", "too-few-rows", "negative-rows",
         "align", "align-0", "tpe-none", "map-type-index", "map-type-bogus", "max-token-num", "unpermute-index",
         "probs-twice", "tpe", "tpe-list", "tpe-list-len", "tpe-shape", "fp8-unpermute", "map-dtype", "merge-shape",
         "restore", "pad-dtype", "id-range", "id-twice",
         "id-dtype", "rm-dtype", "rm-3d", "topk-range", "too-many", "rm-probs-shape", "int-map-2", "int-map-neg",
         "no-experts", "tpe-float", "tpe-meta", "restore-str", "topk-bool", "num-experts-bool", "meta"],
)
def test_bad_input_is_rejected_clearly(call, exc, match):
    x = torch.randn(4, 128)
    rm = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    with pytest.raises(exc, match=match):
        call(x, rm, torch.rand(4, 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_transformer_engines_argument_forms(backend):
    """TransformerEngine's signatures: moe_permute(inp, routing_map, num_out_tokens, max_token_num, map_type)
    and moe_unpermute(inp, row_id_map, merging_probs, restore_shape, map_type, probs, pad_offsets), positionally;
    ``probs`` is TE's deprecated name of ``merging_probs``."""
    rm, probs = routing(20, 4, 2)
    x = torch.randn(20, 128, device=KERNEL_DEVICE)
    out, rmap = moe_permute(x, rm, 40, -1, "mask", backend=backend)
    assert torch.equal(out, moe_permute(x, rm, 40, backend=backend)[0])
    want = moe_unpermute(out, rmap, probs, backend=backend)
    assert torch.equal(moe_unpermute(out, rmap, probs, (20, 128), "mask", backend=backend), want)
    with pytest.warns(DeprecationWarning, match="probs is deprecated"):
        assert torch.equal(moe_unpermute(out, rmap, probs=probs, backend=backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_backward_with_no_routed_rows(backend, padded):
    """No token routed anywhere (zero output rows): backward gives zero gradients (it indexed an empty
    gradient of the permuted probs before)."""
    x = torch.randn(4, 128, device=KERNEL_DEVICE, requires_grad=True)
    probs = torch.rand(4, 3, device=KERNEL_DEVICE, requires_grad=True)
    rm = torch.zeros(4, 3, dtype=torch.bool, device=KERNEL_DEVICE)
    if padded:
        out, pprobs, _, _, _ = moe_permute_and_pad_with_probs(x, probs, rm, [0, 0, 0], 16, backend=backend)
    else:
        out, pprobs, _ = moe_permute_with_probs(x, probs, rm, 0, backend=backend)
    assert out.shape == (0, 128) and pprobs.shape == (0,)
    (out.sum() + pprobs.sum()).backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(probs.grad, torch.zeros_like(probs))


def test_moe_permute_without_probs():
    rm, probs = routing(20, 4, 2)
    x = torch.randn(20, 128, device=KERNEL_DEVICE)
    out, rmap = moe_permute(x, rm, 40, backend="triton")
    out2, _, rmap2 = moe_permute_with_probs(x, probs, rm, 40, backend="reference")
    assert torch.equal(out, out2) and torch.equal(rmap, rmap2)


# ---------------------------------------------------------------------------- GPU only
@requires_cuda
@pytest.mark.parametrize("tokens,experts", [(4096, 256), (16384, 32)])
def test_gpu_bitwise_at_deepseek_sizes(tokens, experts):
    rm, probs = routing(tokens, experts, 8, "cuda", case="plain")
    q = quantize_blockwise(torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16))
    got = moe_permute_and_pad_with_probs(q, probs, rm, rm.sum(0), 128, tokens * 8, backend="triton")
    want = moe_permute_and_pad_with_probs(q, probs, rm, rm.sum(0), 128, tokens * 8, backend="reference")
    assert all(_same(a, b) for a, b in zip(got, want))
    y = got[0].dequantize(torch.bfloat16)
    assert torch.equal(moe_unpermute(y, got[2], probs, pad_offsets=got[3], backend="triton"),
                       moe_unpermute(y, got[2], probs, pad_offsets=got[3], backend="reference"))


@requires_cuda
def test_gpu_no_host_sync():
    rm, probs = routing(2048, 32, 8, "cuda", case="plain")
    q = quantize_blockwise(torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16))
    probs.requires_grad_()

    def step():
        out, pprobs, rmap, pad, padded = moe_permute_and_pad_with_probs(q, probs, rm, rm.sum(0), 128, 2048 * 8)
        y = moe_unpermute(out.dequantize(torch.bfloat16) * 2, rmap, probs, pad_offsets=pad)
        (y.float().sum() + pprobs.sum()).backward()

    assert_no_host_sync(step)


@pytest.mark.skipif(CUDA, reason="on the GPU the check is a device-side assert, which ends the process's CUDA "
                                   "context; the same check runs before the kernel on the CPU paths here")
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", ["row-999", "inp-cut-short", "count-too-large", "pad-past-end"])
def test_unpermute_refuses_a_map_that_names_rows_outside_inp(backend, case):
    """A row_id_map pointing past ``inp`` (a map from another call, a cut-short ``inp``) segfaulted the
    Triton kernel and read garbage; now every path refuses it by name before indexing (CPU: the
    reference and the Triton kernel in the interpreter)."""
    rm = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    y, _, rmap, pad, _ = moe_permute_and_pad_with_probs(torch.randn(4, 128), torch.rand(4, 3), rm, rm.sum(0), 16)
    y = y.dequantize() if isinstance(y, Float8BlockwiseQTensor) else y
    assert moe_unpermute(y, rmap, pad_offsets=pad, backend=backend).shape == (4, 128)  # as returned: fine
    rmap, pad = rmap.clone(), pad.clone()
    if case == "row-999":
        rmap[0, 0] = 999
    elif case == "inp-cut-short":
        y = y[:20]
    elif case == "count-too-large":
        rmap[1, -1] = 3
    else:
        pad[2] = 1000
    with pytest.raises(ValueError, match="row_id_map names rows outside inp's"):
        moe_unpermute(y, rmap, pad_offsets=pad, backend=backend)


@pytest.mark.skipif(CUDA, reason="on the GPU the check is a device-side assert, which ends the process's CUDA "
                                   "context; the same check runs before the kernel on the CPU paths here")
@pytest.mark.parametrize("what", ["map", "pad_offsets"])
def test_unpermute_checks_a_map_written_after_its_permute(what):
    """moe_unpermute skips the bounds check for a permute call's own, unchanged map and pad_offsets; the very
    tensors it returned, written in place afterwards, are checked again (their versions moved) and refused."""
    rm = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    y, _, rmap, pad, _ = moe_permute_and_pad_with_probs(torch.randn(4, 128), torch.rand(4, 3), rm, rm.sum(0), 16)
    y = y.dequantize() if isinstance(y, Float8BlockwiseQTensor) else y
    if what == "map":
        rmap[0, 0] = 999
    else:
        pad[2] = 1000
    with pytest.raises(ValueError, match="row_id_map names rows outside inp's"):
        moe_unpermute(y, rmap, pad_offsets=pad)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_unpermute_checks_only_maps_it_cannot_vouch_for(monkeypatch, padded):
    """The bounds check (about 25 small launches on the GPU) runs for a map this package's permute did not
    return as is (a copy), for other pad_offsets, and for an inp of other rows than that call's output; not
    for the call's own map, pad_offsets and output. Every call's result is the same."""
    from transformer_engine_moe.ops import permute as permute_ops

    calls = []
    check = permute_ops._check_map_rows
    monkeypatch.setattr(permute_ops, "_check_map_rows", lambda *a: (calls.append(1), check(*a))[1])
    rm = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    x = torch.randn(4, 128, device=KERNEL_DEVICE)
    rm = rm.to(KERNEL_DEVICE)
    if padded:
        y, _, rmap, pad, _ = moe_permute_and_pad_with_probs(x, torch.rand(4, 3, device=x.device), rm,
                                                            rm.sum(0).tolist(), 16)
    else:
        (y, rmap), pad = moe_permute(x, rm), None
    want = moe_unpermute(y, rmap, pad_offsets=pad)
    assert calls == []
    assert torch.equal(moe_unpermute(y, rmap.clone(), pad_offsets=pad), want)
    assert len(calls) == 1
    if padded:
        assert torch.equal(moe_unpermute(y, rmap, pad_offsets=pad.clone()), want)
        assert len(calls) == 2
    extra = torch.cat([y, torch.zeros_like(y[:1])])  # one more row than the permute's output: checked
    assert torch.equal(moe_unpermute(extra, rmap, pad_offsets=pad), want)
    assert len(calls) == (3 if padded else 2)


@pytest.mark.skipif(CUDA, reason="on the GPU the check is a device-side assert, which ends the process's CUDA "
                                   "context; the same check runs before the kernel on the CPU paths here")
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_unpermute_refuses_transformer_engines_descending_map(backend):
    """TE lists a token's experts in descending order; this package's map ascending. A TE-ordered map (same
    rows, same experts) is refused by name on every path, not half-read (summed in another order)."""
    rm = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    y, rmap = moe_permute(torch.randn(4, 128), rm)
    e = 3
    te = rmap.clone()
    for t in range(4):
        n = int(te[t, 2 * e])
        te[t, :n], te[t, e:e + n] = rmap[t, :n].flip(0), rmap[t, e:e + n].flip(0)
    assert moe_unpermute(y, rmap, backend=backend).shape == (4, 128)
    with pytest.raises(ValueError, match="out of ascending order: a map built by TransformerEngine"):
        moe_unpermute(y, te, backend=backend)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=interpreter_only)])
def test_out_of_range_map_once_segfaulted_now_refused_in_a_subprocess(backend):
    """The segfault (the Triton unpermute reading row 999) run in its own process: a regression fails here
    instead of ending the suite."""
    out = survives(f"""
import torch
from transformer_engine_moe import moe_permute, moe_unpermute
y, rmap = moe_permute(torch.randn(4, 128), torch.tensor([[1, 0], [0, 1], [1, 1], [0, 0]], dtype=torch.bool))
rmap[0, 0] = 999
try:
    moe_unpermute(y, rmap, backend={backend!r})
except ValueError as e:
    print("ValueError:", e)
""")
    assert "ValueError: moe_unpermute: row_id_map names rows outside inp's" in out


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("host_counts", [True, False], ids=["host-counts", "device-counts"])
def test_unpermute_of_the_padded_output_without_pad_offsets_is_refused(host_counts, backend):
    """The map is the same with and without padding, so the padded output unpermuted without its
    pad_offsets read other tokens' rows silently; the padded permute now registers its map and output
    rows, and moe_unpermute refuses that call by name. The output with its padding stripped (rows equal
    the routed pairs) stays valid without pad_offsets, as does an output that needed no padding."""
    torch.manual_seed(0)
    rm = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    x = torch.randn(4, 128)
    counts = rm.sum(0).tolist() if host_counts else rm.sum(0)
    if CUDA:
        x, rm = x.cuda(), rm.cuda()
        counts = counts if host_counts else counts.cuda()
    y, _, rmap, pad, padded = moe_permute_and_pad_with_probs(x, torch.rand(4, 3, device=x.device), rm, counts, 16,
                                                            backend=backend)
    y = y.dequantize() if isinstance(y, Float8BlockwiseQTensor) else y
    want = moe_unpermute(y, rmap, pad_offsets=pad, backend=backend)
    with pytest.raises(ValueError, match="pass the pad_offsets it returned"):
        moe_unpermute(y, rmap, backend=backend)
    starts = (torch.cumsum(padded, 0) - padded).tolist()
    unpadded = torch.cat([y[s:s + c] for s, c in zip(starts, rm.sum(0).tolist())])
    assert torch.equal(moe_unpermute(unpadded, rmap, backend=backend), want)
    y16, _, rmap16, _, _ = moe_permute_and_pad_with_probs(torch.randn(16, 128), torch.rand(16, 1),
                                                          torch.ones(16, 1, dtype=torch.bool), [16], 16)
    assert moe_unpermute(y16 if not isinstance(y16, Float8BlockwiseQTensor) else y16.dequantize(),
                         rmap16).shape == (16, 128)
    from transformer_engine_moe.ops import permute as permute_ops

    before = len(permute_ops._PERMUTE_MAPS)
    del rmap16
    assert len(permute_ops._PERMUTE_MAPS) == before - 1  # an entry leaves with its map


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_unpermute_hands_back_its_gradient_quantized_per_token_bitwise(backend, fp8):
    """``grad_quantize``: the gradient of the padded expert rows arrives as a rowwise 1x128 FP8 tensor, bitwise
    the quantization of the BF16 gradient the plain backward permutes (each token's row quantized once, its
    copies permuted with their scales; padding rows zero bytes with scale_inv 1, as a quantized zero row),
    special values included."""
    from transformer_engine_moe.ops.quantize import QuantizeArgs

    rm, probs = routing(48, 4, 2)
    counts = rm.sum(0).tolist()
    x, _, row_id_map, pad_offsets, _ = moe_permute_and_pad_with_probs(
        torch.randn(48, 256, device=KERNEL_DEVICE, dtype=torch.bfloat16), probs, rm, counts, 16, backend=backend)
    dy = torch.randn(48, 256, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    dy[0, 5], dy[2, 200], dy[3, 7] = float("nan"), float("inf"), -0.0
    args = QuantizeArgs(fp8_dtype=fp8, backend=backend)  # the quantization compared with below
    grads = []
    for quantize in (None, args):
        y = x.detach().requires_grad_()
        moe_unpermute(y, row_id_map, pad_offsets=pad_offsets, grad_quantize=quantize, backend=backend).backward(dy)
        grads.append(y.grad)
    plain, got = grads
    assert isinstance(got, Float8BlockwiseQTensor) and got.fp8_dtype == fp8 and got.shape == plain.shape
    want = quantize_blockwise(plain, fp8_dtype=fp8, backend=backend)
    assert torch.equal(got.rowwise_data.view(torch.uint8), want.rowwise_data.view(torch.uint8))
    assert torch.equal(got.rowwise_scale_inv.view(torch.int32), want.rowwise_scale_inv.view(torch.int32))


def test_unpermute_grad_quantize_is_checked():
    from transformer_engine_moe.ops.quantize import QuantizeArgs

    rm, probs = routing(8, 4, 2, device="cpu")
    y, row_id_map = moe_permute(torch.randn(8, 128), rm, num_out_tokens=16)
    with pytest.raises(TypeError, match="grad_quantize must be None or QuantizeArgs"):
        moe_unpermute(y, row_id_map, grad_quantize=torch.float8_e4m3fn)
    for bad in (QuantizeArgs(block="128x128"), QuantizeArgs(columnwise=True), QuantizeArgs(amax_epsilon=1e-6)):
        with pytest.raises(ValueError, match="grad_quantize must be 1x128 rowwise only with amax_epsilon 0"):
            moe_unpermute(y, row_id_map, grad_quantize=bad)
    with pytest.raises(ValueError, match="grad_quantize needs merging_probs None"):
        moe_unpermute(y, row_id_map, probs, grad_quantize=QuantizeArgs())


def test_a_map_written_through_data_drops_its_pairs_in_a_subprocess():
    """A ``.data`` write moves no tensor version, so moe_unpermute took a written map (or pad_offsets) for its
    permute call's own and skipped the bounds check, and permute's and unpermute's backward check nothing: the
    Triton kernels read and wrote out of bounds (a segfault at row 10**8). Every kernel now masks each index it
    loads, on the device: an entry out of range (huge, negative, one past the end) drops its pair, on both
    backends alike: the token's output and gradients are zero, and so are its rows' gradients. A count out of
    range is clamped to [0, E]. In a subprocess: a regression fails here instead of ending the suite."""
    out = survives(f"""
import torch
from transformer_engine_moe import moe_permute_and_pad_with_probs, moe_unpermute
from transformer_engine_moe.kernels import permute as kp
from transformer_engine_moe.reference import permute as ref

dev, T, E, H, R = {KERNEL_DEVICE!r}, 6, 3, 32, 12  # R: output rows, each expert's 2 tokens padded to 4
torch.manual_seed(0)
rm = torch.zeros(T, E, dtype=torch.bool, device=dev)
rm[torch.arange(T), torch.arange(T) % E] = True  # top-1; expert 2 (pad_offsets 4): tokens 2, 5 at rows 8, 9
x, probs, merge = torch.randn(T, H, device=dev), torch.rand(T, E, device=dev), torch.rand(T, E, device=dev)
w_out, w_probs, dy = torch.randn(R, H, device=dev), torch.randn(R, device=dev), torch.randn(T, H, device=dev)

def run(backend, what=None, index=None, value=None):
    xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, pprobs, rmap, pad, _ = moe_permute_and_pad_with_probs(xl, pl, rm, [2] * E, 4, backend=backend)
    rows = rmap[:, 0].long() + pad[rmap[:, E].long()]
    if what is not None:
        (rmap if what == "map" else pad).data[index] = value
    ((out * w_out).sum() + (pprobs * w_probs).sum()).backward()  # permute's backward: unpermute of the map
    y1, m1, y2 = out.detach().requires_grad_(), merge.clone().requires_grad_(), out.detach().requires_grad_()
    merged = moe_unpermute(y1, rmap, m1, pad_offsets=pad, backend=backend)
    merged.backward(dy)  # unpermute_backward
    summed = moe_unpermute(y2, rmap, pad_offsets=pad, backend=backend)
    summed.backward(dy)  # a permute of dy
    return rows, dict(gx=xl.grad, gprobs=pl.grad, merged=merged, gm=m1.grad, summed=summed), dict(gy1=y1.grad,
                                                                                                 gy2=y2.grad)

CASES = [("map", (2, 0), 10**8, [2]), ("map", (2, 0), -7, [2]), ("map", (2, 0), R - 4, [2]),
         ("map", (2, E), 10**8, [2]), ("map", (2, E), -1, [2]), ("map", (2, E), E, [2]),
         ("map", (2, 2 * E), 10**8, []), ("map", (2, 2 * E), -1, [2]),
         ("pad", 2, 10**15, [2, 5]), ("pad", 2, -10**15, [2, 5]), ("pad", 2, R - 4, [2, 5])]
for backend in ("triton", "reference"):
    rows, clean_tok, clean_row = run(backend)
    for what, index, value, dropped in CASES:
        _, tok, row = run(backend, what, index, value)
        for name, want in clean_tok.items():
            want = want.clone()
            want[dropped] = 0
            assert torch.equal(tok[name], want), (backend, what, index, value, name)
        for name, want in clean_row.items():
            want = want.clone()
            want[rows[dropped]] = 0
            assert torch.equal(row[name], want), (backend, what, index, value, name)
    print("dropped", backend)

# the launchers on maps and pad_offsets of random entries, in range or not: the kernels read what the reference reads
for seed in range(4):
    g = torch.Generator().manual_seed(seed)
    fz = torch.randint(-3, R + 3, (T, 2 * E + 1), generator=g, dtype=torch.int32)
    fz[:, E:2 * E] = torch.randint(-2, E + 2, (T, E), generator=g, dtype=torch.int32)
    fz[:, 2 * E] = torch.randint(-1, E + 2, (T,), generator=g, dtype=torch.int32)
    fz, pad = fz.to(dev), torch.randint(-4, 8, (E,), generator=g).to(dev)
    y = torch.randn(R, H, device=dev)
    assert torch.equal(kp.unpermute(y, fz, merge, pad), ref.unpermute(y, fz, merge, pad)), seed
print("fuzz")
""")
    assert out.split() == ["dropped", "triton", "dropped", "reference", "fuzz"]


def _strided(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` (1-D or 2-D) as a non-contiguous view. "transposed": the transpose of its contiguous transpose
    (same values; 1-D: as "sliced"); "sliced": every other row of a tensor twice as tall (same values, other
    rows between); "expanded": row 0 broadcast (stride 0): other values, compared with its contiguous copy."""
    if layout == "expanded":
        return t[:1].expand(t.shape)
    if layout == "transposed" and t.dim() == 2:
        return t.t().contiguous().t()
    raw = t.view(torch.uint8) if t.element_size() == 1 else t  # bool and FP8: stacked as bytes
    return torch.stack([raw, raw.flip(0)], dim=1)[:, 0].view(t.dtype)


def _views_equal_contiguous(op, args, layout, backend, exact=True):
    """``op(*views, backend=backend)``'s tensor outputs and the gradients of its floating arguments (for
    seeded output gradients, themselves views) equal the reference's on the views' contiguous copies: bitwise,
    or (``exact`` False: the last gradient, merging probs' float32 dot products) within float32 rounding."""
    views = [_strided(a, layout) for a in args]
    results = []
    for b, inputs in ((backend, views), ("reference", [v.contiguous() for v in views])):
        leaves = [v.detach().requires_grad_() if v.is_floating_point() else v for v in inputs]
        outs = op(*leaves, backend=b)
        outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if isinstance(o, torch.Tensor)]
        diff = [o for o in outs if o.requires_grad]
        gen = torch.Generator().manual_seed(0)
        grads = [_strided(torch.randn(o.shape, generator=gen).to(o), layout) for o in diff]
        grads = [g if inputs is views else g.contiguous() for g in grads]
        results.append(outs + list(torch.autograd.grad(diff, [v for v in leaves if v.requires_grad], grads)))
    got, want = results
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got[:-1], want[:-1]))
    torch.testing.assert_close(got[-1], want[-1], rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded"])
def test_non_contiguous_arguments_equal_their_contiguous_copies(layout, backend):
    """Every tensor argument of every permute op (inp, FP8 inp's data and scales, routing_map, probs, row_id_map,
    merging_probs, pad_offsets) and the gradients backward receives, as a transposed, sliced or expanded view:
    the result of the same values made contiguous, on the reference. The Triton path read wrong rows (max diff
    4.96; NaN from an expanded inp) where the reference was right; its launchers now make views contiguous."""
    t, e, h = 8, 4, 256
    rm, probs = routing(t, e, 2)
    x, merge = torch.randn(t, h, device=KERNEL_DEVICE), torch.rand(t, e, device=KERNEL_DEVICE)
    _views_equal_contiguous(lambda x, rm, backend: moe_permute(x, rm, 2 * t, backend=backend), [x, rm], layout,
                            backend)
    _views_equal_contiguous(lambda x, p, rm, backend: moe_permute_with_probs(x, p, rm, 2 * t, backend=backend),
                            [x, probs, rm], layout, backend)
    _views_equal_contiguous(lambda x, p, rm, backend: moe_permute_and_pad_with_probs(x, p, rm, rm.sum(0), 4, 2 * t,
                                                                                     backend=backend),
                            [x, probs, rm], layout, backend)
    y, _, rmap, pad, _ = moe_permute_and_pad_with_probs(x, probs, rm, rm.sum(0), 4, 2 * t, backend="reference")
    y = torch.randn_like(y)  # "expert outputs"
    _views_equal_contiguous(lambda y, rmap, m, pad, backend: moe_unpermute(y, rmap, m, pad_offsets=pad,
                                                                           backend=backend),
                            [y, rmap, merge, pad], layout, backend, exact=backend == "reference")
    _views_equal_contiguous(lambda y, rmap, pad, backend: moe_unpermute(y, rmap, pad_offsets=pad, backend=backend),
                            [y, rmap, pad], layout, backend)
    # FP8 inp: its data unit-stride along H (the tensor's rule; a transposed layout is sliced), scales any view
    q = quantize_blockwise(x.bfloat16())

    def fp8(data, scale):
        return Float8BlockwiseQTensor(shape=data.shape, dtype=torch.bfloat16, fp8_dtype=data.dtype,
                                      force_pow_2_scales=True, rowwise_data=data, rowwise_scale_inv=scale)

    data = _strided(q.rowwise_data, "sliced" if layout == "transposed" else layout)
    scale = _strided(q.rowwise_scale_inv, layout)
    got = moe_permute_and_pad_with_probs(fp8(data, scale), probs, rm, rm.sum(0), 4, 2 * t, backend=backend)
    want = moe_permute_and_pad_with_probs(fp8(data.contiguous(), scale.contiguous()), probs, rm, rm.sum(0), 4, 2 * t,
                                          backend="reference")
    assert all(_same(a, b) for a, b in zip(got, want))
