"""GraphedFP8FlowMoE: an FP8FlowMoE's forward and backward replayed from CUDA graphs. On the GPU every replay
equals an eager step of the same block bit for bit, over steps of several micro-batches with the FP8 weight cache,
routings with empty experts and all tokens on one expert, and weights an optimizer wrote in place between steps;
no host sync while replaying. On the CPU: its argument checks and refusals."""

import pytest
import torch

from conftest import assert_no_host_sync, requires_cuda
from test_moe_device_splits import E, FFN, H, K, T, inputs, routing
from transformer_engine_moe import GraphedFP8FlowMoE, GraphPool, topk_to_routing_map
from transformer_engine_moe.module import FP8FlowMoE
from utils import ddp_main_grad_hooks  # benchmarks/utils.py


def router_output(seed, case="random", t=T):
    """Megatron's router output for ``routing(seed, case)``: ``(probs [t, E] float32, routing_map [t, E] bool)``."""
    ids, probs = routing(seed, case, t)
    routing_map, probs = topk_to_routing_map(ids, probs, E)
    return probs, routing_map


def pair(backend="triton", recompute=None, grads="grad", single=False):
    """``(graphed, eager block, hook firings of each)``: two device-splits blocks with the same parameters.
    ``grads``: "grad" (autograd's .grad), "main_grad" (Megatron DDP's contract, ``utils.ddp_main_grad_hooks``: its
    hook adds .grad; the graph adds it itself, ``accumulate_into_main_grad``) or "fused" (wgrad GEMMs into
    main_grad, ``fuse_wgrad_accumulation``)."""
    kw = dict(gemm_backend=backend, device="cuda", device_splits=True, recompute=recompute,
              fuse_wgrad_accumulation=grads == "fused", single_grouped_weight=single)
    torch.manual_seed(0)
    graph_block, eager = FP8FlowMoE(E, H, FFN, K, **kw), FP8FlowMoE(E, H, FFN, K, **kw)
    eager.load_state_dict(graph_block.state_dict())
    fired = [ddp_main_grad_hooks(b) for b in (graph_block, eager)] if grads != "grad" else [[], []]
    return GraphedFP8FlowMoE(graph_block, accumulate_into_main_grad=grads == "main_grad"), eager, fired


def step(run, x, probs, routing_map, dy, first):
    """One micro-batch through ``run`` (the graphed block or the eager one): ``(y, dx, dprobs)``."""
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y = run(xi, pi, routing_map, is_first_microbatch=first)
    y.backward(dy)
    return y.detach().clone(), xi.grad, pi.grad


def weight_grads(block, grads):
    return [(p.grad if grads == "grad" else p.main_grad).clone() for p in block.parameters()]


def optimizer_step(block, grads):
    """SGD written through ``.data`` (as Megatron's optimizers write the model's weights), then the step's
    gradients zeroed as Megatron's ``zero_grad_buffer`` does."""
    for p in block.parameters():
        g = p.grad if grads == "grad" else p.main_grad
        p.data.add_(g.to(p.dtype), alpha=-0.1 * p.norm().item() / g.norm().item())  # weights move by ~10%
        if grads == "grad":
            p.grad = None
        else:
            p.main_grad.zero_()
            p.grad_added_to_main_grad = False


CASES = {  # id -> (backend, recompute, grads, single grouped weight)
    "triton-grad": ("triton", None, "grad", False),
    "triton-grad-moe_expert": ("triton", "moe_expert", "grad", False),
    "triton-main_grad-single": ("triton", None, "main_grad", True),
    "triton-fused-moe_expert": ("triton", "moe_expert", "fused", False),
    "auto-main_grad": ("auto", None, "main_grad", False),
    "auto-fused-single-moe_expert": ("auto", "moe_expert", "fused", True),
}
# three steps of micro-batches (routing case, is_first_microbatch); the optimizer steps between them, and before the
# third the cache is reset as Megatron's finish_grad_sync does, so its False micro-batches quantize the new weights
STEPS = [[("random", True), ("one-expert", False), ("ragged", False)],
         [("random", True), ("ragged", False)],
         [("random", False), ("one-expert", False)]]


