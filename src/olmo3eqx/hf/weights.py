"""HF safetensors <-> OLMo3, one tensor at a time: the Python API's load_hf and save_hf.

An HF checkpoint directory holds `config.json` (olmo3eqx.hf.config_json) and either one `model.safetensors` or
shards listed in `model.safetensors.index.json`. HF Linear weights are [out, in] (ours [in, out]); per-layer tensors
`model.layers.{i}.*` are stacked along our leading layer axis. Reading uses safetensors' numpy API and JSON only:
nothing is unpickled. Both directions move one model leaf at a time (read_leaf, write_hf), read and written in
CHUNK_BYTES pieces, so a conversion never needs the whole model in host memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from olmo3eqx.config import ModelConfig
from olmo3eqx.hf.config_json import CONFIG_FILE, config_from_hf, config_to_hf, read_config_json, resolve_token_ids
from olmo3eqx.errors import ConversionError
from olmo3eqx.model import OLMo3, abstract_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


DEFAULT_MAX_SHARD_BYTES = 2 * 10**9


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    path: tuple[str, ...]  # attribute path in OLMo3 (per-layer tensors: under `blocks`)
    layer: int | None  # index along the stacked layer axis; None for top-level tensors
    transpose: bool  # HF Linear [out, in] <-> ours [in, out]
    hf_shape: tuple[int, ...]


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of an HF Olmo3ForCausalLM checkpoint, in the order transformers writes them."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = [
        ("self_attn.q_proj.weight", ("attn", "q_proj", "weight"), True, (q, h)),
        ("self_attn.k_proj.weight", ("attn", "k_proj", "weight"), True, (kv, h)),
        ("self_attn.v_proj.weight", ("attn", "v_proj", "weight"), True, (kv, h)),
        ("self_attn.o_proj.weight", ("attn", "o_proj", "weight"), True, (h, q)),
        ("self_attn.q_norm.weight", ("attn", "q_norm", "weight"), False, (q,)),
        ("self_attn.k_norm.weight", ("attn", "k_norm", "weight"), False, (kv,)),
        ("post_attention_layernorm.weight", ("post_attention_norm", "weight"), False, (h,)),
        ("mlp.gate_proj.weight", ("mlp", "gate_proj", "weight"), True, (i, h)),
        ("mlp.up_proj.weight", ("mlp", "up_proj", "weight"), True, (i, h)),
        ("mlp.down_proj.weight", ("mlp", "down_proj", "weight"), True, (h, i)),
        ("post_feedforward_layernorm.weight", ("post_feedforward_norm", "weight"), False, (h,)),
    ]
    specs = [TensorSpec("model.embed_tokens.weight", ("embed",), None, False, (v, h))]
    for layer in range(cfg.num_hidden_layers):
        specs += [TensorSpec(f"model.layers.{layer}.{name}", ("blocks", *path), layer, t, shape)
                  for name, path, t, shape in per_layer]
    specs += [TensorSpec("model.norm.weight", ("norm", "weight"), None, False, (h,)),
              TensorSpec("lm_head.weight", ("lm_head", "weight"), None, True, (v, h))]
    return specs


def leaf_of(tree, path: tuple[str, ...]):
    """The leaf at attribute path `path` of a model-shaped tree (the model, its abstract twin, its shardings)."""
    for name in path:
        tree = getattr(tree, name)
    return tree


def _first(names: Iterable[str], n: int = 3) -> str:
    names = sorted(names)
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


# --- load: checked once, then read tensor by tensor -----------------------------------------------


def _weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index when there is one."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConversionError(f"{index} is not a safetensors index (a JSON object with a weight_map).") from None
        files = {name: path / file for name, file in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise FileNotFoundError(f"Shard {missing[0]} listed in {index} is missing.")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}; it has no safetensors weights.")
    with safe_open(str(single), framework="numpy") as f:
        return {name: single for name in f.keys()}


def _is_ignorable(name: str) -> bool:
    return ".rotary_emb." in name  # non-persistent RoPE buffers some older exports carry


def leaf_groups(specs: list[TensorSpec]) -> dict[tuple[str, ...], list[TensorSpec]]:
    """Model leaf path -> its HF tensors (one per layer, in layer order, for a stacked block leaf), in spec order."""
    groups: dict[tuple[str, ...], list[TensorSpec]] = {}
    for s in specs:
        groups.setdefault(s.path, []).append(s)
    return groups


@dataclasses.dataclass(frozen=True)
class HFWeights:
    """An HF checkpoint directory whose tensors were checked against its config.json (names, shapes, dtypes)."""

    path: Path
    cfg: ModelConfig
    files: dict[str, Path]
    """HF tensor name -> the safetensors file holding it."""
    specs: list[TensorSpec]


def open_hf(path: str | Path, dtype=jnp.float32, warn=None, eos_token_id: int | None = None,
            pad_token_id: int | None = None) -> HFWeights:
    """Check an HF Olmo3 directory before reading any weight: ConversionError names every missing and every
    unexpected tensor together (a renamed tensor shows where it went), a mis-shaped one, a non-float one. `dtype` is
    the ModelConfig's param and compute dtype; `warn` as in rope_from_hf; the token ids come from resolve_token_ids
    (the given ids fill only what the checkpoint lacks)."""
    path = Path(path)
    raw = read_config_json(path)
    cfg = config_from_hf(raw, dtype, str(path / CONFIG_FILE), resolve_token_ids(path, eos_token_id, pad_token_id),
                         warn)
    files = _weight_files(path)
    specs = tensor_specs(cfg)
    if raw.get("tie_word_embeddings", False) and "lm_head.weight" not in files:
        # Tied checkpoints store the embedding once; ours are untied, so the head gets its own copy.
        specs[-1] = dataclasses.replace(specs[-1], hf_name="model.embed_tokens.weight")
    expected = {s.hf_name for s in specs}
    missing = expected - set(files)
    unexpected = {n for n in files if n not in expected and not _is_ignorable(n)}
    if missing or unexpected:
        found = ([f"missing tensor {_first(missing)}"] if missing else []) + \
                ([f"unexpected tensor {_first(unexpected)}"] if unexpected else [])
        raise ConversionError(f"{path} does not hold the Olmo3ForCausalLM tensors its {CONFIG_FILE} implies: "
                              f"{'; '.join(found)}.")
    by_file: dict[Path, list[TensorSpec]] = {}
    for s in specs:
        by_file.setdefault(files[s.hf_name], []).append(s)
    for file, file_specs in by_file.items():
        with safe_open(str(file), framework="numpy") as f:
            keys = set(f.keys())
            for s in file_specs:
                if s.hf_name not in keys:
                    raise ConversionError(f"Tensor {s.hf_name} is not in {file.name}, where {INDEX_FILE} says it is.")
                info = f.get_slice(s.hf_name)
                if tuple(info.get_shape()) != s.hf_shape:
                    raise ConversionError(f"Tensor {s.hf_name} in {file.name} has shape {list(info.get_shape())} but "
                                          f"{CONFIG_FILE} implies {list(s.hf_shape)}.")
                if info.get_dtype() not in SAFETENSORS_FLOATS:
                    raise ConversionError(f"Tensor {s.hf_name} in {file.name} has dtype {info.get_dtype()}; expected "
                                          f"a floating-point tensor ({', '.join(SAFETENSORS_FLOATS)}).")
    return HFWeights(path, cfg, files, specs)


CHUNK_BYTES = 64 * 2**20
"""Most bytes of one HF tensor in flight at once, read (each piece opens its file afresh) or written."""
HOST_ALIGNMENT = 64
"""Byte alignment at which JAX's CPU client adopts a numpy buffer as a device buffer instead of copying it."""


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array starting on a HOST_ALIGNMENT boundary: put on a CPU device it is aliased, not copied,
    so building a leaf there costs one leaf of host memory, not two."""
    dtype = np.dtype(dtype)
    raw = np.empty(math.prod(shape) * dtype.itemsize + HOST_ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def _read_into(out: np.ndarray, w: HFWeights, s: TensorSpec, index: tuple[slice, ...]) -> None:
    """Fill `out` with the part `index` (in our orientation) of HF tensor `s`, cast to out's dtype, CHUNK_BYTES
    of it at a time along the HF tensor's first axis. Each piece opens the file for itself: safetensors maps files
    into memory, and the pages a read touches stay resident until the file is closed."""
    hf_index = tuple(index[::-1]) if s.transpose else tuple(index)
    rows = range(s.hf_shape[0])[hf_index[0]]
    step = max(1, CHUNK_BYTES // max(1, out.nbytes // max(1, len(rows))))
    for start in range(0, len(rows), step):
        piece = rows[start:start + step]
        with safe_open(str(w.files[s.hf_name]), framework="numpy") as f:
            x = f.get_slice(s.hf_name)[(slice(piece.start, piece.stop), *hf_index[1:])]
        if s.transpose:  # HF [out, in] rows are our columns
            out[:, start:start + len(piece)] = x.T
        else:
            out[start:start + len(piece)] = x


def read_leaf(w: HFWeights, path: tuple[str, ...], sharding: jax.sharding.Sharding, dtype) -> jax.Array:
    """One model leaf, built on `sharding` from the HF tensors: each device's shard is read from the files on its own,
    piece by piece into one host buffer that a CPU device adopts as is, so no host holds more of the leaf than its
    devices' parts (plus one CHUNK_BYTES piece)."""
    group = leaf_groups(w.specs)[path]
    s0 = group[0]
    part = s0.hf_shape[::-1] if s0.transpose else s0.hf_shape
    shape = part if s0.layer is None else (len(group), *part)

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        out = aligned_empty(tuple(len(range(n)[i]) for n, i in zip(shape, index)), dtype)
        if s0.layer is None:
            _read_into(out, w, s0, index)
        else:
            for j, layer in enumerate(range(len(group))[index[0]]):
                _read_into(out[j], w, group[layer], index[1:])
        return out

    return jax.make_array_from_callback(shape, sharding, shard)


