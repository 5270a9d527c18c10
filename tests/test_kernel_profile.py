"""benchmarks/kernel_profile.py on the CPU: kernel names to categories, and kernel time tied to the op that
launched it (synthetic profiler events)."""

import types

import pytest
import torch

import kernel_profile


W, ACT, TORCH = "weight quantization + W^T", "activation quantization", "torch elementwise / fill / copy / reduce"


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
    ("void at::native::(anonymous namespace)::indexFuncLargeIndex<c10::BFloat16>", "torch sort / gather / scatter / index"),
    ("Memset (Device)", TORCH), ("some_new_kernel", "other")])
def test_kernel_categories(kernel, cat):
    assert kernel_profile.category(kernel) == cat


def test_kernel_time_is_tied_to_the_op_that_launched_it():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    k = types.SimpleNamespace

    def op(name, parent=None, kernels=()):
        return k(name=name, device_type=cpu, cpu_parent=parent, kernels=[k(name=n, duration=d) for n, d in kernels])

    wgrad = op("tem::grouped_gemm_wgrad")
    events = [k(name="fill", device_type=cuda, device_time=30.0), k(name="fill", device_type=cuda, device_time=20.0),
              k(name="gemm", device_type=cuda, device_time=500.0), k(name="orphan", device_type=cuda, device_time=10.0),
              wgrad, op("aten::fill_", op("aten::zero_", wgrad), [("fill", 30.0)]),
              op("aten::fill_", None, [("fill", 20.0)]), op("tem::gemm", None, [("gemm", 500.0), ("not_a_kernel", 7.0)])]
    per_kernel, sites = kernel_profile.kernel_sites(events, steps=2)
    assert per_kernel == {"fill": 0.025, "gemm": 0.25, "orphan": 0.005}
    assert sites == {("fill", "aten::fill_ < tem::grouped_gemm_wgrad"): [0.015, 0.5],
                     ("fill", "aten::fill_"): [0.01, 0.5], ("gemm", "tem::gemm"): [0.25, 0.5], ("orphan", ""): [0.005, 0.0]}
