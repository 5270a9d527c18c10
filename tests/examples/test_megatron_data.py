"""Megatron's data arguments in ``examples.pretrain_gpt``: an indexed dataset built with megatron-core's
``IndexedDatasetBuilder`` from the standard library's sources (text on every machine) trained on for 2 steps
with ``--data-path``; ``--mock-data`` through ``MockGPTDataset``; the standard library's bytes only without
data arguments, and the log saying so; clashing or unread data arguments refused by name."""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

import argparse
import json
import pathlib
import sysconfig

import numpy as np
import torch

from conftest import TINY_GPT_ARGS, compact_loop_only
from examples import pretrain_gpt
from examples.compact_loop import parse_args
from examples.megatron_data import data_source, train_valid_test_datasets

pytestmark = compact_loop_only

MODEL = TINY_GPT_ARGS
FILES = 40  # standard-library files in the indexed dataset, one document each


def _stdlib_files():
    return sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:FILES]


@pytest.fixture(scope="module")
def indexed_prefix(tmp_path_factory):
    """``<prefix>.bin`` / ``.idx``: the byte tokens of FILES standard-library sources, one document each."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("indexed") / "stdlib_bytes")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for path in _stdlib_files():
        tokens = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
        builder.add_document(tokens, [tokens.numel()])
    builder.finalize(f"{prefix}.idx")
    return prefix


def test_indexed_dataset_samples_are_the_files_bytes(indexed_prefix):
    args = parse_args(MODEL + ["--data-path", indexed_prefix, "--split", "90,10,0"])
    (train, valid, test), vocab, described = train_valid_test_datasets(args, [8, 2, 0], text_max_bytes=1)
    assert type(train).__name__ == "GPTDataset" and test is None and len(train) >= 8
    assert "GPTDataset" in described and "NullTokenizer" in described
    assert vocab == 384  # NullTokenizer(256): 256 bytes + EOD, padded to a multiple of 128
    corpus = b"\0".join(p.read_bytes() for p in _stdlib_files())
    sample = train[0]
    assert set(sample) >= {"tokens", "labels", "loss_mask", "position_ids"}
    text = bytes(t for t in sample["tokens"][:32].tolist() if t < 256)
    assert len(text) >= 16 and text[:16] in corpus


def test_two_steps_on_an_indexed_dataset(indexed_prefix, tmp_path, capsys):
    pretrain_gpt.main(MODEL + ["--data-path", indexed_prefix, "--split", "90,10,0",
                               "--summary-json", str(tmp_path / "s.json")])
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["steps"] == 2 and all(4.0 < loss < 7.0 for loss in summary["loss_curve"])
    assert summary["data"].startswith("data: megatron-core GPTDataset")
    assert summary["data"] in capsys.readouterr().out


def test_mock_data_is_megatrons_mock_dataset():
    args = parse_args(MODEL + ["--mock-data", "--vocab-size", "1000"])
    (train, _, _), vocab, described = train_valid_test_datasets(args, [4, 0, 0], text_max_bytes=1)
    assert type(train).__name__ == "MockGPTDataset" and "synthetic" in described
    assert vocab == 1024 and int(train[0]["tokens"].max()) <= 1000


def test_standard_library_bytes_only_without_data_arguments():
    args = parse_args(MODEL)
    assert data_source(args) == "stdlib"
    (train, _, _), vocab, described = train_valid_test_datasets(args, [4, 0, 0], text_max_bytes=100_000)
    assert vocab == 256 and len(train) == 4
    assert described.startswith("data: no --data-path or --mock-data given: the Python standard library")


@pytest.mark.parametrize("extra, message", [
    (["--data-path", "x", "--mock-data"], "--mock-data with --data-path ['x']: choose one"),
    (["--data-path", "x", "--train-data-path", "y"], "--data-path and --train/valid/test-data-path exclude"),
], ids=["mock-and-path", "path-and-per-split"])
def test_clashing_data_arguments_are_named(extra, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(MODEL + extra)
    assert message in capsys.readouterr().err


def test_unread_megatron_data_arguments_are_named():
    """Megatron's parser (megatron.training) accepts these; the example refuses them rather than ignore them."""
    args = argparse.Namespace(data_path=None, mock_data=False, data_args_path="blend.txt", reset_attention_mask=True)
    with pytest.raises(ValueError, match="does not read --data-args-path, --reset-attention-mask"):
        data_source(args)


