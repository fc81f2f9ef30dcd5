"""Held-out LM loss on named token sets, and downstream multiple-choice tasks by rank classification.

Held-out sets (`eval.heldout`): each named set is a list of token files in OLMo's format. Its instances are
either `packed` (seq_len consecutive tokens, documents running into each other, as training sees them) or
`document` (OLMo's padded layout for its v3 small perplexity sets: every document, up to and including its
EOS, is its own instance, split every seq_len tokens and padded with the pad id, the padding not scored).
Loss is the token-weighted cross-entropy over every scored token of the set; ppl = exp(loss).

Tasks (`eval.tasks`): a JSONL file per task, one example per line:

    {"id": "arc-e-17", "context": "Question: ...\\nAnswer:", "continuations": [" a", " b", " c"], "gold": 1}

`context` is the whole prompt the model sees (few-shot examples included: render them into it when exporting,
or give them once in a first line `{"fewshot": "<text put before every context>"}`); `gold` indexes
`continuations`. Each continuation is scored by the summed log-likelihood of its tokens given the context
(context and continuation tokenized separately and concatenated; an empty context becomes EOS), left-truncated
to the model length. Metrics (OLMES): `acc` (argmax of the sum), `acc_per_char` (argmax of the sum divided by the
continuation's length in characters) and `bpb` (mean over examples of -log2 p(gold) / UTF-8 bytes of gold).

Everything runs jitted and sharded over the mesh's batch axes like the train step: held-out batches have the
fixed shape [batch_size, seq_len]; task sequences are padded to power-of-two length buckets, so a whole task
compiles at most log2(max_len) shapes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from glob import glob
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from olmo3eqx.config import ConfigError, DataConfig, EvalConfig
from olmo3eqx.data.prepare import _encode, tokenizer_info
from olmo3eqx.data.source import DataError, TokenSource, _check_ids, _file_dtype, expand_paths
from olmo3eqx.model import OLMo3
from olmo3eqx.sharding import batch_sharding
from olmo3eqx.loss import loss_sums, token_logprobs

DEFAULT_SET = "heldout"
"""Name of the held-out set used when eval.heldout names none (data.heldout_paths or the default corpus's)."""
MIN_BUCKET = 16
"""Shortest padded task sequence; buckets double from here up to the model length."""


class TaskError(DataError):
    """A task file that cannot be read; the message names the file, the line and the fix."""


# --- naming sets and tasks ------------------------------------------------------------------------


def parse_named(entries: Sequence[str], what: str) -> list[tuple[str | None, str]]:
    """'name=pattern' -> (name, pattern); a bare 'pattern' -> (None, pattern)."""
    out = []
    for entry in entries:
        name, sep, pattern = entry.partition("=")
        if not sep:
            out.append((None, entry))
            continue
        if not name or "/" in name or not pattern:
            raise ConfigError(f"{what} entry {entry!r} must be 'name=path' with a name free of '/', or a path.")
        out.append((name, pattern))
    return out


def _npy_under(directory: str) -> list[str]:
    return sorted(p for p in glob(os.path.join(directory, "**", "*.npy"), recursive=True) if os.path.isfile(p))


def heldout_sets(eval_cfg: EvalConfig, data_cfg: DataConfig) -> dict[str, list[str]]:
    """Set name -> token files, in config order. `name=glob` names one set (repeating a name adds files); a bare
    directory is OLMo's layout: each subdirectory holding .npy files (at any depth, e.g. `c4_en/val/`) is one
    set named after it, or the directory itself when it holds .npy files directly. No entry: the single set
    `heldout` from data.heldout_paths or the default corpus's held-out split."""
    if not eval_cfg.heldout:
        from olmo3eqx.data.pipeline import resolve_paths

        _, files = resolve_paths(data_cfg)
        if not files:
            raise DataError("No held-out token files; set eval.heldout or data.heldout_paths (or leave data.paths "
                            "empty to use the default corpus's held-out split).")
        return {DEFAULT_SET: files}
    sets: dict[str, list[str]] = {}
    for name, pattern in parse_named(eval_cfg.heldout, "eval.heldout"):
        if name is not None:
            sets.setdefault(name, []).extend(expand_paths([pattern], f"eval.heldout ({name})"))
            continue
        path = os.path.expanduser(pattern)
        if not os.path.isdir(path):
            raise ConfigError(f"eval.heldout entry {pattern!r} is neither 'name=glob' nor a directory; "
                              f"write it as name={pattern}.")
        if glob(os.path.join(path, "*.npy")):
            sets.setdefault(Path(path).name, []).extend(expand_paths([path], "eval.heldout"))
            continue
        found = False
        for sub in sorted(p for p in Path(path).iterdir() if p.is_dir()):
            files = _npy_under(str(sub))
            if files:
                sets.setdefault(sub.name, []).extend(files)
                found = True
        if not found:
            raise ConfigError(f"Directory {path} in eval.heldout holds no .npy token files (directly or in "
                              f"subdirectories, one per set).")
    return sets


def task_files(entries: Sequence[str]) -> dict[str, str]:
    """Task name -> JSONL path: 'name=path', or a bare path named after its file (arc_easy.jsonl -> arc_easy)."""
    out: dict[str, str] = {}
    for name, path in parse_named(entries, "eval.tasks"):
        path = os.path.expanduser(path)
        if not os.path.isfile(path):
            raise TaskError(f"Task file {path} does not exist; give JSONL files exported as described in "
                            f"olmo3eqx.evals (context, continuations, gold, id).")
        name = name or Path(path).name.removesuffix(".gz").removesuffix(".jsonl")
        if name in out:
            raise ConfigError(f"Two eval.tasks are named {name!r}; name them apart with name=path.")
        out[name] = path
    return out


# --- held-out instances ---------------------------------------------------------------------------


class PackedInstances:
    """seq_len consecutive tokens of one file, documents packed (the training layout)."""

    def __init__(self, files: list[str], *, seq_len: int, token_dtype: str, vocab_size: int, what: str):
        self.source = TokenSource(files, seq_len=seq_len, token_dtype=token_dtype, vocab_size=vocab_size, what=what)
        self.num_instances = self.source.num_instances
        self.seq_len = seq_len

    def read(self, ids: Int[np.ndarray, " b"]) -> tuple[Int[np.ndarray, "b s"], Float[np.ndarray, "b s"]]:
        """Tokens and label weights of instances `ids` (-1: padding, weight 0)."""
        valid = ids >= 0
        tokens = np.zeros((ids.size, self.seq_len), np.int32)
        tokens[valid] = self.source.read(ids[valid])
        weights = np.zeros((ids.size, self.seq_len), np.float32)
        weights[valid, :-1] = 1.0
        return tokens, weights


class DocumentInstances:
    """OLMo's padded layout: each document (through its EOS) is its own instance, split every seq_len tokens."""

    def __init__(self, files: list[str], *, seq_len: int, token_dtype: str, vocab_size: int, eos_id: int,
                 pad_id: int, what: str):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.arrays, file_idx, starts, lengths = [], [], [], []
        for path in expand_paths(files, what):
            if not os.path.isfile(path):
                raise DataError(f"Token file {path} does not exist; fix {what}.")
            dtype = _file_dtype(path, token_dtype, vocab_size)
            if os.path.getsize(path) % dtype.itemsize:
                raise DataError(f"Token file {path} is not a whole number of {dtype} tokens; it is truncated or "
                                f"holds another dtype.")
            tokens = np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)
            _check_ids(path, tokens, vocab_size)
            ends = np.flatnonzero(tokens == eos_id) + 1
            if ends.size == 0 or ends[-1] != tokens.size:
                ends = np.append(ends, tokens.size)  # a last document without EOS is still a document
            doc_starts = np.concatenate([[0], ends[:-1]])
            for a, b in zip(doc_starts.tolist(), ends.tolist()):
                for s in range(a, b, seq_len):
                    if min(b, s + seq_len) - s >= 2:  # one token has nothing to predict
                        file_idx.append(len(self.arrays))
                        starts.append(s)
                        lengths.append(min(b, s + seq_len) - s)
            self.arrays.append(tokens)
        if not starts:
            raise DataError(f"{what} holds no document of two or more tokens.")
        self.file_idx, self.starts, self.lengths = (np.asarray(x, np.int64) for x in (file_idx, starts, lengths))
        self.num_instances = len(starts)

    def read(self, ids: Int[np.ndarray, " b"]) -> tuple[Int[np.ndarray, "b s"], Float[np.ndarray, "b s"]]:
        tokens = np.full((ids.size, self.seq_len), self.pad_id, np.int32)
        weights = np.zeros((ids.size, self.seq_len), np.float32)
        for row, i in enumerate(ids.tolist()):
            if i < 0:
                continue
            start, n = int(self.starts[i]), int(self.lengths[i])
            tokens[row, :n] = self.arrays[int(self.file_idx[i])][start:start + n]
            weights[row, :n - 1] = 1.0
        return tokens, weights


