"""Orbax checkpoints: one `Composite` per saved step, the train state saved and restored as one tree.

Layout of a checkpoint directory `C` (an orbax CheckpointManager root):
    C/<step>/state/      the train state's arrays as one tree (olmo3eqx.state.TrainState: model, opt_state, ...);
                         `convert.py hf-to-orbax` writes a state holding only {"model": ...}, as step 0
    C/<step>/config/     the resolved config as JSON (at least {"model": {...}})
    C/<step>/data/       training checkpoints only: the data-iterator state (JSON)
Readers that need part of a state (the model for evaluation or conversion, model and moments for `init_from`)
restore just those top-level parts (`restore_parts`); nothing else is read.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import orbax.checkpoint as ocp

from olmo3eqx.config import ConfigError, ModelConfig, from_dict, to_dict
from olmo3eqx.model import OLMo3, abstract_model
from olmo3eqx.sharding import is_leaf_like, with_shardings

STATE = "state"
"""The item holding the train state (or a converted model) of every checkpoint step."""


def save_model(directory: str | Path, model: OLMo3, cfg: ModelConfig, step: int = 0, extra_config: dict | None = None):
    """Write `model` as step `step` of the checkpoint directory (blocking): a state of the model alone."""
    directory = Path(directory).absolute()
    config = {"model": to_dict(cfg), **(extra_config or {})}
    with ocp.CheckpointManager(directory, item_names=(STATE, "config")) as mngr:
        mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"model": eqx.filter(model, eqx.is_array)}),
            config=ocp.args.JsonSave(config)), force=True)
        mngr.wait_until_finished()


def resolve_step_dir(path: str | Path) -> tuple[Path, int]:
    """Accept a manager root (newest complete step wins) or one step directory; return (root, step)."""
    path = Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {path} does not exist; pass the directory convert.py or train.py wrote.")
    if (path / STATE).is_dir() and path.name.isdigit():
        return path.parent, int(path.name)
    if (path / "checkpoints").is_dir():  # a run directory
        path = path / "checkpoints"
    steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / STATE).is_dir())
    if not steps:
        raise FileNotFoundError(f"No complete checkpoint step under {path}; expected <step>/{STATE}/ subdirectories.")
    return path, steps[-1]


def read_config(root: Path, step: int) -> dict:
    with ocp.CheckpointManager(root, item_names=("config",)) as mngr:
        return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]


def model_config_from_dict(d: dict, where: str) -> ModelConfig:
    try:
        return from_dict(ModelConfig, d["model"], "model")
    except (KeyError, ConfigError) as e:
        raise ConfigError(f"The config stored in checkpoint {where} is not a valid model config: {e}") from None


def saved_parts(root: Path, step: int) -> list[str]:
    """The top-level parts of a step's saved state (a training checkpoint: every TrainState field)."""
    return list(ocp.PyTreeCheckpointer().metadata(root / str(step) / STATE).item_metadata.tree)


def restore_parts(root: Path, step: int, targets: dict[str, Any]) -> dict[str, Any]:
    """Top-level parts of a step's saved state, each restored onto its target (a tree like the part, whose array
    leaves are sharded ShapeDtypeStructs, see sharding.with_shardings); the other parts are not read."""
    missing = sorted(set(targets) - set(saved_parts(root, step)))
    if missing:
        raise ConfigError(f"Checkpoint {root / str(step)} holds no {', '.join(missing)}; a converted checkpoint holds "
                          f"the model only.")
    args = ocp.args.PyTreeRestore(item=targets, restore_args=ocp.checkpoint_utils.construct_restore_args(targets),
                                  partial_restore=True)
    with ocp.CheckpointManager(root, item_names=(STATE,)) as mngr:
        return dict(mngr.restore(step, args=ocp.args.Composite(state=args))[STATE])


def restore_model(root: Path, step: int, cfg: ModelConfig, sharding=None) -> OLMo3:
    """Restore the model arrays of `step` onto `sharding` (a pytree of shardings like the model, or one)."""
    abstract = abstract_model(cfg)
    params, static = eqx.partition(abstract, is_leaf_like)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = sharding if not isinstance(sharding, jax.sharding.Sharding) else jax.tree.map(lambda _: sharding, params)
    restored = restore_parts(root, step, {"model": with_shardings(abstract, shardings)})["model"]
    return eqx.combine(restored, static)


def load_model(ckpt_dir: str | Path, sharding=None) -> tuple[OLMo3, ModelConfig]:
    """The model and its config from a checkpoint directory (manager root, run dir or step dir)."""
    root, step = resolve_step_dir(ckpt_dir)
    cfg = model_config_from_dict(read_config(root, step), str(root / str(step)))
    return restore_model(root, step, cfg, sharding), cfg


