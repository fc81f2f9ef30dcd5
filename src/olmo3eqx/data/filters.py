"""OLMo's repeated n-gram instance filter, vectorised over a batch of instances."""

from __future__ import annotations

import numpy as np
from jaxtyping import Bool, Int

NGRAM_MAX_PERIOD = 13
"""Longest repeating pattern looked for, in tokens (OLMo's repetition_max_period)."""
NGRAM_MAX_REPEATS = 32
"""A pattern repeated back to back this many times rejects the instance (OLMo's repetition_max_count)."""


def repeated_ngram_mask(tokens: Int[np.ndarray, "b s"], max_period: int = NGRAM_MAX_PERIOD,
                        max_repeats: int = NGRAM_MAX_REPEATS) -> Bool[np.ndarray, " b"]:
    """True for each instance holding a pattern of 1..max_period tokens repeated max_repeats or more times
    back to back (31 repeats of a 13-token pattern pass, 32 are rejected).

    A pattern of period p repeated r times is a run where tokens[i] == tokens[i + p] for (r - 1) * p
    consecutive i. Such a run of length L covers a whole aligned block of (L + 1) // 2 positions, so blocks
    screen the rows cheaply; only rows with an all-equal block get the exact check, a cumulative sum.
    """
    b, s = tokens.shape
    reject = np.zeros(b, bool)
    for p in range(1, max_period + 1):
        run = (max_repeats - 1) * p
        if run > s - p:
            break
        equal = tokens[:, p:] == tokens[:, :-p]
        block = (run + 1) // 2
        blocks = (s - p) // block
        rows = np.flatnonzero(~reject & equal[:, :blocks * block].reshape(b, blocks, block).all(axis=2).any(axis=1))
        if rows.size == 0:
            continue
        misses = np.zeros((rows.size, s - p + 1), np.int32)
        np.cumsum(~equal[rows], axis=1, out=misses[:, 1:])
        # A window of `run` positions with no mismatch: the cumulative count does not move across it.
        reject[rows] = (misses[:, run:] == misses[:, :-run]).any(axis=1)
    return reject
