"""Orbax checkpoints: one `Composite` per saved step.

Layout of a checkpoint directory `C` (an orbax CheckpointManager root):
    C/<step>/model/      the model's arrays (StandardSave of `eqx.filter(model, eqx.is_array)`)
    C/<step>/config/     the resolved config as JSON (at least {"model": {...}})
Training checkpoints add `opt_state`, `train` (step, RNG, ...) and `data` (iterator states) items.
`convert.py hf-to-orbax` writes step 0 with the model and config items only.
"""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import orbax.checkpoint as ocp

from olmo3eqx.config import ConfigError, ModelConfig, from_dict, to_dict
from olmo3eqx.model import OLMo3, abstract_model


def is_leaf_like(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def model_arrays(model: OLMo3):
    return eqx.filter(model, eqx.is_array)


def save_model(directory: str | Path, model: OLMo3, cfg: ModelConfig, step: int = 0, extra_config: dict | None = None):
    """Write `model` as step `step` of the checkpoint directory (blocking)."""
    directory = Path(directory).absolute()
    config = {"model": to_dict(cfg), **(extra_config or {})}
    with ocp.CheckpointManager(directory, item_names=("model", "config")) as mngr:
        mngr.save(step, args=ocp.args.Composite(
            model=ocp.args.StandardSave(model_arrays(model)), config=ocp.args.JsonSave(config)), force=True)
        mngr.wait_until_finished()


def resolve_step_dir(path: str | Path) -> tuple[Path, int]:
    """Accept a manager root (newest complete step wins) or one step directory; return (root, step)."""
    path = Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {path} does not exist; pass the directory convert.py or train.py wrote.")
    if (path / "model").is_dir() and path.name.isdigit():
        return path.parent, int(path.name)
    if (path / "checkpoints").is_dir():  # a run directory
        path = path / "checkpoints"
    steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / "model").is_dir())
    if not steps:
        raise FileNotFoundError(f"No complete checkpoint step under {path}; expected <step>/model/ subdirectories.")
    return path, steps[-1]


def read_config(root: Path, step: int) -> dict:
    with ocp.CheckpointManager(root, item_names=("config",)) as mngr:
        return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]


def model_config_from_dict(d: dict, where: str) -> ModelConfig:
    try:
        return from_dict(ModelConfig, d["model"], "model")
    except (KeyError, ConfigError) as e:
        raise ConfigError(f"The config stored in checkpoint {where} is not a valid model config: {e}") from None


def restore_model(root: Path, step: int, cfg: ModelConfig, sharding=None) -> OLMo3:
    """Restore the model arrays of `step` onto `sharding` (a pytree of shardings like the model, or one)."""
    abstract = abstract_model(cfg)
    params, static = eqx.partition(abstract, is_leaf_like)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = sharding if not isinstance(sharding, jax.sharding.Sharding) else jax.tree.map(lambda _: sharding, params)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
    with ocp.CheckpointManager(root, item_names=("model",)) as mngr:
        restored = mngr.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(target)))["model"]
    return eqx.combine(restored, static)


def load_model(ckpt_dir: str | Path, sharding=None) -> tuple[OLMo3, ModelConfig]:
    """The model and its config from a checkpoint directory (manager root, run dir or step dir)."""
    root, step = resolve_step_dir(ckpt_dir)
    cfg = model_config_from_dict(read_config(root, step), str(root / str(step)))
    return restore_model(root, step, cfg, sharding), cfg
