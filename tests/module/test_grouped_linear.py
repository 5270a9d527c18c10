"""GroupedLinear: forward and gradients vs float32 math on the dequantized operands and vs BF16 nn.Linear per
expert; FP8 input; zero-row experts; list vs tensor splits; main_grad fusion; FP8 weight cache; bad inputs; GPU sync."""

import re

import pytest
import torch

from conftest import CUDA, KERNEL_DEVICE, assert_no_host_sync, relerr, requires_cuda
from transformer_engine_moe import FP8FlowRecipe, Format, quantize_blockwise
from transformer_engine_moe.module import GroupedLinear
from transformer_engine_moe.ops.grouped_gemm import stacked_view

BACKENDS = ["reference", "triton"] + (["cublas"] if CUDA else [])  # deepgemm: tests/kernels


def setup(splits, k=256, n=128, backend="triton", device=KERNEL_DEVICE, **kw):
    gl = GroupedLinear(len(splits), k, n, backend=backend, device=device, **kw)
    x = torch.randn(sum(splits), k, device=device, dtype=torch.bfloat16)
    return gl, x


def fp8_math(gl, x, dy, splits):
    """Float32 on the dequantized FP8 operands the module uses (its own quantizations), rounded to BF16."""
    q = lambda t, **kw: quantize_blockwise(t, **kw).dequantize()
    xq, dyq = q(x), q(dy, fp8_dtype=gl.recipe.fp8_dtype(__import__("transformer_engine_moe").Role.GRAD))
    w = [q(wi.detach().float(), block="128x128") for wi in gl.weights]
    y, dx, dw, lo = [], [], [], 0
    for g, s in enumerate(splits):
        y.append(xq[lo:lo + s] @ w[g].t())
        dx.append(dyq[lo:lo + s] @ w[g])
        dw.append(dyq[lo:lo + s].t() @ xq[lo:lo + s])
        lo += s
    return torch.cat(y).bfloat16(), torch.cat(dx).bfloat16(), [d.bfloat16() for d in dw]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", [[100, 0, 156], [256, 0, 0], [512, 512, 0]], ids=str)
def test_matches_fp32_on_dequantized_operands(backend, splits):
    """Relative error <= 1e-2 against BF16-rounded float32 math on the same FP8 operands: what is left is
    BF16 output rounding (2^-9) and, for wgrad, the 128x1 requantization of the scaling-aware transpose
    (exact unless values underflow)."""
    if backend == "cublas" and any(s % 128 for s in splits):
        pytest.skip("cuBLAS wgrad needs groups of 128-multiples")
    size = 512 if backend == "cublas" else 256  # cuBLAS: reductions in multiples of 512
    gl, x = setup(splits, k=size, n=size, backend=backend)
    x.requires_grad_()
    y = gl(x, splits)
    dy = torch.randn_like(y)
    y.backward(dy)
    ry, rdx, rdw = fp8_math(gl, x.detach(), dy, splits)
    assert relerr(y, ry) < 1e-2 and relerr(x.grad, rdx) < 1e-2
    for g, s in enumerate(splits):
        if s:
            assert relerr(gl.weights[g].grad, rdw[g]) < 1e-2
        else:
            assert (gl.weights[g].grad == 0).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_padded_experts_keep_small_weight_gradients(backend):
    """Each expert's rows padded to 128 with zero rows (as FP8FlowMoE's permute does) and gradients of
    ~1e-6 (as in training): the weight gradients stay within FP8 tolerance of the float32 math. (Zero rows
    once set the scaling-aware transpose's column scale to 1 and flushed these gradients to zero.)"""
    real, splits = [40, 100], [128, 128]
    gl, x = setup(splits, backend=backend)
    dy = torch.randn(256, 128, device=KERNEL_DEVICE, dtype=torch.bfloat16) * 1e-6
    for g, r in enumerate(real):  # the padding rows: zero input, zero gradient
        x[g * 128 + r:(g + 1) * 128] = 0
        dy[g * 128 + r:(g + 1) * 128] = 0
    gl(x, splits).backward(dy)
    _, _, rdw = fp8_math(gl, x, dy, splits)
    for g in range(2):
        assert relerr(gl.weights[g].grad, rdw[g]) < 1e-2


@pytest.mark.parametrize("recipe,tol", [(FP8FlowRecipe(), 4e-2), (FP8FlowRecipe(fp8_format=Format.HYBRID), 8e-2)],
                         ids=["e4m3", "hybrid"])
def test_close_to_bf16_linear_per_expert(recipe, tol):
    """FP8 quantization error: E4M3 steps of 2^-4 give ~3e-2 relative error on outputs and gradients
    (HYBRID's E5M2 gradients, 2^-3 steps, about twice that)."""
    splits = [200, 56, 0, 256]
    gl, x = setup(splits, recipe=recipe)
    x.requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y = gl(x, splits)
    dy = torch.randn_like(y)
    y.backward(dy)
    wr = [w.detach().clone().requires_grad_() for w in gl.weights]
    ref = torch.cat([torch.nn.functional.linear(p, w) for p, w in zip(xr.split(splits), wr)])
    ref.backward(dy)
    assert relerr(y, ref) < tol and relerr(x.grad, xr.grad) < tol
    assert all(relerr(w.grad, r.grad) < tol for w, r, s in zip(gl.weights, wr, splits) if s)