@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_gpu_replays_equal_eager_over_steps(case):
    """Every output, input gradient and accumulated weight gradient of the replays equals the eager block's, bit
    for bit, micro-batch by micro-batch over three optimizer steps; each step's first micro-batch repeats the
    first step's tokens, whose output changes with the weights (the graphs read the new weights)."""
    backend, recompute, grads, single = CASES[case]
    graphed, eager, fired = pair(backend, recompute, grads, single)
    params = len(list(eager.parameters()))
    outputs = []
    for s, microbatches in enumerate(STEPS):
        if s == 2:
            graphed.reset_fp8_weight_cache(), eager.reset_fp8_weight_cache()
        for m, (how, first) in enumerate(microbatches):
            seed = 0 if m == 0 else 10 * s + m
            x, dy = inputs(seed)
            probs, routing_map = router_output(seed, how)
            got = step(graphed, x, probs, routing_map, dy, first)
            want = step(eager, x, probs, routing_map, dy, first)
            for i, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(a, b), (s, m, how, i)
            if m == 0:
                outputs.append(got[0])
            # the first micro-batch ran eagerly; the graphs were captured at the next call, before its forward
            assert graphed.captured == ((s, m) != (0, 0)), (s, m)
            assert len(fired[0]) == len(fired[1]) == (params if grads != "grad" else 0)  # DDP's hooks, once each
            fired[0].clear(), fired[1].clear()
        assert graphed.captured
        for a, b in zip(weight_grads(graphed.block, grads), weight_grads(eager, grads)):
            assert a.abs().sum() > 0 and torch.equal(a, b), s
        if grads != "grad":  # DDP's hook dropped .grad: the graph's placeholders or the eager wgrads
            assert all(p.grad is None for b in (graphed.block, eager) for p in b.parameters())
        for block in (graphed.block, eager):
            optimizer_step(block, grads)
    assert not torch.equal(outputs[1], outputs[0]) and not torch.equal(outputs[2], outputs[1])


@requires_cuda
def test_gpu_two_layers_of_one_pool_replay_as_eager():
    """Two blocks of one GraphPool chained as Megatron's layers (the second reads the first's output: forwards in
    order, backwards in reverse), over micro-batches saying True, False, False, True: every output and gradient
    equals two eager blocks', bit for bit. With one memory pool for all their graphs, a micro-batch saying False
    (no weights replay) had the first block's forward write its temporaries over the second's FP8 weight cache,
    captured into memory the first forward's capture had freed: Megatron's tiny GPT drifted from eager at its
    third micro-batch, its pretrain gave NaN gradients (H200)."""
    torch.manual_seed(0)
    kw = dict(gemm_backend="triton", device="cuda", device_splits=True)
    blocks = [FP8FlowMoE(E, H, FFN, K, **kw) for _ in range(2)]
    eagers = [FP8FlowMoE(E, H, FFN, K, **kw) for _ in range(2)]
    for e, b in zip(eagers, blocks):
        e.load_state_dict(b.state_dict())
    pool = GraphPool()
    graphed = [GraphedFP8FlowMoE(b, pool) for b in blocks]
    for m, first in enumerate((True, False, False, True)):
        x, dy = inputs(m)
        routes = [router_output(10 * m + i) for i in range(2)]
        results = []
        for layers, params in ((graphed, blocks), (eagers, eagers)):
            xi = x.clone().requires_grad_()
            h = xi
            for layer, (probs, routing_map) in zip(layers, routes):
                h = layer(h, probs, routing_map, is_first_microbatch=first)
            h.backward(dy)
            results.append([h.detach().clone(), xi.grad, *(p.grad.clone() for b in params for p in b.parameters())])
        assert all(g.captured for g in graphed) == (m > 0)
        for i, (a, b) in enumerate(zip(*results)):
            assert torch.equal(a, b), (m, first, i)


@requires_cuda
def test_gpu_replays_do_not_sync_with_the_host():
    """After the capture, a step's first micro-batch (weights replay, forward and backward replays) and a later one
    run with CUDA's sync debug mode raising on any host sync."""
    graphed, _, _ = pair("auto", "moe_expert", "main_grad")
    x, dy = inputs(1)
    probs, routing_map = router_output(2, "ragged")
    assert_no_host_sync(lambda: [step(graphed, x, probs, routing_map, dy, first) for first in (True, False)])


