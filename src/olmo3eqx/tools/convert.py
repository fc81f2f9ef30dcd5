"""`python convert.py {hf-to-orbax, orbax-to-hf, parity, demo}`: checkpoint conversion with a logit-parity proof.

Parity is measured against `transformers`' own Olmo3 forward on random token batches from a fixed seed:
KL(HF || ours) per token (mean and max), top-1 agreement and max |logit diff|. Bad input stops with one
sentence on stderr and exit code 2; a parity check that fails its threshold exits 1.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np

from olmo3eqx import exits
from olmo3eqx.tools import hostmem


Dtype = Literal["float32", "bfloat16"]


class ParityFailed(exits.CommandError):
    """The converted model's logits are too far from `transformers`'."""

    code = exits.PARITY_FAILED


def random_tokens(vocab_size: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, seq_len), dtype=np.int64)


def format_parity(stats: dict, dtype: str, batch: int, seq_len: int) -> str:
    return (f"parity {dtype}, {batch} x {seq_len} tokens:\n"
            f"  KL(HF || ours) per token: mean {stats['kl_mean']:.3e}  max {stats['kl_max']:.3e}\n"
            f"  top-1 agreement: {100 * stats['top1']:.2f}%\n"
            f"  max |logit diff|: {stats['max_abs_diff']:.3e}  (max |logit| {stats['max_abs_logit']:.3f})")


def _refuse_existing(path: str | Path, what: str) -> None:
    """Stop when `path` (local or a bucket prefix) holds anything: a conversion never writes over a checkpoint."""
    from olmo3eqx import storage

    p = storage.path(path, what, write=True)
    if p.exists() and any(p.iterdir()):
        raise FileExistsError(f"{what} {storage.redact(path)} already exists and is not empty; choose a new path or "
                              f"delete it.")


def conversion_shardings(cfg):
    """Where a conversion puts each model leaf: the training rule (sharding.partition_spec) on the default mesh over
    every device of this process (FSDP over all of them), so no device holds more than its part of a leaf."""
    import equinox as eqx
    import jax

    from olmo3eqx.config import MeshConfig
    from olmo3eqx.model import abstract_model
    from olmo3eqx.sharding import is_leaf_like, make_mesh, tree_shardings

    return tree_shardings(eqx.filter(abstract_model(cfg), is_leaf_like), make_mesh(MeshConfig(), jax.local_devices()))


def released_between(leaves):
    """`leaves`, with the memory malloc kept from each one's write handed back before the next is read."""
    for path, leaf in leaves:
        yield path, leaf
        del leaf
        hostmem.release_freed_memory()