def test_fp8_input_list_and_tensor_splits_and_bias():
    splits = [100, 0, 156]
    gl, x = setup(splits, bias=True)
    xq = quantize_blockwise(x)
    a = gl(xq, splits)
    b = gl(xq, torch.tensor(splits, device=KERNEL_DEVICE))
    c = gl(x, splits)  # BF16 input quantized inside: the same FP8 operand
    assert torch.equal(a, b) and torch.equal(a, c)
    with torch.no_grad():
        gl.bias2.fill_(1.0)
    assert torch.allclose(gl(xq, splits)[100:].float(), a[100:].float() + 1, atol=1e-2, rtol=1e-2)
    x.requires_grad_()
    gl(x, splits).sum().backward()
    assert torch.equal(gl.bias0.grad, torch.full_like(gl.bias0, 100)) and (gl.bias1.grad == 0).all()


@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_trailing_weightless_group(fuse, as_tensor):
    """One split more than experts: those rows' outputs are zero (no bias either), their input gradients
    zero, and every weight and bias gradient is bitwise the module's on the leading rows alone."""
    splits, slack = [100, 0, 156], 72
    mods = []
    for _ in range(2):
        torch.manual_seed(0)
        gl, _ = setup(splits, bias=True, fuse_wgrad_accumulation=fuse)
        for w in gl.weights:
            w.main_grad = torch.zeros(w.shape, device=KERNEL_DEVICE)
        mods.append(gl)
    x = torch.randn(sum(splits) + slack, 256, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    ms = (lambda v: torch.tensor(v, device=KERNEL_DEVICE)) if as_tensor else list
    with torch.no_grad():  # nonzero biases: the weightless rows get none
        for gl in mods:
            for i in range(3):
                getattr(gl, f"bias{i}").fill_(i + 1.0)
    xa, xb = x.clone().requires_grad_(), x[:256].clone().requires_grad_()
    ya, yb = mods[0](xa, ms(splits + [slack])), mods[1](xb, ms(splits))
    assert torch.equal(ya[256:], torch.zeros(slack, 128, dtype=ya.dtype, device=KERNEL_DEVICE))
    assert torch.equal(ya[:256], yb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy[:256])
    assert torch.equal(xa.grad[256:], torch.zeros_like(xa.grad[256:])) and torch.equal(xa.grad[:256], xb.grad)
    for (name, a), b in zip(mods[0].named_parameters(), mods[1].parameters()):
        assert torch.equal(a.main_grad if fuse and name.startswith("weight") else a.grad,
                           b.main_grad if fuse and name.startswith("weight") else b.grad), name


def test_main_grad_accumulation_and_weight_cache():
    splits = [128, 128]
    gl, x = setup(splits, fuse_wgrad_accumulation=True)
    hooked = []

    def ddp_hook(p):  # as Megatron's DDP: runs where autograd accumulates the weight's gradient, drops it
        hooked.append(p.grad_added_to_main_grad)
        p.grad = None

    for w in gl.weights:
        w.main_grad = torch.ones(w.shape, dtype=torch.float32, device=w.device)
        w.register_post_accumulate_grad_hook(ddp_hook)
    ref_gl = GroupedLinear(2, 256, 128, device=KERNEL_DEVICE)
    ref_gl.load_state_dict(gl.state_dict())
    dy = torch.randn(256, 128, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    gl(x, splits).backward(dy)
    ref_gl(x, splits).backward(dy)
    assert hooked == [True, True]
    for w, r in zip(gl.weights, ref_gl.weights):
        assert w.grad is None and w.grad_added_to_main_grad
        assert relerr(w.main_grad - 1, r.grad) < 1e-2


@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_main_grad_in_one_buffer_accumulated_in_place(order, monkeypatch):
    """main_grads that lie one after another in one float32 buffer (forward order) get the wgrad GEMM's
    output accumulated in place as one [G, N, K]; in reverse order (Megatron's DDP layout: no [G, N, K] view
    exists) in place too, each expert's through its own address: no float32 wgrad temporary added after.
    Same values either way."""
    splits = [128, 0, 256]
    gl, x = setup(splits, fuse_wgrad_accumulation=True)
    ref_gl, _ = setup(splits, fuse_wgrad_accumulation=True)
    ref_gl.load_state_dict(gl.state_dict())
    buf = torch.full((3, 128, 256), 2.0, device=KERNEL_DEVICE)
    views = list(buf.unbind(0)) if order == "forward" else list(buf.unbind(0))[::-1]
    assert (stacked_view(views) is not None) == (order == "forward")
    for w, mg, r in zip(gl.weights, views, ref_gl.weights):
        w.main_grad = mg
        r.main_grad = torch.full(w.shape, 2.0, device=w.device)
    dy = torch.randn(384, 128, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    ref_gl(x, splits).backward(dy)
    monkeypatch.setattr(torch, "_foreach_add_", lambda *a: pytest.fail("main_grad added after the GEMM"))
    gl(x, splits).backward(dy)
    for w, r in zip(gl.weights, ref_gl.weights):
        assert torch.equal(w.main_grad, r.main_grad)
    assert torch.equal(gl.weights[1].main_grad, torch.full((128, 256), 2.0, device=KERNEL_DEVICE))  # no rows
    assert not torch.equal(gl.weights[0].main_grad, torch.full((128, 256), 2.0, device=KERNEL_DEVICE))


@pytest.mark.parametrize("layout", ["one_buffer", "reversed", "single_weight"])
@pytest.mark.parametrize("backend", ["triton", "reference"] + (["cublas"] if CUDA else []))
@pytest.mark.parametrize("overwrite", [False, True], ids=["added", "written"])
def test_add_wgrad_into_main_grad_is_what_ddps_hook_adds(layout, backend, overwrite, monkeypatch):
    """``add_wgrad_into_main_grad`` (``FP8FlowMoE.into_main_grad``'s, without wgrad fusion): the gradient rounded to the
    weights' BF16, added into ``main_grad`` (written over it with ``overwrite_main_grad``), bit for bit what
    Megatron DDP's hook adds from the ``.grad`` an unflagged module gives (or copies); in the wgrad GEMM's epilogue
    (no addition after it) but on cuBLAS, which hands over float32 sums: there written, then added. Placeholders for
    ``.grad``, ``grad_added_to_main_grad`` set."""
    splits = [128, 0, 256]
    single = layout == "single_weight"
    gl, x = setup(splits, backend=backend, single_grouped_weight=single, device="cuda" if backend == "cublas" else
                  KERNEL_DEVICE)
    ref_gl, _ = setup(splits, backend=backend, single_grouped_weight=single, device=x.device)
    ref_gl.load_state_dict(gl.state_dict())
    gl.add_wgrad_into_main_grad = True
    buf = torch.randn(3, 128, 256, device=x.device)
    buf[0, 0, :4] = torch.tensor([float("nan"), -0.0, 1e-40, float("inf")])
    views = [buf] if single else list(buf.unbind(0))[::-1 if layout == "reversed" else 1]
    for w, mg in zip(gl.weight_params, views):
        w.main_grad, w.overwrite_main_grad = mg, overwrite
    dy = torch.randn(384, 128, device=x.device, dtype=torch.bfloat16)
    ref_gl(x, splits).backward(dy)
    want = [mg.clone() for mg in views]
    (torch._foreach_copy_ if overwrite else torch._foreach_add_)(want, [w.grad for w in ref_gl.weight_params])
    if backend != "cublas":
        monkeypatch.setattr(torch, "_foreach_add_", lambda *a: pytest.fail("main_grad added after the GEMM"))
        monkeypatch.setattr(torch, "_foreach_copy_", lambda *a: pytest.fail("main_grad written after the GEMM"))
    gl(x, splits).backward(dy)
    for w, mg, r in zip(gl.weight_params, views, want):
        assert torch.equal(mg.view(torch.int32), r.view(torch.int32)) and w.grad_added_to_main_grad
        assert w.grad is not None and (w.grad.is_sparse or w.grad.count_nonzero() == 0)


@pytest.mark.parametrize("layout", ["one_buffer", "reversed", "single_weight"])
def test_overwrite_main_grad_writes_wgrad_over_it(layout):
    """Weights with ``overwrite_main_grad`` (Megatron-FSDP) get wgrad written over their ``main_grad``, NaN
    there included, in one buffer (in place), per expert, or as one grouped weight: bitwise what is added into
    zeros; a zero-row expert's main_grad becomes zero."""
    splits = [128, 0, 256]
    single = layout == "single_weight"
    gl, x = setup(splits, fuse_wgrad_accumulation=True, single_grouped_weight=single)
    ref_gl, _ = setup(splits, fuse_wgrad_accumulation=True, single_grouped_weight=single)
    ref_gl.load_state_dict(gl.state_dict())
    buf = torch.full((3, 128, 256), float("nan"), device=KERNEL_DEVICE)
    views = [buf] if single else list(buf.unbind(0))[::-1 if layout == "reversed" else 1]
    for w, mg, r in zip(gl.weight_params, views, ref_gl.weight_params):
        w.main_grad, w.overwrite_main_grad = mg, True
        r.main_grad = torch.zeros(w.shape, device=w.device)
    dy = torch.randn(384, 128, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    gl(x, splits).backward(dy)
    ref_gl(x, splits).backward(dy)
    for w, r in zip(gl.weight_params, ref_gl.weight_params):
        assert torch.equal(w.main_grad, r.main_grad) and w.grad_added_to_main_grad
    assert torch.equal(buf[1], torch.zeros_like(buf[1])) and buf[0].abs().sum() > 0


def test_overwrite_main_grad_on_some_weights_only_is_refused():
    gl, x = setup([128, 128], fuse_wgrad_accumulation=True)
    for w in gl.weights:
        w.main_grad = torch.zeros(w.shape, device=w.device)
    gl.weights[0].overwrite_main_grad = True
    with pytest.raises(ValueError, match="overwrite_main_grad is set on some of its weights"):
        gl(x, [128, 128]).sum().backward()


def test_fp8_weight_cache_follows_is_first_microbatch():
    """TE's rule. Weights written through ``.data`` (as Megatron's optimizers do: no version bump) are seen
    by None and True; False reuses the cache. Doubling a weight doubles its power-of-two-scaled FP8 exactly."""
    splits = [128, 128]
    gl, x = setup(splits)
    y0 = gl(x, splits, is_first_microbatch=True)
    version = gl.weight1._version
    gl.weight1.data.mul_(2)
    assert gl.weight1._version == version
    assert torch.equal(gl(x, splits, is_first_microbatch=False), y0)
    y1 = gl(x, splits)
    assert torch.equal(y1[:128], y0[:128]) and torch.equal(y1[128:], 2 * y0[128:])
    gl.weight1.data.mul_(2)
    assert torch.equal(gl(x, splits, is_first_microbatch=False)[128:], 4 * y0[128:])  # None kept no cache
    assert gl.fp8_weights(False)[1] is gl.fp8_weights(False)[1]
    assert torch.equal(gl(x, splits, is_first_microbatch=True)[128:], 4 * y0[128:])
    with pytest.raises(TypeError, match="is_first_microbatch must be None or a bool, got 1"):
        gl(x, splits, is_first_microbatch=1)


@pytest.mark.parametrize("transpose", [True, False], ids=["W-and-W^T", "W-alone"])
@pytest.mark.parametrize("flag", [None, True, False])
def test_fp8_weights_one_copy_is_kept_and_cached(monkeypatch, flag, transpose):
    """One launch writes W and W^T: the forward drops W, backward takes W^T as is and the cache holds W^T alone (a
    reused cache gives W by one byte transpose in the forward). ``transpose=False`` (recompute's first pass): W
    alone, kept and cached, transposed in backward. Either way W and W^T are bitwise those of an uncached
    quantization, and outputs and gradients bitwise those of the uncached module."""
    import transformer_engine_moe.module.grouped_linear as grouped_linear

    splits = [128, 0, 128]
    gl, x = setup(splits)
    transposes = []
    real = grouped_linear.transpose_grouped_weight
    monkeypatch.setattr(grouped_linear, "transpose_grouped_weight",
                        lambda *a, **kw: transposes.append("call") or real(*a, **kw))
    w0, w0_t = gl.fp8_weights(None)
    gl.fp8_weights(True, transpose)
    w, w_t = gl.fp8_weights(flag, transpose)
    assert (w_t is None) is (not transpose)
    for a, b in ((w, w0), (w_t, w0_t)) if w_t is not None else ((w, w0),):
        assert torch.equal(a.rowwise_data.view(torch.uint8), b.rowwise_data.view(torch.uint8))
        assert torch.equal(a.rowwise_scale_inv, b.rowwise_scale_inv)
    kept = w_t if transpose else w  # what the cache holds, and backward
    assert (flag is None) is (gl._cache is None)
    assert flag is None or gl._cache[1 if transpose else 0] is kept and gl._cache[0 if transpose else 1] is None
    assert len(transposes) == (flag is False and transpose)

    def run(f):
        transposes.clear()
        xi = x.clone().requires_grad_()
        y = gl(xi, splits, is_first_microbatch=f)
        in_forward, kept = len(transposes), y.grad_fn.weight_bwd
        y.float().square().sum().backward()
        grads = [wi.grad.clone() for wi in gl.weights]
        gl.zero_grad(set_to_none=True)
        return y, xi.grad, grads, kept, (in_forward, len(transposes) - in_forward)

    if not transpose:
        gl.prefetch_fp8_weights(flag, transpose=False)
    y, dx, dw, kept, counts = run(flag)
    assert counts == ((flag is False and transpose), not transpose)  # (in forward, in backward)
    assert kept.shape == ((3, 256, 128) if transpose else (3, 128, 256))
    assert flag is None or kept is gl._cache[1 if transpose else 0]
    y0, dx0, dw0, _, counts = run(None)
    assert counts == (0, 0)
    assert torch.equal(y, y0) and torch.equal(dx, dx0) and all(torch.equal(a, b) for a, b in zip(dw, dw0))


@pytest.mark.parametrize("single", [False, True], ids=["per-expert", "single"])
def test_requantize_in_backward_keeps_no_fp8_weight(monkeypatch, single):
    """``requantize_in_backward`` without a cache: the forward quantizes W alone and keeps no FP8 weight, backward
    quantizes W and W^T again for its dgrad; outputs and gradients bitwise those of the module that keeps W^T. With
    a cache (True, then False) it changes nothing: the cache is what backward reads."""
    import transformer_engine_moe.module.grouped_linear as grouped_linear

    splits = [128, 0, 256]
    gl, x = setup(splits, single_grouped_weight=single)
    calls = []
    real = grouped_linear.quantize_grouped_weight
    monkeypatch.setattr(grouped_linear, "quantize_grouped_weight",
                        lambda ws, *a, **kw: calls.append(kw["transpose"]) or real(ws, *a, **kw))

    def run(flag):
        calls.clear()
        xi = x.clone().requires_grad_()
        y = gl(xi, splits, is_first_microbatch=flag)
        kept, in_forward = y.grad_fn.weight_bwd, list(calls)
        y.float().square().sum().backward()
        grads = [w.grad.clone() for w in gl.weight_params]
        gl.zero_grad(set_to_none=True)
        return (y, xi.grad, *grads), kept, in_forward, calls[len(in_forward):]

    want, kept, *_ = run(None)
    assert kept is not None  # W^T
    gl.requantize_in_backward = True
    got, kept, in_forward, in_backward = run(None)
    assert kept is None and in_forward == [False] and in_backward == [True]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for flag in (True, False):
        got, kept, *_ = run(flag)
        assert kept is not None and all(torch.equal(a, b) for a, b in zip(got, want))


def test_prefetched_fp8_weights_are_taken_once_by_the_matching_forward():
    """``prefetch_fp8_weights``: the next forward with the same flag uses those weights (quantized before the
    weights changed here) and nothing later does; a forward with another flag or after
    ``drop_prefetched_fp8_weights`` quantizes the current weights. Under no_grad without a cache no W^T is
    written."""
    splits = [128, 128]
    gl, x = setup(splits)
    y0 = gl(x, splits)
    for flag, other in ((None, True), (True, None)):
        gl.prefetch_fp8_weights(flag)
        gl.weight1.data.mul_(2)
        assert torch.equal(gl(x, splits, is_first_microbatch=flag), y0)
        assert torch.equal(gl(x, splits, is_first_microbatch=flag)[128:], 2 * y0[128:])
        gl.prefetch_fp8_weights(other)
        gl.weight1.data.mul_(0.5)
        assert torch.equal(gl(x, splits, is_first_microbatch=flag), y0)
        gl.prefetch_fp8_weights(flag)
        gl.drop_prefetched_fp8_weights()
        gl.weight1.data.mul_(2)
        assert torch.equal(gl(x, splits, is_first_microbatch=flag)[128:], 2 * y0[128:])
        gl.weight1.data.mul_(0.5)
    with torch.no_grad():
        assert gl.fp8_weights(None)[1] is None and torch.equal(gl(x, splits), y0)
        assert gl.fp8_weights(True)[1] is not None


def test_checkpoint_gives_same_gradients():
    splits = [64, 192]
    gl, x = setup(splits)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    gl(x1, splits).sum().backward()
    g1 = [w.grad.clone() for w in gl.weights]
    gl.zero_grad()
    torch.utils.checkpoint.checkpoint(gl, x2, splits, use_reentrant=False).sum().backward()
    assert torch.equal(x1.grad, x2.grad) and all(torch.equal(a, w.grad) for a, w in zip(g1, gl.weights))


def test_fp8_weights_are_dropped_after_dgrad_and_a_second_backward_says_so():
    """Backward frees its FP8 W^T before the wgrad output exists (peak memory), as TE
    frees its FP8 tensors; a second backward through the same graph is refused with a clear error."""
    splits = [128, 128]
    gl, x = setup(splits)
    y = gl(x.requires_grad_(), splits)
    fn = y.grad_fn
    y.sum().backward(retain_graph=True)
    assert x.grad is not None and fn.weight_bwd is None
    with pytest.raises(RuntimeError, match="retain_graph=True a second time is not supported"):
        y.sum().backward()


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-rerun"])
def test_recompute_saved_input_regenerates_what_backward_reads_without_the_gemm(monkeypatch, early_stop):
    """A checkpointed FP8 input -> GroupedLinear whose rerun calls ``recompute_saved_input``: the rerun runs no
    GEMM and quantizes no weights, and the gradients are bit for bit those of the plain call."""
    import torch.utils.checkpoint as checkpoint
    import transformer_engine_moe.module.grouped_linear as grouped_linear

    splits = [128, 0, 256]
    gl, x = setup(splits)
    dy = torch.randn(sum(splits), gl.out_features, device=x.device, dtype=torch.bfloat16)

    def grads(checkpointed):
        gl.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        passes = []

        def fn(t):
            q = gl.quantizers[grouped_linear.Role.INPUT](t * 2)
            if passes:
                return gl.recompute_saved_input(q, splits)
            passes.append(1)
            return gl(q, splits)

        y = checkpoint.checkpoint(fn, xi, use_reentrant=False) if checkpointed else fn(xi)
        y.backward(dy)
        return [xi.grad] + [w.grad for w in gl.weights]

    plain = grads(False)
    calls = []
    for name in ("grouped_gemm", "quantize_grouped_weight"):
        monkeypatch.setattr(grouped_linear, name, lambda *a, real=getattr(grouped_linear, name), name=name, **kw:
                            calls.append(name) or real(*a, **kw))
    with checkpoint.set_checkpoint_early_stop(early_stop):
        recomputed = grads(True)
    assert sorted(calls) == ["grouped_gemm", "grouped_gemm", "quantize_grouped_weight"]  # forward, dgrad; weights once
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))


def test_wgrad_operands_are_columnwise_only(monkeypatch):
    """Forward keeps only X^T for wgrad, and backward hands wgrad dY^T without dY's rowwise bytes: nothing
    rowwise outlives its last use (peak memory)."""
    import transformer_engine_moe.module.grouped_linear as grouped_linear

    seen = []
    real = grouped_linear.grouped_gemm_wgrad
    monkeypatch.setattr(grouped_linear, "grouped_gemm_wgrad",
                        lambda dy_t, x_t, *a, **kw: seen.append((dy_t.usages, x_t.usages)) or real(dy_t, x_t, *a, **kw))
    splits = [128, 128]
    gl, x = setup(splits)
    y = gl(x, splits)
    assert [t.dtype for t in y.grad_fn.saved_tensors] == [torch.float8_e4m3fn, torch.float32]
    y.sum().backward()
    assert seen == [(("columnwise",), ("columnwise",))]


def test_transposes_are_queued_before_the_gemms(monkeypatch):
    """The forward queues its input's scaling-aware transpose before its GEMM (the GPU runs it while the host issues
    the GEMM) and saves it, and backward dY^T before the dgrad GEMM. In a checkpoint's first pass
    (``_saved_input_dropped``) no transpose is made: empty tensors of its shapes stand in. No transpose in a
    forward without grad mode (inference)."""
    import dataclasses

    import transformer_engine_moe.module.grouped_linear as grouped_linear

    calls = []
    real_gemm, real_impl = grouped_linear.grouped_gemm, grouped_linear.implementation

    def impl(*a, **kw):
        found = real_impl(*a, **kw)
        t = found.scaling_aware_transpose
        return dataclasses.replace(found, scaling_aware_transpose=lambda d, *b: calls.append(f"T{d.shape[1]}") or
                                   t(d, *b))

    monkeypatch.setattr(grouped_linear, "implementation", impl)
    monkeypatch.setattr(grouped_linear, "grouped_gemm", lambda *a, **kw: calls.append("gemm") or real_gemm(*a, **kw))
    splits = [128, 0, 128]
    gl, x = setup(splits, k=256, n=128)
    y = gl(x.clone().requires_grad_(), splits)
    y.backward(torch.randn_like(y))
    # T256: the input's [M, K=256] transpose; T128: dY's [M, N=128]
    assert calls == ["T256", "gemm", "T128", "gemm"]
    calls.clear()
    y = gl(x.clone().requires_grad_(), splits)
    made = [(t.shape, t.dtype) for t in y.grad_fn.saved_tensors]
    calls.clear()
    gl._saved_input_dropped = True
    dropped = gl(x.clone().requires_grad_(), splits)
    gl._saved_input_dropped = False
    assert calls == ["gemm"] and [(t.shape, t.dtype) for t in dropped.grad_fn.saved_tensors] == made
    calls.clear()
    with torch.no_grad():
        gl(x, splits)
    assert calls == ["gemm"]


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2-taken-as-is", "other-scales-requantized"])
def test_output_gradient_arriving_quantized(pow2):
    """An output gradient that arrives as a rowwise 1x128 FP8 tensor with power-of-two scales (``moe_unpermute``'s
    ``grad_quantize``) is what backward uses: gradients bitwise those of a BF16 gradient whose quantization it is;
    one with other scales is dequantized and quantized again, as its BF16 value would be."""
    splits = [128, 0, 128]
    gl, x = setup(splits)
    dy = torch.randn(x.shape[0], 128, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    q = quantize_blockwise(dy, pow2_scales=pow2)
    same_as = dy if pow2 else q.dequantize(torch.bfloat16)

    def grads(g):
        for w in gl.weights:
            w.grad = None
        xi = x.clone().requires_grad_()
        torch.autograd.backward(gl(xi, splits), g)
        return [xi.grad] + [w.grad for w in gl.weights]

    assert all(torch.equal(a, b) for a, b in zip(grads(q), grads(same_as)))


def test_load_state_dict_drops_the_fp8_weight_cache():
    """A cache made before ``load_state_dict`` is never used after it, even by ``is_first_microbatch=False``."""
    splits = [128, 128]
    gl, x = setup(splits)
    gl(x, splits, is_first_microbatch=True)
    state = {k: 2 * v for k, v in gl.state_dict().items()}
    gl.load_state_dict(state)
    assert torch.equal(gl(x, splits, is_first_microbatch=False), gl(x, splits))
    cached = gl.fp8_weights(True)[1]
    gl.reset_fp8_weight_cache()
    assert gl.fp8_weights(False)[1] is not cached


def test_parameter_names_follow_transformer_engine():
    gl = GroupedLinear(3, 128, 256, bias=True)
    assert [n for n, _ in gl.named_parameters()] == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    assert gl.weight0.shape == (256, 128)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_single_grouped_weight_is_bitwise_the_per_expert_module(backend, fuse):
    """single_grouped_weight: one [G, N, K] parameter (TE's option), the same arithmetic: output, input
    gradient and weight gradients (in .grad, or added into one [G, N, K] main_grad) equal the per-expert
    module's bit for bit, with an empty expert and the FP8 weight cache in use."""
    splits = [100, 0, 156]
    per, x = setup(splits, backend=backend, bias=True, fuse_wgrad_accumulation=fuse)
    one = GroupedLinear(3, 256, 128, backend=backend, device=KERNEL_DEVICE, bias=True, fuse_wgrad_accumulation=fuse,
                        single_grouped_weight=True)
    one.load_state_dict(per.state_dict())  # per-expert keys stacked into `weight` on load
    assert [n for n, _ in one.named_parameters()] == ["weight", "bias0", "bias1", "bias2"]
    assert one.weight.shape == (3, 128, 256) and torch.equal(one.weight[2], per.weight2)
    if fuse:
        for w in per.weights:
            w.main_grad = torch.ones(w.shape, device=w.device)
        one.weight.main_grad = torch.ones(one.weight.shape, device=one.weight.device)
    dy = torch.randn(256, 128, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    outs = []
    for gl in (per, one):
        xi = x.clone().requires_grad_()
        y = gl(xi, splits, is_first_microbatch=True)
        y.backward(dy)
        attr = "main_grad" if fuse else "grad"
        grads = list(getattr(gl.weight, attr).unbind(0)) if gl.single_grouped_weight else \
            [getattr(w, attr) for w in gl.weights]
        outs.append((y, xi.grad, grads, gl.bias1.grad))
    (y0, dx0, dw0, db0), (y1, dx1, dw1, db1) = outs
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(db0, db1)
    assert all(torch.equal(a, b) for a, b in zip(dw0, dw1))
    if fuse:
        assert one.weight.grad_added_to_main_grad and one.weight.grad.shape == one.weight.shape


def test_single_grouped_weight_main_grad_not_contiguous_is_added_to():
    """A single weight's main_grad is accumulated into in place when it is a contiguous float32 [G, N, K]; any
    other buffer (here a strided view) gets the same sum added."""
    splits = [100, 0, 156]
    grads = []
    for strided in (False, True):
        torch.manual_seed(0)
        gl = GroupedLinear(3, 256, 128, device=KERNEL_DEVICE, fuse_wgrad_accumulation=True, single_grouped_weight=True)
        base = torch.ones((3, 256, 128) if strided else (3, 128, 256), device=KERNEL_DEVICE)
        gl.weight.main_grad = base.transpose(1, 2) if strided else base
        x = torch.randn(256, 256, device=KERNEL_DEVICE, dtype=torch.bfloat16)
        gl(x, splits).backward(torch.randn(256, 128, device=KERNEL_DEVICE, dtype=torch.bfloat16))
        grads.append(gl.weight.main_grad.clone())
    assert not torch.equal(grads[0], torch.ones_like(grads[0])) and torch.equal(grads[0], grads[1])


def test_single_grouped_weight_checkpoints_load_both_ways():
    """TE's two checkpoint forms load into either module: `weight` [G, N, K] is split into weight0.. and the
    reverse; a stacked weight of the wrong expert count is refused by name."""
    per = GroupedLinear(2, 128, 256)
    one = GroupedLinear(2, 128, 256, single_grouped_weight=True)
    one.load_state_dict(per.state_dict())
    assert list(one.state_dict()) == ["weight"] and torch.equal(one.weight, torch.stack(per.weights))
    back = GroupedLinear(2, 128, 256)
    back.load_state_dict(one.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.weights, per.weights))
    with pytest.raises(ValueError, match=r"single grouped weight \[num_gemms=3, N, K\] was expected, got \[2, "):
        GroupedLinear(3, 128, 256).load_state_dict(one.state_dict())


def _flagged(gl):
    gl.add_wgrad_into_main_grad = True
    return gl


def _with_main_grads(gl, shared=False, dtype=torch.float32):
    """``gl`` with a ``main_grad`` (float32, or ``dtype``) on every weight: one buffer for all when ``shared``."""
    buf = torch.zeros(gl.out_features, gl.in_features, dtype=dtype)
    for w in gl.weight_params:
        w.main_grad = buf if shared else torch.zeros_like(w, dtype=dtype)
    return gl


@pytest.mark.parametrize(
    "make,call,exc,match",
    [
        (lambda: GroupedLinear(2, 200, 128), None, ValueError, "multiples of 128"),
        (lambda: GroupedLinear(0, 128, 128), None, ValueError, "num_gemms must be a positive int"),
        (lambda: GroupedLinear(2, 128, 128, params_dtype=torch.float16), None, TypeError, "params_dtype"),
        (None, lambda gl: gl(torch.randn(4, 256), [2, 2]), ValueError, r"in_features=128\], got \[4, 256\]"),
        (None, lambda gl: gl.recompute_saved_input(torch.randn(4, 256), [2, 2]), ValueError,
         r"in_features=128\], got \[4, 256\]"),
        (None, lambda gl: gl(torch.randn(4, 128), [3, 2]), ValueError, "sum to M=4"),
        (None, lambda gl: gl(torch.randn(4, 128), [5, -1]), ValueError, ">= 0"),
        (None, lambda gl: gl(torch.ones(4, 128, dtype=torch.int32), [2, 2]), TypeError, "bf16/fp16/fp32"),
        (None, lambda gl: gl(torch.randn(4, 128), [4]), ValueError, "1 groups but the weight has 2 experts"),
        (None, lambda gl: gl(torch.randn(4, 128), [1, 1, 1, 1]), ValueError, r"4 groups .* takes 2 groups, or 3"),
        (lambda: GroupedLinear(2, 128, 128, recipe="e4m3"), None, TypeError, "recipe must be an FP8FlowRecipe"),
        (lambda: GroupedLinear(2, 128, 128, recipe=FP8FlowRecipe(force_pow_2_scales=False)), None, ValueError,
         "force_pow_2_scales must be True"),
        (lambda: GroupedLinear(2, 128, 128, backend="bogus"), None, ValueError, "backend must be one of"),
        (lambda: GroupedLinear(2, 128, 128, fuse_wgrad_accumulation=1), None, TypeError, "must be a bool"),
        (lambda: GroupedLinear(2, 128, 128, fuse_wgrad_accumulation=True), lambda gl: gl(torch.randn(4, 128), [2, 2]),
         ValueError, "weight0 has none"),
        (lambda: GroupedLinear(2, 128, 128, fuse_wgrad_accumulation=True, single_grouped_weight=True),
         lambda gl: gl(torch.randn(4, 128), [2, 2]), ValueError, "main_grad.*; weight has none"),
        (lambda: _flagged(GroupedLinear(2, 128, 128)), lambda gl: gl(torch.randn(4, 128), [2, 2]), ValueError,
         "add_wgrad_into_main_grad=True adds weight gradients into each weight's main_grad .*; weight0 has none"),
        (lambda: GroupedLinear(2, 128, 128, single_grouped_weight="yes"), None, TypeError,
         "single_grouped_weight must be a bool"),
        (lambda: GroupedLinear(2, 128, 128, requantize_in_backward=1), None, TypeError,
         "requantize_in_backward must be a bool, got 1"),
        (None, lambda gl: gl(torch.randn(4, 128, device="meta"), [2, 2]), ValueError, "inp is on meta, the weights"),
        (None, lambda gl: gl(quantize_blockwise(torch.randn(128, 128), block="128x128"), [64, 64]), ValueError,
         "rowwise 1x128 with power-of-two scales"),
        (None, lambda gl: gl(quantize_blockwise(torch.randn(4, 128), force_pow_2_scales=False), [2, 2]), ValueError,
         "rowwise 1x128 with power-of-two scales"),
        # the hostile-input probe: bias="no" (once biases), a flag "yes" to the weight cache (once cached as True), one
        # main_grad buffer for two experts (once both gradients written into it), a module on the meta device
        (lambda: GroupedLinear(2, 128, 128, bias="no"), None, TypeError, "bias must be a bool, got 'no'"),
        (None, lambda gl: gl.fp8_weights("yes"), TypeError, "is_first_microbatch must be None or a bool, got 'yes'"),
        (None, lambda gl: gl.prefetch_fp8_weights(None, transpose="no"), TypeError, "transpose must be a bool"),
        (lambda: _with_main_grads(GroupedLinear(2, 128, 128, fuse_wgrad_accumulation=True), shared=True),
         lambda gl: gl(torch.randn(4, 128), [2, 2]), ValueError,
         "weight0.main_grad and weight1.main_grad share memory"),
        # BF16 main_grads never reach the wgrad op as its out (added after the GEMM): forward's check is their only one
        (lambda: _with_main_grads(GroupedLinear(2, 128, 128, fuse_wgrad_accumulation=True), shared=True,
                                  dtype=torch.bfloat16),
         lambda gl: gl(torch.randn(4, 128), [2, 2]), ValueError,
         "weight0.main_grad and weight1.main_grad share memory"),
        (lambda: GroupedLinear(2, 128, 128, device="meta"), lambda gl: gl(torch.randn(4, 128, device="meta"), [2, 2]),
         ValueError, "got a tensor on the meta device"),
    ],
    ids=["features", "num-gemms", "params-dtype", "in-features", "recompute-in-features", "sum", "negative", "dtype",
         "groups", "groups-4", "recipe-str", "recipe-not-pow2", "backend", "fuse-not-bool", "fuse-without-main-grad",
         "single-fuse-without-main-grad", "add-wgrad-without-main-grad", "single-not-bool", "requantize-not-bool",
         "device", "weight-role-input", "fp32-scales-input",
         "bias-str", "cache-flag-str", "transpose-str", "shared-main-grad", "shared-bf16-main-grad", "meta-module"],
)
def test_bad_input_is_rejected_clearly(make, call, exc, match):
    with pytest.raises(exc, match=match):
        gl = make() if make else GroupedLinear(2, 128, 128)
        call(gl)


BAD_MAIN_GRADS = {  # kind -> (main_grad for a weight parameter of ``shape``, exception, what the message says it got)
    "shape": (lambda shape: torch.zeros(*shape[:-1], 64), ValueError, lambda shape: rf"{[*shape[:-1], 64]} on cpu"),
    "dtype": (lambda shape: torch.zeros(shape, dtype=torch.int32), TypeError, lambda _: "Tensor of dtype torch.int32"),
    "device": (lambda shape: torch.zeros(shape, device="meta"), ValueError, lambda shape: rf"{list(shape)} on meta"),
    "list": (lambda _: [0.0], TypeError, lambda _: "list"),
}


@pytest.mark.parametrize("single", [False, True], ids=["per-expert", "single"])
@pytest.mark.parametrize("kind", list(BAD_MAIN_GRADS))
def test_wrong_main_grad_is_named_in_forward(kind, single):
    """Under fuse_wgrad_accumulation a main_grad that backward could not write into (shape, dtype, device, not a
    tensor) is refused in forward, naming the weight (it used to pass forward and fail in backward)."""
    make, exc, got = BAD_MAIN_GRADS[kind]
    gl = GroupedLinear(2, 128, 128, fuse_wgrad_accumulation=True, single_grouped_weight=single)
    (name, first), *others = gl._weight_names()
    first.main_grad = make(first.shape)
    for _, w in others:
        w.main_grad = torch.zeros(w.shape)
    expected = f"a bf16/fp16/fp32 tensor {list(first.shape)} on cpu"
    with pytest.raises(exc, match=re.escape(f"{name}.main_grad must be {expected}") + ".*, got " + re.escape(
            got(first.shape))):
        gl(torch.randn(4, 128), [2, 2])
    with torch.no_grad():  # no backward, main_grad unread: not checked
        gl(torch.randn(4, 128), [2, 2])


def test_main_grads_shared_after_forward_are_refused_in_backward():
    """A buffer shared after forward's check (one for both experts) reaches the wgrad op as its out list, whose own
    check refuses it before anything is written: why the op checks GroupedLinear's main_grads again in backward
    (forward's check ran before the change)."""
    gl = _with_main_grads(GroupedLinear(2, 128, 128, fuse_wgrad_accumulation=True))
    y = gl(torch.randn(4, 128), [2, 2])
    _with_main_grads(gl, shared=True)
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] share memory"):
        y.float().sum().backward()
    assert not any(w.main_grad.any() for w in gl.weight_params)


def test_init_method_must_be_callable():
    with pytest.raises(TypeError, match=r"init_method must be None or a callable .* got 0\.02"):
        GroupedLinear(2, 128, 128, init_method=0.02)
    gl = GroupedLinear(2, 128, 128, init_method=torch.nn.init.zeros_)
    assert all((w == 0).all() for w in gl.weights)


@requires_cuda
def test_gpu_deepseek_shapes_and_no_host_sync():
    """fc1 of DeepSeek-V3 (7168 -> 2*2048, 8 experts, 16384 tokens): device-tensor splits run forward and
    backward without a host sync (Triton path); results match the host-list (cuBLAS) path."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(8), 16384, replacement=True, generator=gen).bincount(minlength=8)
    splits = (counts // 512 * 512).tolist()
    splits[-1] += 16384 - sum(splits)
    gl = GroupedLinear(8, 7168, 4096, device="cuda")
    x = torch.randn(16384, 7168, device="cuda", dtype=torch.bfloat16)
    st = torch.tensor(splits, device="cuda")
    xq = quantize_blockwise(x)
    dy = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        xi = x.clone().requires_grad_()
        gl(xi, st).backward(dy)
        return xi.grad

    assert_no_host_sync(step)
    dx_t, dw_t = step(), [w.grad.clone() for w in gl.weights]
    gl.zero_grad()
    xi = x.clone().requires_grad_()
    y_c = gl(xi, splits)
    y_c.backward(dy)
    assert relerr(gl(xq, st), y_c) < 1e-2 and relerr(dx_t, xi.grad) < 1e-2
    assert all(relerr(a / 3, b) < 1e-2 for a, b in zip(dw_t, [w.grad for w in gl.weights]))
