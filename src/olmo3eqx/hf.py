"""`transformers` Olmo3 checkpoints <-> OLMo3, and logit parity against `transformers`' own forward.

An HF checkpoint directory holds `config.json` and either one `model.safetensors` or shards listed in
`model.safetensors.index.json`. Every architecture field is read from config.json; a field it omits takes
`transformers.Olmo3Config`'s default (which is what `from_pretrained` would do), so note eps 1e-5 and vocab
50304 there, not ours. HF Linear weights are [out, in] (ours [in, out]); per-layer tensors
`model.layers.{i}.*` are stacked along our leading layer axis. Reading uses safetensors' numpy API and JSON
only: nothing is unpickled, and torch is imported only by `logit_parity`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int
from safetensors import safe_open
from safetensors.numpy import save_file

from olmo3eqx.config import FULL, SLIDING, ConfigError, ModelConfig, olmo_layer_types
from olmo3eqx.model import OLMo3, abstract_model, cast_floating

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# `transformers.Olmo3Config` defaults, used for fields a config.json leaves out.
HF_DEFAULTS = {
    "vocab_size": 50304,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "sliding_window": 4096,
    "rope_theta": 500000.0,
}
# No token-id defaults: Olmo3Config's eos 50279 and pad 1 are OLMo 1's ids, wrong for every OLMo 3 vocabulary, and
# OLMo-core's own export writes null for both. Token ids come from the checkpoint, its tokenizer or a flag
# (resolve_token_ids).
TOKEN_IDS = ("eos_token_id", "pad_token_id")
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"

# The ModelConfig fields that change the forward pass: two configs agreeing on these give the same logits.
ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "sliding_window", "resolved_layer_types", "rms_norm_eps",
               "rope_theta")

DEFAULT_MAX_SHARD_BYTES = 2 * 10**9


class ConversionError(ValueError):
    """An HF checkpoint, or a pairing of checkpoints, that cannot be converted; the message names the thing."""


# --- config.json <-> ModelConfig ------------------------------------------------------------------


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def _rope_theta(d: dict, layer_types: tuple[str, ...], where: str) -> float:
    """The one RoPE theta of the layer types in use; we support plain RoPE with a single theta."""
    params = d.get("rope_parameters")
    if params is None:
        if d.get("rope_scaling"):
            raise ConversionError(
                f"{where} sets rope_scaling {d['rope_scaling']}; only plain (default) RoPE is supported.")
        # transformers >= 5 applies a legacy top-level rope_theta to full-attention layers only; sliding
        # layers keep the default. Mirror that, so a file it reads one way is never read another way here.
        theta = float(d.get("rope_theta", HF_DEFAULTS["rope_theta"]))
        params = {FULL: {"rope_theta": theta}, SLIDING: {"rope_theta": HF_DEFAULTS["rope_theta"]}}
    elif "rope_theta" in params or "rope_type" in params:  # one set of parameters for every layer type
        params = {FULL: params, SLIDING: params}
    thetas = {}
    for kind in sorted(set(layer_types)):
        p = params.get(kind) or {}
        rope_type = p.get("rope_type", "default")
        if rope_type != "default":
            raise ConversionError(
                f"{where} uses rope_type {rope_type!r} for {kind} layers; only plain (default) RoPE is supported.")
        thetas[kind] = float(p.get("rope_theta", d.get("rope_theta", HF_DEFAULTS["rope_theta"])))
    if len(set(thetas.values())) > 1:
        raise ConversionError(
            f"{where} gives different RoPE thetas per layer type ({thetas}); this model supports one rope_theta "
            f"for all layers.")
    return next(iter(thetas.values()))


def config_from_hf(d: dict, dtype=jnp.float32, where: str = CONFIG_FILE,
                   token_ids: dict[str, int] | None = None) -> ModelConfig:
    """A ModelConfig from a parsed config.json; params and compute both in `dtype` (parity needs that). `token_ids`
    gives eos_token_id / pad_token_id where config.json has none (resolve_token_ids finds them elsewhere); without
    an EOS from either this stops, and a missing PAD becomes the EOS (padding is never scored)."""
    model_type = d.get("model_type")
    if model_type != "olmo3":
        raise ConversionError(f"{where} has model_type {model_type!r}; only 'olmo3' checkpoints are supported.")
    if d.get("attention_bias", False):
        raise ConversionError(f"{where} sets attention_bias true; OLMo 3 has no biases and neither does this model.")
    if d.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{where} sets hidden_act {d['hidden_act']!r}; only 'silu' (SwiGLU) is supported.")

    def get(name):
        v = d.get(name)
        return HF_DEFAULTS[name] if v is None else v

    heads = int(get("num_attention_heads"))
    layers = int(get("num_hidden_layers"))
    layer_types = tuple(d["layer_types"]) if d.get("layer_types") is not None else olmo_layer_types(layers)
    if d.get("sliding_window") is None and "sliding_window" in d and SLIDING in layer_types:
        raise ConversionError(f"{where} has sliding_attention layers but sliding_window null; set the window size.")
    ids = {**(token_ids or {}), **{name: v for name in TOKEN_IDS if (v := _token_id(d.get(name))) is not None}}
    if "eos_token_id" not in ids:
        raise ConversionError(f"{where} has no eos_token_id and nothing else names one; pass --eos-token-id to "
                              f"convert.py hf-to-orbax (dolma2: 100257) or set eos_token_id in {CONFIG_FILE}.")
    eos = ids["eos_token_id"]
    pad = ids.get("pad_token_id", eos)
    try:
        return ModelConfig(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(get("hidden_size")) // heads),
            sliding_window=int(get("sliding_window")),
            layer_types=layer_types,
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=_rope_theta(d, layer_types, where),
            max_position_embeddings=int(get("max_position_embeddings")),
            initializer_range=float(get("initializer_range")),
            eos_token_id=eos,
            pad_token_id=pad,
            param_dtype=dtype_name(dtype),
            compute_dtype=dtype_name(dtype),
        )
    except ConfigError as e:
        raise ConversionError(f"{where} does not describe a valid model: {e}") from None


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
    """config.json contents for `transformers.Olmo3ForCausalLM`."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.resolved_layer_types),
        "rope_parameters": {FULL: dict(rope), SLIDING: dict(rope)},
        "rope_theta": cfg.rope_theta,  # for transformers < 5, which reads only this
        "bos_token_id": None,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def read_config_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"HF checkpoint directory {path} does not exist; pass a directory written by "
                                f"save_pretrained or convert.py orbax-to-hf.")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing; an HF checkpoint directory needs its config.json.")
    return _read_json(file)