@pytest.mark.parametrize("extra, message", [
    (["--split", "90,10,0"], "the data here is the standard library's bytes (no data argument given), so these flags "
                             "would do nothing: --split (read only with --mock-data or --data-path"),
    (["--vocab-size", "1000", "--eod-mask-loss"], "would do nothing: --eod-mask-loss (read only with --mock-data or "
                                                  "--data-path or --train/valid/test-data-path); --vocab-size"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type (read only with --mock-data"),
    (["--mock-data", "--no-mmap-bin-files"], "the data here is --mock-data, so these flags would do nothing: "
                                             "--no-mmap-bin-files (read only with --data-path"),
    (["--mock-data", "--text-max-bytes", "5"], "--text-max-bytes (read only with the standard library's bytes"),
    (["--data-path", "PREFIX", "--text-max-bytes", "5"],
     "the data here is --data-path or --train/valid/test-data-path, so these flags would do nothing: --text-max-bytes"),
    (["--train-data-path", "PREFIX", "--split", "90,10,0"], "--split 90,10,0 divides --data-path; with "
                                                            "--train/valid/test-data-path it would do nothing"),
], ids=["split", "tokenizer-and-loss", "tokenizer-type", "mmap", "text-bytes-mock", "text-bytes-indexed",
        "split-per-split"])
def test_data_flags_the_chosen_data_ignores_are_named(indexed_prefix, extra, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(MODEL + [indexed_prefix if a == "PREFIX" else a for a in extra])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--data-path", "/nonexistent/corpus"], "--data-path: no indexed dataset at prefix '/nonexistent/corpus': "
                                             "/nonexistent/corpus.bin and /nonexistent/corpus.idx not found"),
    (["--data-path"], "--data-path needs at least one dataset prefix (or weight-prefix pairs), got none"),
    (["--data-path", "0.5", "PREFIX", "-0.5", "PREFIX"], "--data-path: the blend weights must be positive and finite, "
                                                          "got [0.5, -0.5]"),
    (["--train-data-path", "/nonexistent/corpus"], "--train-data-path: no indexed dataset at prefix"),
    (["--train-data-path", "PREFIX", "--valid-data-path", "PREFIX"],
     "--valid-data-path: the compact loop trains without evaluating"),
], ids=["missing", "empty", "negative-weight", "missing-per-split", "valid-in-compact-loop"])
def test_missing_or_unused_data_paths_are_named_before_anything_is_built(indexed_prefix, extra, message, capsys):
    """A prefix without its files was an AssertionError deep in megatron-core's builder (plus an AttributeError in
    IndexedDataset.__del__); an empty --data-path trained on the standard library's bytes."""
    with pytest.raises(SystemExit):
        parse_args(MODEL + [indexed_prefix if a == "PREFIX" else a for a in extra])
    assert message in capsys.readouterr().err


def test_per_split_paths_need_the_training_one():
    args = argparse.Namespace(data_path=None, train_data_path=None, valid_data_path=["x"], test_data_path=None,
                              mock_data=False)
    with pytest.raises(ValueError, match="--valid-data-path / --test-data-path need --train-data-path"):
        data_source(args)


def test_standard_library_vocabulary_is_padded_as_megatron_pads():
    args = parse_args(MODEL + ["--make-vocab-size-divisible-by", "7"])
    _, vocab, described = train_valid_test_datasets(args, [1, 0, 0], text_max_bytes=10_000)
    assert vocab == 259 and "vocabulary 256, embedding 259" in described
