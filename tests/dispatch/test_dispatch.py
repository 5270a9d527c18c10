"""Token dispatchers: alltoall over gloo at EP=2 (two subgroups at once) and EP=4, one spawn of four
processes, against a single-process oracle built from the global batch (received rows, ids, probs
and counts; FP8 bytes and scales; combine; gradients of both; byte counts); local identity; a
world of one in this process; byte ratio; bad input. deepep runs the same cases where it can."""

import json
import os
import sys
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
from transformer_engine_moe import FP8FlowRecipe, Format, quantize_blockwise, topk_to_routing_map
from transformer_engine_moe.dispatch import (
    AllToAllTokenDispatcher,
    DispatchHandle,
    LocalTokenDispatcher,
    combine_payload_bytes,
    dispatch_payload_bytes,
    get_dispatcher,
)
from transformer_engine_moe.dispatch.base import slots_per_expert
from transformer_engine_moe.ops import PermuteLayout, permute_layout

WORLD = 4
EP_SIZES = [2, 4]
SCENARIOS = ["random", "zero_tokens", "one_expert", "empty"]
E_LOCAL = 3


# ---------------------------------------------------------------- the global batch and its oracle
def make_batch(scenario, g, seed, hidden):
    """Per EP rank s: ``(x [T_s, H] bf16, topk_ids [T_s, k] int64, topk_probs [T_s, k] fp32)``.

    random: distinct experts, one unselected slot (-1); zero_tokens: rank 1 has no tokens and
    the last rank owns none of the chosen experts (receives nothing); one_expert: every token
    to the last expert only; empty: T = 0 everywhere."""
    gen = torch.Generator().manual_seed(seed)
    num_experts = E_LOCAL * g
    sizes, k, choose_from = {
        "random": ([5, 8, 3, 6], 3, num_experts),
        "zero_tokens": ([6, 0, 4, 7], 2, E_LOCAL * (g - 1)),
        "one_expert": ([4, 5, 3, 2], 1, num_experts),
        "empty": ([0, 0, 0, 0], 2, num_experts),
    }[scenario]
    batch = []
    for t in sizes[:g]:
        x = torch.randn(t, hidden, generator=gen).bfloat16()
        ids = torch.rand(t, choose_from, generator=gen).argsort(1)[:, :k]
        if scenario == "one_expert":
            ids[:] = num_experts - 1
        if scenario == "random" and t > 1:
            ids[1, 2] = -1
        batch.append((x, ids, torch.rand(t, k, generator=gen)))
    return batch, num_experts


def expected_receive(batch, r):
    """What EP rank r receives: ``(sources [(s, t)], local ids [R, k], probs [R, k])``, source ranks
    ascending, token order within a source."""
    k = batch[0][1].shape[1]
    src, ids, probs = [], [torch.zeros(0, k, dtype=torch.int64)], [torch.zeros(0, k)]
    for s, (_, ids_s, probs_s) in enumerate(batch):
        local = ids_s - r * E_LOCAL
        mine = (local >= 0) & (local < E_LOCAL)
        for t in range(ids_s.shape[0]):
            if mine[t].any():
                src.append((s, t))
                ids.append(torch.where(mine[t], local[t], -1)[None])
                probs.append(torch.where(mine[t], probs_s[t], 0.0)[None])
    return src, torch.cat(ids), torch.cat(probs)


def expert(h, probs):
    """Stand-in for the experts: each received row times the sum of its local probs, BF16 out."""
    return (h.float() * probs.sum(1, keepdim=True)).to(torch.bfloat16)


def grad_out(batch, s, seed):
    return torch.randn(batch[s][0].shape, generator=torch.Generator().manual_seed(seed + s)).bfloat16()


def sum_back(batch, s, recv, rows_of):
    """Token t of rank s: float32 sum over ranks ascending of ``rows_of[r][row(r, s, t)]``, ``[T_s, ...]``."""
    out = torch.zeros((batch[s][0].shape[0],) + rows_of[0].shape[1:])
    for r, (src, _, _) in enumerate(recv):
        for row, (s2, t) in enumerate(src):
            if s2 == s:
                out[t] = out[t] + rows_of[r][row].float()
    return out