def heldout_instances(files: list[str], *, mode: str, seq_len: int, token_dtype: str, vocab_size: int,
                      eos_id: int, pad_id: int, what: str):
    if mode == "packed":
        return PackedInstances(files, seq_len=seq_len, token_dtype=token_dtype, vocab_size=vocab_size, what=what)
    return DocumentInstances(files, seq_len=seq_len, token_dtype=token_dtype, vocab_size=vocab_size, eos_id=eos_id,
                             pad_id=pad_id, what=what)


# --- jitted, sharded computations -----------------------------------------------------------------


def heldout_sums(model: OLMo3, tokens: Int[Array, "b s"],
                 weights: Float[Array, "b s"]) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(sum of CE, sum of weights) with weights[b, t] scoring the prediction of tokens[b, t + 1]."""
    ce, _ = loss_sums(model, tokens, weights, 0.0)
    return ce, jnp.sum(weights)


def continuation_scores(model: OLMo3, tokens: Int[Array, "b s"], targets: Int[Array, "b s"],
                        weights: Float[Array, "b s"]) -> tuple[Float[Array, " b"], Bool[Array, " b"]]:
    """Per row: summed log-likelihood of the weighted targets, and whether every one of them is greedy."""
    lp, greedy = token_logprobs(model, tokens, targets)
    return jnp.sum(lp * weights, axis=1), jnp.all(greedy | (weights == 0), axis=1)


def _put_rows(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Global host rows -> a batch-sharded array; each process contributes its contiguous slice."""
    n, p = jax.process_count(), jax.process_index()
    rows = x.shape[0] // n
    return jax.make_array_from_process_local_data(sharding, x[p * rows:(p + 1) * rows], x.shape)