@requires_cuda
def test_gpu_refusals_after_capture():
    graphed, eager, _ = pair()
    x, dy = inputs(1)
    probs, routing_map = router_output(2)
    step(graphed, x, probs, routing_map, dy, True)  # eagerly
    with pytest.raises(ValueError, match=r"hidden must be torch.bfloat16 \[256, 512\] on cuda:0 as when the graphs "
                                         r"were captured, got torch.bfloat16 \[128, 512\]"):
        graphed(x[:128], probs[:128], routing_map[:128])
    assert graphed.captured  # at that call, before its inputs were checked
    # one micro-batch in flight: the first forward's activations are gone once a second one replayed
    first = graphed(x.requires_grad_(), probs, routing_map, is_first_microbatch=False)
    second = graphed(x, probs, routing_map, is_first_microbatch=False)
    with pytest.raises(RuntimeError, match="a later forward replay overwrote the activations it saved"):
        first.backward(dy)
    second.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="or its backward already ran"):
        second.backward(dy)
    # evaluation runs eagerly (the same output)
    graphed.block.eval(), eager.eval()
    with torch.no_grad():
        assert torch.equal(graphed(x, probs, routing_map), eager(x, probs, routing_map))
    graphed.block.train()
    # weights replaced instead of written in place: the graphs would read the old memory
    w = graphed.block.linear_fc1.weight0
    w.data = w.data.clone()
    with pytest.raises(RuntimeError, match="weights or their main_grad moved since the CUDA graphs were captured"):
        graphed(x, probs, routing_map, is_first_microbatch=True)


def _block(**kw):
    return FP8FlowMoE(E, H, FFN, K, device="cpu", device_splits=True, **kw)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: GraphedFP8FlowMoE(torch.nn.Linear(2, 2)), TypeError, "block must be an FP8FlowMoE, got Linear"),
    (lambda: GraphedFP8FlowMoE(FP8FlowMoE(E, H, FFN, K)), ValueError, "block must be built with device_splits=True"),
    (lambda: GraphedFP8FlowMoE(_block(), pool="pool"), TypeError, "pool must be a GraphPool or None, got str"),
    (lambda: GraphedFP8FlowMoE(_block(), accumulate_into_main_grad=1), TypeError,
     "accumulate_into_main_grad must be a bool, got 1"),
], ids=["not-a-block", "host-counts", "pool", "accumulate"])
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_graph_pool_names_what_it_cannot_take():
    """Issue 41's probe: the pool once stored anything (an AttributeError at the next capture), and without a GPU
    raised torch's "dummy base class" error."""
    pool = GraphPool()
    with pytest.raises(TypeError, match="graphed must be a GraphedFP8FlowMoE, got int"):
        pool.register(3)
    pool.capture_pending()  # nothing registered: nothing to do, GPU or not
    if not torch.cuda.is_available():
        pool.register(GraphedFP8FlowMoE(_block(), pool))
        with pytest.raises(RuntimeError, match="a CUDA graph memory pool needs a CUDA GPU"):
            pool.capture_pending()


def test_cpu_training_call_is_refused_and_evaluation_runs_eagerly():
    """On the CPU there is nothing to capture: a training call says so; evaluation and no-grad calls run the block
    itself (the same output)."""
    graphed = GraphedFP8FlowMoE(_block(), GraphPool())
    x = inputs(1, t=8)[0].cpu()
    probs, routing_map = (t.cpu() for t in router_output(2, t=8))
    with pytest.raises(ValueError, match="replays CUDA graphs: hidden must be a CUDA tensor, got cpu"):
        graphed(x, probs, routing_map)
    with pytest.raises(TypeError, match="is_first_microbatch must be None or a bool, got 1"):
        graphed(x, probs, routing_map, is_first_microbatch=1)
    with torch.no_grad():
        assert torch.equal(graphed(x, probs, routing_map), graphed.block(x, probs, routing_map))
    graphed.block.eval()
    assert torch.equal(graphed(x, probs, routing_map), graphed.block(x, probs, routing_map))
    assert not graphed.captured


