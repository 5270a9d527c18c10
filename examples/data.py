"""Real text on every machine: the Python standard library's ``.py`` files as byte tokens.

The default data of ``examples.pretrain_gpt`` when no data argument is given (``megatron_data``
handles Megatron's). Tokens are bytes (vocabulary 256, no tokenizer). Files are read in sorted path
order and joined by a NUL byte (absent from source text) up to ``max_bytes`` and cut into windows of
``seq_length`` bytes; sample ``i`` of the stream is window ``order[i % windows]``, ``order`` a permutation
drawn once from the fixed ``SHUFFLE_SEED`` (as Megatron's ``GPTDataset`` shuffles its samples, but the same
for every ``--seed``: runs that differ in their seed see the same batches). Consecutive samples therefore
come from all over the corpus, and the splits (consecutive ranges of samples) are alike: sorted files in
order would train on one package after another and evaluate on the next, so the last hundred iterations
(a run of encoding tables, say) would decide the evaluation. The stream is the same on every machine with
the same Python and does not depend on the number of ranks.
"""

import pathlib
import random
import sysconfig

import torch

VOCAB_SIZE = 256
TEXT_MAX_BYTES = 8 << 20  # the compact loop's default --text-max-bytes
SHUFFLE_SEED = 1234  # the window order's (Python's ``random``: the same order on every machine)


def stdlib_bytes(max_bytes: int) -> torch.Tensor:
    """``[N]`` uint8, N <= max_bytes: the standard library's sources, NUL-separated."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive (got {max_bytes})")
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes() + b"\0"
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class ByteStream:
    """Deterministic ``[batch, seq_length]`` token / label windows over ``corpus``, in a fixed shuffled order.

    ``batch(first, count)`` returns samples ``first .. first+count-1`` (sample ``i``: the window starting at
    byte ``order[i % windows] * seq_length``): tokens ``int64 [count, seq_length]`` and labels (the next byte)
    of the same shape.
    """

    def __init__(self, corpus: torch.Tensor, seq_length: int):
        if not isinstance(seq_length, int) or isinstance(seq_length, bool) or seq_length < 1:
            raise ValueError(f"seq_length must be a positive int, got {seq_length!r}")
        if corpus.numel() <= seq_length + 1:
            raise ValueError(f"corpus of {corpus.numel()} bytes is too short for seq_length "
                             f"{seq_length}")
        self.corpus = corpus
        self.seq_length = seq_length
        self.windows = (corpus.numel() - 1) // seq_length
        order = list(range(self.windows))
        random.Random(SHUFFLE_SEED).shuffle(order)
        self.order = torch.tensor(order)

    def batch(self, first: int, count: int):
        starts = self.order[torch.arange(first, first + count) % self.windows] * self.seq_length
        index = starts[:, None] + torch.arange(self.seq_length + 1)
        window = self.corpus[index].long()
        return window[:, :-1], window[:, 1:]


class StdlibBytesDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of a ``ByteStream`` from sample ``offset``, as Megatron's GPT datasets
    return samples: ``tokens``, ``labels`` int64, ``loss_mask`` float32 (ones), ``position_ids`` int64,
    each ``[seq_length]``."""

    def __init__(self, stream: ByteStream, offset: int, num_samples: int):
        self.stream, self.offset, self.num_samples = stream, offset, num_samples

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        tokens, labels = self.stream.batch(self.offset + index, 1)
        return {"tokens": tokens[0], "labels": labels[0], "loss_mask": torch.ones(tokens.shape[1]),
                "position_ids": torch.arange(tokens.shape[1])}