@dataclass(frozen=True)
class Runner:
    """The compiled, sharded functions one evaluation uses, and the global batch they take."""

    mesh: Mesh
    batch_size: int
    heldout_fn: Callable
    score_fn: Callable

    @staticmethod
    def make(mesh: Mesh, model_shardings, batch_size: int) -> Runner:
        dp = mesh.shape["data"] * mesh.shape["fsdp"]
        if batch_size <= 0 or batch_size % dp or batch_size % jax.process_count():
            raise ConfigError(f"The evaluation batch {batch_size} must be a positive multiple of the {dp} "
                              f"data-parallel devices and of the {jax.process_count()} processes.")
        bsh, rep = batch_sharding(mesh, 2), NamedSharding(mesh, P())
        heldout_fn = jax.jit(heldout_sums, in_shardings=(model_shardings, bsh, bsh), out_shardings=(rep, rep))
        score_fn = jax.jit(continuation_scores, in_shardings=(model_shardings, bsh, bsh, bsh),
                           out_shardings=(rep, rep))
        return Runner(mesh, batch_size, heldout_fn, score_fn)


def heldout_loss(runner: Runner, model: OLMo3, instances, max_instances: int = 0) -> dict[str, float]:
    """Token-weighted CE over the first `max_instances` instances (0: all) of a set, and its perplexity."""
    n = instances.num_instances if max_instances <= 0 else min(max_instances, instances.num_instances)
    b = runner.batch_size
    bsh = batch_sharding(runner.mesh, 2)
    sums = []
    for start in range(0, n, b):
        ids = np.arange(start, start + b, dtype=np.int64)
        tokens, weights = instances.read(np.where(ids < n, ids, -1))
        sums.append(runner.heldout_fn(model, _put_rows(tokens, bsh), _put_rows(weights, bsh)))
    total = sum(float(ce) for ce, _ in sums)  # fetched after every batch is dispatched
    count = sum(float(w) for _, w in sums)
    loss = total / max(count, 1.0)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}


