"""The evaluator: held-out LM loss on named token sets (data/heldout.py) and downstream tasks (tasks.py, read by
olmo_tasks.py), jitted and sharded over the mesh's batch axes like the train step, in the loop and from the eval CLI.

Held-out loss is the token-weighted cross-entropy over every scored token of a set; ppl = exp(loss). Held-out
batches have the fixed shape [batch_size, seq_len]; task rows are padded to power-of-two length buckets, so a whole
task compiles at most log2(max_len) shapes. Metric names: eval/<set>/loss, eval/<set>/ppl and
eval/downstream/<task>/<metric> (tasks.py: acc, len_norm, bpb, bpb_v1, primary). In the loop, a memorisation
watch compares the recent training loss with the first held-out set's loss after every evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from olmo3eqx.config import DataConfig, EvalConfig, ModelConfig
from olmo3eqx.errors import ConfigError
from olmo3eqx.data.heldout import open_heldout
from olmo3eqx.gen_tasks import GENERATIVE, GenerativeTask, load_generative, model_generator, run_task
from olmo3eqx.loss import candidate_logprobs, loss_sums, token_logprobs
from olmo3eqx.model import OLMo3
from olmo3eqx.olmo_tasks import load_tasks
from olmo3eqx.sharding import batch_sharding, data_parallel_size, on_mesh
from olmo3eqx.tasks import Task, Tokenizer, choice_batches, request_batches, task_metrics

DOWNSTREAM = "eval/downstream"
"""Prefix of task metrics: eval/downstream/<task>/<metric>."""


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


class ShardedScorer:
    """The jitted, sharded computations of an evaluation and the global batch they take: `batch_size` rows split
    over the mesh's data-parallel devices, each process contributing its contiguous rows."""

    def __init__(self, mesh: Mesh, model_shardings, batch_size: int):
        dp = data_parallel_size(mesh)
        if batch_size <= 0 or batch_size % dp or batch_size % jax.process_count():
            raise ConfigError(f"The evaluation batch {batch_size} must be a positive multiple of the {dp} "
                              f"data-parallel devices and of the {jax.process_count()} processes.")
        self.mesh, self.batch_size = mesh, batch_size
        b1, b2, rep = batch_sharding(mesh, 1), batch_sharding(mesh, 2), NamedSharding(mesh, P())
        self._heldout = jax.jit(on_mesh(mesh, heldout_sums), in_shardings=(model_shardings, b2, b2),
                                out_shardings=(rep, rep))
        self._score = jax.jit(on_mesh(mesh, continuation_scores), in_shardings=(model_shardings, b2, b2, b2),
                              out_shardings=(rep, rep))
        self._choices = jax.jit(on_mesh(mesh, candidate_logprobs), in_shardings=(model_shardings, b2, b1, b2), out_shardings=rep)

    def _put_rows(self, x: np.ndarray) -> jax.Array:
        """Global host rows -> a batch-sharded array; each process contributes its contiguous slice."""
        n, p = jax.process_count(), jax.process_index()
        rows = x.shape[0] // n
        return jax.make_array_from_process_local_data(batch_sharding(self.mesh, x.ndim),
                                                      x[p * rows:(p + 1) * rows], x.shape)

    def heldout_loss(self, model: OLMo3, instances, max_instances: int = 0) -> dict[str, float]:
        """Token-weighted CE over the first `max_instances` instances (0: all) of a set, and its perplexity."""
        n = instances.num_instances if max_instances <= 0 else min(max_instances, instances.num_instances)
        sums = []
        for start in range(0, n, self.batch_size):
            ids = np.arange(start, start + self.batch_size, dtype=np.int64)
            tokens, weights = instances.read(np.where(ids < n, ids, -1))
            sums.append(self._heldout(model, self._put_rows(tokens), self._put_rows(weights)))
        total = sum(float(ce) for ce, _ in sums)  # fetched after every batch is dispatched
        count = sum(float(w) for _, w in sums)
        loss = total / max(count, 1.0)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}

    def score_requests(self, model: OLMo3, requests: Sequence[tuple[np.ndarray, np.ndarray, int]], *, max_len: int,
                       pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(summed log-likelihood, greedy) of every request (tasks.build_request), batched by length bucket."""
        pending = [(rows, self._score(model, *map(self._put_rows, arrays)))
                   for rows, *arrays in request_batches(requests, max_len=max_len, batch_size=self.batch_size,
                                                        pad_id=pad_id)]
        logprob = np.zeros(len(requests), np.float64)
        greedy = np.zeros(len(requests), bool)
        for rows, (lp, g) in pending:  # fetched after every batch is dispatched
            logprob[rows] = np.asarray(lp)[:rows.size]
            greedy[rows] = np.asarray(g)[:rows.size]
        return logprob, greedy

    def score_choices(self, model: OLMo3, queries: Sequence[np.ndarray], choices: Sequence[np.ndarray], *,
                      max_len: int, pad_id: int) -> list[np.ndarray]:
        """Per query: log p(choice | query) of each of its one-token choices, one forward per query."""
        pending = [(rows, self._choices(model, *map(self._put_rows, arrays)))
                   for rows, *arrays in choice_batches(queries, choices, max_len=max_len,
                                                       batch_size=self.batch_size, pad_id=pad_id)]
        out: list[np.ndarray] = [np.zeros(0)] * len(queries)
        for rows, lp in pending:  # fetched after every batch is dispatched
            lp = np.asarray(lp, np.float64)
            for row, i in enumerate(rows.tolist()):
                out[i] = lp[row, :len(choices[i])]
        return out

    def task_logliks(self, model: OLMo3, task: Task, *, max_len: int, pad_id: int) -> np.ndarray:
        """Every request's summed log-likelihood, in the order of task.requests."""
        if not task.fast:
            return self.score_requests(model, task.rows, max_len=max_len, pad_id=pad_id)[0]
        loglik = np.zeros(len(task.requests), np.float64)
        for members, lp in zip(task.members, self.score_choices(model, task.rows, task.choices, max_len=max_len,
                                                                pad_id=pad_id)):
            loglik[members] = lp
        return loglik

    def evaluate_task(self, model: OLMo3, task: Task, *, max_len: int, pad_id: int) -> dict[str, float]:
        return task_metrics(task, self.task_logliks(model, task, max_len=max_len, pad_id=pad_id))


# --- one evaluation: every set and task -----------------------------------------------------------


@dataclass(frozen=True)
class Evaluator:
    """evaluator(model) -> every metric of one evaluation; what it evaluates: the held-out sets (in config order)
    and each task's primary metric."""

    evaluate: Callable[[OLMo3], dict[str, float]]
    heldout_names: list[str]
    primary: dict[str, str]

    def __call__(self, model: OLMo3) -> dict[str, float]:
        return self.evaluate(model)


def make_evaluator(scorer: ShardedScorer, *, sets: dict[str, object], tasks: Sequence[Task], max_instances: int,
                   max_len: int, pad_id: int, gen_tasks: Sequence[GenerativeTask] = (),
                   tokenizer: Tokenizer | None = None) -> Evaluator:
    """An Evaluator of {eval/<set>/loss, eval/<set>/ppl, eval/downstream/<task>/<metric>}; generative tasks
    (gen_tasks.py) are generated greedily within the model's positions, `scorer.batch_size` requests at a time."""

    def evaluate(model: OLMo3) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, instances in sets.items():
            r = scorer.heldout_loss(model, instances, max_instances)
            out[f"eval/{name}/loss"], out[f"eval/{name}/ppl"] = r["loss"], r["ppl"]
        for task in tasks:
            for k, v in scorer.evaluate_task(model, task, max_len=max_len, pad_id=pad_id).items():
                out[f"{DOWNSTREAM}/{task.name}/{k}"] = v
        for task in gen_tasks:
            generator = model_generator(model, tokenizer, max_len=model.cfg.max_position_embeddings, mesh=scorer.mesh)
            for k, v in run_task(task, generator, scorer.batch_size)[0].items():
                out[f"{DOWNSTREAM}/{task.name}/{k}"] = v
        return out

    primary = {t.name: t.primary for t in tasks} | {t.name: t.primary for t in gen_tasks}
    return Evaluator(evaluate, list(sets), primary)


def build_evaluator(eval_cfg: EvalConfig, data_cfg: DataConfig, model_cfg: ModelConfig, *, mesh: Mesh,
                    model_shardings, batch_size: int, seq_len: int, max_instances: int,
                    with_heldout: bool = True) -> Evaluator:
    """The Evaluator of a run's config; `with_heldout=False` evaluates the tasks only. Sets and tasks are opened,
    tokenized and checked here."""
    vocab = data_cfg.vocab_size or model_cfg.vocab_size
    sets = open_heldout(eval_cfg, data_cfg, seq_len=seq_len, vocab_size=vocab, eos_id=model_cfg.eos_token_id,
                        pad_id=model_cfg.pad_token_id) if with_heldout else {}
    if DOWNSTREAM.split("/")[1] in sets:
        raise ConfigError("A held-out set may not be named 'downstream' (task metrics live under eval/downstream/); "
                          "rename it with name=glob.")
    tasks, gen, tokenizer = [], [], None
    scored = [e for e in eval_cfg.tasks if e not in GENERATIVE]
    if eval_cfg.tasks:
        tokenizer = Tokenizer.load(eval_cfg.tokenizer)
    if scored:
        tasks = load_tasks(scored, tokenizer, max_len=seq_len, vocab_size=model_cfg.vocab_size,
                           limit=eval_cfg.task_limit)
    gen = [load_generative(e, limit=eval_cfg.task_limit, tokenizer=eval_cfg.tokenizer,
                           chat_template=eval_cfg.chat_template, max_new_tokens=eval_cfg.gen_max_tokens)
           for e in dict.fromkeys(eval_cfg.tasks) if e in GENERATIVE]
    scorer = ShardedScorer(mesh, model_shardings, batch_size)
    return make_evaluator(scorer, sets=sets, tasks=tasks, max_instances=max_instances, max_len=seq_len,
                          pad_id=model_cfg.pad_token_id, gen_tasks=gen, tokenizer=tokenizer)


def split_name(key: str) -> tuple[str, str, str]:
    """('heldout' | 'task', set or task name, metric) of a metric key."""
    parts = key.split("/")
    if key.startswith(DOWNSTREAM + "/"):
        return "task", parts[2], parts[3]
    return "heldout", parts[1], parts[2]


def summary(metrics: dict[str, float], primary: dict[str, str]) -> str:
    """One line for the training log: set losses, then each task's primary metric."""
    parts = []
    for k, v in metrics.items():
        kind, name, what = split_name(k)
        if kind == "heldout" and what == "loss":
            parts.append(f"{name} loss {v:.4f}")
        elif kind == "task" and what == "primary":
            parts.append(f"{name} {primary.get(name, what)} {v:.4f}")
    return ", ".join(parts)


TASK_COLUMNS = ("acc", "len_norm", "bpb", "bpb_v1", "exact_match")


def table(metrics: dict[str, float], primary: dict[str, str] | None = None) -> str:
    """Rows of a fixed-width table: held-out sets (loss, ppl), then tasks (acc, len_norm, bpb, bpb_v1 and which is
    primary)."""
    sets: dict[str, dict[str, float]] = {}
    tasks: dict[str, dict[str, float]] = {}
    for k, v in metrics.items():
        kind, name, what = split_name(k)
        (tasks if kind == "task" else sets).setdefault(name, {})[what] = v
    width = max([len(n) for n in [*sets, *tasks]] + [8])
    lines = []
    if sets:
        lines.append(f"{'held-out':<{width}}  {'loss':>9}  {'ppl':>11}")
        lines += [f"{n:<{width}}  {r['loss']:>9.4f}  {r['ppl']:>11.3f}" for n, r in sets.items()]
    if tasks:
        lines.append("")
        lines.append(f"{'task':<{width}}" + "".join(f"  {c:>8}" for c in TASK_COLUMNS) + "  primary")
        for n, r in tasks.items():
            cells = "".join(f"  {r[c]:>8.4f}" if c in r else f"  {'-':>8}" for c in TASK_COLUMNS)
            lines.append(f"{n:<{width}}{cells}  {(primary or {}).get(n, '')}")
    return "\n".join(lines).strip("\n")


# --- in the training loop -------------------------------------------------------------------------


class MemorisationWatch:
    """The reproduction's signature: training loss well below held-out loss for a sustained window."""

    def __init__(self, gap: float, window: int = 3):
        self.gap, self.window = gap, window
        self.gaps: list[float] = []

    def update(self, train: float | None, heldout: float) -> str | None:
        """A warning when the mean recent train loss `train` has sat more than `gap` below the held-out loss for
        the last `window` evaluations; None otherwise (and when there is no train loss yet)."""
        if train is None:
            return None
        self.gaps = (self.gaps + [heldout - train])[-self.window:]
        if len(self.gaps) == self.window and min(self.gaps) > self.gap:
            return (f"warning: train loss has been more than {self.gap} below held-out loss for {self.window} "
                    f"evaluations (now {train:.4f} vs {heldout:.4f}): memorisation, or repeated data?")
        return None


@dataclass(frozen=True)
class Samples:
    """eval.samples: prompts completed at each evaluation, as text."""

    prompts: tuple[str, ...]
    tokenizer: Tokenizer
    new_tokens: int
    temperature: float
    mesh: Mesh | None = None

    def __call__(self, model: OLMo3) -> list[str]:
        """Each prompt followed by its completion (greedy, or sampled with seed 0)."""
        from olmo3eqx.decode import Sampler
        from olmo3eqx.generate import generate

        ids = [x.tolist() or [model.cfg.eos_token_id] for x in self.tokenizer.encode(list(self.prompts))]
        keep = max(1, model.cfg.max_position_embeddings - self.new_tokens)
        done = generate(model, [x[-keep:] for x in ids], max_new_tokens=self.new_tokens,
                        sampler=Sampler(self.temperature), decode=self.tokenizer.decode, mesh=self.mesh)
        return [p + c.text for p, c in zip(self.prompts, done)]


class LoopEvaluator:
    """Evaluation inside the training loop: every eval.every steps and at the last; logs the metrics and a summary
    line, then the memorisation watch's verdict on the first held-out set; with `samples`, the completions as text
    (the latest kept in `last_samples`)."""

    def __init__(self, evaluator: Evaluator, *, every: int, last_step: int, gap: float, log,
                 samples: Samples | None = None):
        self.evaluator, self.heldout_names = evaluator, evaluator.heldout_names
        self.every, self.last_step, self.log = every, last_step, log
        self.watch = MemorisationWatch(gap)
        self.samples = samples
        self.last_samples: tuple[int, list[str]] | None = None

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last_step

    def run(self, step: int, model: OLMo3, recent_train_loss: float | None = None) -> None:
        metrics = self.evaluator(model)
        self.log.log(step, metrics)
        self.log.print(f"eval step {step}: {summary(metrics, self.evaluator.primary)}")
        if self.samples is not None:
            texts = self.samples(model)
            self.log.log_text(step, {f"samples/{i}": t for i, t in enumerate(texts)})
            self.last_samples = (step, texts)
        if self.heldout_names:
            warning = self.watch.update(recent_train_loss, metrics[f"eval/{self.heldout_names[0]}/loss"])
            if warning:
                self.log.print(warning)