# ---------------------------------------------------------------- one case on one rank
def run_case(dispatcher, batch, me, fp8, device, seed):
    """Dispatch -> expert -> combine -> backward on EP rank ``me``; compare with the oracle. Every
    collective runs before any comparison (a failed check never leaves a peer waiting)."""
    g, hidden, k = len(batch), batch[0][0].shape[1], batch[0][1].shape[1]
    x, ids, probs = (t.to(device, copy=True) for t in batch[me])
    x.requires_grad_(), probs.requires_grad_()
    q = quantize_blockwise(x) if fp8 else None
    res = dispatcher.dispatch(q if fp8 else x, ids, probs)
    sent = dispatcher.last_dispatch_bytes
    if not fp8:  # BF16 round trip, no expert in between
        round_trip = dispatcher.combine(res.hidden.detach(), res.handle)
    h = res.hidden.dequantize(torch.bfloat16) if fp8 else res.hidden
    out = dispatcher.combine(expert(h, res.topk_probs), res.handle)
    combined = dispatcher.last_combine_bytes
    gout = grad_out(batch, me, seed)
    (out.float() * gout.to(device).float()).sum().backward()
    sent_back, combined_back = dispatcher.last_dispatch_bytes, dispatcher.last_combine_bytes

    recv = [expected_receive(batch, r) for r in range(g)]
    quantized = [quantize_blockwise(b[0]) for b in batch] if fp8 else None
    grad_q = dispatcher.grad_quantizer if fp8 else None  # combine's backward sends FP8 grads
    h_exp, gy_exp, gh_exp, gp_exp = [], [], [], []
    for src, _, p in recv:
        rows = [(quantized[s].dequantize(torch.bfloat16) if fp8 else batch[s][0])[t] for s, t in src]
        gys = [(grad_q(grad_out(batch, s, seed)).dequantize(torch.bfloat16) if grad_q
                else grad_out(batch, s, seed))[t] for s, t in src]
        hr = (torch.stack(rows) if rows else torch.zeros(0, hidden, dtype=torch.bfloat16)).requires_grad_()
        pr = p.clone().requires_grad_()
        y = expert(hr, pr)
        y.backward(torch.stack(gys) if gys else torch.zeros_like(y))
        h_exp.append(hr.detach()), gy_exp.append(y.detach()), gh_exp.append(hr.grad), gp_exp.append(pr.grad)
    src, ids_exp, probs_exp = recv[me]
    num_sent = sum(s == me for r in range(g) for s, _ in recv[r][0])
    gp_local = [torch.where(rcv[1] >= 0, gp, 0.0) for rcv, gp in zip(recv, gp_exp)]  # owner's slots only

    failures = []

    def check(what, ok):
        if not ok:
            failures.append(f"rank {me} {'fp8' if fp8 else 'bf16'}: {what}")

    got = res.hidden
    check("received shape", tuple(got.shape) == (len(src), hidden))
    if fp8:
        data = torch.stack([quantized[s].rowwise_data[t].view(torch.uint8) for s, t in src]) if src else None
        scales = torch.stack([quantized[s].rowwise_scale_inv[t] for s, t in src]) if src else None
        check("FP8 bytes preserved", data is None or torch.equal(got.rowwise_data.cpu().view(torch.uint8), data))
        check("scales preserved", scales is None or torch.equal(got.rowwise_scale_inv.cpu(), scales))
        check("FP8 format kept", got.fp8_dtype == q.fp8_dtype and got.dtype == torch.bfloat16)
    else:
        check("BF16 rows", torch.equal(got.detach().cpu().view(torch.int16), h_exp[me].view(torch.int16)))
        rt_exp = sum_back(batch, me, recv, h_exp).to(torch.bfloat16)
        check("BF16 round trip bitwise", torch.equal(round_trip.cpu().view(torch.int16), rt_exp.view(torch.int16)))
    check("local topk_ids", torch.equal(res.topk_ids.cpu(), ids_exp))
    check("topk_probs", torch.equal(res.topk_probs.detach().cpu(), probs_exp))
    check("tokens_per_expert", res.tokens_per_expert == [int((ids_exp == e).sum()) for e in range(E_LOCAL)])
    check("combine", torch.equal(out.detach().cpu(), sum_back(batch, me, recv, gy_exp).to(torch.bfloat16)))
    check("grad of hidden", torch.equal(x.grad.cpu(), sum_back(batch, me, recv, gh_exp).to(torch.bfloat16)))
    gp_want = sum_back(batch, me, recv, gp_local)
    # the expert's d(probs) is a sum over hidden: on a GPU it runs in another order than the CPU oracle's
    check("grad of probs", torch.equal(probs.grad.cpu(), gp_want) if device == "cpu"
          else torch.allclose(probs.grad.cpu(), gp_want, rtol=1e-5, atol=1e-5))
    check(f"dispatch bytes {sent}", sent == dispatch_payload_bytes(num_sent, hidden, k, fp8))
    check(f"combine bytes {combined}", combined == combine_payload_bytes(len(src), hidden))
    check(f"combine backward bytes {sent_back}", sent_back == dispatch_payload_bytes(num_sent, hidden, 0, fp8))
    check(f"dispatch backward bytes {combined_back}", combined_back == combine_payload_bytes(len(src), hidden, k))
    return failures


