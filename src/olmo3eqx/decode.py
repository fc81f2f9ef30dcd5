"""KV-cached decoding of OLMo3, in the model's own terms: prefill a batch of prompts, then one token at a time.

Prompts of different lengths are left-padded to one length P; row b's first `pad[b]` columns are padding, masked
out of every attention and skipped by RoPE (each row's positions start at 0 at its first real token, as
`transformers`' generate derives them from the attention mask), so padding changes nothing. All rows then share one
column index t, the next token's.

The cache keeps, per layer, the keys and values after QK-norm and RoPE:
- full-attention layers: every column, [batch, max_len, kv_heads, head_dim];
- sliding layers: a ring of R = min(sliding_window, max_len) slots, column c in slot c % R, so their memory does not
  grow with the length. At column t, slot s holds column t - ((t - s) mod R): exactly the window's W keys
  i - W + 1 <= j <= i (attention.py's semantics) once t >= W - 1.
Prefill runs the layers as a `lax.scan` over the groups of the layer period, as training does; decoding runs them
unrolled, one cache array per layer updated in place. Both read the model's own stacked weights, each layer's cast to
the compute dtype where it is used (nothing when the weights are held in it, as checkpoint.load_any loads them): no
second copy of the weights exists while generating. XLA:CPU copies each weight out of the stack before its matmul (it
fuses no slice into a dot), which costs the CPU decode step time (bench/bench_generate.py); its default scheduler,
ordering for concurrency, starts every such copy ahead of the first matmul, a second copy of the layers after all,
which the memory-minimising one (jaxenv.SPEAKING_XLA_FLAGS, set by the eval and generate commands) avoids
(bench/bench_speak_memory.py, docs/generation.md).

Prefill is the training forward over the padded prompts with segment ids (padding 0, the prompt 1): the same
attention backends (attention.py), so the same numbers; the decode step attends one query per row to the cache in
float32 (scores, softmax), probabilities cast to the values' dtype as every backend does. Sampling: greedy,
temperature, top-k, top-p (sample_logits). The host loop, stop strings and tokenizers are olmo3eqx.generate's.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, UInt

from olmo3eqx.attention import attention
from olmo3eqx.config import SLIDING, ModelConfig
from olmo3eqx.model import DTYPE, Block, OLMo3, RopeTable, cast_floating, document_positions, layer_period, rope_tables

LEFT_PAD_SEGMENT = 0
"""Segment id of left padding in the prefill (prompt tokens are 1)."""


@dataclasses.dataclass(frozen=True)
class Sampler:
    """How the next token is chosen from the logits: temperature 0 is greedy (argmax); otherwise softmax(logits /
    temperature) restricted to the top_k most likely tokens (0: all) and then to the smallest set whose probability
    reaches top_p (1.0: all), in that order, as `transformers`' generate applies them."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not self.top_k >= 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")


class Cache(eqx.Module):
    """The KV cache of a batch (see the module doc): k[i], v[i] of layer i."""

    k: tuple[Float[Array, "batch _length kv_heads dim"], ...]
    v: tuple[Float[Array, "batch _length kv_heads dim"], ...]
    pad: Int[Array, " batch"]
    length: Int[Array, ""]
    """Columns written: the next token's column."""


def cache_lengths(cfg: ModelConfig, max_len: int) -> tuple[int, ...]:
    """Cache length per layer: the ring of a sliding layer, max_len for a full one."""
    return tuple(min(cfg.sliding_window, max_len) if kind == SLIDING else max_len
                 for kind in cfg.resolved_layer_types)


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int) -> int:
    """Bytes of the cache for `batch` rows of `max_len` columns, in the compute dtype."""
    per_column = 2 * cfg.num_key_value_heads * cfg.head_dim * jnp.dtype(DTYPE[cfg.compute_dtype]).itemsize
    return batch * per_column * sum(cache_lengths(cfg, max_len))


def layer(blocks: Block, i: int | Int[Array, ""], dtype) -> Block:
    """Layer i's weights, sliced out of the stacked blocks inside the jit and cast to `dtype`."""
    return cast_floating(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), blocks), dtype)


