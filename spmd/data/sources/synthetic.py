"""Synthetic datasets that are pure functions of (seed, step, row).

Each example has its own generator seeded by (seed, step, global row), so a
process that owns rows [start, stop) produces exactly those, whatever the process
count, and a resumed run regenerates the same batches.
"""

from __future__ import annotations

import numpy as np


def row_rng(seed: int, step: int, row: int, stream: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, stream, step, row])


class ArithmeticTokens:
    """Token sequences x_t = (start + t * stride) mod vocab: learnable next-token data."""

    def __init__(self, seed: int, batch_size: int, seq_len: int, vocab_size: int,
                 max_stride: int = 7, stream: int = 0):
        self.seed, self.batch_size = seed, batch_size
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.max_stride, self.stream = max_stride, stream

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        seqs = np.empty((stop - start, self.seq_len + 1), dtype=np.int32)
        t = np.arange(self.seq_len + 1)
        for i, row in enumerate(range(start, stop)):
            rng = row_rng(self.seed, step, row, self.stream)
            first = rng.integers(self.vocab_size)
            stride = rng.integers(1, self.max_stride + 1)
            seqs[i] = (first + t * stride) % self.vocab_size
        return {"inputs": seqs[:, :-1], "targets": seqs[:, 1:]}


class TeacherRegression:
    """y = sin(x @ W) for x ~ N(0, 1) and a fixed teacher W drawn from the seed."""

    def __init__(self, seed: int, d_in: int, d_out: int, stream: int = 0):
        self.seed, self.d_in, self.stream = seed, d_in, stream
        teacher = np.random.default_rng([seed, 999_999])
        self.weights = teacher.normal(size=(d_in, d_out)).astype(np.float32) / np.sqrt(d_in)

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        x = np.stack([
            row_rng(self.seed, step, row, self.stream).normal(size=self.d_in)
            for row in range(start, stop)
        ]).astype(np.float32)
        return {"inputs": x, "targets": np.sin(x @ self.weights).astype(np.float32)}
