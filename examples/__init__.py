"""Runnable examples of FP8-Flow with Megatron-core, run from a checkout (not installed).

``python -m examples.pretrain_gpt <Megatron args>``: GPT-MoE pretraining (Megatron's own ``pretrain``
where ``megatron.training`` exists, else ``compact_loop`` on the CPU); ``python -m examples.demo``: the
main job (``make demo``). ``data`` holds the default data (the standard library's bytes) and
``megatron_data`` Megatron's data arguments (indexed or mock datasets, tokenizers); ``megatron_log`` parses
a Megatron run's log lines (for the demo and ``benchmarks/bench_megatron_pretrain.py``).

These are the entry points that may change the process: ``compact_loop`` installs
``megatron_patches.cpu_shims`` on a machine without CUDA, and ``pretrain_gpt`` replaces Megatron's
host-synchronising multi-tensor fallbacks (used without TE or apex) by ``multi_tensor``'s; importing or
applying ``megatron_patches`` never does.
"""