def test_pending_captures_run_in_replay_order_and_never_inside_a_backward(monkeypatch):
    """The pool captures the blocks that ran their first training call, all at once, as
    ``make_graphed_callables``: warm-ups, then forwards in the order the blocks first ran, then backwards in
    reverse (the order they replay); the weights graphs into a memory pool of their own (they replay only when the
    weights change: in the forwards' pool a skipped weights replay let a forward's temporaries overwrite a cache),
    the forwards and backwards into another; each block once; never while autograd's backward runs (a forward
    re-run inside it), where the engine could run other ready nodes inside the capture."""
    log, pool = [], GraphPool()
    blocks = [GraphedFP8FlowMoE(_block(), pool) for _ in range(2)]
    for i, graphed in enumerate(blocks):
        graphed._warm_up = lambda i=i: log.append(("warm-up", i))
        graphed._capture_forward = lambda weights, handle, i=i: log.append(("forward", i, weights, handle))
        graphed._capture_backward = lambda handle, i=i: log.append(("backward", i, handle))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    handles = iter(["pool 1", "pool 2"])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    for graphed in (blocks[0], blocks[1], blocks[0]):  # a second registration of one block is one
        pool.register(graphed)

    class CallInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            pool.capture_pending()
            return grad

    CallInBackward.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert log == []
    pool.capture_pending()
    assert log == [("warm-up", 0), ("warm-up", 1), ("forward", 0, "pool 1", "pool 2"),
                   ("forward", 1, "pool 1", "pool 2"), ("backward", 1, "pool 2"), ("backward", 0, "pool 2")]
    pool.capture_pending()
    assert len(log) == 6


@pytest.mark.parametrize("single", [False, True], ids=["per_expert", "single"])
def test_captures_see_the_weights_through_leaves_of_their_own(single):
    """Inside ``_weight_leaves`` the block's trainable parameters are new parameters over the same memory and
    version counter, with the same attributes (Megatron's ``main_grad``), so a captured backward ends in
    AccumulateGrad nodes of its own, not the ones Megatron's DDP keeps from its set-up on the default stream;
    a second use takes the same leaves; afterwards the block holds its own parameters again."""
    from transformer_engine_moe.module.graphed_moe import _weight_leaves

    block = _block(single_grouped_weight=single)
    trainable = lambda: [p for p in block.parameters() if p.requires_grad]
    same = lambda xs, ys: len(xs) == len(ys) and all(x is y for x, y in zip(xs, ys))
    params = trainable()
    for p in params:
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    with _weight_leaves(block) as leaves:
        assert same(trainable(), leaves) and len(leaves) == len(params)
        assert all(a is not b and a.data_ptr() == b.data_ptr() and a.main_grad is b.main_grad
                   for a, b in zip(leaves, params))
        before, value = params[0]._version, params[0].detach().flatten()[0].clone()
        with torch.no_grad():
            leaves[0].add_(1)  # one memory and one version counter: the block's parameter sees both move
        assert params[0]._version == leaves[0]._version > before
        assert params[0].detach().flatten()[0] == value + 1
        block.linear_fc1.weight_params[0].sum().backward()  # the block's modules read the leaves
        assert leaves[0].grad is not None and params[0].grad is None
    assert same(trainable(), params)
    with _weight_leaves(block, leaves) as again:
        assert again is leaves and same(trainable(), leaves)
    assert same(trainable(), params)


@pytest.mark.parametrize("fused", [False, True], ids=["hook", "fused"])
def test_weight_gradients_go_into_main_grad_where_every_weight_has_ddps(fused):
    """``FP8FlowMoE.into_main_grad`` (the warm-up's decision, which the capture reads from the linears; the eager
    block's at each training forward with ``accumulate_into_main_grad``): with the block's wgrad fusion, always;
    wanted, with a ``main_grad`` on every weight, the linears' ``add_wgrad_into_main_grad`` set (the hook's sums, in
    the wgrad GEMMs); a weight without one, a Megatron-FSDP weight (``get_main_grad``: its own hook makes
    ``main_grad`` and copies ``.grad`` into it), or not wanted: neither."""
    block = _block(fuse_wgrad_accumulation=fused)
    params = [p for p in block.parameters() if p.requires_grad]
    linears = (block.linear_fc1, block.linear_fc2)
    for p in params:
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    for wanted in (True, False):
        assert block.into_main_grad(wanted) == (fused or wanted)
        assert all(lin.add_wgrad_into_main_grad == (wanted and not fused) for lin in linears)
    params[0].get_main_grad = lambda: params[0].main_grad
    assert block.into_main_grad(True) == fused and not any(lin.add_wgrad_into_main_grad for lin in linears)
    del params[0].get_main_grad
    assert block.into_main_grad(True) and all(lin.add_wgrad_into_main_grad == (not fused) for lin in linears)
    del params[-1].main_grad
    assert block.into_main_grad(True) == fused and not any(lin.add_wgrad_into_main_grad for lin in linears)
