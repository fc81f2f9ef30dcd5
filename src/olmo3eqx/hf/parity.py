"""Logit parity: our model against `transformers`' own Olmo3 forward on the same tokens (KL, top-1, max diff).

torch and transformers are imported only inside hf_logits, so the rest of the package never needs them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from olmo3eqx.config import ModelConfig
from olmo3eqx.hf.config_json import (config_mismatches, dtype_name, is_flat_scaled_form, read_config_json,
                                     read_hf_architecture, read_hf_config, rope_to_hf)
from olmo3eqx.errors import ConversionError
from olmo3eqx.model import OLMo3, cast_floating


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
