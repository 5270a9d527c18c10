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
import math
import os
from typing import Callable

from megatron_patches.arguments import flag

from .data import TEXT_MAX_BYTES, VOCAB_SIZE, ByteStream, StdlibBytesDataset, stdlib_bytes

STDLIB, MOCK, INDEXED = "stdlib", "mock", "indexed"
SPLITS = ("train", "valid", "test")
DEFAULT_SPLIT = "969,30,1"  # Megatron-LM's default train/valid/test weights
# Megatron-LM data arguments this example does not read: refused by name rather than ignored.
_UNREAD = ("data_args_path", "per_split_data_args_path", "reset_attention_mask")
_TOKENIZED = (MOCK, INDEXED)
# This example's data, tokenizer and loss flags -> (their value when not given: add_data_args' default, and Megatron's
# parser's with megatron_pretrain's args_defaults; the data sources that read them). One given with another source
# would do nothing (the standard library's bytes are their own tokens, vocabulary 256): refused by name. A flag the
# parser lacks (another Megatron version's name) counts as not given.
_READ_BY = {
    "split": (None, _TOKENIZED),
    "data_cache_path": (None, _TOKENIZED),
    "mmap_bin_files": (True, (INDEXED,)),
    "reset_position_ids": (False, _TOKENIZED),
    "eod_mask_loss": (False, _TOKENIZED),
    "tokenizer_type": ("NullTokenizer", _TOKENIZED),
    "vocab_size": (VOCAB_SIZE, _TOKENIZED),
    **{name: (None, _TOKENIZED) for name in ("tokenizer_model", "vocab_file", "merge_file", "tokenizer_metadata",
                                             "tiktoken_pattern", "tokenizer_special_tokens")},
    "tiktoken_num_special_tokens": (1000, _TOKENIZED),
    **{name: (False, _TOKENIZED) for name in ("tokenizer_sentencepiece_legacy", "tokenizer_hf_use_fast",
                                              "tokenizer_hf_include_special_tokens", "trust_remote_code")},
    "text_max_bytes": (TEXT_MAX_BYTES, (STDLIB,)),
}
_SOURCE_FLAGS = {STDLIB: "the standard library's bytes (no data argument given)", MOCK: "--mock-data",
                 INDEXED: "--data-path or --train/valid/test-data-path"}


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
    g.add_argument("--tokenizer-type", default=_READ_BY["tokenizer_type"][0])
    g.add_argument("--vocab-size", type=int, default=_READ_BY["vocab_size"][0])
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    for name in ("--tokenizer-model", "--vocab-file", "--merge-file", "--tokenizer-metadata", "--tiktoken-pattern"):
        g.add_argument(name, default=None)
    g.add_argument("--tokenizer-special-tokens", nargs="+", default=None)
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=_READ_BY["tiktoken_num_special_tokens"][0])
    for name in ("--tokenizer-sentencepiece-legacy", "--tokenizer-hf-use-fast",
                 "--tokenizer-hf-include-special-tokens", "--trust-remote-code"):
        g.add_argument(name, action="store_true")
    return parser


def data_source(args) -> str:
    """``INDEXED``, ``MOCK`` or ``STDLIB`` (no data argument given); ValueError, before anything is built, for
    arguments that clash, that this example does not read, that the chosen data ignores (``_READ_BY``), an empty
    data path, or a dataset prefix without its ``.bin`` / ``.idx`` files."""
    unread = [flag(n) for n in _UNREAD if getattr(args, n, None)]
    if unread:
        raise ValueError(f"examples.pretrain_gpt does not read {', '.join(unread)} (it builds no attention "
                         "masks and takes data paths from --data-path or --train/valid/test-data-path)")
    data_path = getattr(args, "data_path", None)
    paths = {f"--{s}-data-path": getattr(args, f"{s}_data_path", None) for s in SPLITS}
    per_split = any(p is not None for p in paths.values())
    if data_path is not None and per_split:
        raise ValueError("--data-path and --train/valid/test-data-path exclude each other: give one")
    indexed = data_path is not None or per_split
    if indexed and args.mock_data:
        given = f"--data-path {data_path}" if data_path is not None else "--train/valid/test-data-path"
        raise ValueError(f"--mock-data with {given}: choose one data source")
    source = INDEXED if indexed else MOCK if args.mock_data else STDLIB
    ignored = [n for n, (unset, read_by) in _READ_BY.items()
               if source not in read_by and getattr(args, n, unset) != unset]
    if ignored:
        raise ValueError(f"the data here is {_SOURCE_FLAGS[source]}, so these flags would do nothing: " + "; ".join(
            f"{flag(n)} (read only with {' or '.join(_SOURCE_FLAGS[s] for s in _READ_BY[n][1])})" for n in ignored))
    if per_split:
        if paths["--train-data-path"] is None:
            raise ValueError("--valid-data-path / --test-data-path need --train-data-path: training reads it")
        if getattr(args, "split", None) is not None:
            raise ValueError(f"--split {args.split} divides --data-path; with --train/valid/test-data-path it would "
                             "do nothing")
    for option, blend in ({"--data-path": data_path} if data_path is not None else paths).items():
        if blend is not None:
            _check_blend(option, blend)
    return source


def _check_blend(option: str, blend: list) -> None:
    """``blend`` (a data-path flag's prefixes, or weight-prefix pairs, as megatron-core parses them) names
    indexed datasets that exist: ValueError naming ``option`` otherwise (megatron-core asserts deep in the dataset
    builder). Object-storage prefixes (``scheme://``) are left to megatron-core."""
    from megatron.core.datasets.utils import get_blend_from_list

    if not blend:
        raise ValueError(f"{option} needs at least one dataset prefix (or weight-prefix pairs), got none")
    prefixes, weights = get_blend_from_list(blend)
    if weights is not None and not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"{option}: the blend weights must be positive and finite, got {weights}")
    for prefix in prefixes:
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if "://" not in prefix and missing:
            raise ValueError(f"{option}: no indexed dataset at prefix {prefix!r}: {' and '.join(missing)} not found "
                             "(expected PREFIX.bin and PREFIX.idx, megatron-core's IndexedDatasetBuilder output)")


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
    vocabulary the model needs (the tokenizer's, or 256 for the standard library's bytes, padded by
    ``--make-vocab-size-divisible-by`` as Megatron pads it) and a line for the log saying which data it is."""
    source = data_source(args)
    if source == STDLIB:
        stream = ByteStream(stdlib_bytes(text_max_bytes), args.seq_length)
        offsets = (0, num_samples[0], num_samples[0] + num_samples[1])
        datasets = tuple(StdlibBytesDataset(stream, o, n) if n else None for o, n in zip(offsets, num_samples))
        vocab = padded_vocab_size(VOCAB_SIZE, args.make_vocab_size_divisible_by)
        return datasets, vocab, (
            "data: no --data-path or --mock-data given: the Python standard library's sources as byte "
            f"tokens (vocabulary {VOCAB_SIZE}, embedding {vocab}, {stream.corpus.numel():,} bytes; examples/data.py)")
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