# --- tokenizers and task files --------------------------------------------------------------------


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
        return [ids.astype(np.int32) for ids in _encode([t.encode("utf-8") for t in texts], self.spec)]


@dataclass(frozen=True)
class Example:
    id: str
    context: str
    continuations: tuple[str, ...]
    gold: int


def load_task(path: str | Path, limit: int = 0) -> list[Example]:
    """The examples of a task JSONL file (the first `limit` if positive), few-shot prefix applied."""
    import gzip

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


# --- scoring (context, continuation) pairs --------------------------------------------------------


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


def score_requests(runner: Runner, model: OLMo3, requests: Sequence[tuple[np.ndarray, np.ndarray, int]], *,
                   max_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(summed log-likelihood, greedy) of every request, batched by length bucket (longest first)."""
    sizes = buckets(max_len)
    lengths = np.asarray([len(r[0]) for r in requests])
    bucket_of = np.searchsorted(sizes, lengths)
    order = np.lexsort((-lengths, -bucket_of))
    b = runner.batch_size
    bsh = batch_sharding(runner.mesh, 2)
    pending = []
    for k in sorted(set(bucket_of.tolist()), reverse=True):
        idx = order[bucket_of[order] == k]
        length = sizes[k]
        for start in range(0, idx.size, b):
            rows = idx[start:start + b]
            tokens = np.full((b, length), pad_id, np.int32)
            targets = np.zeros((b, length), np.int32)
            weights = np.zeros((b, length), np.float32)
            for row, i in enumerate(rows.tolist()):
                inp, tgt, scored = requests[i]
                tokens[row, :len(inp)], targets[row, :len(tgt)] = inp, tgt
                weights[row, len(tgt) - scored:len(tgt)] = 1.0
            out = runner.score_fn(model, _put_rows(tokens, bsh), _put_rows(targets, bsh), _put_rows(weights, bsh))
            pending.append((rows, out))
    logprob = np.zeros(len(requests), np.float64)
    greedy = np.zeros(len(requests), bool)
    for rows, (lp, g) in pending:
        logprob[rows] = np.asarray(lp)[:rows.size]
        greedy[rows] = np.asarray(g)[:rows.size]
    return logprob, greedy


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


def evaluate_task(runner: Runner, model: OLMo3, task: Task, *, max_len: int, pad_id: int) -> dict[str, float]:
    logprob, _ = score_requests(runner, model, task.requests, max_len=max_len, pad_id=pad_id)
    return task_metrics(task.examples, logprob)


# --- one evaluation: every set and task -----------------------------------------------------------


def make_evaluator(runner: Runner, *, sets: dict[str, object], tasks: Sequence[Task], max_instances: int,
                   max_len: int, pad_id: int) -> Callable[[OLMo3], dict[str, float]]:
    """model -> {eval/<set>/loss, eval/<set>/ppl, eval/<task>/acc, .../acc_per_char, .../bpb}."""

    def evaluate(model: OLMo3) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, instances in sets.items():
            r = heldout_loss(runner, model, instances, max_instances)
            out[f"eval/{name}/loss"], out[f"eval/{name}/ppl"] = r["loss"], r["ppl"]
        for task in tasks:
            for k, v in evaluate_task(runner, model, task, max_len=max_len, pad_id=pad_id).items():
                out[f"eval/{task.name}/{k}"] = v
        return out

    return evaluate


def build_evaluator(eval_cfg: EvalConfig, data_cfg: DataConfig, model_cfg, *, mesh: Mesh, model_shardings,
                    batch_size: int, seq_len: int, max_instances: int,
                    with_heldout: bool = True) -> tuple[Callable, list[str]]:
    """(evaluate(model) -> metrics, names of the held-out sets in config order) for a run's config;
    `with_heldout=False` evaluates the tasks only."""
    vocab = data_cfg.vocab_size or model_cfg.vocab_size
    named = heldout_sets(eval_cfg, data_cfg) if with_heldout else {}
    sets = {name: heldout_instances(files, mode=eval_cfg.heldout_instances, seq_len=seq_len,
                                    token_dtype=data_cfg.token_dtype, vocab_size=vocab, eos_id=model_cfg.eos_token_id,
                                    pad_id=model_cfg.pad_token_id, what=f"eval.heldout ({name})")
            for name, files in named.items()}
    tasks = []
    if eval_cfg.tasks:
        tokenizer = Tokenizer.load(eval_cfg.tokenizer)
        tasks = [Task.load(name, path, tokenizer, max_len=seq_len, vocab_size=model_cfg.vocab_size,
                           limit=eval_cfg.task_limit) for name, path in task_files(eval_cfg.tasks).items()]
        clash = set(sets) & {t.name for t in tasks}
        if clash:
            raise ConfigError(f"{sorted(clash)} name both a held-out set and a task; rename one with name=path.")
    runner = Runner.make(mesh, model_shardings, batch_size)
    evaluate = make_evaluator(runner, sets=sets, tasks=tasks, max_instances=max_instances, max_len=seq_len,
                              pad_id=model_cfg.pad_token_id)
    return evaluate, list(sets)


def summary(metrics: dict[str, float]) -> str:
    """One line for the training log: set losses, then task accuracies."""
    parts = []
    for k, v in metrics.items():
        _, name, what = k.split("/")
        if what in ("loss", "acc"):
            parts.append(f"{name} {what} {v:.4f}")
    return ", ".join(parts)


def table(metrics: dict[str, float]) -> str:
    """Rows of a fixed-width table: held-out sets (loss, ppl), then tasks (acc, acc_per_char, bpb)."""
    rows: dict[str, dict[str, float]] = {}
    for k, v in metrics.items():
        _, name, what = k.split("/")
        rows.setdefault(name, {})[what] = v
    width = max([len(n) for n in rows] + [8])
    lines = []
    sets = [n for n, r in rows.items() if "loss" in r]
    tasks = [n for n, r in rows.items() if "acc" in r]
    if sets:
        lines.append(f"{'held-out':<{width}}  {'loss':>9}  {'ppl':>11}")
        lines += [f"{n:<{width}}  {rows[n]['loss']:>9.4f}  {rows[n]['ppl']:>11.3f}" for n in sets]
    if tasks:
        lines.append("")
        lines.append(f"{'task':<{width}}  {'acc':>7}  {'acc_per_char':>12}  {'bpb':>8}")
        lines += [f"{n:<{width}}  {rows[n]['acc']:>7.4f}  {rows[n]['acc_per_char']:>12.4f}  {rows[n]['bpb']:>8.4f}"
                  for n in tasks]
    return "\n".join(lines).strip("\n")


def model_shardings_for(model: OLMo3, mesh: Mesh):
    """The training sharding rule applied to a model (for evaluating a loaded checkpoint)."""
    from olmo3eqx.sharding import tree_shardings

    return tree_shardings(eqx.filter(model, eqx.is_array), mesh)

