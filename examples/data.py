"""Real text on every machine: the Python standard library's ``.py`` files as byte tokens.

The default data of ``examples.pretrain_gpt`` when no data argument is given (``megatron_data``
handles Megatron's). Tokens are bytes (vocabulary 256, no tokenizer). Files are read in sorted path
order and joined by a NUL byte (absent from source text) up to ``max_bytes``; sample ``i`` of the
stream is the window starting at ``i * seq_length`` (wrapping), so the stream is the same on every
machine with the same Python and does not depend on the number of ranks.
"""

import pathlib
import sysconfig

import torch

VOCAB_SIZE = 256
TEXT_MAX_BYTES = 8 << 20  # the compact loop's default --text-max-bytes


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
    """Deterministic ``[batch, seq_length]`` token / label windows over ``corpus``.

    ``batch(first, count)`` returns samples ``first .. first+count-1``: tokens ``int64
    [count, seq_length]`` and labels (the next byte) of the same shape.
    """

    def __init__(self, corpus: torch.Tensor, seq_length: int):
        if corpus.numel() <= seq_length + 1:
            raise ValueError(f"corpus of {corpus.numel()} bytes is too short for seq_length "
                             f"{seq_length}")
        self.corpus = corpus
        self.seq_length = seq_length
        self.windows = (corpus.numel() - 1) // seq_length

    def batch(self, first: int, count: int):
        starts = (torch.arange(first, first + count) % self.windows) * self.seq_length
        index = starts[:, None] + torch.arange(self.seq_length + 1)
        window = self.corpus[index].long()
        return window[:, :-1], window[:, 1:]


class StdlibBytesDataset(torch.utils.data.Dataset):
    """``num_samples`` windows of a ``ByteStream`` from window ``offset``, as Megatron's GPT datasets
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
