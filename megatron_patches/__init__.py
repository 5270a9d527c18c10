"""Megatron-core integration for FP8-Flow-MoE.

Users with their own ``pretrain_gpt.py`` add one line before Megatron parses its arguments::

    import megatron_patches; megatron_patches.apply()

and pass ``extra_args_provider=megatron_patches.arguments.add_fp8_flow_args`` and their layer spec
through ``megatron_patches.experts.fp8_flow_layer_spec(spec, config)``, or run
``python -m examples.pretrain_gpt <Megatron args>`` from a checkout, which does all three.

Modules: ``config`` (TransformerConfig fields and validation), ``arguments`` (flags),
``settings`` (the rules both share), ``experts`` (the expert and dispatcher swap), ``cpu_shims``
(megatron-core on a CPU-only torch: process-wide replacements that only a CPU entry point installs,
by calling ``cpu_shims.apply_cpu_shims()`` itself; ``apply()`` never does).
"""


def apply() -> str:
    """Patch megatron-core for FP8-Flow; idempotent. Returns the megatron-core version.

    Checks the version (RuntimeError outside 0.16.1 / 0.19.x), makes ``TransformerConfig``
    accept ``moe_fp8_flow`` and ``recompute_modules`` 'moe_expert' with validation, makes
    ``set_is_first_microbatch`` reach the FP8-Flow layers (``experts.patch_set_is_first_microbatch``) and
    DDP's ``finish_grad_sync`` drop their cached FP8 weights before the optimizer step
    (``experts.patch_finish_grad_sync``).
    It patches megatron-core only: nothing in ``torch`` changes, with or without CUDA.
    """
    from .config import megatron_core_version, patch_transformer_config
    from .experts import patch_finish_grad_sync, patch_set_is_first_microbatch

    version = megatron_core_version()
    patch_transformer_config()
    patch_set_is_first_microbatch()
    patch_finish_grad_sync()
    return version
