"""Evaluate a checkpoint: held-out LM loss per named set and multiple-choice tasks; prints a table, writes JSON.

    python -m olmo3eqx.eval --ckpt runs/tiny --heldout c4_en=data/c4_en/*.npy --tasks tasks/arc_easy.jsonl

`--ckpt` is a run directory, its checkpoints/, one step directory, convert.py's output, or an HF Olmo3
directory (config.json + safetensors). Flags left unset come from the run's stored config (eval.heldout or its
default held-out set, eval.tasks, eval.tokenizer, data.seq_len); an HF directory's tokenizer.json is used when
present. The JSON (default: <run>/eval/step_<N>.json for a run, else eval_step_<N>.json here) holds the
metrics under their logged names plus what was evaluated.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from olmo3eqx import exits

DEFAULT_SEQ_LEN = 2048
"""Model length for checkpoints that store no data.seq_len (capped by max_position_embeddings)."""


@dataclass(frozen=True)
class Args:
    """Evaluate a checkpoint on held-out token sets and multiple-choice task files."""

    ckpt: str
    """Run directory, checkpoints/ directory, step directory, or HF Olmo3 directory."""
    heldout: tuple[str, ...] | None = None
    """Held-out sets, 'name=glob' or an OLMo-layout directory (see eval.heldout); unset: the run's own."""
    tasks: tuple[str, ...] | None = None
    """Task JSONL files, 'path' or 'name=path'; unset: the run's eval.tasks."""
    tokenizer: str | None = None
    """'bytes' or a tokenizer.json; unset: the run's eval.tokenizer, an HF directory's tokenizer.json, or bytes."""
    heldout_instances: Literal["packed", "document"] | None = None
    """packed or document (OLMo's padded perplexity layout); unset: the run's eval.heldout_instances."""
    seq_len: int | None = None
    """Instance length of held-out sets and the model length tasks are left-truncated to; unset: data.seq_len."""
    batch_size: int = 0
    """Sequences per jitted batch; 0: 4 per device. Rounded up to a multiple of the device count."""
    max_instances: int = 0
    """Held-out instances per set; 0: every instance."""
    limit: int = 0
    """Examples per task; 0: all."""
    out: str | None = None
    """Where to write the JSON results."""


def load_any(ckpt: str):
    """(model, ModelConfig, stored run config dict or None, HF tokenizer.json or None, step, run dir or None)."""
    from olmo3eqx import checkpoint, hf

    path = Path(ckpt)
    if (path / hf.CONFIG_FILE).is_file():
        model, cfg = hf.load_hf(path)
        tok = path / "tokenizer.json"
        return model, cfg, None, str(tok) if tok.is_file() else None, 0, None
    root, step = checkpoint.resolve_step_dir(path)
    stored = checkpoint.read_config(root, step)
    model = checkpoint.restore_model(root, step, checkpoint.model_config_from_dict(stored, str(root / str(step))))
    run_dir = root.parent if root.name == "checkpoints" else None
    return model, model.cfg, stored, None, step, run_dir


def run_config(stored: dict | None):
    """The stored TrainConfig, or None when the checkpoint holds only a model config."""
    from olmo3eqx.config import ConfigError, TrainConfig, from_dict

    if not stored or set(stored) <= {"model"}:
        return None
    try:
        return from_dict(TrainConfig, stored)
    except (ConfigError, TypeError):
        return None


def evaluate_checkpoint(args: Args) -> dict:
    import jax

    from olmo3eqx.config import DataConfig, EvalConfig, MeshConfig
    from olmo3eqx.evaluator import build_evaluator
    from olmo3eqx.sharding import data_parallel_size, make_mesh, model_shardings
    from olmo3eqx.tasks import TaskError

    model, model_cfg, stored, hf_tokenizer, step, run_dir = load_any(args.ckpt)
    train_cfg = run_config(stored)
    base_eval = train_cfg.eval if train_cfg else EvalConfig()
    data_cfg = train_cfg.data if train_cfg else DataConfig()
    heldout = args.heldout if args.heldout is not None else (base_eval.heldout if train_cfg else ())
    use_default_set = args.heldout is None and train_cfg is not None and not heldout
    eval_cfg = dataclasses.replace(
        base_eval, heldout=heldout, heldout_mix=base_eval.heldout_mix if args.heldout is None else None,
        tasks=args.tasks if args.tasks is not None else base_eval.tasks,
        tokenizer=args.tokenizer or (base_eval.tokenizer if train_cfg else hf_tokenizer or base_eval.tokenizer),
        heldout_instances=args.heldout_instances or base_eval.heldout_instances, task_limit=args.limit)
    seq_len = args.seq_len or (data_cfg.seq_len if train_cfg else min(DEFAULT_SEQ_LEN,
                                                                       model_cfg.max_position_embeddings))
    if not (eval_cfg.heldout or use_default_set or eval_cfg.tasks):
        raise TaskError("Nothing to evaluate: give --heldout and/or --tasks (this checkpoint stores no run "
                              "config to take them from).")

    mesh = make_mesh(MeshConfig())
    devices = data_parallel_size(mesh)
    batch = args.batch_size or 4 * devices
    batch = -(-batch // devices) * devices
    shardings = model_shardings(model, mesh)
    model = jax.device_put(model, shardings)
    evaluate, _ = build_evaluator(eval_cfg, data_cfg, model_cfg, mesh=mesh, model_shardings=shardings,
                                  batch_size=batch, seq_len=seq_len, max_instances=args.max_instances,
                                  with_heldout=bool(eval_cfg.heldout or use_default_set))
    t = time.perf_counter()
    metrics = evaluate(model)
    return {"ckpt": str(Path(args.ckpt).absolute()), "step": step, "seq_len": seq_len, "batch_size": batch,
            "tokenizer": eval_cfg.tokenizer, "heldout_instances": eval_cfg.heldout_instances,
            "seconds": round(time.perf_counter() - t, 3), "metrics": metrics, "_run_dir": run_dir}


def main(argv: list[str] | None = None) -> int:
    import tyro

    from olmo3eqx.checkpoint import CheckpointLoadError
    from olmo3eqx.config import ConfigError
    from olmo3eqx.data import DataError
    from olmo3eqx.hf import ConversionError

    args = tyro.cli(Args, args=argv, description=__doc__.splitlines()[0])
    try:
        result = evaluate_checkpoint(args)
    except (ConfigError, DataError, CheckpointLoadError, ConversionError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return exits.BAD_INPUT
    run_dir = result.pop("_run_dir")
    if args.out:
        out = Path(args.out)
    elif run_dir is not None:
        out = run_dir / "eval" / f"step_{result['step']}.json"
    else:
        out = Path(f"eval_step_{result['step']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['ckpt']} step {result['step']} (seq_len {result['seq_len']}, {result['seconds']:.1f} s)")
    from olmo3eqx.evaluator import table

    print(table(result["metrics"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
