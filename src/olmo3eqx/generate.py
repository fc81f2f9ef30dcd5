"""Text generation, the host side: prompts batched and left-padded, the decode loop with EOS, stop strings and a
length limit, streaming (`generate`, used by olmo3eqx-generate, the generative tasks and the lm-eval adapter). The
device side (KV cache, prefill, decode steps, sampling) is olmo3eqx.decode; texts go through olmo3eqx.tasks.Tokenizer
both ways. The command is olmo3eqx.tools.generate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from olmo3eqx.errors import GenerationError

MIN_BUCKET = 16
"""Prompts are left-padded to a power of two at least this long, so a stream of prompts compiles few shapes."""


@dataclass
class Completion:
    """One prompt's generation: the new token ids (without the EOS that ended it), their text (cut before a stop
    string), and why it ended: 'eos', 'stop' (a stop string) or 'length' (max_new_tokens)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = "length"


def bucket(n: int) -> int:
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_positions: int, max_new_tokens: int
                  ) -> None:
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise GenerationError(f"Prompt {i} is empty; give at least one token (a BOS-less model needs some text "
                                  f"to continue).")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise GenerationError(f"Prompt {i} holds token id {bad[0]}, outside the model's vocabulary "
                                  f"[0, {vocab_size}); use the tokenizer the model was trained with.")
        if len(p) + max_new_tokens > max_positions:
            raise GenerationError(f"Prompt {i} has {len(p)} tokens; with max_new_tokens {max_new_tokens} that is "
                                  f"more than the model's {max_positions} positions (model.max_position_embeddings): "
                                  f"shorten the prompt or generate fewer tokens.")


def _stop_at(text: str, stop: Sequence[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(found) if found else None


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampler=None, seed: int = 0,
             eos_id: int | None = None, stop: Sequence[str] = (), decode: Callable[[Sequence[int]], str] | None = None,
             chunk: int = 16, on_text: Callable[[int, str], None] | None = None, mesh=None) -> list[Completion]:
    """Complete each prompt (token ids) with up to max_new_tokens tokens, all prompts in one batch.

    Stops a row at `eos_id` (default: the model's), at the first of `stop` in its text (needs `decode`, ids ->
    text), or after max_new_tokens. `chunk` decode steps run per device program (1 streams token by token).
    `on_text(row, new_text)` receives each row's text as it grows (held back while it could still begin a stop
    string or ends in a partial UTF-8 character). With `mesh`, prompts are split over its data axes when the batch divides (the model as placed)."""

    from olmo3eqx import decode as dec

    cfg = model.cfg
    sampler = sampler or dec.Sampler()
    eos_id = cfg.eos_token_id if eos_id is None else eos_id
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
    if stop and decode is None:
        raise GenerationError("Stop strings need a decode function (ids -> text).")
    check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings, max_new_tokens)
    batch = len(prompts)
    width = min(bucket(max(len(p) for p in prompts)), cfg.max_position_embeddings - max_new_tokens)
    steps = -(-max_new_tokens // chunk) * chunk
    max_len = width + steps
    tokens = np.full((batch, width), eos_id, np.int32)
    pad = np.zeros(batch, np.int32)
    for i, p in enumerate(prompts):
        pad[i] = width - len(p)
        tokens[i, pad[i]:] = p
    put = _placer(mesh, batch)
    tokens, pad = put(tokens), put(pad)
    logits, cache = dec.prefill(model, tokens, pad, max_len)
    seed_array = np.asarray(seed, np.uint32)  # host scalars: replicated on every device and process
    last = dec.first_token(logits, seed_array, np.asarray(width, np.int32), sampler)
    done = last == eos_id
    out = [Completion() for _ in range(batch)]
    shown = [0] * batch
    hold = max((len(s) for s in stop), default=1) - 1
    generated = _to_host(last)[None, :]
    while True:
        host_done = np.zeros(batch, bool)
        for row in range(batch):
            c = out[row]
            if c.finish != "length" or len(c.tokens) >= max_new_tokens:
                host_done[row] = True
                continue
            for t in generated[:, row]:
                if t == eos_id:
                    c.finish = "eos"
                    break
                c.tokens.append(int(t))
                if len(c.tokens) >= max_new_tokens:
                    break
            if decode is not None:
                c.text = decode(c.tokens)
                cut = _stop_at(c.text, stop)
                if cut is not None:
                    c.text, c.finish = c.text[:cut], "stop"
            if on_text is not None:
                final = c.finish != "length" or len(c.tokens) >= max_new_tokens
                upto = len(c.text) if final else max(shown[row], len(c.text) - hold)
                while not final and upto > shown[row] and c.text[upto - 1] == "\ufffd":
                    upto -= 1  # the start of a character whose other bytes are still to come
                if upto > shown[row]:
                    on_text(row, c.text[shown[row]:upto])
                    shown[row] = upto
            host_done[row] = c.finish != "length" or len(c.tokens) >= max_new_tokens
        if host_done.all():
            break
        done = done | put(host_done)
        generated, cache, last, done = dec.decode_chunk(model, cache, last, done, seed_array, max_len, chunk,
                                                        sampler, eos_id)
        generated = _to_host(generated)
    return out


def _placer(mesh, batch: int) -> Callable[[np.ndarray], object]:
    """Host rows -> a device array: split over the mesh's data axes when the batch divides, else replicated; on
    several processes each builds the same global array from the rows every process holds."""
    import jax
    import jax.numpy as jnp

    if mesh is None:
        return jnp.asarray
    from jax.sharding import NamedSharding, PartitionSpec

    from olmo3eqx.sharding import batch_sharding, data_parallel_size

    split = batch % data_parallel_size(mesh) == 0

    def put(x: np.ndarray):
        sharding = batch_sharding(mesh, x.ndim) if split else NamedSharding(mesh, PartitionSpec())
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return put


def _to_host(x) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
