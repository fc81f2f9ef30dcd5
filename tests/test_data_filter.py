"""OLMo's repeated n-gram filter: 31 repeats pass, 32 are rejected."""

import numpy as np
import pytest

from olmo3eqx.data.filters import NGRAM_MAX_PERIOD, NGRAM_MAX_REPEATS, repeated_ngram_mask

SEQ = 8192


def with_repeats(period, repeats, at=1000, seed=0):
    """Random tokens with `repeats` back-to-back copies of a `period`-token pattern planted at `at`."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50000, SEQ).astype(np.int32)
    tokens[at:at + period * repeats] = np.tile(np.arange(60000, 60000 + period), repeats)
    return tokens


@pytest.mark.parametrize("period", [1, 2, 7, NGRAM_MAX_PERIOD])
def test_threshold(period):
    batch = np.stack([with_repeats(period, NGRAM_MAX_REPEATS - 1), with_repeats(period, NGRAM_MAX_REPEATS)])
    assert repeated_ngram_mask(batch).tolist() == [False, True]


def test_edges_and_partial_repeat():
    """A run touching either end of the instance is seen; a partial 32nd copy does not count."""
    assert repeated_ngram_mask(with_repeats(13, 32, at=0)[None])[0]
    assert repeated_ngram_mask(with_repeats(13, 32, at=SEQ - 13 * 32)[None])[0]
    tokens = with_repeats(13, 31)
    tokens[1000 + 13 * 31:1000 + 13 * 32 - 1] = np.arange(60000, 60012)
    assert not repeated_ngram_mask(tokens[None])[0]


def test_longer_periods_are_not_looked_for():
    assert not repeated_ngram_mask(with_repeats(NGRAM_MAX_PERIOD + 1, 40)[None])[0]


def test_ordinary_text_passes():
    words = "the of and data model loss batch token shard epoch a an is was training held out".split()
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(words, 20000)).encode()
    tokens = np.frombuffer(text, np.uint8)[: 4 * SEQ].astype(np.int32).reshape(4, SEQ)
    assert not repeated_ngram_mask(tokens).any()
    assert not repeated_ngram_mask(rng.integers(0, 258, (4, SEQ))).any()


def test_short_instances():
    assert repeated_ngram_mask(np.zeros((2, 32), np.int32)).tolist() == [True, True]
    assert repeated_ngram_mask(np.zeros((2, 31), np.int32)).tolist() == [False, False]
