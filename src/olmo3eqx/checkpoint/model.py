"""The model alone in a checkpoint: written for conversion (`save_model`, `save_model_leaves`), read back for
`init_from`, evaluation, generation and conversion (`restore_model`, `load_model`, `load_any`, `restore_model_leaf`).

Readers that need part of a state (the moments for `init_from`, one leaf for conversion) restore just those
top-level parts (`restore_parts`); nothing else is read. The model alone (`restore_model`: `init_from`, evaluation,
generation, `load_model`, `load_any`) is read leaf by leaf and stored chunk by stored chunk straight into the buffers
of the device shards it lands on, in the dtype asked for: a restore holds the weights it returns plus about one
stored chunk (orbax's own restore reads each shard whole in the stored dtype, then casts and copies it: 1.7x the
weights at its peak restoring a float32 checkpoint as float32, 2.1x as bfloat16, bench/bench_speak_memory.py).
save_model and save_model_leaves store arrays in chunks of at most CHUNK_BYTES; a training checkpoint's chunks are
its device shards.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
from etils import epath
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental import v1 as ocp_v1
from orbax.checkpoint.experimental.v1 import partial as ocp_partial

from olmo3eqx import storage
from olmo3eqx.checkpoint.layout import (
    COMMITTED, STATE, check_model_config, checkpoint_dir, is_remote, model_config_from_dict, read_config,
    resolve_step_dir,
)
from olmo3eqx.config import ModelConfig, to_dict
from olmo3eqx.errors import ConfigError
from olmo3eqx.hf.weights import aligned_empty
from olmo3eqx.model import DTYPE, OLMo3, abstract_model
from olmo3eqx.sharding import is_leaf_like, model_shardings
from olmo3eqx.storage import StorePath

CHUNK_BYTES = 64 * 2**20
"""Largest stored chunk of an array that save_model and save_model_leaves write: restore_model decodes one chunk at a
time, so this bounds what a restore holds beyond the weights (a chunk is compressed whole, so a larger one is read
whole whatever part of it is wanted)."""


def save_model(directory: str | StorePath, model: OLMo3, cfg: ModelConfig, step: int = 0, extra_config: dict | None = None):
    """Write `model` as step `step` of the checkpoint directory (blocking): a state of the model alone."""
    directory = checkpoint_dir(directory, write=True)
    config = {"model": to_dict(cfg), **(extra_config or {})}
    state = {"model": eqx.filter(model, eqx.is_array)}
    chunked = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), state)
    with ocp.CheckpointManager(directory, item_names=(STATE, "config")) as mngr:
        mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state, save_args=chunked),
            config=ocp.args.JsonSave(config)), force=True)
        mngr.wait_until_finished()


def _nest(path: tuple[str, ...], leaf) -> dict:
    """{"a": {"b": leaf}} for path ("a", "b"): one model leaf as a tree orbax saves and restores under the same keys
    as the leaf inside the saved OLMo3 (module attributes and dict keys name a leaf alike)."""
    for name in reversed(path):
        leaf = {name: leaf}
    return leaf


def save_model_leaves(directory: str | StorePath, cfg: ModelConfig, leaves: Iterable[tuple[tuple[str, ...], jax.Array]],
                      step: int = 0, extra_config: dict | None = None) -> None:
    """Write step `step` of the checkpoint directory from the model's leaves given one at a time as (attribute path,
    array), e.g. (("blocks", "mlp", "up_proj", "weight"), x): each is written (orbax's partial save) and released
    before the next is asked for, so memory stays near one leaf. The result is save_model's layout, read back by
    load_model and restore_parts. Staged under `<step>.partial` and renamed into place when complete. A directory in
    a bucket is staged in a local temporary directory (orbax's partial save cannot write a bucket: "Snapshot is not
    supported for CommitFileTemporaryPath"; TMPDIR must hold the checkpoint), then uploaded file by file, COMMITTED
    last. One process (the conversion tools run in one)."""
    if is_remote(directory):
        target = checkpoint_dir(directory, write=True)
        with tempfile.TemporaryDirectory(prefix="olmo3eqx-convert-") as tmp:
            save_model_leaves(tmp, cfg, leaves, step, extra_config)
            local = Path(tmp) / str(step)
            (local / COMMITTED).write_text(f"checkpoint step {step} written by olmo3eqx\n")
            storage.upload_tree(local, str(target / str(step)), last=[COMMITTED])
        return
    directory = checkpoint_dir(directory, write=True)
    staging, final = directory / f"{step}.partial", directory / str(step)
    directory.mkdir(parents=True, exist_ok=True)
    chunked = ocp_v1.Context()
    chunked.array.saving.storage_options.chunk_byte_size = CHUNK_BYTES
    with chunked:
        for path, leaf in leaves:
            ocp_partial.save(staging, {"model": _nest(path, leaf)})
            del leaf
        ocp_partial.finalize(staging)
    config = {"model": to_dict(cfg), **(extra_config or {})}
    ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(staging / "config", args=ocp.args.JsonSave(config))
    staging.rename(final)


def saved_parts(root: StorePath, step: int) -> list[str]:
    """The top-level parts of a step's saved state (a training checkpoint: every TrainState field)."""
    # The item's handler reads the tree's own _METADATA; a Checkpointer would also look for a step-level
    # _CHECKPOINT_METADATA inside the item directory, which is never there, and log an absl warning every time.
    return list(ocp.PyTreeCheckpointHandler().metadata(epath.Path(str(root)) / str(step) / STATE).tree)


def restore_parts(root: StorePath, step: int, targets: dict[str, Any], restore_args=None) -> dict[str, Any]:
    """Top-level parts of a step's saved state, each restored onto its target (a tree like the part, whose array
    leaves are sharded ShapeDtypeStructs, see sharding.with_shardings; `restore_args`, a tree like `targets`, can ask
    for another type); the other parts are not read."""
    missing = sorted(set(targets) - set(saved_parts(root, step)))
    if missing:
        raise ConfigError(f"Checkpoint {root / str(step)} holds no {', '.join(missing)}; a converted checkpoint holds "
                          f"the model only.")
    restore_args = restore_args or ocp.checkpoint_utils.construct_restore_args(targets)
    args = ocp.args.PyTreeRestore(item=targets, restore_args=restore_args, partial_restore=True)
    with ocp.CheckpointManager(root, item_names=(STATE,)) as mngr:
        return dict(mngr.restore(step, args=ocp.args.Composite(state=args))[STATE])


VOCAB_AXIS = {"embed": 0, "lm_head.weight": 1}
"""The vocabulary axis of the model's two vocabulary-sized leaves (by attribute path): the embedding is [vocab, hidden],
the LM head's Linear weight [hidden, vocab]."""


def restore_model(root: StorePath, step: int, cfg: ModelConfig, sharding=None,
                  vocab_rows: int | None = None) -> OLMo3:
    """The model of `step` in cfg.param_dtype (cast as it is read, when the checkpoint stores another dtype), each leaf
    built on `sharding` (a tree of shardings like the model's arrays, or one; default the first device). Leaves are
    read one at a time, every device shard chunk by stored chunk straight into that shard's own buffer (which a CPU
    device adopts as is), and each process reads only the shards of its own devices: the restore holds the model it
    returns plus one stored chunk, whatever the checkpoint's dtype, mesh or process count. `vocab_rows`: the
    checkpoint's vocabulary when it is smaller than cfg.vocab_size; the embedding rows and LM-head columns past it
    read as zeros (pad_vocabulary fills them)."""
    if "model" not in saved_parts(root, step):
        raise ConfigError(f"Checkpoint {root / str(step)} holds no model; pass one that train.py or convert.py "
                          f"wrote.")
    abstract = abstract_model(cfg)
    params, static = eqx.partition(abstract, is_leaf_like)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = sharding if not isinstance(sharding, jax.sharding.Sharding) else jax.tree.map(lambda _: sharding, params)
    reader = StateReader(root / str(step) / STATE)
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)

    def stored_shape(name: str, like: jax.ShapeDtypeStruct) -> tuple[int, ...]:
        shape = list(like.shape)
        if vocab_rows is not None and name in VOCAB_AXIS:
            shape[VOCAB_AXIS[name]] = vocab_rows
        return tuple(shape)

    names = [jax.tree_util.keystr(path, simple=True, separator=".") for path, _ in leaves]
    arrays = [reader.read("model." + name, like, s, stored_shape(name, like))
              for name, (_, like), s in zip(names, leaves, jax.tree.leaves(shardings))]
    return eqx.combine(jax.tree.unflatten(tree, arrays), static)


class StateReader:
    """Arrays of a step's saved state read with tensorstore through the specs orbax reads them with (any of its
    layouts: OCDBT or not, zarr2 or zarr3, written by any number of processes, local or in a bucket)."""

    def __init__(self, state_dir: StorePath):
        from orbax.checkpoint._src.serialization import tensorstore_utils, types

        self.state_dir, self.tsu, self.types = state_dir, tensorstore_utils, types
        self.layout = json.loads((state_dir / "_METADATA").read_text())
        self.context = tensorstore_utils.get_ts_context(use_ocdbt=self.layout["use_ocdbt"])

    def open(self, name: str, dtype):
        """The stored array `name` (orbax's name: the tree path joined by dots), read as `dtype`."""
        import tensorstore as ts

        info = self.types.ParamInfo(name=name, parent_dir=self.state_dir, use_zarr3=self.layout["use_zarr3"],
                                    ts_context=self.context)
        spec = self.tsu.build_array_read_spec(info, use_ocdbt=self.layout["use_ocdbt"], target_dtype=dtype)
        return ts.open(spec.json, open=True, context=self.context).result()

    def read(self, name: str, like: jax.ShapeDtypeStruct, sharding: jax.sharding.Sharding,
             stored_shape: tuple[int, ...] | None = None) -> jax.Array:
        """Array `name` shaped like `like`, in its dtype, on `sharding`; each addressable shard filled one stored chunk
        at a time (a wider read would decode every chunk it spans before copying any). `stored_shape` (default like's,
        nowhere larger): the shape the checkpoint must hold; what lies past it reads as zeros."""
        stored = self.open(name, like.dtype)
        expected = tuple(like.shape) if stored_shape is None else tuple(stored_shape)
        if tuple(stored.shape) != expected:
            raise ConfigError(f"Array {name} of checkpoint {self.state_dir.parent} has shape {list(stored.shape)}, "
                              f"but its config implies {list(expected)}.")
        chunk = stored.chunk_layout.read_chunk.shape

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            region = [range(n)[i] for n, i in zip(like.shape, index)]
            out = aligned_empty(tuple(len(r) for r in region), like.dtype)
            held = [range(r.start, min(r.stop, n)) for r, n in zip(region, expected)]  # what the checkpoint holds
            if held != region:
                out.fill(0)
            cells = [range(h.start - h.start % c, h.stop, c) for h, c in zip(held, chunk)]
            for corner in itertools.product(*cells):
                lo = [max(c, h.start) for c, h in zip(corner, held)]
                hi = [min(c + k, h.stop) for c, k, h in zip(corner, chunk, held)]
                part = tuple(slice(a - r.start, b - r.start) for a, b, r in zip(lo, hi, region))
                out[part] = stored[tuple(slice(a, b) for a, b in zip(lo, hi))].read().result()
            return out

        return jax.make_array_from_callback(tuple(like.shape), sharding, shard, dtype=like.dtype)


def restore_model_leaf(root: StorePath, step: int, path: tuple[str, ...], like: jax.ShapeDtypeStruct) -> np.ndarray:
    """One model leaf (attribute path, as in save_model_leaves) of a step's state, shaped `like`, as a host array (no
    device needs to hold it); no other array is read."""
    restore_args = _nest(path, ocp.RestoreArgs(restore_type=np.ndarray, dtype=like.dtype))
    tree = restore_parts(root, step, {"model": _nest(path, like)}, {"model": restore_args})["model"]
    for name in path:
        tree = tree[name]
    return tree


def open_model(ckpt_dir: str | StorePath) -> tuple[StorePath, int, ModelConfig]:
    """(manager root, step, model config) of a checkpoint directory (manager root, run dir or step dir)."""
    root, step = resolve_step_dir(ckpt_dir)
    return root, step, model_config_from_dict(read_config(root, step), str(root / str(step)))


def load_model(ckpt_dir: str | StorePath, sharding=None) -> tuple[OLMo3, ModelConfig]:
    """The model and its config from a checkpoint directory (manager root, run dir or step dir)."""
    root, step, cfg = open_model(ckpt_dir)
    return restore_model(root, step, cfg, sharding), cfg


class Loaded(NamedTuple):
    """A model to evaluate or generate with, and what its checkpoint says about it (load_any)."""

    model: OLMo3
    cfg: ModelConfig
    stored: dict | None
    """The config stored with an orbax checkpoint (a training run's: model, data, eval, ...); None for HF."""
    tokenizer: str | None
    """An HF directory's tokenizer.json, when it has one."""
    step: int
    run_dir: StorePath | None
    """The run directory of a training checkpoint."""


def speaking_config(cfg: ModelConfig, dtype: str | None) -> ModelConfig:
    """`cfg` with params and compute in `dtype` (None: cfg's compute dtype). The forward casts every weight to the
    compute dtype before using it, so weights held in that dtype give the same outputs in a fraction of the memory of
    float32 masters."""
    dtype = dtype or cfg.compute_dtype
    return dataclasses.replace(cfg, param_dtype=dtype, compute_dtype=dtype)


def load_any(ckpt: str, mesh, dtype: str | None = None) -> Loaded:
    """The model of `ckpt` (a run directory's newest step, its checkpoints/, one step, convert.py's output, local or in
    a bucket, or a local HF Olmo3 directory) restored straight onto `mesh` where training would shard it (one copy,
    each process reading only its own devices' shards), in `dtype` (params and compute; None: the checkpoint's compute
    dtype, float32 for an HF directory)."""
    from olmo3eqx.hf import config_json, weights

    if dtype is not None and dtype not in DTYPE:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPE)}.")
    if not storage.is_url(ckpt) and (Path(ckpt) / config_json.CONFIG_FILE).is_file():
        w = weights.open_hf(ckpt, DTYPE[dtype or "float32"])
        model = weights.load_weights(w, model_shardings(abstract_model(w.cfg), mesh))
        tokenizer = Path(ckpt) / "tokenizer.json"
        return Loaded(model, w.cfg, None, str(tokenizer) if tokenizer.is_file() else None, 0, None)
    root, step = resolve_step_dir(ckpt)
    stored = read_config(root, step)
    cfg = speaking_config(model_config_from_dict(stored, str(root / str(step))), dtype)
    model = restore_model(root, step, cfg, model_shardings(abstract_model(cfg), mesh))
    return Loaded(model, cfg, stored, None, step, root.parent if root.name == "checkpoints" else None)


