"""The evaluator: held-out LM loss on named token sets (data/heldout.py) and downstream multiple-choice tasks
(tasks.py), jitted and sharded over the mesh's batch axes like the train step, in the loop and from the eval CLI.

Held-out loss is the token-weighted cross-entropy over every scored token of a set; ppl = exp(loss). Held-out
batches have the fixed shape [batch_size, seq_len]; task requests are padded to power-of-two length buckets, so a
whole task compiles at most log2(max_len) shapes. In the loop, a memorisation watch compares the recent training
loss with the first held-out set's loss after every evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from olmo3eqx.config import ConfigError, DataConfig, EvalConfig, ModelConfig
from olmo3eqx.data.heldout import heldout_instances, heldout_sets
from olmo3eqx.loss import loss_sums, token_logprobs
from olmo3eqx.model import OLMo3
from olmo3eqx.sharding import batch_sharding, data_parallel_size, on_mesh
from olmo3eqx.tasks import Task, Tokenizer, request_batches, task_files, task_metrics


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
        bsh, rep = batch_sharding(mesh, 2), NamedSharding(mesh, P())
        self._heldout = jax.jit(on_mesh(mesh, heldout_sums), in_shardings=(model_shardings, bsh, bsh), out_shardings=(rep, rep))
        self._score = jax.jit(on_mesh(mesh, continuation_scores), in_shardings=(model_shardings, bsh, bsh, bsh),
                              out_shardings=(rep, rep))

    def _put_rows(self, x: np.ndarray) -> jax.Array:
        """Global host rows -> a batch-sharded array; each process contributes its contiguous slice."""
        n, p = jax.process_count(), jax.process_index()
        rows = x.shape[0] // n
        return jax.make_array_from_process_local_data(batch_sharding(self.mesh, 2), x[p * rows:(p + 1) * rows],
                                                      x.shape)

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

    def evaluate_task(self, model: OLMo3, task: Task, *, max_len: int, pad_id: int) -> dict[str, float]:
        logprob, _ = self.score_requests(model, task.requests, max_len=max_len, pad_id=pad_id)
        return task_metrics(task.examples, logprob)


# --- one evaluation: every set and task -----------------------------------------------------------


def make_evaluator(scorer: ShardedScorer, *, sets: dict[str, object], tasks: Sequence[Task], max_instances: int,
                   max_len: int, pad_id: int) -> Callable[[OLMo3], dict[str, float]]:
    """model -> {eval/<set>/loss, eval/<set>/ppl, eval/<task>/acc, .../acc_per_char, .../bpb}."""

    def evaluate(model: OLMo3) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, instances in sets.items():
            r = scorer.heldout_loss(model, instances, max_instances)
            out[f"eval/{name}/loss"], out[f"eval/{name}/ppl"] = r["loss"], r["ppl"]
        for task in tasks:
            for k, v in scorer.evaluate_task(model, task, max_len=max_len, pad_id=pad_id).items():
                out[f"eval/{task.name}/{k}"] = v
        return out

    return evaluate


def build_evaluator(eval_cfg: EvalConfig, data_cfg: DataConfig, model_cfg: ModelConfig, *, mesh: Mesh,
                    model_shardings, batch_size: int, seq_len: int, max_instances: int,
                    with_heldout: bool = True) -> tuple[Callable, list[str]]:
    """(evaluate(model) -> metrics, names of the held-out sets in config order) for a run's config;
    `with_heldout=False` evaluates the tasks only. Sets and task files are opened and checked here."""
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
    scorer = ShardedScorer(mesh, model_shardings, batch_size)
    evaluate = make_evaluator(scorer, sets=sets, tasks=tasks, max_instances=max_instances, max_len=seq_len,
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


class LoopEvaluator:
    """Evaluation inside the training loop: every eval.every steps and at the last; logs the metrics and a summary
    line, then the memorisation watch's verdict on the first held-out set."""

    def __init__(self, evaluate: Callable[[OLMo3], dict[str, float]], heldout_names: list[str], *, every: int,
                 last_step: int, gap: float, log):
        self.evaluate, self.heldout_names = evaluate, heldout_names
        self.every, self.last_step, self.log = every, last_step, log
        self.watch = MemorisationWatch(gap)

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last_step

    def run(self, step: int, model: OLMo3, recent_train_loss: float | None = None) -> None:
        metrics = self.evaluate(model)
        self.log.log(step, metrics)
        self.log.print(f"eval step {step}: {summary(metrics)}")
        if self.heldout_names:
            warning = self.watch.update(recent_train_loss, metrics[f"eval/{self.heldout_names[0]}/loss"])
            if warning:
                self.log.print(warning)
