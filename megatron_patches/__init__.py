"""Megatron-core integration for FP8-Flow-MoE.

Users with their own ``pretrain_gpt.py`` add one line before Megatron parses its arguments::

    import megatron_patches; megatron_patches.apply()

and pass ``extra_args_provider=megatron_patches.arguments.add_fp8_flow_args`` and their layer spec
through ``megatron_patches.experts.fp8_flow_layer_spec(spec, config)``, or run
``python -m megatron_patches.pretrain_gpt <Megatron args>``, which does all three.

Modules: ``config`` (TransformerConfig fields and validation), ``arguments`` (flags),
``settings`` (the rules both share), ``cpu_shims`` (CPU-only torch), ``experts`` (the expert and
dispatcher swap), ``pretrain_gpt`` (entry point), ``compact_loop`` and ``data`` (the CPU loop).
"""


def apply() -> str:
    """Patch megatron-core for FP8-Flow; idempotent. Returns the megatron-core version.

    Checks the version (RuntimeError outside 0.16.1 / 0.19.x), makes ``TransformerConfig``
    accept ``moe_fp8_flow`` and ``recompute_modules`` 'moe_expert' with validation, makes
    ``set_is_first_microbatch`` reach the FP8-Flow layers (``experts.patch_set_is_first_microbatch``),
    and on a machine without CUDA installs ``cpu_shims``.
    """
    from .config import megatron_core_version, patch_transformer_config
    from .cpu_shims import apply_cpu_shims
    from .experts import patch_set_is_first_microbatch

    version = megatron_core_version()
    patch_transformer_config()
    patch_set_is_first_microbatch()
    apply_cpu_shims()
    return version
