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
