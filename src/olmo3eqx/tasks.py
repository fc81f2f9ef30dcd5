"""Downstream multiple-choice tasks by rank classification: task files, their tokenized requests, and the metrics
from each request's log-likelihood (scored by olmo3eqx.evaluator). Host-side only: nothing here runs on a device.

Tasks (`eval.tasks`): a JSONL file per task, one example per line:

    {"id": "arc-e-17", "context": "Question: ...\\nAnswer:", "continuations": [" a", " b", " c"], "gold": 1}

`context` is the whole prompt the model sees (few-shot examples included: render them into it when exporting,
or give them once in a first line `{"fewshot": "<text put before every context>"}`); `gold` indexes
`continuations`. Each continuation is scored by the summed log-likelihood of its tokens given the context
(context and continuation tokenized separately and concatenated; an empty context becomes EOS), left-truncated
to the model length. Metrics (OLMES): `acc` (argmax of the sum), `acc_per_char` (argmax of the sum divided by the
continuation's length in characters) and `bpb` (mean over examples of -log2 p(gold) / UTF-8 bytes of gold).
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jaxtyping import Float, Int

from olmo3eqx.config import ConfigError, parse_named
from olmo3eqx.data.prepare import encode_texts, tokenizer_info
from olmo3eqx.data.source import DataError

MIN_BUCKET = 16
"""Shortest padded request; buckets double from here up to the model length."""


class TaskError(DataError):
    """A task file that cannot be read; the message names the file, the line and the fix."""


def task_files(entries: Sequence[str]) -> dict[str, str]:
    """Task name -> JSONL path: 'name=path', or a bare path named after its file (arc_easy.jsonl -> arc_easy)."""
    out: dict[str, str] = {}
    for name, path in parse_named(entries, "eval.tasks"):
        path = os.path.expanduser(path)
        if not os.path.isfile(path):
            raise TaskError(f"Task file {path} does not exist; give JSONL files exported as described in "
                            f"olmo3eqx.tasks (context, continuations, gold, id).")
        name = name or Path(path).name.removesuffix(".gz").removesuffix(".jsonl")
        if name in out:
            raise ConfigError(f"Two eval.tasks are named {name!r}; name them apart with name=path.")
        out[name] = path
    return out


@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer spec ('bytes' or a tokenizer.json) as a text -> ids function, with its EOS."""

    spec: str
    eos_id: int
    vocab_size: int

    @staticmethod
    def load(spec: str) -> Tokenizer:
        info = tokenizer_info(spec)
        return Tokenizer(spec, info["eos_id"], info["vocab_size"])

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        if not texts:
            return []
        return [ids.astype(np.int32) for ids in encode_texts([t.encode("utf-8") for t in texts], self.spec)]


@dataclass(frozen=True)
class Example:
    id: str
    context: str
    continuations: tuple[str, ...]
    gold: int


