"""benchmarks/kernel_profile.py on the CPU: kernel names to categories (this package's, torch's and Megatron's
kernels), categories refined by the op that launched them, kernel time tied to that op (synthetic profiler
events), and a training iteration's table by group and category against a baseline (fake profiles)."""

import types

import pytest
import torch

import kernel_profile


W, ACT, TORCH = "weight quantization + W^T", "activation quantization", "torch elementwise / fill / copy / reduce"
INDEX, ATTENTION = "torch sort / gather / scatter / index", "attention core"
GROUPED_CUTLASS = ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
                   "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int>>>>>")
BF16_NVJET, FP8_NVJET = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_coopA"
FOREACH_ADD = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
               "TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, "
               "std::plus<float>, float>")
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3>>"


@pytest.mark.parametrize("kernel, cat", [
    ("_quantize_grouped_weight_kernel", W), ("_byte_transpose_kernel", W), ("_quantize_128x128_kernel", W),
    ("_quantize_1x128_kernel", ACT), ("_quantize_128x1_kernel", ACT),
    ("_scaling_aware_transpose_kernel", "scaling-aware transpose"),
    ("_fill_kernel", "permute / unpermute"), ("_chunk_counts_kernel", "permute / unpermute"),
    ("_unpermute_backward_kernel", "permute / unpermute"), ("_weighted_swiglu_quant_kernel", "swiglu"),
    ("_grouped_wgrad_kernel", "gemm"), ("void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u>", "gemm"),
    ("nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_coopA", "gemm"),
    ("void transformer_engine::block_scaled_1d_cast_transpose_kernel<float>", "TE casts / padding"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", TORCH),
    ("void at::native::(anonymous namespace)::indexFuncLargeIndex<c10::BFloat16>", INDEX),
    ("Memset (Device)", TORCH), ("some_new_kernel", "other"),
    # Megatron's training step: attention cores (torch SDPA's cuDNN, flash and memory-efficient kernels)
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0", ATTENTION),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<192, 64, 128>>",
     ATTENTION),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)",
     ATTENTION),
    (GROUPED_CUTLASS, "gemm"), (BF16_NVJET, "gemm"),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("ncclDevKernel_AllToAll_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>", "optimizer"),
    (FOREACH_ADD, TORCH),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>", "norm"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16, float>", "norm"),
    ("void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel<float, float, __nv_bfloat16>", "norm"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>",
     INDEX),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", TORCH)])
def test_kernel_categories(kernel, cat):
    assert kernel_profile.category(kernel) == cat


@pytest.mark.parametrize("kernel, launched_by, cat", [
    (BF16_NVJET, "aten::mm < LinearWithGradAccumulationAndAsyncCommunication", "dense gemm"),
    (BF16_NVJET, "aten::mm < RouterGatingLinearFunctionBackward", "dense gemm"), (BF16_NVJET, "", "dense gemm"),
    (GROUPED_CUTLASS, "aten::_grouped_mm", "expert gemm"),
    (GROUPED_CUTLASS, "aten::_grouped_mm < GroupedMmBackward0", "expert gemm"),
    ("void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u>", "_GroupedLinearFunction", "expert gemm"),
    (FP8_NVJET, "_GroupedLinearFunctionBackward", "expert gemm"),
    ("_grouped_wgrad_kernel", "_GroupedLinearFunctionBackward", "expert gemm"),
    (BF16_NVJET, "autograd::engine::evaluate_function: _GroupedLinearBackward", "expert gemm"),  # TE's experts
    ("_quantize_1x128_kernel", "_GroupedLinearFunction", ACT),  # only GEMMs are split by their op
    (FOREACH_ADD, "aten::_foreach_add_ < Optimizer.step#AdamW.step", "optimizer"),
    (ADD, f"aten::copy_ < {kernel_profile.OPTIMIZER_SCOPE}", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", f"c10d::allreduce_ < {kernel_profile.OPTIMIZER_SCOPE}",
     "communication"),
    (ADD, "aten::add_ < autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", "gradient accumulation"),
    (ADD, "aten::add_ < SwiGLUFunctionBackward", TORCH)])
def test_site_category_refines_the_name_by_the_op_that_launched_it(kernel, launched_by, cat):
    assert kernel_profile.site_category(kernel, launched_by) == cat


def test_kernel_time_is_tied_to_the_op_that_launched_it():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    k = types.SimpleNamespace

    def gpu(name, device_time, annotation=False):
        return k(name=name, device_type=cuda, device_time=device_time, is_user_annotation=annotation)

    def op(name, parent=None, kernels=()):
        return k(name=name, device_type=cpu, cpu_parent=parent, kernels=[k(name=n, duration=d) for n, d in kernels])

    wgrad = op("tem::grouped_gemm_wgrad")
    events = [gpu("fill", 30.0), gpu("fill", 20.0), gpu("gemm", 500.0), gpu("orphan", 10.0),
              gpu("Optimizer.step#AdamW.step", 900.0, annotation=True),  # a profiler range's span, not a kernel
              wgrad, op("aten::fill_", op("aten::zero_", wgrad), [("fill", 30.0)]),
              op("aten::fill_", None, [("fill", 20.0)]), op("tem::gemm", None, [("gemm", 500.0), ("not_a_kernel", 7.0)])]
    per_kernel, sites = kernel_profile.kernel_sites(events, steps=2)
    assert per_kernel == {"fill": 0.025, "gemm": 0.25, "orphan": 0.005}
    assert sites == {("fill", "aten::fill_ < tem::grouped_gemm_wgrad"): [0.015, 0.5],
                     ("fill", "aten::fill_"): [0.01, 0.5], ("gemm", "tem::gemm"): [0.25, 0.5], ("orphan", ""): [0.005, 0.0]}