# --- training checkpoints -------------------------------------------------------------------------

TRAIN_ITEMS = (STATE, "data", "config")


class CheckpointLoadError(RuntimeError):
    """Every checkpoint in a run directory failed to load: never start from scratch over them."""


class Checkpointer:
    """Composite checkpoints of a train state: `state` (the TrainState's arrays, one tree), `data` (the iterator
    state, JSON) and `config` (the resolved config, JSON). `checkpoints/N/` holds the state after N updates and a
    data state that has consumed exactly N global batches."""

    def __init__(self, directory: str | Path, *, keep: int, keep_every: int = 0, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, keep_period=keep_every or None, enable_async_checkpointing=async_save,
            create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=TRAIN_ITEMS)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(eqx.filter(state, eqx.is_array)),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config)), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def read_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def restore(self, step: int, target):
        """(state, data_state) of `step`. `target` is the train state as sharded ShapeDtypeStructs of the current
        mesh (Layout.state_target()), so the restore lands resharded."""
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        return out[STATE], out["data"]

    def restore_latest(self, target, model_cfg: ModelConfig, warn=print):
        """The newest checkpoint that loads, falling back over torn or unreadable ones with a warning; None when
        the directory has no checkpoint; CheckpointLoadError when it has some and none loads. A readable
        checkpoint whose model config differs from `model_cfg` is a ConfigError, not a fallback."""
        steps = self.steps()
        errors = []
        for step in reversed(steps):
            try:
                config = self.read_config(step)
            except Exception as e:  # noqa: BLE001
                config, read_error = None, e
            if config is not None:
                check_model_config(config, model_cfg, str(self.directory / str(step)))
            try:
                if config is None:
                    raise read_error
                state, data_state = self.restore(step, target)
                self._set_aside([s for s in steps if s > step])
                return step, state, data_state
            except Exception as e:  # noqa: BLE001 - any failure to read a step means: try the previous one
                errors.append(f"step {step}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                warn(f"warning: checkpoint {self.directory / str(step)} could not be restored "
                     f"({errors[-1]}); falling back to the previous one.")
        if steps:
            raise CheckpointLoadError(
                f"None of the checkpoints in {self.directory} could be restored ({'; '.join(errors)}); refusing to "
                f"start from scratch over them. Fix or move the directory, or use a new run.name.")
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Rename unreadable newer steps to `<step>.unreadable-<unix time>`: kept for inspection, out of the way of
        the steps the resumed run will write again."""
        if not steps:
            return
        if jax.process_index() == 0:
            stamp = int(time.time())
            for step in steps:
                (self.directory / str(step)).rename(self.directory / f"{step}.unreadable-{stamp}")
        self.manager.reload()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


# Fields that may change between a checkpoint and the run that loads it: they change how the model is computed,
# not what its parameters are.
COMPUTE_ONLY_FIELDS = ("remat", "attention_impl", "attention_block_q", "attention_block_kv", "scan_layers",
                       "compute_dtype", "max_position_embeddings")


def model_config_mismatch(saved: ModelConfig, current: ModelConfig) -> list[str]:
    return [f"{f.name} (checkpoint {getattr(saved, f.name)!r}, config {getattr(current, f.name)!r})"
            for f in dataclasses.fields(ModelConfig)
            if f.name not in COMPUTE_ONLY_FIELDS and getattr(saved, f.name) != getattr(current, f.name)]


def check_model_config(saved: dict, current: ModelConfig, where: str) -> None:
    diff = model_config_mismatch(model_config_from_dict(saved, where), current)
    if diff:
        raise ConfigError(f"The model config differs from checkpoint {where} in {', '.join(diff)}; use the "
                          f"checkpoint's values or start a new run (a new run.name).")


def init_from(path: str | Path, fresh, target, *, with_optimizer: bool):
    """`fresh` with the parts it takes from checkpoint `path` replaced: the model, and with `with_optimizer` the AdamW
    state (stage 2's start); step, data position and spike-guard history stay the fresh state's. `target` is as in
    Checkpointer.restore."""
    root, step = resolve_step_dir(path)
    where = str(root / str(step))
    check_model_config(read_config(root, step), fresh.model.cfg, where)
    parts = ("model", "opt_state") if with_optimizer else ("model",)
    if with_optimizer and "opt_state" not in saved_parts(root, step):
        raise FileNotFoundError(f"Checkpoint {where} has no optimizer state (a converted checkpoint has weights "
                                f"only); drop --init-optimizer to start with fresh moments.")
    taken = restore_parts(root, step, {name: getattr(target, name) for name in parts})
    return eqx.tree_at(lambda s: [getattr(s, name) for name in parts], fresh, [taken[name] for name in parts])