def iter_leaves(w: HFWeights, shardings, dtype) -> Iterator[tuple[tuple[str, ...], jax.Array]]:
    """(leaf path, array) for every model leaf, one at a time; `shardings` is a tree like the model's arrays (see
    sharding.tree_shardings) or one Sharding for all."""
    for path in leaf_groups(w.specs):
        one = shardings if isinstance(shardings, jax.sharding.Sharding) else leaf_of(shardings, path)
        yield path, read_leaf(w, path, one, dtype)


def model_from_leaves(cfg: ModelConfig, leaves: dict[tuple[str, ...], jax.Array]) -> OLMo3:
    """Fill OLMo3.init's own (abstract) tree, so structure, shapes and dtypes are init's by construction."""
    abstract = abstract_model(cfg)
    paths = list(leaves)
    for p in paths:
        want = leaf_of(abstract, p)
        if (leaves[p].shape, leaves[p].dtype) != (want.shape, want.dtype):
            raise AssertionError(f"load_hf built {'.'.join(p)} as {leaves[p].shape} {leaves[p].dtype}, OLMo3.init "
                                 f"as {want.shape} {want.dtype}; the name mapping is wrong.")
    model = eqx.tree_at(lambda m: [leaf_of(m, p) for p in paths], abstract, [leaves[p] for p in paths])
    left = [x for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    if left:
        raise AssertionError(f"load_hf left {len(left)} model leaves unfilled; the name mapping is incomplete.")
    return model


def load_weights(w: HFWeights, sharding=None) -> OLMo3:
    """The whole model of a checked directory in w.cfg's param dtype, each leaf read tensor by tensor onto `sharding`
    (one Sharding, or a tree of them like the model's arrays; default the first device)."""
    sharding = sharding if sharding is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return model_from_leaves(w.cfg, dict(iter_leaves(w, sharding, w.cfg.param_dtype)))


def load_hf(path: str | Path, dtype=jnp.float32, sharding=None, warn=None, eos_token_id: int | None = None,
            pad_token_id: int | None = None) -> tuple[OLMo3, ModelConfig]:
    """An OLMo3 (params and compute in `dtype`) and its config from an HF Olmo3 checkpoint directory, its token ids
    from resolve_token_ids (the given ids fill only what the checkpoint lacks).

    Every tensor is checked by name, shape and dtype before any is read (open_hf), then read onto `sharding` as in
    load_weights. The whole model ends up in memory: to convert without holding it, iterate iter_leaves instead (as
    `convert.py hf-to-orbax` does).
    """
    w = open_hf(path, dtype, warn, eos_token_id, pad_token_id)
    return load_weights(w, sharding), w.cfg


# --- save: planned from shapes, then written tensor by tensor --------------------------------------

SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
"""Stored dtypes and their safetensors names."""
SAFETENSORS_FLOATS = ("F64", "F32", "BF16", "F16")
"""safetensors dtypes a checkpoint's weights may have."""


def plan_shards(specs: list[TensorSpec], itemsize: int, max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive specs packed into files of at most max_shard_bytes (a tensor larger than that gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for s in specs:
        size = math.prod(s.hf_shape) * itemsize
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(s)
        used += size
    return shards


def _start_safetensors(file: Path, specs: list[TensorSpec], dtype: str) -> dict[str, int]:
    """Write the safetensors header of `specs` (stored in this order, as `dtype`) and return each tensor's absolute
    byte offset in the file, so tensors can be written in any order without holding the shard in memory. Format
    (safetensors' own): u64 little-endian header length, JSON header padded with spaces to 8 bytes, raw data."""
    itemsize = jnp.dtype(dtype).itemsize
    header, begin = {"__metadata__": {"format": "pt"}}, 0
    for s in specs:
        end = begin + math.prod(s.hf_shape) * itemsize
        header[s.hf_name] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(s.hf_shape), "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
    data = 8 + len(text)
    return {s.hf_name: data + header[s.hf_name]["data_offsets"][0] for s in specs}


def _write_tensor(f, offset: int, t: np.ndarray, s: TensorSpec, dtype: str) -> None:
    """Write our tensor `t` as HF tensor `s` at byte `offset` of open file `f`, transposed and cast CHUNK_BYTES at a
    time (rows of the HF tensor)."""
    if (t.shape[::-1] if s.transpose else t.shape) != s.hf_shape:
        raise ConversionError(f"Model leaf {'.'.join(s.path)} gives {s.hf_name} the shape "
                              f"{list(t.shape[::-1] if s.transpose else t.shape)} but the config implies "
                              f"{list(s.hf_shape)}; the model and its config disagree.")
    step = max(1, CHUNK_BYTES // max(1, math.prod(s.hf_shape[1:]) * jnp.dtype(dtype).itemsize))
    f.seek(offset)
    for start in range(0, s.hf_shape[0], step):
        piece = t[:, start:start + step].T if s.transpose else t[start:start + step]
        np.ascontiguousarray(piece, dtype=dtype).tofile(f)


def write_hf(path: str | Path, cfg: ModelConfig, leaf: Callable[[tuple[str, ...]], np.ndarray | jax.Array],
             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype=None) -> list[Path]:
    """Write an HF Olmo3ForCausalLM directory (config.json, safetensors shards, their index) from `leaf(path)`, which
    gives one model leaf at a time (a host array restored from a checkpoint, or a device array of a model); each is
    fetched to the host once, written out piece by piece and released before the next is asked for, so host memory
    stays near one leaf. Files are laid out layer by layer, as transformers writes them. `dtype` (default
    cfg.param_dtype) is the stored dtype. Returns the shard files."""
    path = Path(path)
    out = jnp.dtype(dtype if dtype is not None else cfg.param_dtype).name
    if out not in SAFETENSORS_DTYPE:
        raise ConversionError(f"Stored dtype {out} is not one of {', '.join(SAFETENSORS_DTYPE)}.")
    specs = tensor_specs(cfg)
    shards = plan_shards(specs, jnp.dtype(out).itemsize, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    path.mkdir(parents=True, exist_ok=True)
    where, offsets = {}, {}
    for name, shard in zip(names, shards):
        offsets.update(_start_safetensors(path / name, shard, out))
        where.update({s.hf_name: name for s in shard})
    with ExitStack() as stack:
        handles = {name: stack.enter_context(open(path / name, "r+b")) for name in names}
        for leaf_path, group in leaf_groups(specs).items():
            x = np.asarray(jax.device_get(leaf(leaf_path)))
            for s in group:
                _write_tensor(handles[where[s.hf_name]], offsets[s.hf_name], x if s.layer is None else x[s.layer], s,
                              out)
            del x
    if n > 1:
        total = sum(math.prod(s.hf_shape) for s in specs) * jnp.dtype(out).itemsize
        index = {"metadata": {"total_size": total}, "weight_map": where}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / CONFIG_FILE).write_text(json.dumps(config_to_hf(cfg, out), indent=2) + "\n")
    return [path / name for name in names]


def save_hf(model: OLMo3, cfg: ModelConfig, path: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            dtype=None) -> list[Path]:
    """Write `model` as an HF Olmo3ForCausalLM directory (write_hf): its shapes are checked against `cfg` before any
    file is written; tensors go from the device to the file one at a time."""
    for s in tensor_specs(cfg):
        leaf = leaf_of(model, s.path)
        shape = tuple(leaf.shape[1:] if s.layer is not None else leaf.shape)
        want = s.hf_shape[::-1] if s.transpose else s.hf_shape
        if shape != want:
            raise ConversionError(f"Model leaf {'.'.join(s.path)} has shape {list(shape)} but the config implies "
                                  f"{list(want)}; the model and its config disagree.")
    return write_hf(path, cfg, lambda p: leaf_of(model, p), max_shard_bytes, dtype)

