"""Token dispatchers: alltoall over gloo at EP=2 (two subgroups at once) and EP=4, one spawn of four
processes, against a single-process oracle built from the global batch (received rows, ids, probs
and counts; FP8 bytes and scales; combine; gradients of both; byte counts); local identity; a
world of one in this process; byte ratio; bad input. deepep runs the same cases where it can."""

import json
import os
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from transformer_engine_moe import FP8FlowRecipe, Format, quantize_blockwise
from transformer_engine_moe.dispatch import (
    AllToAllTokenDispatcher,
    DispatchHandle,
    LocalTokenDispatcher,
    combine_payload_bytes,
    dispatch_payload_bytes,
    get_dispatcher,
)

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
    check("grad of probs", torch.equal(probs.grad.cpu(), sum_back(batch, me, recv, gp_local)))
    check(f"dispatch bytes {sent}", sent == dispatch_payload_bytes(num_sent, hidden, k, fp8))
    check(f"combine bytes {combined}", combined == combine_payload_bytes(len(src), hidden))
    check(f"combine backward bytes {sent_back}", sent_back == dispatch_payload_bytes(num_sent, hidden, 0, fp8))
    check(f"dispatch backward bytes {combined_back}", combined_back == combine_payload_bytes(len(src), hidden, k))
    return failures


# ---------------------------------------------------------------- the spawned ranks
def _scenario_seed(g, group_index, scenario):
    return 1000 * g + 100 * group_index + SCENARIOS.index(scenario)


def _worker(rank, port, out_dir, backend, device, hidden):
    """One of WORLD ranks: every scenario at EP=2 (ranks {0,1} and {2,3}, concurrently) and EP=4;
    writes ``{"<ep>-<scenario>": [failures]}`` to ``out_dir/rank<rank>.json``."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for g, group, group_index in [(2, pairs[rank // 2], rank // 2), (4, dist.group.WORLD, 0)]:
        me = dist.get_rank(group)
        for scenario in SCENARIOS:
            seed = _scenario_seed(g, group_index, scenario)
            batch, num_experts = make_batch(scenario, g, seed, hidden)
            recipe = FP8FlowRecipe(fp8_format=Format.HYBRID) if scenario == "random" else None  # E5M2 grads
            try:
                dispatcher = get_dispatcher(backend, group, num_experts=num_experts, recipe=recipe)
                results[f"{g}-{scenario}"] = [
                    f for fp8 in (True, False) for f in run_case(dispatcher, batch, me, fp8, device, seed)
                ]
            except Exception:
                results[f"{g}-{scenario}"] = [f"rank {rank}: " + traceback.format_exc()]
    try:
        get_dispatcher(backend, num_experts=6)
        results["divisible"] = ["num_experts=6 over 4 ranks was accepted"]
    except ValueError as e:
        results["divisible"] = [] if "num_experts=6 must be divisible by the EP group size 4" in str(e) else [str(e)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _spawn(tmp_path_factory, backend, device, hidden):
    out_dir = tmp_path_factory.mktemp(backend)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(out_dir), backend, device, hidden), nprocs=WORLD, join=True)
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {key: [f for res in results for f in res[key]] for key in results[0]}


@pytest.fixture(scope="module")
def alltoall_results(tmp_path_factory):
    return _spawn(tmp_path_factory, "alltoall", "cpu", hidden=320)  # 320: a partial last 1x128 block


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("ep", EP_SIZES, ids=lambda ep: f"ep{ep}")
def test_alltoall_matches_oracle(alltoall_results, ep, scenario):
    failures = alltoall_results[f"{ep}-{scenario}"]
    assert not failures, "\n".join(failures)


def test_alltoall_refuses_indivisible_experts(alltoall_results):
    assert not alltoall_results["divisible"], alltoall_results["divisible"]


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")
def test_deepep_matches_oracle(tmp_path_factory):
    pytest.importorskip("deep_ep")
    results = _spawn(tmp_path_factory, "deepep", "cuda", hidden=512)
    failures = [f for fs in results.values() for f in fs]
    assert not failures, "\n".join(failures)
