"""Megatron's data arguments for ``examples.pretrain_gpt``: indexed datasets, mock data, tokenizers.

The data comes from the arguments given (Megatron-LM's names, parsed by Megatron's parser with
``megatron.training`` or by ``add_data_args`` in the compact loop):

- ``--data-path`` (a prefix, prefixes, or weight-prefix pairs; ``--split``) or ``--train-data-path`` /
  ``--valid-data-path`` / ``--test-data-path``: megatron-core's ``GPTDataset`` over indexed datasets
  (``<prefix>.bin`` / ``.idx``) through ``BlendedMegatronDatasetBuilder``;
- ``--mock-data``: ``MockGPTDataset`` (synthetic token ramps);
- none of them: the standard library's bytes (``data.StdlibBytesDataset``, vocabulary 256).

Tokenizers: megatron-core's ``build_tokenizer`` for ``--tokenizer-type`` and friends (0.16:
``tokenizers.text.utils``, 0.19: ``tokenizers.utils``); the default is ``NullTokenizer`` with
``--vocab-size 256``. Every sample is a dict of ``[seq_length]`` tensors: ``tokens``, ``labels``
int64, ``loss_mask`` float32, ``position_ids`` int64.
"""

from __future__ import annotations

import argparse
from typing import Callable

from .data import VOCAB_SIZE, ByteStream, StdlibBytesDataset, stdlib_bytes

STDLIB, MOCK, INDEXED = "stdlib", "mock", "indexed"
SPLITS = ("train", "valid", "test")
DEFAULT_SPLIT = "969,30,1"  # Megatron-LM's default train/valid/test weights
# Megatron-LM data arguments this example does not read: refused by name rather than ignored.
_UNREAD = ("data_args_path", "per_split_data_args_path", "reset_attention_mask")


def add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's data and tokenizer flags that ``train_valid_test_datasets`` reads (the compact loop's
    parser; Megatron's own parser has them all)."""
    g = parser.add_argument_group("data (Megatron-LM's flags; none given: the standard library's bytes)")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", default=None, help=f"train,valid,test weights (default {DEFAULT_SPLIT})")
    for split in SPLITS:
        g.add_argument(f"--{split}-data-path", nargs="*", default=None)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g = parser.add_argument_group("tokenizer (Megatron-LM's flags)")
    g.add_argument("--tokenizer-type", default="NullTokenizer")
    g.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    for name in ("--tokenizer-model", "--vocab-file", "--merge-file", "--tokenizer-metadata", "--tiktoken-pattern"):
        g.add_argument(name, default=None)
    g.add_argument("--tokenizer-special-tokens", nargs="+", default=None)
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    for name in ("--tokenizer-sentencepiece-legacy", "--tokenizer-hf-use-fast",
                 "--tokenizer-hf-include-special-tokens", "--trust-remote-code"):
        g.add_argument(name, action="store_true")
    return parser


def data_source(args) -> str:
    """``INDEXED``, ``MOCK`` or ``STDLIB`` (no data argument given); ValueError for arguments that clash
    or that this example does not read."""
    unread = [f"--{n.replace('_', '-')}" for n in _UNREAD if getattr(args, n, None)]
    if unread:
        raise ValueError(f"examples.pretrain_gpt does not read {', '.join(unread)} (it builds no attention "
                         "masks and takes data paths from --data-path or --train/valid/test-data-path)")
    per_split = any(getattr(args, f"{s}_data_path", None) for s in SPLITS)
    if args.data_path and per_split:
        raise ValueError("--data-path and --train/valid/test-data-path exclude each other: give one")
    indexed = bool(args.data_path) or per_split
    if indexed and args.mock_data:
        raise ValueError(f"--mock-data with --data-path {args.data_path}: choose one data source")
    return INDEXED if indexed else MOCK if args.mock_data else STDLIB


def build_tokenizer(args):
    """megatron-core's tokenizer for Megatron-LM's tokenizer arguments."""
    try:  # megatron-core 0.19
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as build
    except ImportError:  # 0.16
        from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as build
    return build(args)


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Megatron's embedding size without tensor parallelism: ``vocab_size`` rounded up to a multiple of
    ``divisible_by``."""
    return -(-vocab_size // divisible_by) * divisible_by


def gpt_dataset_config(args, tokenizer):
    """``GPTDatasetConfig`` from Megatron-LM's arguments (the fields Megatron-LM's ``pretrain_gpt.py`` sets
    that both megatron-core 0.16 and 0.19 have); no attention mask (causal)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    per_split = [getattr(args, f"{s}_data_path", None) for s in SPLITS]
    blend_per_split = [get_blend_from_list(p) for p in per_split] if any(per_split) else None
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=get_blend_from_list(args.data_path),
        blend_per_split=blend_per_split, split=None if blend_per_split else args.split or DEFAULT_SPLIT,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=False,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=False)


def train_valid_test_datasets(args, num_samples, text_max_bytes: int,
                              is_built_on_rank: Callable[[], bool] = lambda: True):
    """``((train, valid, test), vocab_size, description)`` for ``num_samples`` = [train, valid, test]
    sample counts: the datasets (None for a split of 0 samples or one Megatron leaves empty), the
    vocabulary the model needs (256 for the standard library's bytes, else the tokenizer's padded by
    ``--make-vocab-size-divisible-by``) and a line for the log saying which data it is."""
    source = data_source(args)
    if source == STDLIB:
        stream = ByteStream(stdlib_bytes(text_max_bytes), args.seq_length)
        offsets = (0, num_samples[0], num_samples[0] + num_samples[1])
        datasets = tuple(StdlibBytesDataset(stream, o, n) if n else None for o, n in zip(offsets, num_samples))
        return datasets, VOCAB_SIZE, (
            "data: no --data-path or --mock-data given: the Python standard library's sources as byte "
            f"tokens (vocabulary {VOCAB_SIZE}, {stream.corpus.numel():,} bytes; examples/data.py)")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    tokenizer = build_tokenizer(args)
    config = gpt_dataset_config(args, tokenizer)
    cls = MockGPTDataset if source == MOCK else GPTDataset
    datasets = BlendedMegatronDatasetBuilder(cls, list(num_samples), is_built_on_rank, config).build()
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by)
    where = "synthetic" if source == MOCK else (
        f"blend {config.blend}, split {config.split}" if config.blend else f"per split {config.blend_per_split}")
    return tuple(datasets), vocab, (f"data: megatron-core {cls.__name__} ({where}), tokenizer {args.tokenizer_type} "
                                    f"(vocabulary {tokenizer.vocab_size}, embedding {vocab})")
