"""config.json (and the token ids beside it) <-> ModelConfig: every form an Olmo3 config.json has carried.

Every architecture field is read from config.json; a field it omits takes `transformers.Olmo3Config`'s default
(which is what `from_pretrained` would do), so note eps 1e-5 and vocab 50304 there, not ours. RoPE is read from any
of the forms config.json has carried (rope_from_hf): AI2's released files (legacy `rope_scaling`), transformers >=
5.13 (`rope_parameters` per layer type) and 5.0-5.12 (one flat `rope_parameters`), all as AI2 trained the model:
YaRN on the full-attention layers only. Token ids are never guessed (resolve_token_ids). JSON only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp

from olmo3eqx.config import FULL, SLIDING, ModelConfig, RopeScalingConfig, olmo_layer_types
from olmo3eqx.errors import ConfigError, ConversionError

CONFIG_FILE = "config.json"

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


def is_flat_scaled_form(d: dict) -> bool:
    """config.json carries a flat, scaled rope_parameters set (transformers 5.0-5.12), see FLAT_FORM_WARNING."""
    params = d.get("rope_parameters")
    return isinstance(params, dict) and _is_flat(params) and \
        params.get("rope_type", params.get("type", "default")) != "default"

