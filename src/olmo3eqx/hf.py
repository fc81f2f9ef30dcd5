"""`transformers` Olmo3 checkpoints <-> OLMo3, and logit parity against `transformers`' own forward.

An HF checkpoint directory holds `config.json` and either one `model.safetensors` or shards listed in
`model.safetensors.index.json`. Every architecture field is read from config.json; a field it omits takes
`transformers.Olmo3Config`'s default (which is what `from_pretrained` would do), so note eps 1e-5 and vocab
50304 there, not ours. HF Linear weights are [out, in] (ours [in, out]); per-layer tensors
`model.layers.{i}.*` are stacked along our leading layer axis. Reading uses safetensors' numpy API and JSON
only: nothing is unpickled, and torch is imported only by `logit_parity`.

RoPE is read from any of the forms config.json has carried (rope_from_hf): AI2's released files (legacy
`rope_scaling`), transformers >= 5.13 (`rope_parameters` per layer type) and 5.0-5.12 (one flat `rope_parameters`),
all as AI2 trained the model: YaRN on the full-attention layers only. Both directions move one tensor at a time
(read_leaf, write_hf), so a conversion never needs the whole model in host memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int
from safetensors import safe_open

from olmo3eqx.config import FULL, SLIDING, ConfigError, ModelConfig, RopeScalingConfig, olmo_layer_types
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
               "rope_theta", "rope_scaling")

DEFAULT_MAX_SHARD_BYTES = 2 * 10**9


class ConversionError(ValueError):
    """An HF checkpoint, or a pairing of checkpoints, that cannot be converted; the message names the thing."""


# --- config.json <-> ModelConfig ------------------------------------------------------------------


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


ROPE_TYPES = ("default", "yarn")
"""RoPE types this model computes; any other (llama3, dynamic, longrope, linear...) stops the conversion."""
YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "attention_factor",
             "beta_fast", "beta_slow", "truncate"}
"""Keys of a YaRN parameter set that AI2's YaRN has; others (mscale, mscale_all_dim, ...) are refused by name."""
FLAT_FORM_WARNING = (
    "{where} gives one flat rope_parameters set with rope_type {rope_type!r}, as transformers 5.0-5.12 wrote it; that "
    "library applied it to every layer, and newer ones read this form as plain RoPE everywhere (5.24 does). Reading it "
    "as AI2 trained the model: {rope_type} on the full-attention layers only, plain RoPE on the sliding ones.")


def _is_flat(params: dict) -> bool:
    return not ({FULL, SLIDING} & set(params))


def _per_layer_type_rope(d: dict, where: str, warn) -> dict[str, dict]:
    """RoPE parameters per layer type from any config.json form, read as AI2 means them.

    Legacy `rope_scaling` (+ top-level `rope_theta`, what AI2's released files carry) and per-type `rope_parameters`
    (transformers >= 5.13) are read as transformers >= 5.13 reads them: the scaling and the top-level theta go to the
    full-attention layers, sliding layers keep the default RoPE. A flat `rope_parameters` set (5.0-5.12) goes to the
    full-attention layers likewise, its theta to both, with FLAT_FORM_WARNING.
    """
    params = d.get("rope_parameters")
    legacy = d.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise ConversionError(f"{where} has {name} {value!r}; it must be a JSON object.")
    top_theta = d.get("rope_theta") or HF_DEFAULTS["rope_theta"]
    if params is None:
        per_type = {FULL: {}, SLIDING: {}}
    elif _is_flat(params):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            warn(FLAT_FORM_WARNING.format(where=where, rope_type=rope_type))
        per_type = {FULL: dict(params), SLIDING: {"rope_theta": params.get("rope_theta", top_theta)}}
    else:
        per_type = {kind: dict(params.get(kind) or {}) for kind in (FULL, SLIDING)}
    if legacy:
        per_type[FULL].update(legacy)
    # transformers gives the top-level theta to the full-attention layers only; sliding ones fall back to its default.
    per_type[FULL].setdefault("rope_theta", top_theta)
    per_type[SLIDING].setdefault("rope_theta", HF_DEFAULTS["rope_theta"])
    return per_type


def _scaling_from_hf(p: dict, kind: str, max_positions: int, where: str) -> RopeScalingConfig:
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConversionError(f"{where} uses rope_type {rope_type!r} for {kind} layers; supported are "
                              f"{', '.join(map(repr, ROPE_TYPES))} (YaRN on full-attention layers, as AI2's OLMo 3).")
    if rope_type == "default":
        return RopeScalingConfig()
    if kind == SLIDING:
        raise ConversionError(f"{where} applies {rope_type!r} RoPE to sliding_attention layers; AI2's OLMo 3 scales "
                              f"RoPE on full-attention layers only, and so does this model.")
    unknown = sorted(set(p) - YARN_KEYS)
    if unknown:
        raise ConversionError(f"{where} sets {', '.join(unknown)} in its YaRN parameters, which AI2's YaRN does not "
                              f"have; only {', '.join(sorted(YARN_KEYS - {'type'}))} are supported.")
    if p.get("truncate", True) is not True:
        raise ConversionError(f"{where} sets YaRN truncate {p['truncate']!r}; AI2's YaRN always truncates the ramp.")
    if p.get("factor") is None:
        raise ConversionError(f"{where} gives YaRN without a factor; set rope_scaling.factor (OLMo 3: 8.0).")
    try:
        return RopeScalingConfig(
            rope_type="yarn", factor=float(p["factor"]),
            # transformers' fallbacks for keys a YaRN set leaves out
            original_max_position_embeddings=int(p.get("original_max_position_embeddings") or max_positions),
            beta_fast=float(p.get("beta_fast") or 32.0), beta_slow=float(p.get("beta_slow") or 1.0),
            attention_factor=None if p.get("attention_factor") is None else float(p["attention_factor"]))
    except ConfigError as e:
        raise ConversionError(f"{where} has YaRN parameters this model cannot use: {e}") from None


