"""Megatron-core integration for FP8-Flow-MoE (not built yet).

This package will hold ``apply()``, which patches megatron-core so that the
FP8-Flow settings (``moe_fp8_flow``, ``--recompute-modules moe_expert``) are
accepted by ``TransformerConfig`` and the argument parser, and swaps Megatron's
MoE experts and token dispatcher for this package's FP8-Flow ones. Until then
importing it does nothing; see the Megatron integration issue.
"""