def run_probs_used_on_one_rank(dispatcher, batch, me, device):
    """Only EP rank 0's experts use the probs (the others get zero gradients for them from autograd):
    every rank must still run the same collectives."""
    x, ids, probs = (t.to(device, copy=True).requires_grad_(t.is_floating_point()) for t in batch[me])
    res = dispatcher.dispatch(x, ids, probs)
    y = expert(res.hidden, res.topk_probs) if me == 0 else res.hidden * 2
    dispatcher.combine(y, res.handle).float().sum().backward()
    return [] if x.grad.shape == x.shape and probs.grad.shape == probs.shape else [f"rank {me}: gradient shapes"]


# ---------------------------------------------------------------- the spawned ranks
def _scenario_seed(g, group_index, scenario):
    return 1000 * g + 100 * group_index + SCENARIOS.index(scenario)


def _worker(rank, world, port, out_dir, backend, device, hidden):
    """One of ``world`` ranks: every scenario at EP=2 (rank pairs {0,1}, {2,3}, ... concurrently) and,
    for a world of 4, EP=4; writes ``{"<ep>-<scenario>": [failures]}`` to ``out_dir/rank<rank>.json``."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    groups = [(2, pairs[rank // 2], rank // 2)] + ([(world, dist.group.WORLD, 0)] if world > 2 else [])
    results = {}
    for g, group, group_index in groups:
        me = dist.get_rank(group)
        for scenario in SCENARIOS:
            seed = _scenario_seed(g, group_index, scenario)
            batch, num_experts = make_batch(scenario, g, seed, hidden)
            recipe = FP8FlowRecipe(fp8_format=Format.HYBRID) if scenario == "random" else None  # E5M2 grads
            try:
                dispatcher = get_dispatcher(backend, group, num_experts=num_experts, recipe=recipe)
                results[f"{g}-{scenario}"] = [
                    f for fp8 in (True, False) for f in run_case(dispatcher, batch, me, fp8, device, seed)
                ] + run_probs_used_on_one_rank(dispatcher, batch, me, device)
            except Exception:
                results[f"{g}-{scenario}"] = [f"rank {rank}: " + traceback.format_exc()]
    indivisible = E_LOCAL * world + 1
    try:
        get_dispatcher(backend, num_experts=indivisible)
        results["divisible"] = [f"num_experts={indivisible} over {world} ranks was accepted"]
    except ValueError as e:
        expected = f"num_experts={indivisible} must be divisible by the EP group size {world}"
        results["divisible"] = [] if expected in str(e) else [str(e)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _spawn(tmp_path_factory, world, backend, device, hidden):
    out_dir = tmp_path_factory.mktemp(backend)
    port = free_port()
    mp.spawn(_worker, args=(world, port, str(out_dir), backend, device, hidden), nprocs=world, join=True)
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
    return {key: [f for res in results for f in res[key]] for key in results[0]}


@pytest.fixture(scope="module")
def alltoall_results(tmp_path_factory):
    return _spawn(tmp_path_factory, WORLD, "alltoall", "cpu", hidden=320)  # 320: a partial last 1x128 block


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("ep", EP_SIZES, ids=lambda ep: f"ep{ep}")
def test_alltoall_matches_oracle(alltoall_results, ep, scenario):
    failures = alltoall_results[f"{ep}-{scenario}"]
    assert not failures, "\n".join(failures)


def test_alltoall_refuses_indivisible_experts(alltoall_results):
    assert not alltoall_results["divisible"], alltoall_results["divisible"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("backend", ["deepep", "alltoall"])
def test_gpu_backend_matches_oracle(tmp_path_factory, backend):
    """The oracle cases over NCCL: DeepEP's Buffer, or all_to_all_single with the permute kernels."""
    if backend == "deepep":
        pytest.importorskip("deep_ep")
    world = 4 if torch.cuda.device_count() >= 4 else 2
    results = _spawn(tmp_path_factory, world, backend, "cuda", hidden=512)
    failures = [f for fs in results.values() for f in fs]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- in this process
