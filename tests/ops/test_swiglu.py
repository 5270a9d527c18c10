"""weighted_swiglu_quant: kernel vs reference, the reference vs float64 autograd, zero rows, non-finite
values, bad input, and (GPU) bitwise equality at full size."""

import pytest
import torch

from conftest import CUDA, KERNEL_DEVICE, assert_no_host_sync, requires_cuda
from transformer_engine_moe import FP8FlowRecipe, Format, quantize_blockwise, weighted_swiglu_quant
from transformer_engine_moe.reference import swiglu as ref

HYBRID = FP8FlowRecipe(fp8_format=Format.HYBRID)


def inputs(m, f, device=KERNEL_DEVICE, dtype=torch.bfloat16, with_probs=True):
    x = (torch.randn(m, 2 * f) * 3).to(dtype).to(device)
    probs = torch.rand(m).to(device) if with_probs else None
    return x, probs


def assert_dprobs_close(dp, dp_ref, dy, x):
    """Float32 sums over F in another order: within F float32 roundings of the sum of |terms|."""
    f = x.shape[1] // 2
    a, b = x[:, :f].float(), x[:, f:].float()
    terms = ((dy.float() * (a / (1 + torch.exp2(-a * ref.LOG2E)))) * b).abs().sum(1)
    assert ((dp - dp_ref).abs() <= f * 2.0**-24 * terms + 1e-30).all()