def _token_id(value) -> int | None:
    """A token-id field's value: an int, the first of a list (generation_config.json lists every stop token, the EOS
    first), or None for null or absent."""
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConversionError(f"Token id {value!r} is not an integer; fix the checkpoint's token-id fields.")
    return value


def _read_json(file: Path) -> dict:
    try:
        d = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{file} is not valid JSON ({e}).") from None
    if not isinstance(d, dict):
        raise ConversionError(f"{file} must hold a JSON object.")
    return d


def _tokenizer_token_ids(path: Path) -> dict[str, tuple[int, str]]:
    """eos/pad ids named by the tokenizer saved beside the weights: tokenizer_config.json's eos_token / pad_token,
    looked up in its added_tokens_decoder or tokenizer.json's added_tokens."""
    config_file = path / TOKENIZER_CONFIG_FILE
    if not config_file.is_file():
        return {}
    tc = _read_json(config_file)
    ids = {v.get("content"): int(k) for k, v in (tc.get("added_tokens_decoder") or {}).items()
           if isinstance(v, dict) and str(k).isdigit()}
    if (path / TOKENIZER_FILE).is_file():
        ids.update({t.get("content"): t.get("id") for t in _read_json(path / TOKENIZER_FILE).get("added_tokens") or []
                    if isinstance(t, dict)})
    found = {}
    for name in TOKEN_IDS:
        token = tc.get(name.replace("_id", ""))
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(ids.get(token), int):
            found[name] = (ids[token], f"{config_file} ({token!r})")
    return found


