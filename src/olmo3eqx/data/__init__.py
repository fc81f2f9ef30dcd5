"""Token data: prepare (text -> token files), mixes (AI2's label,path mixes -> files), source (files -> instances),
order (global batch -> instance ids: ours or OLMo-core's), pipeline (grain -> batches), heldout (named held-out sets
and their instances).

Exports resolve lazily so `python -m olmo3eqx.data.prepare` (and its worker processes) skip grain and JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DataError": "olmo3eqx.data.source",
    "TokenSource": "olmo3eqx.data.source",
    "repeated_ngram_mask": "olmo3eqx.data.filters",
    "prepare": "olmo3eqx.data.prepare",
    "BYTE_EOS": "olmo3eqx.data.prepare",
    "BYTE_PAD": "olmo3eqx.data.prepare",
    "BYTE_VOCAB": "olmo3eqx.data.prepare",
    "default_corpus": "olmo3eqx.data.corpus",
    "resolve_mix": "olmo3eqx.data.mixes",
    "training_files": "olmo3eqx.data.pipeline",
    "heldout_files": "olmo3eqx.data.pipeline",
    "build_train_iterator": "olmo3eqx.data.pipeline",
    "TrainIterator": "olmo3eqx.data.pipeline",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
