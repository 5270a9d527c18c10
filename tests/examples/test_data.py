"""examples/data.py: the standard library's bytes as Megatron-style samples (fixed shuffled window order)."""

import pytest
import torch

from examples.data import ByteStream, StdlibBytesDataset, stdlib_bytes

SEQ = 8


def _marked_corpus(windows):
    """A corpus whose window ``w`` (bytes ``w*SEQ .. w*SEQ+SEQ-1``) holds the byte ``w % 256``, plus one byte."""
    return torch.cat([torch.arange(windows).repeat_interleave(SEQ), torch.zeros(1, dtype=torch.int64)]).to(torch.uint8)


def test_samples_are_every_window_once_then_wrap():
    stream = ByteStream(_marked_corpus(200), SEQ)
    tokens, labels = stream.batch(0, 400)
    first = tokens[:, 0].tolist()
    assert sorted(first[:200]) == list(range(200)) and first[200:] == first[:200]
    assert torch.equal(tokens[:, 1:], labels[:, :-1])  # labels: the next byte
    assert all(len(set(row)) == 1 for row in tokens.tolist())  # each sample one whole window


def test_order_is_shuffled_and_the_same_on_every_build():
    a, b = ByteStream(_marked_corpus(200), SEQ), ByteStream(_marked_corpus(200), SEQ)
    assert torch.equal(a.order, b.order)
    first = a.batch(0, 20)[0][:, 0]
    assert first.tolist() != list(range(20))
    assert first.max() - first.min() > 100  # the first tenth of the samples spans most of the corpus


def test_splits_are_disjoint_and_alike():
    """Train, valid and test as megatron_data builds them (consecutive sample ranges) share no window, and
    each draws from the whole corpus (sorted files in order would give each split its own packages)."""
    stream = ByteStream(_marked_corpus(200), SEQ)
    sizes = (150, 30, 20)
    offsets = (0, 150, 180)
    splits = [StdlibBytesDataset(stream, o, n) for o, n in zip(offsets, sizes)]
    windows = [{int(s[i]["tokens"][0]) for i in range(len(s))} for s in splits]
    assert [len(w) for w in windows] == list(sizes)
    assert not (windows[0] & windows[1] or windows[0] & windows[2] or windows[1] & windows[2])
    assert min(max(w) - min(w) for w in windows) > 100
    sample = splits[1][0]
    assert sample["loss_mask"].dtype == torch.float32 and torch.equal(sample["position_ids"], torch.arange(SEQ))


def test_standard_library_stream_reads_real_source():
    stream = ByteStream(stdlib_bytes(1 << 16), 256)
    tokens, _ = stream.batch(0, 4)
    assert tokens.shape == (4, 256) and tokens.dtype == torch.int64 and tokens.max() < 256


@pytest.mark.parametrize("seq_length", [0, -4, 2.0, True])
def test_bad_sequence_lengths_are_named(seq_length):
    with pytest.raises(ValueError, match=f"seq_length must be a positive int, got {seq_length!r}"):
        ByteStream(_marked_corpus(20), seq_length)


def test_a_corpus_shorter_than_a_window_is_named():
    with pytest.raises(ValueError, match="too short for seq_length 8"):
        ByteStream(torch.zeros(8, dtype=torch.uint8), SEQ)