def unembed(model: OLMo3, x: Float[Array, "batch hidden"]) -> Float[Array, "batch vocab"]:
    """Float32 logits of the final hidden states (normed here), in the compute dtype as the training forward computes
    them."""
    dtype = DTYPE[model.cfg.compute_dtype]
    h = cast_floating(model.norm, dtype)(x)
    return jnp.matmul(h, model.lm_head.weight.astype(dtype), preferred_element_type=jnp.float32)


def _to_cache(x: Float[Array, "batch seq kv_heads dim"], length: int) -> Float[Array, "batch length kv_heads dim"]:
    """The prompt's keys (or values) as a cache of `length` slots: column c in slot c % length."""
    seq = x.shape[1]
    if seq <= length:
        return jnp.pad(x, ((0, 0), (0, length - seq), (0, 0), (0, 0)))
    # a ring shorter than the prompt keeps its last `length` columns, column c in slot c % length
    return jnp.roll(x[:, seq - length:], (seq - length) % length, axis=1)


@eqx.filter_jit
def prefill(model: OLMo3, tokens: Int[Array, "batch seq"], pad: Int[Array, " batch"], max_len: int
            ) -> tuple[Float[Array, "batch vocab"], Cache]:
    """Run the left-padded prompts (row b's first pad[b] tokens are padding) and fill a cache of max_len columns.
    Returns the float32 logits at the last column, the next token's distribution."""
    cfg = model.cfg
    dtype = DTYPE[cfg.compute_dtype]
    batch, seq = tokens.shape
    segment_ids = jnp.where(jnp.arange(seq)[None, :] >= pad[:, None], 1, LEFT_PAD_SEGMENT).astype(jnp.int32)
    positions = document_positions(segment_ids)
    tables = {kind: table.at(positions) for kind, table in rope_tables(seq, cfg).items()}
    kinds = cfg.resolved_layer_types
    period = layer_period(kinds)
    lengths = cache_lengths(cfg, max_len)[:period]

    def run_group(x, group):
        ks, vs = [], []
        for j in range(period):
            blk = layer(model.blocks, group * period + j, dtype)
            sliding = kinds[j] == SLIDING
            q, k, v = blk.attn.project(x, cfg, tables[kinds[j]])
            out = attention(q, k, v, window=cfg.sliding_window if sliding else None, impl=cfg.attention_impl,
                            block_q=cfg.attention_block_q, block_kv=cfg.attention_block_kv, segment_ids=segment_ids)
            h = x + blk.post_attention_norm(blk.attn.output(out, cfg))
            x = h + blk.post_feedforward_norm(blk.mlp(h))
            ks.append(_to_cache(k, lengths[j]))
            vs.append(_to_cache(v, lengths[j]))
        return x, (tuple(ks), tuple(vs))

    x = model.embed[tokens].astype(dtype)
    groups = jnp.arange(cfg.num_hidden_layers // period)
    x, (ks, vs) = jax.lax.scan(run_group, x, groups)  # caches [groups, ...] per position in the period
    logits = unembed(model, x[:, -1])
    per_layer = lambda c: tuple(c[i % period][i // period] for i in range(cfg.num_hidden_layers))  # noqa: E731
    return logits, Cache(per_layer(ks), per_layer(vs), pad.astype(jnp.int32), jnp.asarray(seq, jnp.int32))


def _attend(q: Float[Array, "batch heads dim"], k: Float[Array, "batch length kv_heads dim"],
            v: Float[Array, "batch length kv_heads dim"], valid: Bool[Array, "batch length"]
            ) -> Float[Array, "batch heads dim"]:
    batch, heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(batch, kv_heads, heads // kv_heads, dim)  # query head h uses kv head h // groups
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(dim)
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgs,bskd->bkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, heads, dim).astype(q.dtype)


def _valid(cache_len: int, t: Int[Array, ""], pad: Int[Array, " batch"], ring: bool) -> Bool[Array, "batch length"]:
    """Which slots a query at column t may attend to (t itself already written)."""
    slot = jnp.arange(cache_len)
    column = t - jnp.mod(t - slot, cache_len) if ring else slot
    ok = (column <= t) & (column >= 0)
    return ok[None, :] & (column[None, :] >= pad[:, None])


@eqx.filter_jit
def decode_step(model: OLMo3, cache: Cache, tokens: Int[Array, " batch"], tables: dict[str, RopeTable]
                ) -> tuple[Float[Array, "batch vocab"], Cache]:
    """Feed one token per row at column cache.length; return the float32 logits for the next column and the cache
    with this column written. `tables`: decode_tables(cfg, max_len)."""
    cfg = model.cfg
    t = cache.length
    positions = (t - cache.pad)[:, None]  # [batch, 1]: each row's position within its prompt + generation
    row_tables = {kind: table.at(positions) for kind, table in tables.items()}
    x = model.embed[tokens].astype(DTYPE[cfg.compute_dtype])[:, None]
    new_k, new_v = [], []
    for i, kind in enumerate(cfg.resolved_layer_types):
        blk = layer(model.blocks, i, DTYPE[cfg.compute_dtype])
        q, k, v = blk.attn.project(x, cfg, row_tables[kind])  # [batch, 1, heads, dim]
        length = cache.k[i].shape[1]
        ring = kind == SLIDING
        slot = jnp.mod(t, length) if ring else t
        kc = jax.lax.dynamic_update_slice_in_dim(cache.k[i], k.astype(cache.k[i].dtype), slot, axis=1)
        vc = jax.lax.dynamic_update_slice_in_dim(cache.v[i], v.astype(cache.v[i].dtype), slot, axis=1)
        out = _attend(q[:, 0], kc, vc, _valid(length, t, cache.pad, ring))
        h = x + blk.post_attention_norm(blk.attn.output(out[:, None], cfg))
        x = h + blk.post_feedforward_norm(blk.mlp(h))
        new_k.append(kc)
        new_v.append(vc)
    return unembed(model, x[:, 0]), Cache(tuple(new_k), tuple(new_v), cache.pad, t + 1)


def decode_tables(cfg: ModelConfig, max_len: int) -> dict[str, RopeTable]:
    """The RoPE tables decode_step reads rows of (positions < max_len)."""
    return rope_tables(max_len, cfg)


def sample_logits(logits: Float[Array, "batch vocab"], key: PRNGKeyArray, sampler: Sampler) -> Int[Array, " batch"]:
    """The next token of each row (see Sampler)."""
    if sampler.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampler.temperature
    if 0 < sampler.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampler.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampler.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above each
        keep_sorted = before < sampler.top_p  # the smallest prefix reaching top_p (the first token always)
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@eqx.filter_jit(donate="all-except-first")
def decode_chunk(model: OLMo3, cache: Cache, tokens: Int[Array, " batch"], done: Bool[Array, " batch"],
                 seed: UInt[Array, ""], max_len: int, steps: int, sampler: Sampler, eos_id: int
                 ) -> tuple[Int[Array, "steps batch"], Cache, Int[Array, " batch"], Bool[Array, " batch"]]:
    """`steps` decode steps in one program: feed `tokens`, sample the next ones (the token of column c drawn with
    key fold_in(key(seed), c)), mark rows that emitted EOS done. Returns the sampled tokens [steps, batch], the
    cache, the last tokens and done. Everything but the model is donated: the cache is updated in place."""
    tables = decode_tables(model.cfg, max_len)
    key = jax.random.key(seed)

    def step(carry, _):
        cache, tokens, done = carry
        logits, cache = decode_step(model, cache, tokens, tables)
        nxt = sample_logits(logits, jax.random.fold_in(key, cache.length), sampler)
        nxt = jnp.where(done, eos_id, nxt)
        done = done | (nxt == eos_id)
        return (cache, nxt, done), nxt

    (cache, tokens, done), out = jax.lax.scan(step, (cache, tokens, done), None, length=steps)
    return out, cache, tokens, done


@eqx.filter_jit
def first_token(logits: Float[Array, "batch vocab"], seed: UInt[Array, ""], column: Int[Array, ""], sampler: Sampler
                ) -> Int[Array, " batch"]:
    """The token after the prompt (column `column`), drawn as decode_chunk draws the others."""
    return sample_logits(logits, jax.random.fold_in(jax.random.key(seed), column), sampler)