def resolve_token_ids(path: str | Path, eos_token_id: int | None = None,
                      pad_token_id: int | None = None) -> dict[str, int]:
    """The eos/pad token ids of an HF checkpoint directory, never guessed: the first of config.json,
    generation_config.json and the saved tokenizer that names one, else the given flag. A flag that contradicts the
    checkpoint is an error; a name nothing gives is left out (config_from_hf then stops for a missing EOS)."""
    path = Path(path)
    sources = [({name: (v, str(path / file)) for name in TOKEN_IDS if (v := _token_id(d.get(name))) is not None})
               for file in (CONFIG_FILE, GENERATION_CONFIG_FILE) if (path / file).is_file()
               for d in [_read_json(path / file)]]
    sources.append(_tokenizer_token_ids(path))
    flags = {"eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    resolved = {}
    for name, flag in flags.items():
        found = next((source[name] for source in sources if name in source), None)
        if found is not None and flag is not None and flag != found[0]:
            raise ConversionError(f"--{name.replace('_', '-')} {flag} contradicts {name} {found[0]} in {found[1]}; "
                                  f"drop the flag or fix the checkpoint.")
        value = found[0] if found is not None else flag
        if value is not None:
            resolved[name] = value
    return resolved


def read_hf_architecture(path: str | Path, like: ModelConfig) -> ModelConfig:
    """An HF directory's ModelConfig for comparing its architecture with `like` (config_mismatches). Token ids do not
    change the forward pass, so those config.json lacks are taken from `like` instead of stopping."""
    return config_from_hf(read_config_json(path), where=str(Path(path) / CONFIG_FILE),
                          token_ids={name: getattr(like, name) for name in TOKEN_IDS})


def config_mismatches(a: ModelConfig, b: ModelConfig) -> list[str]:
    """'field: a vs b' for every architecture field on which the two configs disagree."""
    return [f"{f}: {getattr(a, f)} vs {getattr(b, f)}" for f in ARCH_FIELDS if getattr(a, f) != getattr(b, f)]


# --- tensor names ---------------------------------------------------------------------------------


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


def _get(tree, path: tuple[str, ...]):
    for name in path:
        tree = getattr(tree, name)
    return tree


def _first(names: Iterable[str], n: int = 3) -> str:
    names = sorted(names)
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


# --- load -----------------------------------------------------------------------------------------


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


def load_hf(path: str | Path, dtype=jnp.float32, eos_token_id: int | None = None,
            pad_token_id: int | None = None) -> tuple[OLMo3, ModelConfig]:
    """An OLMo3 (params and compute in `dtype`) and its config from an HF Olmo3 checkpoint directory, its token ids
    from resolve_token_ids (the given ids fill only what the checkpoint lacks).

    Every tensor is checked by name and shape before any is read; a missing, unexpected or mis-shaped
    tensor raises ConversionError naming it.
    """
    path = Path(path)
    raw = read_config_json(path)
    cfg = config_from_hf(raw, dtype, str(path / CONFIG_FILE), resolve_token_ids(path, eos_token_id, pad_token_id))
    files = _weight_files(path)
    specs = tensor_specs(cfg)
    if raw.get("tie_word_embeddings", False) and "lm_head.weight" not in files:
        # Tied checkpoints store the embedding once; ours are untied, so the head gets its own copy.
        specs[-1] = dataclasses.replace(specs[-1], hf_name="model.embed_tokens.weight")
    expected = {s.hf_name for s in specs}
    missing = expected - set(files)
    if missing:
        raise ConversionError(f"{path} is missing tensor {_first(missing)} for the config in its {CONFIG_FILE}.")
    unexpected = {n for n in files if n not in expected and not _is_ignorable(n)}
    if unexpected:
        raise ConversionError(f"{path} has unexpected tensor {_first(unexpected)}; it is not an Olmo3ForCausalLM "
                              f"of the architecture its {CONFIG_FILE} describes.")

    np_dtype = jnp.dtype(dtype)
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="numpy")) for f in set(files.values())}
        for s in specs:
            if s.hf_name not in handles[files[s.hf_name]].keys():
                raise ConversionError(f"Tensor {s.hf_name} is not in {files[s.hf_name].name}, where {INDEX_FILE} "
                                      f"says it is.")
            shape = tuple(handles[files[s.hf_name]].get_slice(s.hf_name).get_shape())
            if shape != s.hf_shape:
                raise ConversionError(f"Tensor {s.hf_name} in {files[s.hf_name].name} has shape {list(shape)} but "
                                      f"{CONFIG_FILE} implies {list(s.hf_shape)}.")

        def read(s: TensorSpec) -> np.ndarray:
            x = handles[files[s.hf_name]].get_tensor(s.hf_name)
            if not np.issubdtype(x.dtype, np.floating) and x.dtype != jnp.bfloat16:
                raise ConversionError(f"Tensor {s.hf_name} has dtype {x.dtype}; expected a floating-point tensor.")
            return (x.T if s.transpose else x).astype(np_dtype)

        leaves: dict[tuple[str, ...], jax.Array] = {}
        for s in specs:
            if s.layer is None:
                leaves[s.path] = jax.device_put(read(s))
        # One stacked host buffer per block leaf at a time, then onto the device.
        layer_specs = [s for s in specs if s.layer is not None]
        for leaf_path in dict.fromkeys(s.path for s in layer_specs):
            group = [s for s in layer_specs if s.path == leaf_path]
            first = read(group[0])
            stacked = np.empty((cfg.num_hidden_layers, *first.shape), np_dtype)
            stacked[0] = first
            for s in group[1:]:
                stacked[s.layer] = read(s)
            leaves[leaf_path] = jax.device_put(stacked)
            del stacked

    # Fill OLMo3.init's own (abstract) tree, so structure, shapes and dtypes are init's by construction.
    abstract = abstract_model(cfg)
    paths = list(leaves)
    for p in paths:
        want = _get(abstract, p)
        if (leaves[p].shape, leaves[p].dtype) != (want.shape, want.dtype):
            raise AssertionError(f"load_hf built {'.'.join(p)} as {leaves[p].shape} {leaves[p].dtype}, OLMo3.init "
                                 f"as {want.shape} {want.dtype}; the name mapping is wrong.")
    model = eqx.tree_at(lambda m: [_get(m, p) for p in paths], abstract, [leaves[p] for p in paths])
    left = [x for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    if left:
        raise AssertionError(f"load_hf left {len(left)} model leaves unfilled; the name mapping is incomplete.")
    return model, cfg


# --- save -----------------------------------------------------------------------------------------


def save_hf(model: OLMo3, cfg: ModelConfig, path: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            dtype=None) -> list[Path]:
    """Write `model` as an HF Olmo3ForCausalLM directory (config.json, safetensors shards and their index).

    Tensors are fetched from the device one at a time into the shard being written, so host memory stays
    near one shard. `dtype` (default: cfg.param_dtype) is the stored dtype. Returns the shard files.
    """
    path = Path(path)
    out_dtype = jnp.dtype(dtype if dtype is not None else cfg.param_dtype)
    specs = tensor_specs(cfg)
    for s in specs:
        leaf = _get(model, s.path)
        shape = tuple(leaf.shape[1:] if s.layer is not None else leaf.shape)
        want = s.hf_shape[::-1] if s.transpose else s.hf_shape
        if shape != want:
            raise ConversionError(f"Model leaf {'.'.join(s.path)} has shape {list(shape)} but the config implies "
                                  f"{list(want)}; the model and its config disagree.")
    # Plan the shards first (sizes are known from shapes) so file names can carry the shard count.
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for s in specs:
        size = math.prod(s.hf_shape) * out_dtype.itemsize
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(s)
        used += size

    path.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        tensors = {}
        for s in shard:
            leaf = _get(model, s.path)
            x = np.asarray(jax.device_get(leaf[s.layer] if s.layer is not None else leaf)).astype(out_dtype)
            tensors[s.hf_name] = np.ascontiguousarray(x.T if s.transpose else x)
            weight_map[s.hf_name] = name
            total += x.nbytes
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / CONFIG_FILE).write_text(json.dumps(config_to_hf(cfg, out_dtype.name), indent=2) + "\n")
    return [path / name for name in names]


