"""torch.compile over the ops (docs/compile.md): quantize_blockwise -> GroupedLinear -> weighted_swiglu_quant is one
graph without a break (torch._dynamo.explain), forward and backward, holding the launchers' custom ops, and the
compiled step equals eager bit for bit: on the CPU with the reference and with the Triton kernels (interpreter),
on the GPU with the kernels. The FP8FlowMoE block with the local dispatcher breaks only at its one host sync (the
dispatcher's host split list, in dispatch/local.py); its experts phase compiles whole, forward and backward."""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from conftest import interpreter_only, requires_cuda
from transformer_engine_moe import (
    FP8FlowMoE,
    GroupedLinear,
    dequantize_blockwise,
    grouped_gemm,
    moe_permute,
    moe_unpermute,
    quantize_blockwise,
    quantize_grouped_weight,
    scaling_aware_transpose,
    weighted_swiglu_quant,
)


# torch 2.11 (the GPU machines' image) reads a CPU tensor's device assert (``check_on_device`` under compile) as a
# data-dependent operator when it traces GroupedLinear's backward inside the block's forward: graph breaks on CPU
# tensors only (the CUDA assert is asynchronous). docs/compile.md.
needs_torch_2_13 = pytest.mark.skipif(torch.__version__ < "2.13", reason="CPU device asserts break the block's "
                                      "graph under torch.compile before torch 2.13 (docs/compile.md)")


def _launcher_ops(fn, x) -> set[str]:
    """The te_moe custom ops in the forward and backward graphs AOTAutograd makes of ``fn(x)`` (one forward and
    backward: ``fullgraph=True``, a graph break raises)."""
    ops = set()

    def record(gm, example_inputs):
        ops.update(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("te_moe."))
        return make_boxed_func(gm)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    compiled(x).float().sum().backward()
    return {op.removeprefix("te_moe.").removesuffix(".default") for op in ops}


def _step(fn, x, params):
    """Forward + backward: (output, x's gradient, the parameters' gradients)."""
    for p in params:
        p.grad = None
    xi = x.clone().requires_grad_()
    y = fn(xi)
    y.float().square().sum().backward()
    return [y, xi.grad] + [p.grad.clone() for p in params]