def rope_from_hf(d: dict, layer_types: tuple[str, ...], max_positions: int, where: str,
                 warn=None) -> tuple[float, RopeScalingConfig]:
    """(rope_theta, rope_scaling) of a parsed config.json, whichever form it writes RoPE in (see _per_layer_type_rope).

    One theta for every layer kind in use, plain RoPE on sliding layers, default or YaRN on full ones; anything else
    stops with ConversionError naming it. `warn` (default: a line on stderr) gets FLAT_FORM_WARNING.
    """
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    per_type = _per_layer_type_rope(d, where, warn)
    kinds = sorted(set(layer_types))
    thetas = {kind: float(per_type[kind]["rope_theta"]) for kind in kinds}
    if len(set(thetas.values())) > 1:
        raise ConversionError(
            f"{where} gives different RoPE thetas per layer type ({thetas}); this model supports one rope_theta "
            f"for all layers.")
    scaling = {kind: _scaling_from_hf(per_type[kind], kind, max_positions, where) for kind in kinds}
    return next(iter(thetas.values())), scaling.get(FULL, RopeScalingConfig())


def rope_to_hf(cfg: ModelConfig) -> dict:
    """config.json's RoPE keys: per-type `rope_parameters` as transformers >= 5.13 writes them, plus the legacy
    top-level `rope_theta` and `rope_scaling` of AI2's released files for readers older than transformers 5."""
    plain = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out = {"rope_parameters": {FULL: dict(plain), SLIDING: dict(plain)}, "rope_theta": cfg.rope_theta}
    r = cfg.rope_scaling
    if r.rope_type == "yarn":
        yarn = {"rope_type": "yarn", "factor": r.factor,
                "original_max_position_embeddings": r.original_max_position_embeddings,
                "beta_fast": r.beta_fast, "beta_slow": r.beta_slow, "attention_factor": r.attention_factor}
        out["rope_parameters"][FULL] = {**yarn, "rope_theta": cfg.rope_theta}
        out["rope_scaling"] = yarn
    return out


def config_from_hf(d: dict, dtype=jnp.float32, where: str = CONFIG_FILE,
                   token_ids: dict[str, int] | None = None, warn=None) -> ModelConfig:
    """A ModelConfig from a parsed config.json; params and compute both in `dtype` (parity needs that). `token_ids`
    gives eos_token_id / pad_token_id where config.json has none (resolve_token_ids finds them elsewhere); without
    an EOS from either this stops, and a missing PAD becomes the EOS (padding is never scored). `warn` as in
    rope_from_hf."""
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
    max_positions = int(get("max_position_embeddings"))
    theta, rope_scaling = rope_from_hf(d, layer_types, max_positions, where, warn)
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
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
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
        **rope_to_hf(cfg),
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
                          token_ids={name: getattr(like, name) for name in TOKEN_IDS}, warn=lambda _: None)


def read_hf_config(path: str | Path, dtype=jnp.float32, warn=None) -> ModelConfig:
    """The ModelConfig of an HF checkpoint directory (reads config.json only); `warn` as in rope_from_hf."""
    return config_from_hf(read_config_json(path), dtype, str(Path(path) / CONFIG_FILE), warn=warn)


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


def is_flat_scaled_form(d: dict) -> bool:
    """config.json carries a flat, scaled rope_parameters set (transformers 5.0-5.12), see FLAT_FORM_WARNING."""
    params = d.get("rope_parameters")
    return isinstance(params, dict) and _is_flat(params) and \
        params.get("rope_type", params.get("type", "default")) != "default"


def hf_logits(hf_model_dir: str | Path, tokens: np.ndarray, dtype, like: ModelConfig | None = None) -> np.ndarray:
    """`transformers`' own Olmo3 forward (eager attention) on `tokens`, logits as float32 numpy.

    transformers reads config.json itself, except for the flat form of 5.0-5.12, which it would read as plain RoPE:
    there it gets the per-type RoPE of AI2's reading (rope_to_hf), the form it writes itself. `like` supplies the
    token ids a config.json may lack (read_hf_architecture); they do not change the logits.
    """
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name(dtype)]
    config = transformers.AutoConfig.from_pretrained(str(hf_model_dir))
    if is_flat_scaled_form(read_config_json(hf_model_dir)):
        ours = (read_hf_architecture(hf_model_dir, like) if like is not None
                else read_hf_config(hf_model_dir, warn=lambda _: None))
        config.rope_parameters = rope_to_hf(ours)["rope_parameters"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_model_dir), config=config, dtype=torch_dtype, attn_implementation="eager")
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
    ref = hf_logits(hf_model_dir, tokens, dtype, model.cfg)
    return kl_stats(ref, ours)
