"""transformer_engine_moe: FP8-Flow-MoE, the whole MoE expert path in blockwise FP8."""

from setuptools import find_packages, setup

setup(
    name="transformer_engine_moe",
    version="0.1.0",
    description="FP8-Flow-MoE: blockwise-FP8 Mixture-of-Experts expert path for Megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # examples/ (pretrain_gpt, the compact CPU loop, the demo) runs from a checkout: `python -m examples.demo`.
    packages=find_packages(include=["transformer_engine_moe*", "megatron_patches*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "numpy",
        # Triton kernels on Linux GPUs (and its CPU interpreter for tests); the plain-PyTorch
        # reference path runs without it.
        "triton>=3.4; platform_system == 'Linux'",
    ],
    extras_require={
        "megatron": ["megatron-core==0.16.1; python_version < '3.12'",
                     "megatron-core>=0.19,<0.20; python_version >= '3.12'"],
        # TransformerEngine: tested with 2.20.0.dev0 (main d0067d0, docs/transformer_engine.md); its GroupedLinear
        # takes the blockwise FP8 recipe (Float8BlockScaling, the te_blockwise baseline and the interop tests) since 2.18
        "te": ["transformer-engine[pytorch]>=2.18"],
        # DeepGEMM's grouped FP8 GEMMs (backend "deepgemm", Hopper): module deep_gemm, built from source
        # at install time (needs the CUDA toolkit); "auto" uses it when it imports.
        "deepgemm": ["deepinfer-gemm>=2.8.2"],
        "test": ["pytest", "triton==3.6.0; platform_system == 'Linux'"],
    },
)