def _inputs(t=6, hidden=256, num_experts=4, k=2):
    x = torch.randn(t, hidden, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.rand(t, num_experts).argsort(1)[:, :k]
    ids[0, 1] = -1
    probs = torch.rand(t, k, requires_grad=True)
    return x, ids, probs


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo group of one rank in this process (alltoall with EP=1)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_local_is_the_identity(fp8):
    x, ids, probs = _inputs()
    hidden = quantize_blockwise(x) if fp8 else x
    dispatcher = get_dispatcher("local", num_experts=4)
    assert isinstance(dispatcher, LocalTokenDispatcher) and dispatcher.num_local_experts == 4
    res = dispatcher.dispatch(hidden, ids, probs)
    assert res.hidden is hidden and res.topk_ids is ids  # nothing copied, nothing quantized
    assert torch.equal(res.topk_probs, torch.where(ids >= 0, probs, 0.0))
    assert res.tokens_per_expert == [int((ids == e).sum()) for e in range(4)]
    h = res.hidden.dequantize(torch.bfloat16) if fp8 else res.hidden
    out = dispatcher.combine(expert(h, res.topk_probs), res.handle)
    gout = torch.randn(out.shape, dtype=torch.bfloat16)
    (out.float() * gout.float()).sum().backward()
    h_ref, p_ref = h.detach().requires_grad_(), probs.detach().requires_grad_()
    out_ref = expert(h_ref, torch.where(ids >= 0, p_ref, 0.0))
    (out_ref.float() * gout.float()).sum().backward()
    assert torch.equal(out, out_ref) and torch.equal(x.grad, h_ref.grad) and torch.equal(probs.grad, p_ref.grad)
    assert dispatcher.last_dispatch_bytes == dispatcher.last_combine_bytes == 0


@pytest.mark.parametrize("host_counts", [True, False])
def test_local_routing_is_the_ids_routing_map(world_of_one, host_counts):
    """The local dispatcher's ``routing`` (from the kernel that checks the ids) is ``topk_to_routing_map`` of
    the ids and probs it returns, gradients included, and its counts are the map's column sums; with an
    ``align_size`` it also holds the map's ``permute_layout``; the exchanging dispatchers give none."""
    x, ids, probs = _inputs()
    ids[3] = 2  # all of a token's slots on one expert but one: -1 is still allowed next to it
    ids[3, 1] = -1
    res = LocalTokenDispatcher(4, host_counts=host_counts).dispatch(x, ids, probs)
    routing_map, ref_probs = topk_to_routing_map(ids, res.topk_probs, 4)
    assert torch.equal(res.routing[0], routing_map) and torch.equal(res.routing[1], ref_probs)
    counts = res.tokens_per_expert if host_counts else res.tokens_per_expert.tolist()
    assert counts == routing_map.sum(0).tolist() == [int((ids == e).sum()) for e in range(4)]
    g = torch.randn(ref_probs.shape)
    (grad,) = torch.autograd.grad((res.routing[1] * g).sum(), probs)
    assert torch.equal(grad, torch.where(ids >= 0, g.gather(1, ids.clamp(min=0)), 0.0))
    assert res.routing[2] is None  # no align_size: no permute layout
    assert get_dispatcher("alltoall", world_of_one, num_experts=4).dispatch(x, ids, probs).routing is None
    padded = LocalTokenDispatcher(4, host_counts=host_counts, align_size=16).dispatch(x, ids, probs)
    layout = padded.routing[2]
    assert isinstance(layout, PermuteLayout) and layout.routing_map is padded.routing[0] and layout.align_size == 16
    want = permute_layout(routing_map, 16)
    assert all(torch.equal(a, b) for a, b in zip(layout[2:], want[2:]))
    assert (padded.tokens_per_expert if host_counts else padded.tokens_per_expert.tolist()) == counts


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_alltoall_world_of_one_matches_local_forward(world_of_one, fp8):
    x, ids, probs = _inputs()
    hidden = quantize_blockwise(x) if fp8 else x
    res = get_dispatcher("alltoall", world_of_one, num_experts=4).dispatch(hidden, ids, probs)
    ref = get_dispatcher("local", num_experts=4).dispatch(hidden, ids, probs)
    assert isinstance(res.hidden, type(hidden))
    assert torch.equal(res.hidden.dequantize() if fp8 else res.hidden, ref.hidden.dequantize() if fp8 else ref.hidden)
    assert torch.equal(res.topk_ids, ref.topk_ids) and torch.equal(res.topk_probs, ref.topk_probs)
    assert res.tokens_per_expert == ref.tokens_per_expert


@pytest.mark.parametrize("scenario", ["random", "one_expert", "empty"])
def test_alltoall_world_of_one_makes_no_collective_call(world_of_one, monkeypatch, scenario):
    """A group of one rank receives what it sends: dispatch, combine and both backward passes run without a
    collective (each was a launch and a copy at EP=1) and still match the oracle bit for bit, FP8 combine
    gradients (HYBRID: E5M2) included."""
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: pytest.fail("a collective at EP=1"))
    seed = _scenario_seed(1, 0, scenario)
    batch, num_experts = make_batch(scenario, 1, seed, hidden=320)
    dispatcher = get_dispatcher("alltoall", world_of_one, num_experts=num_experts,
                                recipe=FP8FlowRecipe(fp8_format=Format.HYBRID))
    failures = [f for fp8 in (True, False) for f in run_case(dispatcher, batch, 0, fp8, "cpu", seed)]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", ["local", "local-device-counts", "alltoall"])