def load_task(path: str | Path, limit: int = 0) -> list[Example]:
    """The examples of a task JSONL file (the first `limit` if positive), few-shot prefix applied."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    examples: list[Example] = []
    prefix = ""
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                raise TaskError(f"{where} is not valid JSON; each line must be one example object.") from None
            if not isinstance(d, dict):
                raise TaskError(f"{where} must be a JSON object.")
            if "continuations" not in d and "fewshot" in d:
                if examples or prefix:
                    raise TaskError(f"{where}: a {{\"fewshot\": ...}} line may only come first.")
                prefix = str(d["fewshot"])
                continue
            missing = [k for k in ("context", "continuations", "gold") if k not in d]
            if missing:
                raise TaskError(f"{where} lacks {missing}; an example needs context, continuations, gold (and id).")
            conts = d["continuations"]
            if (not isinstance(conts, list) or len(conts) < 2 or not all(isinstance(c, str) and c for c in conts)
                    or not isinstance(d["context"], str)):
                raise TaskError(f"{where}: context must be a string and continuations a list of two or more "
                                f"non-empty strings.")
            gold = d["gold"]
            if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(conts):
                raise TaskError(f"{where}: gold must be an index into continuations (0..{len(conts) - 1}), "
                                f"got {gold!r}.")
            examples.append(Example(str(d.get("id", lineno)), prefix + d["context"], tuple(conts), gold))
            if 0 < limit <= len(examples):
                break
    if not examples:
        raise TaskError(f"{path} holds no examples.")
    return examples


# --- requests -----------------------------------------------------------------------------------


def buckets(max_len: int) -> list[int]:
    """Padded lengths: powers of two from MIN_BUCKET below max_len, then max_len."""
    out, b = [], MIN_BUCKET
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


def build_request(context: Int[np.ndarray, " c"], continuation: Int[np.ndarray, " k"], *, max_len: int,
                  eos_id: int) -> tuple[Int[np.ndarray, " s"], Int[np.ndarray, " s"], int]:
    """(inputs, targets, scored): the last `scored` targets are the continuation. An empty context becomes EOS;
    the sequence is left-truncated so inputs fit max_len."""
    if len(continuation) == 0:
        raise TaskError("A continuation tokenized to nothing; every continuation needs at least one token.")
    if len(continuation) > max_len:
        raise TaskError(f"A continuation of {len(continuation)} tokens does not fit the model length {max_len}.")
    context = context if len(context) else np.asarray([eos_id])
    whole = np.concatenate([context, continuation]).astype(np.int32)[-(max_len + 1):]
    return whole[:-1], whole[1:], len(continuation)


def request_batches(requests: Sequence[tuple[np.ndarray, np.ndarray, int]], *, max_len: int, batch_size: int,
                    pad_id: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(request indices, tokens, targets, weights) of fixed-size batches, requests grouped by length bucket (longest
    first) and padded to the bucket: weights are 1 on the continuation's targets, 0 elsewhere; unused rows are
    padding."""
    sizes = buckets(max_len)
    lengths = np.asarray([len(r[0]) for r in requests])
    bucket_of = np.searchsorted(sizes, lengths)
    order = np.lexsort((-lengths, -bucket_of))
    for k in sorted(set(bucket_of.tolist()), reverse=True):
        idx = order[bucket_of[order] == k]
        length = sizes[k]
        for start in range(0, idx.size, batch_size):
            rows = idx[start:start + batch_size]
            tokens = np.full((batch_size, length), pad_id, np.int32)
            targets = np.zeros((batch_size, length), np.int32)
            weights = np.zeros((batch_size, length), np.float32)
            for row, i in enumerate(rows.tolist()):
                inp, tgt, scored = requests[i]
                tokens[row, :len(inp)], targets[row, :len(tgt)] = inp, tgt
                weights[row, len(tgt) - scored:len(tgt)] = 1.0
            yield rows, tokens, targets, weights


@dataclass(frozen=True)
class Task:
    """A task's examples with their requests tokenized (one per continuation, example by example)."""

    name: str
    examples: list[Example]
    requests: list[tuple[np.ndarray, np.ndarray, int]]

    @staticmethod
    def load(name: str, path: str, tokenizer: Tokenizer, *, max_len: int, vocab_size: int, limit: int = 0) -> Task:
        examples = load_task(path, limit)
        contexts = tokenizer.encode([e.context for e in examples])
        conts = tokenizer.encode([c for e in examples for c in e.continuations])
        top = max(int(x.max(initial=0)) for x in contexts + conts)
        if top >= vocab_size:
            raise TaskError(f"Task {name} ({path}) tokenized with {tokenizer.spec} has token id {top} >= the model's "
                            f"vocab_size {vocab_size}; set eval.tokenizer to the tokenizer the model was trained with.")
        requests, k = [], 0
        for e, ctx in zip(examples, contexts):
            for _ in e.continuations:
                try:
                    requests.append(build_request(ctx, conts[k], max_len=max_len, eos_id=tokenizer.eos_id))
                except TaskError as err:
                    raise TaskError(f"Task {name} example {e.id}: {err}") from None
                k += 1
        return Task(name, examples, requests)


def task_metrics(examples: Sequence[Example],
                 logprobs: Float[np.ndarray, " n"] | Sequence[float]) -> dict[str, float]:
    """acc, acc_per_char and bpb (of the gold continuation) from each continuation's summed log-likelihood,
    `logprobs` flattened example by example."""
    k, correct, correct_char, bpb = 0, 0, 0, 0.0
    for e in examples:
        ll = np.asarray(logprobs[k:k + len(e.continuations)], np.float64)
        k += len(e.continuations)
        chars = np.asarray([len(c) for c in e.continuations], np.float64)
        correct += int(np.argmax(ll) == e.gold)
        correct_char += int(np.argmax(ll / chars) == e.gold)
        bpb += -ll[e.gold] / (math.log(2) * len(e.continuations[e.gold].encode("utf-8")))
    n = len(examples)
    return {"acc": correct / n, "acc_per_char": correct_char / n, "bpb": bpb / n}