# --- parity ---------------------------------------------------------------------------------------


def with_dtype(model: OLMo3, dtype) -> OLMo3:
    """The same model with params and compute in `dtype` (as `from_pretrained(dtype=...)` gives torch)."""
    name = dtype_name(dtype)
    cfg = dataclasses.replace(model.cfg, param_dtype=name, compute_dtype=name)
    return dataclasses.replace(cast_floating(model, jnp.dtype(name)), cfg=cfg)


@eqx.filter_jit
def batch_logits(model: OLMo3, tokens: Int[Array, "batch seq"]):
    return jax.vmap(model)(tokens)


def check_tokens(tokens: Int[np.ndarray, "batch seq"], vocab_size: int) -> None:
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ConversionError(f"Token id {bad} is outside the vocabulary [0, {vocab_size}); pass ids below vocab_size.")


def kl_stats(ref_logits: np.ndarray, logits: np.ndarray) -> dict:
    """KL(ref || other) per token (float64), top-1 agreement and max abs logit difference."""
    ref = ref_logits.astype(np.float64).reshape(-1, ref_logits.shape[-1])
    other = logits.astype(np.float64).reshape(-1, logits.shape[-1])

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(other)
    kl = np.maximum((np.exp(lp) * (lp - lq)).sum(-1), 0.0)  # clamp float64 rounding below zero
    diff = np.abs(ref - other)
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1": float((ref.argmax(-1) == other.argmax(-1)).mean()),
        "max_abs_diff": float(diff.max()),
        "max_abs_logit": float(np.abs(ref).max()),
        "tokens": int(ref.shape[0]),
    }