def test_before_host_wait_runs_once_and_changes_nothing(world_of_one, name):
    """``before_host_wait`` runs once per dispatch (also where nothing is waited for); the result is the same."""
    x, ids, probs = _inputs()
    make = lambda: (get_dispatcher("local", num_experts=4, host_counts=False) if name == "local-device-counts"
                    else get_dispatcher(name.split("-")[0], num_experts=4))
    calls = []
    res = make().dispatch(x, ids, probs, lambda: calls.append(1))
    ref = make().dispatch(x, ids, probs)
    assert calls == [1]
    assert torch.equal(res.hidden, ref.hidden) and torch.equal(res.topk_probs, ref.topk_probs)
    counts = res.tokens_per_expert
    assert counts == ref.tokens_per_expert if isinstance(counts, list) else torch.equal(counts, ref.tokens_per_expert)
    with pytest.raises(TypeError, match="before_host_wait must be None or a callable taking no arguments, got 1"):
        make().dispatch(x, ids, probs, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_host_list_does_not_wait_for_the_work_queued_before_the_wait():
    """The counts are read behind an event recorded before ``before_host_wait``: the host returns while the GPU
    still runs what that callable queued (a plain ``tolist()`` would wait for it)."""
    from transformer_engine_moe.layout import host_list

    counts = torch.arange(5, device="cuda")
    torch.cuda.synchronize()
    values = host_list(counts, lambda: torch.cuda._sleep(2_000_000_000))  # about a second of GPU time
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert values == [0, 1, 2, 3, 4] and still_running


def test_fp8_payload_is_at_most_53_percent_of_bf16():
    fp8, bf16 = (dispatch_payload_bytes(4096, 7168, 8, f) for f in (True, False))
    assert fp8 == 4096 * (7168 + 4 * 56 + 8 * 12) and bf16 == 4096 * (2 * 7168 + 8 * 12)
    assert fp8 / bf16 <= 0.53, fp8 / bf16  # 7488 / 14432 = 0.519
    assert combine_payload_bytes(4096, 7168) == 4096 * 2 * 7168
    assert combine_payload_bytes(10, 7168, 8) == 10 * (2 * 7168 + 32)
    assert dispatch_payload_bytes(0, 7168, 8, True) == 0


def _bad(kind):
    x, ids, probs = _inputs()
    x = x.detach()
    return {
        "ids_dtype": ((x, ids.int(), probs), TypeError, r"topk_ids must be a torch.int64 tensor, got torch.int32"),
        "ids_rows": ((x, ids[:5], probs), ValueError, r"topk_ids must have shape \[6, k >= 1\], got \[5, 2\]"),
        "probs_shape": ((x, ids, probs[:, :1]), ValueError, r"topk_probs must have shape \[6, 2\], got \[6, 1\]"),
        "probs_dtype": ((x, ids, probs.bfloat16()), TypeError, r"topk_probs must be a torch.float32 tensor, got torch.bfloat16"),
        "id_too_large": ((x, ids.clamp(max=3) + 1, probs), ValueError, r"outside \[-1, num_experts=4\)"),
        "id_below_minus_one": ((x, ids - 2, probs), ValueError, r"outside \[-1, num_experts=4\)"),
        "hidden_fp32": ((x.float(), ids, probs), TypeError, r"hidden must be BF16 .* got torch.float32"),
        "hidden_3d": ((x.view(2, 3, 256), ids, probs), ValueError, r"hidden must be 2-D .* got shape \[2, 3, 256\]"),
        "hidden_list": (([1.0], ids, probs), TypeError, r"hidden must be a BF16 tensor or a Float8BlockwiseQTensor, got list"),
        "fp8_columnwise_only": ((quantize_blockwise(x, rowwise=False, columnwise=True), ids, probs), ValueError,
                                r"rowwise 1x128 data .* usages=\('columnwise',\)"),
        "fp8_2d_scaled": ((quantize_blockwise(x, "128x128"), ids, probs), ValueError, r"rowwise 1x128 data .* block=128x128"),
        # the hostile-input probe: docs/inputs.md promised this check; the dispatchers once sent (and counted) the
        # slot twice
        "id_twice": ((x, ids[:, :1].expand(6, 2), probs), ValueError, "topk_ids names an expert twice for one token"),
    }[kind]


BAD = ["ids_dtype", "ids_rows", "probs_shape", "probs_dtype", "id_too_large", "id_below_minus_one", "hidden_fp32",
       "hidden_3d", "hidden_list", "fp8_columnwise_only", "fp8_2d_scaled", "id_twice"]


@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("name", ["local", "alltoall"])
def test_dispatch_bad_input(world_of_one, name, kind):
    args, exc, match = _bad(kind)
    with pytest.raises(exc, match=match):
        get_dispatcher(name, num_experts=4).dispatch(*args)


@pytest.mark.parametrize("name", ["local", "alltoall"])
def test_combine_bad_input(world_of_one, name):
    dispatcher = get_dispatcher(name, num_experts=4)
    x, ids, probs = _inputs()
    handle = dispatcher.dispatch(x, ids, probs).handle
    y = torch.zeros(6, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="handle must be the DispatchHandle dispatch returned, got tuple"):
        dispatcher.combine(y, (1, 2))
    with pytest.raises(TypeError, match="x must be the BF16 expert output .* got Float8BlockwiseQTensor"):
        dispatcher.combine(quantize_blockwise(y), handle)
    with pytest.raises(TypeError, match="x must be the BF16 expert output .* dtype torch.float32"):
        dispatcher.combine(y.float(), handle)
    with pytest.raises(ValueError, match=r"x must be \[num_recv_tokens=6, hidden\], got shape \[5, 64\]"):
        dispatcher.combine(y[:5], handle)
    assert isinstance(handle, DispatchHandle) and handle.num_recv_tokens == 6


def test_get_dispatcher_names_and_arguments(world_of_one):
    assert isinstance(get_dispatcher("alltoall", num_experts=4), AllToAllTokenDispatcher)
    with pytest.raises(ValueError, match=r"unknown token dispatcher 'nccl'; choose one of \['alltoall', 'deepep', 'local'\]"):
        get_dispatcher("nccl", num_experts=4)
    with pytest.raises(ValueError, match="num_experts must be a positive int, got 0"):
        get_dispatcher("local", num_experts=0)
    with pytest.raises(ValueError, match="takes no recipe"):
        get_dispatcher("local", num_experts=4, recipe=FP8FlowRecipe())
    with pytest.raises(TypeError, match="recipe must be an FP8FlowRecipe or None, got 'e4m3'"):
        get_dispatcher("alltoall", num_experts=4, recipe="e4m3")
    grad_dtype = get_dispatcher("alltoall", num_experts=4, recipe=FP8FlowRecipe(fp8_format=Format.HYBRID)).grad_quantizer.dtype
    assert grad_dtype == torch.float8_e5m2


@pytest.mark.parametrize("name", ["local", "alltoall", "deepep"])
def test_ep_group_must_be_a_process_group(name):
    """Checked by name at construction, before the group is asked for its size (an AttributeError) and before
    torch.distributed or DeepEP are needed."""
    with pytest.raises(TypeError, match="ep_group must be None or a torch.distributed.ProcessGroup .* got str 'world'"):
        get_dispatcher(name, "world", num_experts=4)


def test_deepep_runs_before_host_wait_after_its_dispatch(world_of_one, monkeypatch):
    """DeepEP's dispatch makes its communication stream wait for the caller's, then waits on the host for its
    counts: ``before_host_wait`` runs after that dispatch (GPU work queued before it would lengthen the wait),
    once. A stand-in ``deep_ep`` for one rank (it receives what it sends) records the order of the calls."""
    import types

    calls = []

    class Buffer:
        def __init__(self, group, num_nvl_bytes, num_rdma_bytes):
            pass

        def get_dispatch_layout(self, topk_idx, num_experts):
            calls.append("layout")
            in_rank = (topk_idx >= 0).any(1, keepdim=True)
            return in_rank.sum(0), None, slots_per_expert(topk_idx, num_experts), in_rank, None

        def dispatch(self, x, num_tokens_per_expert, topk_idx, topk_weights, **layout):
            calls.append("dispatch")
            return x, topk_idx, topk_weights, num_tokens_per_expert.tolist(), "handle", None

    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(Buffer=Buffer))
    x, ids, probs = _inputs()
    res = get_dispatcher("deepep", world_of_one, num_experts=4).dispatch(x, ids, probs,
                                                                         lambda: calls.append("before_host_wait"))
    assert calls == ["layout", "dispatch", "before_host_wait"]
    assert res.tokens_per_expert == get_dispatcher("local", num_experts=4).dispatch(x, ids, probs).tokens_per_expert


def test_deepep_needs_deep_ep():
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="the deepep dispatcher needs DeepEP with its V1 API"):
            get_dispatcher("deepep", num_experts=4)
    else:
        pytest.skip("deep_ep is installed: test_gpu_backend_matches_oracle[deepep] runs it")