def _chain(device, backend, shape):
    """``x [M, H] -> quantize_blockwise -> GroupedLinear (2 experts) -> weighted_swiglu_quant -> dequantize``."""
    torch.manual_seed(0)
    m, h, f = shape
    fc1 = GroupedLinear(2, h, 2 * f, device=device, backend=backend)
    probs = torch.rand(m, device=device)

    def chain(x):
        q = quantize_blockwise(x, backend=backend)
        y = weighted_swiglu_quant(fc1(q, [m // 2, m // 2]), probs, backend=backend)
        return y.dequantize(torch.bfloat16, backend=backend)

    return chain, torch.randn(m, h, device=device, dtype=torch.bfloat16), fc1.weights


CHAIN_OPS = {"quantize_grouped_weight", "quantize_1x128", "grouped_gemm", "scaling_aware_transpose",
             "weighted_swiglu_quant", "dequantize_1x128", "weighted_swiglu_backward", "grouped_gemm_wgrad"}


@pytest.mark.parametrize("backend,device,kernel_ops", [
    ("reference", "cpu", set()),
    # the interpreter: the requested ops run the kernels; GroupedLinear's weight quantization and transposes
    # follow "auto", the reference on CPU tensors
    pytest.param("triton", "cpu", {"quantize_1x128", "grouped_gemm", "weighted_swiglu_quant", "dequantize_1x128",
                                   "weighted_swiglu_backward", "grouped_gemm_wgrad"}, marks=interpreter_only),
    pytest.param("auto", "cuda", CHAIN_OPS, marks=requires_cuda),
], ids=["cpu-reference", "cpu-interpreter-kernels", "gpu-kernels"])
def test_quantize_grouped_linear_swiglu_is_one_graph(backend, device, kernel_ops):
    shape = (128, 256, 128) if device == "cuda" or backend == "reference" else (64, 128, 128)
    chain, x, weights = _chain(device, backend, shape)
    explained = torch._dynamo.explain(chain)(x.clone().requires_grad_())
    assert (explained.graph_count, explained.graph_break_count, explained.break_reasons) == (1, 0, [])
    ops = _launcher_ops(chain, x.clone().requires_grad_())
    assert {op.rsplit("_", 1)[0].removesuffix("_into") for op in ops} == CHAIN_OPS
    assert {op.rsplit("_", 1)[0] for op in ops if not op.endswith("_reference")} == kernel_ops
    eager = _step(chain, x, weights)
    torch._dynamo.reset()
    compiled = _step(torch.compile(chain, backend="aot_eager", fullgraph=True), x, weights)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


def _op_cases():
    """(name, fn, argument): each public op on its own, the FP8 tensor passed in or made in the graph."""
    torch.manual_seed(0)
    x = torch.randn(128, 256)
    q = quantize_blockwise(x)
    routing = torch.zeros(128, 4, dtype=torch.bool)
    routing[torch.arange(128), torch.randint(0, 4, (128,))] = True
    w, _ = quantize_grouped_weight([torch.randn(256, 256), torch.randn(256, 256)], transpose=False)
    return [
        ("dequantize", lambda t: dequantize_blockwise(t, torch.bfloat16), q),
        ("transpose", lambda t: scaling_aware_transpose(t, [64, 64]).columnwise_data, q),
        ("transpose-in-graph", lambda t: scaling_aware_transpose(quantize_blockwise(t), [64, 64]).dequantize(
            usage="columnwise"), x),
        ("permute-unpermute", lambda t: moe_unpermute(*moe_permute(t, routing)), x),
        ("permute-fp8", lambda t: moe_permute(t, routing)[0].dequantize(), q),
        ("grouped-gemm", lambda t: grouped_gemm(t, w, [64, 64]), q),
        ("swiglu", lambda t: weighted_swiglu_quant(t, torch.rand(128)).dequantize(), x),
    ]


@pytest.mark.parametrize("case", range(len(_op_cases())), ids=[c[0] for c in _op_cases()])
def test_each_op_is_one_graph(case):
    _, fn, arg = _op_cases()[case]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(arg)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _block(device="cpu", **kw):
    torch.manual_seed(0)
    block = FP8FlowMoE(4, 256, 128, 2, device=device, **kw)
    probs, ids = torch.softmax(torch.randn(64, 4), -1).topk(2)
    return block, *(t.to(device) for t in (torch.randn(64, 256, dtype=torch.bfloat16), ids, probs))


def test_block_breaks_only_at_the_host_split_list():
    """The local dispatcher reads ``tokens_per_expert`` to the host (``.tolist()`` in ``layout.host_list``):
    the one graph break; nothing in the quantize, permute, GEMM, SwiGLU or combine ops breaks. The compiled
    forward equals eager."""
    block, x, ids, probs = _block()
    explained = torch._dynamo.explain(block.forward_topk)(x.clone().requires_grad_(), ids, probs)
    where = {(b.user_stack[-1].filename.rsplit("transformer_engine_moe/", 1)[-1], b.user_stack[-1].name)
             for b in explained.break_reasons}
    assert where == {("layout.py", "host_list")} and explained.graph_break_count >= 1
    assert all("_local_scalar_dense" in b.reason for b in explained.break_reasons)
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(block.forward_topk, backend="aot_eager")(x, ids, probs),
                           block.forward_topk(x, ids, probs))


def test_block_experts_phase_is_one_graph_forward_and_backward():
    """Everything after the host sync (permute -> fc1 -> SwiGLU+quant -> fc2 -> unpermute) on the dispatched FP8
    tokens, which require grad: fullgraph, and the gradients of the tokens, probs and weights equal eager's."""
    block, x, ids, probs = _block()

    def step(compiled):
        block.zero_grad(set_to_none=True)
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        res = block.dispatch(block.quantize(xi), ids, pi)

        def experts(hidden, topk_ids, topk_probs):
            return block.experts(hidden, topk_ids, topk_probs, res.tokens_per_expert)

        if compiled:
            torch._dynamo.reset()
            experts = torch.compile(experts, backend="aot_eager", fullgraph=True)
        y = block.combine(experts(res.hidden, res.topk_ids, res.topk_probs), res.handle)
        y.float().square().sum().backward()
        return [y, xi.grad, pi.grad] + [w.grad.clone() for w in block.linear_fc1.weights + block.linear_fc2.weights]

    assert all(torch.equal(a, b) for a, b in zip(step(True), step(False)))


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_torch_2_13),
                                    pytest.param("cuda", marks=requires_cuda)])
def test_block_with_device_splits_is_one_graph_and_trains_compiled(device):
    """``device_splits=True`` keeps the per-expert counts on the device: the whole block, dispatch to combine,
    is one graph without a break, and the compiled forward + backward equals eager bit for bit (the limit of
    training the host-split block compiled, docs/compile.md, does not arise)."""
    block, x, ids, probs = _block(device, device_splits=True)
    explained = torch._dynamo.explain(block.forward_topk)(x, ids, probs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons

    def step(fn):
        block.zero_grad(set_to_none=True)
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y = fn(xi, ids, pi)
        y.float().square().sum().backward()
        return [y, xi.grad, pi.grad] + [p.grad.clone() for p in block.parameters()]

    eager = step(block.forward_topk)
    torch._dynamo.reset()
    compiled = step(torch.compile(block.forward_topk, backend="aot_eager", fullgraph=True))
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