INIT_FROM_CHANGEABLE = ("rope_scaling",)
"""Fields a run started from a checkpoint (init_from) may also change: the long-context stage switches YaRN on
over weights trained with plain RoPE. A resumed run keeps them."""


def init_from(path: str | StorePath, fresh, target, *, with_optimizer: bool, note=None):
    """`fresh` with the parts it takes from checkpoint `path` replaced: the model, and with `with_optimizer` the AdamW
    state (stage 2's start); step, data position and spike-guard history stay the fresh state's. `target` is as in
    Checkpointer.restore. A checkpoint with a smaller vocabulary than the config (AI2's released 100,278 rows against
    the 100,352 OLMo-core trains) gives its rows; the padding rows keep the fresh state's initialisation
    (pad_vocabulary), and `note` (a function of one line) says so."""
    root, step = resolve_step_dir(path)
    where = str(root / str(step))
    stored = read_config(root, step)
    current = fresh.model.cfg
    rows = model_config_from_dict(stored, where).vocab_size
    padded = rows < current.vocab_size
    check_model_config(stored, current, where, allow=INIT_FROM_CHANGEABLE + (("vocab_size",) if padded else ()))
    if with_optimizer and padded:
        raise ConfigError(f"Checkpoint {where} has {rows:,} vocabulary rows and the config {current.vocab_size:,}: "
                          f"a padded vocabulary starts with fresh moments, none are carried into rows the checkpoint "
                          f"never trained; drop --init-optimizer, or set model.vocab_size to {rows}.")
    if with_optimizer and "opt_state" not in saved_parts(root, step):
        raise FileNotFoundError(f"Checkpoint {where} has no optimizer state (a converted checkpoint has weights "
                                f"only); drop --init-optimizer to start with fresh moments.")
    shardings = jax.tree.map(lambda a: a.sharding, target.model)  # the target's leaves are sharded ShapeDtypeStructs
    model = restore_model(root, step, current, shardings, vocab_rows=rows if padded else None)
    if padded:
        model = pad_vocabulary(model, fresh.model, rows)
        if note is not None:
            note(f"padded the vocabulary from {rows:,} to {current.vocab_size:,} rows: embedding rows and LM-head "
                 f"columns {rows:,}-{current.vocab_size - 1:,} initialised as OLMo-core initialises them (truncated "
                 f"normal, std {current.initializer_range}, from run.seed); the checkpoint's tokenizer has no id "
                 f"that reaches them")
    state = eqx.tree_at(lambda s: s.model, fresh, model)
    if with_optimizer:
        opt_state = restore_parts(root, step, {"opt_state": target.opt_state})["opt_state"]
        state = eqx.tree_at(lambda s: s.opt_state, state, opt_state)
    return state


def pad_vocabulary(model: OLMo3, fresh: OLMo3, rows: int) -> OLMo3:
    """`model` with its embedding rows and LM-head columns from `rows` on taken from `fresh`: the padding of a
    vocabulary (OLMo-core pads the tokenizer's to a multiple of 128) initialised as every row of a fresh model is, the
    truncated normal of model.initializer_range from the run's seed, as OLMo-core's InitMethod.normal initialises its
    embedding and LM head. No token id reaches those rows (the tokenizer's ids are below `rows`); their LM-head
    columns stay in the softmax, as in OLMo-core's loss, which masks no logit. Each matrix is merged under jit on its
    own sharding, never whole on one device."""
    def merge(path, loaded, init):
        axis = VOCAB_AXIS.get(jax.tree_util.keystr(path, simple=True, separator="."))
        if axis is None:
            return loaded
        keep = lambda a, b: jnp.where(jax.lax.broadcasted_iota(jnp.int32, a.shape, axis) < rows, a, b)  # noqa: E731
        return jax.jit(keep, out_shardings=loaded.sharding)(loaded, init)

    params, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.tree_util.tree_map_with_path(merge, params, eqx.filter(fresh, eqx.is_array)), static)