def hf_logits(hf_model_dir: str | Path, tokens: np.ndarray, dtype) -> np.ndarray:
    """`transformers`' own Olmo3 forward (eager attention) on `tokens`, logits as float32 numpy."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name(dtype)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_model_dir), dtype=torch_dtype, attn_implementation="eager")
    hf.eval()
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(np.asarray(tokens, np.int64))).logits
    return out.float().numpy()


def logit_parity(hf_model_dir: str | Path, model: OLMo3, tokens_batch: Int[np.ndarray | Array, "batch seq"],
                 dtype=jnp.float32) -> dict:
    """KL(HF || ours) per token (mean, max), top-1 agreement and max abs logit diff, both sides in `dtype`.

    HF side: `transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir)` in `dtype`; ours: `model`
    cast to `dtype` (params and compute). Raises ConversionError if the two configs disagree (naming the
    fields) or a token id is outside the vocabulary.
    """
    if dtype_name(dtype) not in ("float32", "bfloat16"):
        raise ConversionError(f"Parity dtype must be float32 or bfloat16, got {dtype_name(dtype)}.")
    hf_cfg = read_hf_architecture(hf_model_dir, model.cfg)
    diff = config_mismatches(hf_cfg, model.cfg)
    if diff:
        raise ConversionError(f"The HF config ({hf_model_dir}) and the model's config disagree on "
                              f"{'; '.join(diff)} (HF vs ours).")
    tokens = np.asarray(tokens_batch)
    check_tokens(tokens, model.cfg.vocab_size)
    ours = np.asarray(batch_logits(with_dtype(model, dtype), jnp.asarray(tokens, jnp.int32)), np.float32)
    ref = hf_logits(hf_model_dir, tokens, dtype)
    return kl_stats(ref, ours)
