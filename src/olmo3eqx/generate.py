"""Text generation from any checkpoint: `python -m olmo3eqx.generate --ckpt runs/tiny "def fib(n):"` (also the
`olmo3eqx-generate` console script). The device side (KV cache, prefill, decode steps, sampling) is olmo3eqx.decode;
this module is the host side (texts through olmo3eqx.tasks.Tokenizer both ways): prompts batched and left-padded, the decode loop with EOS, stop
strings and a length limit, streaming, and the command.

    olmo3eqx-generate --ckpt runs/tiny "def fib(n):"                       # streams the completion
    olmo3eqx-generate --ckpt runs/tiny --temperature 0.8 --top-p 0.95 --seed 1 "import os"
    olmo3eqx-generate --ckpt ckpt/olmo3-7b --file prompts.jsonl --out completions.jsonl

`--ckpt` takes what olmo3eqx-eval takes (a run, one of its steps, convert.py's output, an HF Olmo3 directory); the
tokenizer is `--tokenizer`, else an HF directory's tokenizer.json, else the run's eval.tokenizer; a converted
checkpoint without one needs `--tokenizer`. `--file` reads JSONL lines ({"prompt": ...}, or a JSON string) and
writes one {"prompt", "completion", "finish", "tokens"} line per prompt (to `--out`: a local file, or a gs:// or
s3:// URL written when the last prompt is done). The checkpoint is restored straight onto every device's shard in
the compute dtype (olmo3eqx.checkpoint.load_any); several processes run the same command together (run's doc).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated

import numpy as np
import tyro

from olmo3eqx import exits, jaxenv
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


# --- the command ----------------------------------------------------------------------------------


@dataclass
class Args:
    """Generate text from a checkpoint."""

    prompts: Annotated[tuple[str, ...], tyro.conf.Positional] = ()
    """Prompts to complete; or --file."""
    ckpt: str = "runs/tiny"
    """A run directory (its newest step), a step, convert.py's output, or an HF Olmo3 directory."""
    tokenizer: str | None = None
    """'bytes' or a tokenizer.json; unset: an HF directory's tokenizer.json, else the run's eval.tokenizer."""
    file: str | None = None
    """JSONL of prompts: {"prompt": ...} objects or JSON strings, one per line."""
    out: str | None = None
    """With --file: write one {"prompt", "completion", "finish", "tokens"} JSON line per prompt here, a local path or
    a gs:// or s3:// URL (default: stdout)."""
    max_new_tokens: int = 128
    """Most tokens to generate per prompt."""
    temperature: float = 0.0
    """0: greedy; otherwise sample from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    top_p: float = 1.0
    """Sample among the smallest set of tokens whose probability reaches top_p (1.0: all)."""
    seed: int = 0
    """Sampling seed: the same seed, prompts and checkpoint give the same text."""
    stop: tuple[str, ...] = ()
    """Stop a completion at the first of these strings (not included); \\n and \\t stand for a newline and a tab."""
    batch_size: int = 16
    """Prompts generated together (--file)."""
    dtype: str | None = None
    """Weights and compute in this dtype (float32, bfloat16, float16); unset: the checkpoint's compute dtype (float32
    for an HF directory)."""


def resolve_tokenizer(args_tokenizer: str | None, hf_tokenizer: str | None, stored: dict | None, ckpt: str) -> str:
    if args_tokenizer:
        return args_tokenizer
    if hf_tokenizer:
        return hf_tokenizer
    run_eval = (stored or {}).get("eval") or {}
    if run_eval.get("tokenizer"):
        return run_eval["tokenizer"]
    raise GenerationError(f"The checkpoint {ckpt} names no tokenizer (a converted checkpoint keeps only the model); "
                          f"pass --tokenizer bytes or --tokenizer path/to/tokenizer.json.")


def read_prompt_file(path: str) -> list[str]:
    from olmo3eqx import storage

    prompts = []
    for i, line in enumerate(storage.read_text(path).splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise GenerationError(f"Line {i + 1} of {path} is not JSON; write one {{\"prompt\": ...}} object or "
                                  f"JSON string per line.") from None
        text = rec.get("prompt") if isinstance(rec, dict) else rec
        if not isinstance(text, str):
            raise GenerationError(f"Line {i + 1} of {path} has no \"prompt\" string.")
        prompts.append(text)
    return prompts


@exits.command
def main(argv: list[str] | None = None) -> int:
    if "jax" not in sys.modules:  # the command, before JAX starts (not a test or a notebook calling main)
        jaxenv.prepare_speaking(os.environ)
    return run(tyro.cli(Args, args=argv, description=__doc__.splitlines()[0]))


def run(args: Args) -> int:
    """The command. Several processes (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a cluster JAX
    detects) generate together, the model sharded over all their devices; process 0 prints and writes."""
    from olmo3eqx import decode as dec
    from olmo3eqx import distributed, storage
    from olmo3eqx.config import DistConfig

    distributed.initialize(DistConfig())  # before anything touches a device
    import jax

    from olmo3eqx.checkpoint import load_any
    from olmo3eqx.config import MeshConfig
    from olmo3eqx.sharding import make_mesh
    from olmo3eqx.tasks import Tokenizer

    out = storage.check(args.out, "--out", write=True) if args.out else None  # refused first
    prompts = list(args.prompts)
    if args.file:
        prompts += read_prompt_file(args.file)
    if not prompts:
        raise GenerationError("No prompt given: pass prompts as arguments or --file prompts.jsonl.")
    try:
        sampler = dec.Sampler(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise GenerationError(str(e)) from None
    mesh = make_mesh(MeshConfig())  # every device: parameters FSDP-sharded as in training, prompts over the data axes
    model, cfg, stored, hf_tokenizer, step, _ = load_any(args.ckpt, mesh, args.dtype)
    tokenizer = Tokenizer.load(resolve_tokenizer(args.tokenizer, hf_tokenizer, stored, args.ckpt))
    speaks = jax.process_index() == 0
    if tokenizer.vocab_size > cfg.vocab_size and speaks:
        print(f"warning: the tokenizer {tokenizer.spec} has {tokenizer.vocab_size} ids, the model {cfg.vocab_size}; an "
              f"id beyond the model's stops generation with an error.", file=sys.stderr)
    ids = [x.tolist() for x in tokenizer.encode(prompts)]
    stop = tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in args.stop)
    if len(prompts) == 1 and not args.file and out is None:
        if speaks:
            sys.stdout.write(prompts[0])
            sys.stdout.flush()
        t0 = time.perf_counter()
        [c] = generate(model, ids, max_new_tokens=args.max_new_tokens, sampler=sampler, seed=args.seed,
                       stop=stop, decode=tokenizer.decode, chunk=1, mesh=mesh,
                       on_text=(lambda _, text: (sys.stdout.write(text), sys.stdout.flush())) if speaks else None)
        if speaks:
            sys.stdout.write("\n")
            print(f"[{len(c.tokens)} tokens in {time.perf_counter() - t0:.1f} s, ended by {c.finish}; step {step} of "
                  f"{args.ckpt}]", file=sys.stderr)
        return exits.OK
    if speaks and out is not None:
        storage.write_bytes(out, b"")  # a batch at a time below: appended to an empty file or object
    for start in range(0, len(ids), args.batch_size):
        batch = ids[start:start + args.batch_size]
        done = generate(model, batch, max_new_tokens=args.max_new_tokens, sampler=sampler, seed=args.seed + start,
                        stop=stop, decode=tokenizer.decode, mesh=mesh)
        if not speaks:  # process 0 prints and writes
            continue
        lines = "".join(json.dumps({"prompt": p, "completion": c.text, "finish": c.finish, "tokens": len(c.tokens)})
                        + "\n" for p, c in zip(prompts[start:start + len(batch)], done))
        if out is not None:  # a batch at a time: a local file or an object in a bucket (appended once, see storage)
            storage.append_bytes(out, lines.encode())
        else:
            sys.stdout.write(lines)
            sys.stdout.flush()
        print(f"{min(start + args.batch_size, len(ids))}/{len(ids)} prompts", file=sys.stderr)
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