def assert_fp8_close(a, b):
    """Bitwise on the GPU; under the interpreter (numpy's exp) scales exact, data within one FP8 step."""
    assert torch.equal(a.rowwise_scale_inv, b.rowwise_scale_inv)
    da, db = a.rowwise_data.view(torch.uint8), b.rowwise_data.view(torch.uint8)
    if CUDA:
        assert torch.equal(da, db)
    else:
        assert ((da.int() - db.int()).abs() <= 1).all()


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
@pytest.mark.parametrize("shape", [(0, 128), (1, 128), (37, 256), (64, 384)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_forward_kernel_matches_reference(with_probs, shape, dtype):
    x, probs = inputs(*shape, dtype=dtype, with_probs=with_probs)
    a = weighted_swiglu_quant(x, probs, backend="triton")
    b = weighted_swiglu_quant(x, probs, backend="reference")
    assert a.shape == (shape[0], shape[1]) and a.dtype == dtype and a.fp8_dtype == torch.float8_e4m3fn
    assert a.rowwise_scale_inv.shape == (shape[0], shape[1] // 128) and a.force_pow_2_scales
    assert_fp8_close(a, b)


def test_forward_is_quantize_blockwise_of_the_reference_y():
    x, probs = inputs(50, 256, "cpu")
    y = ref.weighted_swiglu(x, probs)
    out = weighted_swiglu_quant(x, probs, HYBRID, backend="reference")
    q = quantize_blockwise(y, backend="reference")
    assert torch.equal(out.rowwise_data.view(torch.uint8), q.rowwise_data.view(torch.uint8))
    assert torch.equal(out.rowwise_scale_inv, q.rowwise_scale_inv)


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
def test_reference_backward_matches_float64_autograd(with_probs):
    x, probs = inputs(33, 256, "cpu", torch.float32, with_probs)
    x64 = x.double().requires_grad_()
    p64 = probs.double().requires_grad_() if with_probs else None
    a, b = x64[:, :256], x64[:, 256:]
    y = torch.nn.functional.silu(a) * b * (p64[:, None] if with_probs else 1.0)
    dy = torch.randn(33, 256, dtype=torch.float64)
    grads = torch.autograd.grad(y, (x64, p64) if with_probs else (x64,), dy)
    dx, dp = ref.weighted_swiglu_grad(dy.float(), x, probs)
    torch.testing.assert_close(dx.double(), grads[0], rtol=1e-5, atol=1e-5)
    if with_probs:
        torch.testing.assert_close(dp.double(), grads[1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
@pytest.mark.parametrize("quantize_grad", [False, True], ids=["bf16-grad", "fp8-grad"])
def test_backward_kernel_matches_reference(with_probs, quantize_grad):
    x, probs = inputs(37, 256, with_probs=with_probs)
    dy = torch.randn(37, 256, device=KERNEL_DEVICE)
    grads = {}
    for backend in ("triton", "reference"):
        xr = x.clone().requires_grad_()
        pr = probs.clone().requires_grad_() if with_probs else None
        out = weighted_swiglu_quant(xr, pr, HYBRID, quantize_grad=quantize_grad, backend=backend)
        out.dequantize().backward(dy)
        grads[backend] = (xr.grad, pr.grad if with_probs else None)
    (dxa, dpa), (dxb, dpb) = grads["triton"], grads["reference"]
    if quantize_grad:
        assert dxa.fp8_dtype == torch.float8_e5m2 and dxa.shape == x.shape
        assert_fp8_close(dxa, dxb)
    elif CUDA:
        assert torch.equal(dxa, dxb)
    else:
        torch.testing.assert_close(dxa, dxb, rtol=2**-7, atol=1e-6)
    if with_probs:
        assert_dprobs_close(dpa, dpb, dy, x)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_quantized_grad_is_the_quantized_unquantized_grad(backend, dtype):
    """``quantize_grad=True`` gives bitwise ``quantize_blockwise`` of the dx that ``quantize_grad=False`` gives (the
    fused backward rounds dx to x's dtype before its 1x128 quantization, as storing it would): fc1's dgrad operand
    without writing and reading a BF16 dx. Special values and a tiny block (the overflowing scale's value is the
    input dtype's) included."""
    x, probs = inputs(64, 384, dtype=dtype)
    x[5, 7], x[9, 400] = float("nan"), float("inf")
    dy = torch.randn(64, 384, device=KERNEL_DEVICE)
    dy[11, 128:256] *= 1e-38  # a block whose fp8_max / amax overflows float32
    dxs = []
    for quantize_grad in (False, True):
        xr = x.clone().requires_grad_()
        weighted_swiglu_quant(xr, probs, HYBRID, quantize_grad=quantize_grad, backend=backend).dequantize().backward(dy)
        dxs.append(xr.grad)
    want = quantize_blockwise(dxs[0], fp8_dtype=torch.float8_e5m2, backend=backend)
    assert torch.equal(dxs[1].rowwise_data.view(torch.uint8), want.rowwise_data.view(torch.uint8))
    assert torch.equal(dxs[1].rowwise_scale_inv.view(torch.int32), want.rowwise_scale_inv.view(torch.int32))


def test_zero_rows_give_zeros_and_zero_gradients():
    x, probs = inputs(16, 128)
    x[3:9] = 0.0
    probs[3:9] = 0.0  # padding rows of permute+pad
    xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out = weighted_swiglu_quant(xr, pr, backend="triton")
    assert (out.rowwise_data.view(torch.uint8)[3:9] == 0).all() and (out.rowwise_scale_inv[3:9] == 1).all()
    out.dequantize().backward(torch.randn(16, 128, device=KERNEL_DEVICE))
    assert (xr.grad[3:9] == 0).all() and (pr.grad[3:9] == 0).all()


@pytest.mark.parametrize("recipe", [FP8FlowRecipe(), HYBRID], ids=["e4m3", "hybrid"])
def test_non_finite_values_propagate(recipe):
    x, probs = inputs(4, 128, dtype=torch.float32)
    x[0, 5], x[0, 128 + 5] = 1e30, 1e30  # y overflows float32 to inf
    x[1, 7] = float("nan")
    x[2, 128 + 9] = -float("inf")  # b = -inf: y = -inf
    for backend in ("triton", "reference"):
        out = weighted_swiglu_quant(x, probs, recipe, backend=backend)
        y = out.dequantize()
        assert not torch.isfinite(y[0, 5]) and torch.isnan(y[1, 7]) and not torch.isfinite(y[2, 9])
        assert torch.isfinite(y[3]).all()
        # blocks holding +-inf are marked by a NaN scale_inv; the NaN row keeps a finite scale
        assert torch.isnan(out.rowwise_scale_inv[[0, 2], 0]).all() and torch.isfinite(out.rowwise_scale_inv[[1, 3]]).all()


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: (torch.randn(4, 200), None), ValueError, r"F a multiple of 128.*\[4, 200\]"),
        (lambda: (torch.randn(4, 384), None), ValueError, "F a multiple of 128"),
        (lambda: (torch.randn(256), None), ValueError, r"\[M, 2F\]"),
        (lambda: (torch.ones(4, 256, dtype=torch.int32), None), TypeError, "bf16/fp16/fp32"),
        (lambda: (quantize_blockwise(torch.randn(4, 256)), None), TypeError, "Float8BlockwiseQTensor"),
        (lambda: (torch.randn(4, 256), torch.rand(5)), ValueError, r"probs must have shape \[M=4\]"),
        (lambda: (torch.randn(4, 256), torch.ones(4, dtype=torch.int64)), TypeError, "floating-point"),
    ],
    ids=["f200", "f192", "1d", "int", "fp8", "probs-shape", "probs-dtype"],
)
def test_bad_input_is_rejected_clearly(make, exc, match):
    x, probs = make()
    with pytest.raises(exc, match=match):
        weighted_swiglu_quant(x, probs)


def test_bad_recipe():
    with pytest.raises(TypeError, match="recipe must be an FP8FlowRecipe"):
        weighted_swiglu_quant(torch.randn(4, 256), None, recipe="hybrid")
    with pytest.raises(TypeError, match="quantize_grad must be a bool .*, got 'no'"):  # once an FP8 gradient
        weighted_swiglu_quant(torch.randn(4, 256), None, quantize_grad="no")


@requires_cuda
@pytest.mark.parametrize("m,f", [(65536, 2048), (32768, 1536)])
def test_gpu_bitwise_at_full_size(m, f):
    x, probs = inputs(m, f, "cuda")
    assert_fp8_close(weighted_swiglu_quant(x, probs, backend="triton"),
                     weighted_swiglu_quant(x, probs, backend="reference"))
    dy = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    from transformer_engine_moe.kernels import swiglu as ks

    dx, _, dp = ks.weighted_swiglu_backward(dy, x, probs)
    rdx, rdp = ref.weighted_swiglu_grad(dy, x, probs)
    assert torch.equal(dx, rdx.to(x.dtype))
    assert_dprobs_close(dp, rdp, dy, x)


@requires_cuda
def test_gpu_permute_activation_unpermute_has_no_host_sync():
    """permute+pad (FP8) -> SwiGLU+quant -> unpermute, forward and backward, under sync-debug mode."""
    from transformer_engine_moe import moe_permute_and_pad_with_probs, moe_unpermute

    tokens, experts, hidden = 2048, 32, 512
    logits = torch.randn(tokens, experts, device="cuda")
    rm = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda").scatter_(1, logits.topk(8, 1).indices, True)
    probs = torch.softmax(logits, -1).requires_grad_()
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, 2 * hidden, device="cuda", dtype=torch.bfloat16)

    def step():
        out, pprobs, rmap, pad, _ = moe_permute_and_pad_with_probs(
            quantize_blockwise(x), probs, rm, rm.sum(0), 128, tokens * 8)  # counts on the device: no sync
        h = weighted_swiglu_quant(out.dequantize(torch.bfloat16) @ w, pprobs, HYBRID, quantize_grad=True)
        y = moe_unpermute(h.dequantize(torch.bfloat16), rmap, probs, pad_offsets=pad)
        y.float().sum().backward()

    assert_no_host_sync(step)