SDPA = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0"


def _kernel(kernel, launched_by, ms, launches=1.0):
    return dict(kernel=kernel, launched_by=launched_by, ms=ms, launches=launches)


PROFILES = {  # what megatron_bench_entry.py --bench-profile-out writes, per variant
    "bf16_grouped_mm": dict(iteration=4, wall_ms=1000.0, kernels=[
        _kernel(BF16_NVJET, "aten::_grouped_mm", 400.0, 192.0),
        _kernel(BF16_NVJET, "aten::mm < LinearWithGradAccumulation", 200.0),
        _kernel(SDPA, "aten::_scaled_dot_product_cudnn_attention", 150.0),
        _kernel(ADD, "aten::_foreach_add_ < Optimizer.step#AdamW.step", 50.0),
        _kernel("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16>", "aten::index_select",
                100.0)]),
    "fp8_flow_single_weight": dict(iteration=4, wall_ms=880.0, kernels=[
        _kernel("void deep_gemm::sm90_fp8_gemm_1d2d_impl<0u>", "_GroupedLinearFunction", 250.0),
        _kernel(BF16_NVJET, "aten::mm < LinearWithGradAccumulation", 200.0),
        _kernel(SDPA, "aten::_scaled_dot_product_cudnn_attention", 150.0),
        _kernel(ADD, "aten::_foreach_add_ < Optimizer.step#AdamW.step", 50.0),
        _kernel("_quantize_1x128_kernel", "_GroupedLinearFunction", 60.0),
        _kernel("_permute_kernel", "_Permute", 40.0), _kernel("_unpermute_kernel", "_Unpermute", 30.0)]),
}


def row_of(rows, part, variant, **key):
    return next(r for r in rows if r["part"] == part and r["variant"] == variant
                and all(r.get(k) == v for k, v in key.items()))


def test_iteration_rows_compare_each_group_and_category_with_the_baselines():
    timed = {"bf16_grouped_mm": 990.0, "fp8_flow_single_weight": 860.0}
    rows = kernel_profile.iteration_rows(dict(PROFILES, fp8_flow=dict(error="RuntimeError: boom")), "bf16_grouped_mm",
                                         timed, top=2)
    assert rows[0] == dict(part="by group", variant="fp8_flow", group="no profile", error="RuntimeError: boom")
    expert = row_of(rows, "by group", "fp8_flow_single_weight", group="expert GEMMs")
    assert (expert["ms"], expert["share"], expert["vs_bf16_grouped_mm_ms"]) == (250.0, 250 / 880, -150.0)
    assert row_of(rows, "by group", "bf16_grouped_mm", group="dense GEMMs")["vs_bf16_grouped_mm_ms"] == 0.0
    own = row_of(rows, "by group", "fp8_flow_single_weight", group="FP8-Flow non-GEMM")
    assert (own["ms"], own["vs_bf16_grouped_mm_ms"]) == (130.0, 130.0)
    assert row_of(rows, "by group", "bf16_grouped_mm", group="FP8-Flow non-GEMM")["ms"] == 0.0  # it ran none
    assert row_of(rows, "by group", "bf16_grouped_mm", group=kernel_profile.OTHER)["ms"] == 100.0  # its permute
    assert row_of(rows, "by group", "fp8_flow_single_weight", group="optimizer")["ms"] == 50.0
    groups = [r["group"] for r in rows if r["part"] == "by group" and r["variant"] == "bf16_grouped_mm"]
    assert groups[0] == "expert GEMMs" and groups[-4:] == [  # largest first, then the iteration's totals
        "all kernels", "GPU idle (wall - kernels)", "iteration wall (profiled)", kernel_profile.TIMED]
    idle = row_of(rows, "by group", "fp8_flow_single_weight", group="GPU idle (wall - kernels)")
    assert (idle["ms"], idle["vs_bf16_grouped_mm_ms"]) == (100.0, 0.0)
    timed = row_of(rows, "by group", "fp8_flow_single_weight", group=kernel_profile.TIMED)
    assert (timed["ms"], timed["vs_bf16_grouped_mm_ms"]) == (860.0, -130.0)
    quantize = row_of(rows, "by category", "fp8_flow_single_weight", category="activation quantization")
    assert (quantize["group"], quantize["ms"]) == ("FP8-Flow non-GEMM", 60.0)
    assert row_of(rows, "by category", "bf16_grouped_mm", category="expert gemm")["ms"] == 400.0
    top = [r for r in rows if r["part"] == "top kernels: fp8_flow_single_weight"]
    assert [(r["category"], r["ms"], r["launched_by"]) for r in top] == [
        ("expert gemm", 250.0, "_GroupedLinearFunction"),
        ("dense gemm", 200.0, "aten::mm < LinearWithGradAccumulation")]
    alone = kernel_profile.iteration_rows({"fp8_flow": PROFILES["fp8_flow_single_weight"]}, "bf16_grouped_mm", {})
    assert {r["vs_bf16_grouped_mm_ms"] for r in alone if r["part"] == "by group"} == {None}  # no stand-in profile
    assert row_of(alone, "by group", "fp8_flow", group=kernel_profile.TIMED)["ms"] is None