def hf_to_orbax(hf_dir: Path, out: str | Path, dtype: Dtype = "float32", max_kl: float = 1e-4, force: bool = False,
                skip_parity: bool = False, seq_len: int = 128, batch: int = 2, seed: int = 0,
                eos_token_id: int | None = None, pad_token_id: int | None = None) -> None:
    """Convert an HF Olmo3 checkpoint directory to an orbax checkpoint (step 0), after a float32 parity check.

    Token ids are never guessed: they come from config.json, generation_config.json or the saved tokenizer, else
    from --eos-token-id / --pad-token-id (OLMo-core's save_hf_model writes null for both); no EOS from any of them
    stops the conversion.

    The checkpoint is written one model leaf at a time, each read tensor by tensor into its shards on this
    process's devices: host memory stays near the largest leaf. The parity check needs both whole models
    (`transformers`' and ours) in memory; --skip-parity converts without it (then run `convert.py parity`).

    Args:
        hf_dir: HF checkpoint directory (config.json + safetensors).
        out: Orbax checkpoint directory to create: a local path, or gs://... or s3://... (written straight there).
        dtype: Stored parameter dtype (the parity check always runs in float32, before the cast).
        max_kl: Refuse to write if the float32 mean KL(HF || ours) per token exceeds this.
        force: Write even if the parity check fails.
        skip_parity: Do not run the parity check (no torch/transformers needed; memory bounded by one leaf).
        seq_len: Tokens per parity sequence.
        batch: Parity sequences.
        seed: Seed of the random parity tokens.
        eos_token_id: End-of-document token id, for a checkpoint that names none (dolma2: 100257).
        pad_token_id: Padding token id, for a checkpoint that names none (dolma2: 100277); default the EOS.
    """
    import dataclasses

    import jax.numpy as jnp

    from olmo3eqx import hf
    from olmo3eqx.checkpoint.model import save_model_leaves
    from olmo3eqx.hf.weights import iter_leaves, load_weights, open_hf

    _refuse_existing(out, "Output checkpoint")
    # every name, shape and dtype checked before any work
    weights = open_hf(hf_dir, jnp.float32, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if not skip_parity:
        model = load_weights(weights)
        stats = hf.logit_parity(hf_dir, model, random_tokens(weights.cfg.vocab_size, batch, seq_len, seed),
                                jnp.float32)
        del model
        print(format_parity(stats, "float32", batch, seq_len))
        if not stats["kl_mean"] <= max_kl:
            msg = (f"Float32 mean KL {stats['kl_mean']:.3e} exceeds --max-kl {max_kl:g}; the conversion is wrong "
                   f"or the checkpoint is not a standard Olmo3.")
            if not force:
                raise ParityFailed(msg + " Nothing written (pass --force to write anyway).")
            print(f"warning: {msg} Writing anyway (--force).", file=sys.stderr)
    cfg = dataclasses.replace(weights.cfg, param_dtype=dtype, compute_dtype=dtype)
    leaves = iter_leaves(weights, conversion_shardings(cfg), dtype)
    save_model_leaves(out, cfg, released_between(leaves), step=0)
    print(f"wrote {out} (step 0, {dtype})")


def orbax_to_hf(ckpt: str | Path, out: str | Path, dtype: Dtype | None = None, max_shard_gb: float = 2.0,
                tokenizer: str | None = None, chat_template: str | None = None) -> None:
    """Convert an orbax checkpoint (newest step, or a step directory) to an HF Olmo3 checkpoint directory.

    Each model leaf is restored on its own, to host memory, and written out piece by piece: host memory stays near
    the largest leaf. An `out` in a bucket is written to a local temporary directory first (safetensors files are
    written in place), then uploaded file by file, the index and config last. generation_config.json names the
    model's EOS and PAD; with --tokenizer the tokenizer and its chat template go beside the weights, and the ids a
    reply ends at join the EOS there (olmo3eqx.hf.tokenizer), so the model chats in transformers and vLLM.

    Args:
        ckpt: Orbax checkpoint directory (manager root, run directory or one step directory; local, gs:// or s3://).
        out: HF directory to create (config.json, safetensors shards, index): local, gs:// or s3://.
        dtype: Stored dtype; default the checkpoint's param_dtype.
        max_shard_gb: Largest safetensors shard, in GB (10^9 bytes).
        tokenizer: An HF tokenizer directory (tokenizer.json, tokenizer_config.json) or a tokenizer.json: written
            beside the weights with the chat template.
        chat_template: With --tokenizer: a built-in template (olmo, olmo_thinker, ...), a .jinja file or a
            tokenizer_config.json; unset: the one the checkpoint's data was prepared with (its recorded hash), else
            the tokenizer's own, else none (a base model).
    """
    from olmo3eqx.checkpoint.model import open_model, restore_model_leaf
    from olmo3eqx.errors import ConversionError
    from olmo3eqx.hf import tokenizer as hf_tokenizer
    from olmo3eqx.hf import weights
    from olmo3eqx.model import abstract_model

    if chat_template is not None and tokenizer is None:
        raise ConversionError("--chat-template goes with the tokenizer it is written beside; add --tokenizer.")
    _refuse_existing(out, "Output directory")
    root, step, cfg = open_model(ckpt)
    # every refusal of the tokenizer or its template before the first file is written
    tok = tokenizer_for_export(tokenizer, chat_template, str(ckpt), cfg) if tokenizer is not None else None
    abstract = abstract_model(cfg)

    def leaf(path: tuple[str, ...]):
        hostmem.release_freed_memory()  # what the previous leaf's restore left in malloc's arenas
        return restore_model_leaf(root, step, path, weights.leaf_of(abstract, path))

    with staged(out) as local:
        files = weights.write_hf(local, cfg, leaf, max_shard_bytes=int(max_shard_gb * 1e9), dtype=dtype)
        hf_tokenizer.write_generation_config(local, cfg, tok.stop_ids if tok is not None else ())
        if tok is not None:
            hf_tokenizer.write_tokenizer(local, tok.source, tok.config)
    print(f"wrote {out} ({len(files)} safetensors file{'s' if len(files) > 1 else ''}, "
          f"{dtype or cfg.param_dtype}{f', the tokenizer{tok.said}' if tok is not None else ''})")


class TokenizerExport(NamedTuple):
    """What orbax-to-hf writes of a tokenizer: its tokenizer.json, the tokenizer_config.json to write beside it (the
    chat template in it), the ids a reply ends at besides the EOS, and how the summary line names the template."""

    source: Path
    config: dict
    stop_ids: list[int]
    said: str


def tokenizer_for_export(tokenizer: str, spec: str | None, ckpt: str, cfg) -> TokenizerExport:
    """The tokenizer `tokenizer` (a directory or its tokenizer.json) as an export of checkpoint `ckpt` writes it, with
    the chat template its data was prepared with (template_record.chat_tokenizer: `spec`, or the recorded one; no
    other), or the tokenizer's own, or none where nothing names one (a base model)."""
    from olmo3eqx.data import template_record
    from olmo3eqx.hf import tokenizer as hf_tokenizer

    source = hf_tokenizer.tokenizer_json(tokenizer)
    recorded = template_record.recorded_templates(ckpt)
    chat = None
    if spec is not None or recorded or template_record.own_template(str(source)) is not None:
        chat = template_record.chat_tokenizer(str(source), spec, recorded, ckpt)
    config = hf_tokenizer.tokenizer_config(source, cfg, chat.template if chat is not None else None,
                                           functools.partial(print, file=sys.stderr))
    if chat is None:
        return TokenizerExport(source, config, [], " (no chat template)")
    return TokenizerExport(source, config, hf_tokenizer.end_of_turn_ids(chat),
                           f" and the chat template (sha256 {chat.sha256[:12]}...)")


@contextlib.contextmanager
def staged(out: str | Path):
    """A local directory to write `out` into: `out` itself when local; for a bucket a temporary directory, uploaded
    to `out` when the block ends without an error (config.json and the safetensors index last, so a reader that finds
    them finds every shard) and removed."""
    from olmo3eqx import storage

    if not storage.is_url(out):
        yield Path(out)
        return
    with tempfile.TemporaryDirectory(prefix="olmo3eqx-hf-") as tmp:
        yield Path(tmp)
        last = [name for name in os.listdir(tmp) if name == "config.json" or name.endswith(".index.json")]
        storage.upload_tree(tmp, out, last=last)


def parity(hf_dir: Path, ckpt: str | Path, seq_len: int = 128, batch: int = 2, dtype: Dtype = "float32", seed: int = 0,
           max_kl: float | None = None) -> None:
    """Print KL(HF || ours) per token (mean, max), top-1 agreement and max |logit diff| of a checkpoint.

    Args:
        hf_dir: HF checkpoint directory: the reference, run with `transformers`' own Olmo3 forward.
        ckpt: Orbax checkpoint directory to check (local, gs:// or s3://).
        seq_len: Tokens per sequence.
        batch: Sequences (random tokens from `seed`).
        dtype: Both sides run in this dtype.
        seed: Seed of the random tokens.
        max_kl: If given, exit 1 when the mean KL exceeds it.
    """
    from olmo3eqx import hf
    from olmo3eqx.checkpoint.model import load_model
    from olmo3eqx.hf import config_json

    model, cfg = load_model(ckpt)
    hf_cfg = config_json.read_hf_architecture(hf_dir, cfg)
    diff = config_json.config_mismatches(hf_cfg, cfg)
    if diff:
        raise hf.ConversionError(f"The HF config and the checkpoint config disagree on {'; '.join(diff)} "
                                 f"(HF vs checkpoint); they are not the same model.")
    stats = hf.logit_parity(hf_dir, model, random_tokens(cfg.vocab_size, batch, seq_len, seed), dtype)
    print(format_parity(stats, dtype, batch, seq_len))
    if max_kl is not None and not stats["kl_mean"] <= max_kl:
        raise ParityFailed(f"Mean KL {stats['kl_mean']:.3e} exceeds --max-kl {max_kl:g}.")


def demo(out: Path, seed: int = 0) -> None:
    """Write a tiny random `transformers` Olmo3ForCausalLM to OUT (for trying the other commands).

    Args:
        out: Directory to create.
        seed: torch seed of the random weights.
    """
    _refuse_existing(out, "Output directory")
    save_tiny_hf_model(out, seed=seed)
    print(f"wrote a tiny random Olmo3ForCausalLM to {out}; now try:\n"
          f"  python convert.py hf-to-orbax --hf-dir {out} --out {out}-orbax\n"
          f"  python convert.py parity --hf-dir {out} --ckpt {out}-orbax\n"
          f"  python convert.py orbax-to-hf --ckpt {out}-orbax --out {out}-hf")


def save_tiny_hf_model(out: Path, seed: int = 0, init_std: float = 0.5, max_shard_size: str | None = None,
                       **config) -> None:
    """A small random Olmo3ForCausalLM via `transformers`, saved with save_pretrained (in shards of `max_shard_size`,
    e.g. "100KB", when given).

    Embeddings are N(0, 1), Linear weights N(0, init_std^2 / fan_in) (the LM head 4x that, so the next-token
    distributions are peaked and top-1 agreement means something), norm weights 1 + N(0, 0.25) (not all ones,
    so swapping two norms changes the logits). `config` overrides Olmo3Config fields.
    """
    import torch
    import transformers

    fields = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=16, rms_norm_eps=1e-6, eos_token_id=0,
                  pad_token_id=1, max_position_embeddings=4096)
    fields.update(config)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                scale = 4.0 if name == "lm_head.weight" else 1.0
                p.copy_(torch.randn_like(p) * scale * init_std / p.shape[1] ** 0.5)
    model.save_pretrained(str(out), **({"max_shard_size": max_shard_size} if max_shard_size else {}))


COMMANDS = {"hf-to-orbax": hf_to_orbax, "orbax-to-hf": orbax_to_hf, "parity": parity, "demo": demo}


@exits.command
def main(args: list[str] | None = None) -> int:
    import tyro

    tyro.extras.subcommand_cli_from_dict(COMMANDS, args=args, description=__doc__.splitlines()[0])
    return exits.OK
