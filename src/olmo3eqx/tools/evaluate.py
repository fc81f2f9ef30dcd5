"""Evaluate a checkpoint, or every kept checkpoint of a run: held-out LM loss per named set and downstream tasks;
prints a table, writes JSON.

    olmo3eqx-eval --ckpt runs/tiny --heldout c4_en=data/c4_en/*.npy --tasks seed-eight
    olmo3eqx-eval --ckpt runs/tiny --all-checkpoints
    olmo3eqx-eval --list-tasks

`--ckpt` is a run directory, its checkpoints/, one step directory, convert.py's output, or an HF Olmo3
directory (config.json + safetensors). Flags left unset come from the run's stored config (eval.heldout or its
default held-out set, eval.tasks, eval.tokenizer, data.seq_len); an HF directory's tokenizer.json is used when
present. `--tasks` takes what eval.tasks takes: olmo_eval task names, the named sets, JSONL files. The JSON
(default: <run>/eval/step_<N>.json for a run, else eval_step_<N>.json here) holds the metrics under their
logged names, each task's primary metric and what was evaluated (`spec`). `--all-checkpoints` scores every kept
step of the run in turn into <run>/eval/step_<N>.json, skipping steps whose file already holds the same spec;
`olmo3eqx-compare` reads these files beside metrics.jsonl.

The checkpoint is restored straight onto the devices' shards in the compute dtype (olmo3eqx.checkpoint.load_any).
Several processes (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a cluster JAX detects) evaluate
together over all their devices, each reading its own shards of the model; process 0 prints and writes the results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from olmo3eqx import exits
from olmo3eqx.storage import StorePath

DESCRIPTION = ("Evaluate a checkpoint, or every kept checkpoint of a run, on "
               "held-out sets and downstream tasks: prints a table, writes JSON.")
"""--help's description (the module doc's first line is not a sentence on its own)."""

DEFAULT_SEQ_LEN = 2048
"""Model length for checkpoints that store no data.seq_len (capped by max_position_embeddings)."""


@dataclass(frozen=True)
class Args:
    """Evaluate a checkpoint (or every checkpoint of a run) on held-out token sets and downstream tasks."""

    ckpt: str = ""
    """Run directory, checkpoints/ directory, step directory (local, gs:// or s3://), or HF Olmo3 directory."""
    heldout: tuple[str, ...] | None = None
    """Held-out sets, 'name=glob' or an OLMo-layout directory (see eval.heldout); unset: the run's own."""
    tasks: tuple[str, ...] | None = None
    """olmo_eval task names, named sets (olmo3-in-loop, seed-eight), JSONL files ('path' or 'name=path'), or
    gsm8k (few-shot) and gsm8k_chat (zero-shot through the chat template), generated (olmo3eqx.gen_tasks); unset:
    the run's eval.tasks."""
    tokenizer: str | None = None
    """'bytes' or a tokenizer.json; unset: the run's eval.tokenizer, an HF directory's tokenizer.json, or bytes."""
    chat_template: str | None = None
    """The template gsm8k_chat asks through (a built-in name, a .jinja file or a tokenizer_config.json); unset: the
    run's eval.chat_template, else the tokenizer's own."""
    max_new_tokens: int = 0
    """Most new tokens per generative request; 0: the run's eval.gen_max_tokens, else each task's own."""
    heldout_instances: Literal["packed", "document"] | None = None
    """packed or document (OLMo's padded perplexity layout); unset: the run's eval.heldout_instances."""
    seq_len: int | None = None
    """Instance length of held-out sets and the model length tasks are left-truncated to; unset: data.seq_len."""
    batch_size: int = 0
    """Sequences per jitted batch; 0: 4 per device. Rounded up to a multiple of the device count."""
    max_instances: int = 0
    """Held-out instances per set; 0: every instance."""
    limit: int = 0
    """Documents per task; 0: all."""
    out: str | None = None
    """Where to write the JSON results (one checkpoint only; local, gs:// or s3://)."""
    dtype: str | None = None
    """Weights and compute in this dtype (float32, bfloat16); unset: the checkpoint's compute dtype (float32 for an HF
    directory)."""
    all_checkpoints: bool = False
    """Score every kept checkpoint of the run (those already scored with the same spec are skipped)."""
    list_tasks: bool = False
    """Print the task names and named sets eval.tasks takes, and exit."""


def run_config(stored: dict | None):
    """The stored TrainConfig, or None when the checkpoint holds only a model config."""
    from olmo3eqx.config import TrainConfig, from_dict
    from olmo3eqx.errors import ConfigError

    if not stored or set(stored) <= {"model"}:
        return None
    try:
        return from_dict(TrainConfig, stored)
    except (ConfigError, TypeError):
        return None


@dataclass
class Setup:
    """What one or many evaluations share: the first model loaded, its evaluator and the spec of what it scores."""

    model: object
    """The loaded model (None once evaluate_all has dropped it to restore the steps one at a time)."""
    step: int
    run_dir: StorePath | None
    evaluator: object
    shardings: object
    spec: dict


def setup(args: Args) -> Setup:
    """Load the checkpoint `args.ckpt` names (the newest step of a run), resolve what to evaluate, build the
    evaluator (sets and tasks read and tokenized once)."""
    from olmo3eqx.checkpoint.model import load_any
    from olmo3eqx.config import DataConfig, EvalConfig
    from olmo3eqx.evaluator import build_evaluator
    from olmo3eqx.sharding import data_parallel_size, model_shardings, node_mesh
    from olmo3eqx.errors import TaskError

    mesh = node_mesh()
    model, model_cfg, stored, hf_tokenizer, step, run_dir = load_any(args.ckpt, mesh, args.dtype)
    train_cfg = run_config(stored)
    base_eval = train_cfg.eval if train_cfg else EvalConfig()
    data_cfg = train_cfg.data if train_cfg else DataConfig()
    heldout = args.heldout if args.heldout is not None else (base_eval.heldout if train_cfg else ())
    use_default_set = args.heldout is None and train_cfg is not None and not heldout
    eval_cfg = dataclasses.replace(
        base_eval, heldout=heldout, heldout_mix=base_eval.heldout_mix if args.heldout is None else None,
        tasks=args.tasks if args.tasks is not None else base_eval.tasks,
        tokenizer=args.tokenizer or (base_eval.tokenizer if train_cfg else hf_tokenizer or base_eval.tokenizer),
        heldout_instances=args.heldout_instances or base_eval.heldout_instances, task_limit=args.limit,
        chat_template=args.chat_template or base_eval.chat_template,
        gen_max_tokens=args.max_new_tokens or base_eval.gen_max_tokens)
    seq_len = args.seq_len or (data_cfg.seq_len if train_cfg else min(DEFAULT_SEQ_LEN,
                                                                       model_cfg.max_position_embeddings))
    if not (eval_cfg.heldout or use_default_set or eval_cfg.tasks):
        raise TaskError("Nothing to evaluate: give --heldout and/or --tasks (this checkpoint stores no run "
                        "config to take them from).")

    devices = data_parallel_size(mesh)
    batch = args.batch_size or 4 * devices
    batch = -(-batch // devices) * devices
    shardings = model_shardings(model, mesh)
    evaluator = build_evaluator(eval_cfg, data_cfg, model_cfg, mesh=mesh, model_shardings=shardings,
                                batch_size=batch, seq_len=seq_len, max_instances=args.max_instances,
                                with_heldout=bool(eval_cfg.heldout or use_default_set))
    spec = {"heldout": list(eval_cfg.heldout) if eval_cfg.heldout else ("default" if use_default_set else []),
            "tasks": list(eval_cfg.tasks), "tokenizer": eval_cfg.tokenizer,
            "heldout_instances": eval_cfg.heldout_instances, "seq_len": seq_len, "max_instances": args.max_instances,
            "limit": args.limit}
    spec |= {k: v for k, v in (("chat_template", eval_cfg.chat_template), ("max_new_tokens", eval_cfg.gen_max_tokens))
             if v}  # only where set: specs stored before these settings existed still match
    return Setup(model, step, run_dir, evaluator, shardings, spec)


def score(s: Setup, model, step: int, ckpt: str) -> dict:
    t = time.perf_counter()
    metrics = s.evaluator(model)
    return {"ckpt": ckpt, "step": step, "seconds": round(time.perf_counter() - t, 3), "metrics": metrics,
            "primary": s.evaluator.primary, "spec": s.spec}


def write(result: dict, out: str, evaluator) -> None:
    """Print and write one checkpoint's results (process 0 of several; the others computed the same ones)."""
    import jax

    from olmo3eqx import storage
    from olmo3eqx.evaluator import table

    if jax.process_index() != 0:
        return
    storage.makedirs(storage.parent(out) or ".")
    storage.write_text(out, json.dumps(result, indent=2) + "\n")
    print(f"{result['ckpt']} step {result['step']} (seq_len {result['spec']['seq_len']}, "
          f"{result['seconds']:.1f} s)")
    print(table(result["metrics"], evaluator.primary))
    print(f"wrote {out}")


def evaluate_one(args: Args) -> None:
    from olmo3eqx import storage

    s = setup(args)
    ckpt = args.ckpt if storage.is_url(args.ckpt) else str(Path(args.ckpt).absolute())
    result = score(s, s.model, s.step, storage.redact(ckpt))
    if args.out:
        out = storage.check(args.out, "--out", write=True)
    elif s.run_dir is not None:
        out = str(s.run_dir / "eval" / f"step_{s.step}.json")
    else:
        out = f"eval_step_{s.step}.json"
    write(result, out, s.evaluator)


def already_scored(path: str, spec: dict) -> bool:
    from olmo3eqx import storage

    try:
        return json.loads(storage.read_text(path)).get("spec") == spec
    except (OSError, ValueError):
        return False


def evaluate_all(args: Args) -> None:
    """Every kept step of the run, oldest first, into <run>/eval/step_<N>.json; steps already scored with the same
    spec are skipped."""
    import jax

    from olmo3eqx.checkpoint.layout import complete_steps
    from olmo3eqx.checkpoint.model import restore_model
    from olmo3eqx.errors import ConfigError

    root, steps = complete_steps(args.ckpt)
    if args.out:
        raise ConfigError("--out names one file; --all-checkpoints writes <run>/eval/step_<N>.json per step.")
    run_dir = root.parent if root.name == "checkpoints" else root
    s = setup(dataclasses.replace(args, ckpt=str(root)))  # the newest step: its config says what to evaluate
    outs = {step: str(run_dir / "eval" / f"step_{step}.json") for step in steps}
    # every process reads these before process 0 can write any (scoring a step takes all of them)
    todo = [step for step in steps if not already_scored(outs[step], s.spec)]
    if jax.process_index() == 0:
        for step in sorted(set(steps) - set(todo)):
            print(f"step {step}: already scored ({outs[step]})")
    cfg = s.model.cfg
    if todo != [s.step]:
        s.model = None  # one model in memory at a time: each step, the newest too, restored in its turn
    for step in todo:
        model = s.model if s.model is not None else restore_model(root, step, cfg, s.shardings)
        write(score(s, model, step, str(root / str(step))), out=outs[step], evaluator=s.evaluator)
        del model


def list_all_tasks() -> None:
    from olmo3eqx import olmo_tasks

    for name, members in olmo_tasks.TASK_SETS.items():
        print(f"{name}: {' '.join(members)}")
    print()
    print("\n".join(olmo_tasks.supported_tasks()))
    from olmo3eqx.gen_tasks import GENERATIVE

    print("\n".join(f"{name} (generative)" for name in GENERATIVE))


@exits.command
def main(argv: list[str] | None = None) -> int:
    from olmo3eqx import jaxenv

    if "jax" not in sys.modules:  # the command, before JAX starts (not a test or a notebook calling main)
        jaxenv.prepare_speaking(os.environ)
    import tyro

    from olmo3eqx import distributed
    from olmo3eqx.config import DistConfig
    from olmo3eqx.errors import ConfigError

    args = tyro.cli(Args, args=argv, description=DESCRIPTION)
    distributed.initialize(DistConfig())  # several processes score together (see the module doc)
    if args.list_tasks:
        list_all_tasks()
    elif not args.ckpt:
        raise ConfigError("Give --ckpt (a run, checkpoint or HF directory), or --list-tasks.")
    elif args.all_checkpoints:
        evaluate_all(args)
    else:
        evaluate_one(args)
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
