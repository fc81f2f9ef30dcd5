"""Orbax checkpoint directories: where a step's parts lie, which steps are whole, and the model config a step stores.

Layout of a checkpoint directory `C` (an orbax CheckpointManager root):
    C/<step>/state/      the train state's arrays as one tree (olmo3eqx.state.TrainState: model, opt_state, ...);
                         `convert.py hf-to-orbax` writes a state holding only {"model": ...}, as step 0, one leaf at
                         a time (save_model_leaves), and orbax-to-hf reads it back one leaf at a time
                         (restore_model_leaf)
    C/<step>/config/     the resolved config as JSON (at least {"model": {...}})
    C/<step>/data/       training checkpoints only: the data-iterator state (JSON)
    C/<step>/_CHECKPOINT_METADATA   orbax's step metadata; a training checkpoint's records whether it is permanent

Every directory here may be local or a gs:// or s3:// URL (olmo3eqx.storage). On a bucket orbax writes the arrays
through tensorstore's own gcs/s3 kvstores (orbax_s3 teaches it s3://) and the rest through etils.epath; a step is
written under its final name and committed by `commit_success.txt` written last (a bucket cannot rename a directory
atomically), so a step without one is torn, whoever wrote it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import orbax.checkpoint as ocp

from olmo3eqx import storage
from olmo3eqx.config import ModelConfig, from_dict
from olmo3eqx.errors import ConfigError
from olmo3eqx.storage import StorePath

STATE = "state"
"""The item holding the train state (or a converted model) of every checkpoint step."""
COMMITTED = "commit_success.txt"
"""What orbax writes last into a step it commits on a bucket (and locally with async saves); convert.py's steps on a
bucket get one too."""
STEP_METADATA = "_CHECKPOINT_METADATA"
"""orbax's metadata of a step (JSON), written with the step before it commits; its "custom_metadata" holds what the
saver passed (a training checkpoint's permanence, olmo3eqx.checkpoint.retention; the chat templates of its data,
olmo3eqx.data.template_record)."""


def checkpoint_dir(directory, what: str = "Checkpoint", *, write: bool = False) -> StorePath:
    """A checkpoint directory as the path object orbax takes: an absolute pathlib.Path, or an etils.epath.Path of a
    gs:// or s3:// URL (with orbax taught s3://)."""
    d = storage.path(directory, what, write=write)
    if isinstance(d, Path):
        return d.absolute()
    if str(d).startswith("s3://"):
        from olmo3eqx import orbax_s3

        orbax_s3.install()
    return d


def is_remote(directory) -> bool:
    return storage.is_url(directory)


def is_complete_step(p) -> bool:
    """A step directory holding a whole checkpoint: locally its state (orbax renames a step into place when it is
    whole), on a bucket its commit marker (written last)."""
    return (p / COMMITTED).exists() if is_remote(p) else (p / STATE).is_dir()


def complete_steps(path: str | StorePath) -> tuple[StorePath, list[int]]:
    """(manager root, its complete steps in order) of a manager root or a run directory."""
    path = checkpoint_dir(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {storage.redact(path)} does not exist; pass the directory convert.py or "
                                f"train.py wrote.")
    if (path / "checkpoints").is_dir():  # a run directory
        path = path / "checkpoints"
    steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and is_complete_step(p))
    if not steps:
        raise FileNotFoundError(f"No complete checkpoint step under {storage.redact(path)}; expected <step>/{STATE}/ "
                                f"subdirectories{f' with {COMMITTED}' if is_remote(path) else ''}.")
    return path, steps


def resolve_step_dir(path: str | StorePath) -> tuple[StorePath, int]:
    """Accept a manager root (newest complete step wins) or one step directory; return (root, step)."""
    path = checkpoint_dir(path)
    if path.name.isdigit() and is_complete_step(path):
        return path.parent, int(path.name)
    root, steps = complete_steps(path)
    return root, steps[-1]


def step_custom_metadata(step_dir: StorePath) -> dict:
    """The custom metadata a step was saved with ({} without any: a converted checkpoint, or a step written before
    the record existed)."""
    try:
        metadata = json.loads(storage.read_text(str(step_dir / STEP_METADATA)))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    custom = metadata.get("custom_metadata") if isinstance(metadata, dict) else None
    return custom if isinstance(custom, dict) else {}


def read_config(root: StorePath, step: int) -> dict:
    with ocp.CheckpointManager(root, item_names=("config",)) as mngr:
        return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]


def model_config_from_dict(d: dict, where: str) -> ModelConfig:
    try:
        return from_dict(ModelConfig, d["model"], "model")
    except (KeyError, ConfigError) as e:
        raise ConfigError(f"The config stored in checkpoint {where} is not a valid model config: {e}") from None


# Fields that may change between a checkpoint and the run that loads it: they change how the model is computed,
# not what its parameters are.
COMPUTE_ONLY_FIELDS = ("remat", "remat_by_chip", "attention_impl", "attention_block_q", "attention_block_kv",
                       "scan_layers", "compute_dtype", "max_position_embeddings")


def model_config_mismatch(saved: ModelConfig, current: ModelConfig, allow: tuple[str, ...] = ()) -> list[str]:
    def value(cfg: ModelConfig, name: str):
        # layer_types None is OLMo's rule spelled out: a converted config.json lists it, a preset leaves it unset.
        return cfg.resolved_layer_types if name == "layer_types" else getattr(cfg, name)

    return [f"{f.name} (checkpoint {value(saved, f.name)!r}, config {value(current, f.name)!r})"
            for f in dataclasses.fields(ModelConfig)
            if f.name not in COMPUTE_ONLY_FIELDS + allow and value(saved, f.name) != value(current, f.name)]


def check_model_config(saved: dict, current: ModelConfig, where: str, allow: tuple[str, ...] = ()) -> None:
    diff = model_config_mismatch(model_config_from_dict(saved, where), current, allow)
    if diff:
        raise ConfigError(f"The model config differs from checkpoint {where} in {', '.join(diff)}; use the "
                          f"checkpoint's values or start a new run (a new run.name).")
