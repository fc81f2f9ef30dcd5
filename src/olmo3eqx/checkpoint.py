"""Orbax checkpoints: one `Composite` per saved step.

Layout of a checkpoint directory `C` (an orbax CheckpointManager root):
    C/<step>/model/      the model's arrays (StandardSave of `eqx.filter(model, eqx.is_array)`)
    C/<step>/config/     the resolved config as JSON (at least {"model": {...}})
Training checkpoints add `opt_state`, `train` (step, RNG, ...) and `data` (iterator states) items.
`convert.py hf-to-orbax` writes step 0 with the model and config items only.
"""

from __future__ import annotations

import dataclasses
import time
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


# --- training checkpoints -------------------------------------------------------------------------

TRAIN_ITEMS = ("model", "opt_state", "train", "data", "config")


class CheckpointLoadError(RuntimeError):
    """Every checkpoint in a run directory failed to load: never start from scratch over them."""


def abstract_with_shardings(abstract, shardings):
    """ShapeDtypeStruct leaves carrying the *current* mesh's shardings, so a restore lands resharded
    (a run saved on 4 devices resumes on 2 or 8)."""
    params, _ = eqx.partition(abstract, is_leaf_like)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)


class Checkpointer:
    """Composite checkpoints of a train state: `model`, `opt_state`, `train` (step, spike-guard buffers, RNG),
    `data` (the iterator state, JSON) and `config` (the resolved config, JSON). `checkpoints/N/` holds the
    state after N updates and a data state that has consumed exactly N global batches."""

    def __init__(self, directory: str | Path, *, keep: int, keep_every: int = 0, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, keep_period=keep_every or None, enable_async_checkpointing=async_save,
            create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=TRAIN_ITEMS)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        train = {"step": state.step, "spike": state.spike, "key": state.key}
        self.manager.save(step, args=ocp.args.Composite(
            model=ocp.args.StandardSave(model_arrays(state.model)),
            opt_state=ocp.args.StandardSave(state.opt_state),
            train=ocp.args.StandardSave(train),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config)), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def read_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def restore(self, step: int, abstract_state, shardings):
        """(state, data_state) of `step`, restored onto `shardings`."""
        target = abstract_with_shardings(abstract_state, shardings)
        train_target = {"step": target.step, "spike": target.spike, "key": target.key}
        out = self.manager.restore(step, args=ocp.args.Composite(
            model=ocp.args.StandardRestore(target.model),
            opt_state=ocp.args.StandardRestore(target.opt_state),
            train=ocp.args.StandardRestore(train_target),
            data=ocp.args.JsonRestore()))
        from olmo3eqx.step import TrainState

        _, static_model = eqx.partition(abstract_state.model, is_leaf_like)
        train = out["train"]
        state = TrainState(eqx.combine(out["model"], static_model), out["opt_state"], train["step"],
                           train["spike"], train["key"])
        return state, out["data"]

    def restore_latest(self, abstract_state, shardings, model_cfg: ModelConfig, warn=print):
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
                state, data_state = self.restore(step, abstract_state, shardings)
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
COMPUTE_ONLY_FIELDS = ("remat", "attention_impl", "scan_layers", "compute_dtype", "max_position_embeddings")


def model_config_mismatch(saved: ModelConfig, current: ModelConfig) -> list[str]:
    return [f"{f.name} (checkpoint {getattr(saved, f.name)!r}, config {getattr(current, f.name)!r})"
            for f in dataclasses.fields(ModelConfig)
            if f.name not in COMPUTE_ONLY_FIELDS and getattr(saved, f.name) != getattr(current, f.name)]


def check_model_config(saved: dict, current: ModelConfig, where: str) -> None:
    diff = model_config_mismatch(model_config_from_dict(saved, where), current)
    if diff:
        raise ConfigError(f"The model config differs from checkpoint {where} in {', '.join(diff)}; use the "
                          f"checkpoint's values or start a new run (a new run.name).")


def init_from(path: str | Path, state, abstract_state, shardings, *, with_optimizer: bool):
    """A fresh state whose weights (and with `with_optimizer` the AdamW moments) come from checkpoint `path`;
    step, data position, spike-guard history and RNG stay those of the fresh state (stage 2's start)."""
    root, step = resolve_step_dir(path)
    where = str(root / str(step))
    check_model_config(read_config(root, step), state.model.cfg, where)
    model = restore_model(root, step, state.model.cfg, shardings.model)
    opt_state = state.opt_state
    if with_optimizer:
        if not (root / str(step) / "opt_state").is_dir():
            raise FileNotFoundError(f"Checkpoint {where} has no optimizer state (a converted checkpoint has weights "
                                    f"only); drop --init-optimizer to start with fresh moments.")
        target = abstract_with_shardings(abstract_state, shardings).opt_state
        with ocp.CheckpointManager(root, item_names=("opt_state",)) as mngr:
            opt_state = mngr.restore(step, args=ocp.args.Composite(
                opt_state=ocp.args.StandardRestore(target)))["opt_state"]
    return type(state)(model, opt_state, state.step, state.spike, state.key)
