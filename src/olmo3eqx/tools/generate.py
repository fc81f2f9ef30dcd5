"""Text generation from any checkpoint: `python -m olmo3eqx.tools.generate --ckpt runs/tiny "def fib(n):"` (also the
`olmo3eqx-generate` console script). The device side (KV cache, prefill, decode steps, sampling) is olmo3eqx.decode;
the host loop is olmo3eqx.generate; this module is the command.

    olmo3eqx-generate --ckpt runs/tiny "def fib(n):"                       # streams the completion
    olmo3eqx-generate --ckpt runs/tiny --temperature 0.8 --top-p 0.95 --seed 1 "import os"
    olmo3eqx-generate --ckpt ckpt/olmo3-7b --file prompts.jsonl --out completions.jsonl
    olmo3eqx-generate --ckpt runs/sft --chat --system "Be brief." "What is 12+7?"  # the chat template, one turn
    olmo3eqx-generate --ckpt runs/sft --chat --conversation chat.json --interactive --out chat.json  # many turns

`--ckpt` takes what olmo3eqx-eval takes (a run, one of its steps, convert.py's output, an HF Olmo3 directory); the
tokenizer is `--tokenizer`, else an HF directory's tokenizer.json, else the run's eval.tokenizer; a converted
checkpoint without one needs `--tokenizer`. `--file` reads JSONL lines ({"prompt": ...}, or a JSON string) and
writes one {"prompt", "completion", "finish", "tokens"} line per prompt (to `--out`: a local file, or a gs:// or
s3:// URL written when the last prompt is done). With --chat the template is the one the checkpoint's data was
prepared with (its recorded hash, olmo3eqx.data.template_record), and another is refused; --conversation answers a
JSON list of messages, --interactive then reads user messages from stdin, one a line (olmo3eqx.conversation), and
--out gets the whole conversation as JSON. The checkpoint is restored straight onto every device's shard in
the compute dtype (olmo3eqx.checkpoint.load_any); several processes run the same command together (run's doc).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Annotated

import tyro

from olmo3eqx import exits, jaxenv
from olmo3eqx.errors import GenerationError
from olmo3eqx.generate import generate

DESCRIPTION = "Complete prompts with a checkpoint: streamed to stdout, or from a JSONL file to JSONL lines."
"""--help's description (the module doc's first line is not a sentence on its own)."""


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
    a gs:// or s3:// URL (default: stdout); with --conversation or --interactive: the whole conversation, answers
    included, as JSON (a file --conversation takes back)."""
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
    chat: bool = False
    """Each prompt is a user message: the chat template renders it with the assistant's prompt, and generation stops
    at the template's end of turn (EOS, or <|im_end|>)."""
    conversation: str | None = None
    """With --chat: a JSON file of the conversation so far (a list of {"role", "content"} messages, or
    {"messages": [...]}); its last message is answered (instead of prompts)."""
    interactive: bool = False
    """With --chat: then read user messages from stdin, one a line, each answered with the conversation so far,
    until the input ends (one process)."""
    system: str | None = None
    """With --chat: a system message before each user message (or opening the conversation)."""
    chat_template: str | None = None
    """With --chat: a built-in template (olmo, olmo_thinker, bytes), a .jinja file or a tokenizer_config.json; unset:
    the one the checkpoint's data was prepared with (prepare chat's hash, kept by the trainer), else
    chat_template.jinja or tokenizer_config.json beside the tokenizer.json, the bytes template for 'bytes'. A template
    other than the one the data was prepared with is refused (exit 2)."""
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
    return run(tyro.cli(Args, args=argv, description=DESCRIPTION))


def run(args: Args) -> int:
    """The command. Several processes (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a cluster JAX
    detects) generate together, the model sharded over all their devices; process 0 prints and writes."""
    from olmo3eqx import decode as dec
    from olmo3eqx import distributed, storage
    from olmo3eqx.config import DistConfig

    distributed.initialize(DistConfig())  # before anything touches a device
    import jax

    from olmo3eqx import conversation
    from olmo3eqx.checkpoint.model import load_any
    from olmo3eqx.data import template_record
    from olmo3eqx.sharding import node_mesh
    from olmo3eqx.tasks import Tokenizer

    out = storage.check(args.out, "--out", write=True) if args.out else None  # refused first
    if (args.system is not None or args.chat_template is not None or args.conversation is not None
            or args.interactive) and not args.chat:
        raise GenerationError("--system, --chat-template, --conversation and --interactive apply to chat; add --chat.")
    many_turns = args.conversation is not None or args.interactive
    prompts = list(args.prompts)
    if args.file:
        prompts += read_prompt_file(args.file)
    if many_turns and prompts:
        raise GenerationError("Prompts and --file are one-turn chats; with --conversation or --interactive put the "
                              "user's messages in the conversation or on stdin.")
    if not prompts and not many_turns:
        raise GenerationError("No prompt given: pass prompts as arguments or --file prompts.jsonl.")
    if args.interactive and jax.process_count() > 1:
        raise GenerationError("--interactive reads stdin in one process; give several processes a --conversation.")
    messages = conversation.read_conversation(args.conversation) if args.conversation else []
    if messages and messages[-1]["role"] == "assistant" and not args.interactive:
        raise GenerationError(f"The conversation in {args.conversation} ends with the assistant's message: nothing to "
                              f"answer; end it with a user message, or add --interactive.")
    if many_turns:
        messages = conversation.with_system(messages, args.system)
    try:
        sampler = dec.Sampler(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise GenerationError(str(e)) from None
    mesh = node_mesh()  # every device: parameters FSDP-sharded within a node as in training, prompts over the data axes
    model, cfg, stored, hf_tokenizer, step, _ = load_any(args.ckpt, mesh, args.dtype)
    tokenizer = Tokenizer.load(resolve_tokenizer(args.tokenizer, hf_tokenizer, stored, args.ckpt))
    speaks = jax.process_index() == 0
    if tokenizer.vocab_size > cfg.vocab_size and speaks:
        print(f"warning: the tokenizer {tokenizer.spec} has {tokenizer.vocab_size} ids, the model {cfg.vocab_size}; an "
              f"id beyond the model's stops generation with an error.", file=sys.stderr)
    stop = tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in args.stop)
    if args.chat:
        chat = template_record.chat_tokenizer(tokenizer.spec, args.chat_template,
                                              template_record.recorded_templates(args.ckpt), args.ckpt)
        if many_turns:
            return chat_turns(args, model, chat, tokenizer, sampler, stop + chat.end_of_turn, mesh, speaks, out,
                              messages, step)
        system = [{"role": "system", "content": args.system}] if args.system else []
        ids = [chat.encode(system + [{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
        stop += chat.end_of_turn
    else:
        ids = [x.tolist() for x in tokenizer.encode(prompts)]
    if len(prompts) == 1 and not args.file and out is None:
        if speaks and not args.chat:  # a chat reply is printed alone, without the template around the message
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


def chat_turns(args: Args, model, chat, tokenizer, sampler, stop: tuple[str, ...], mesh, speaks: bool, out,
               messages: list[dict], step: int) -> int:
    """--conversation / --interactive: each answer streamed to stdout as it is generated from the conversation so
    far, then added to it; the whole conversation written to --out (JSON) at the end."""
    from olmo3eqx import conversation, storage

    turns = 0

    def reply(so_far: list[dict]) -> str:
        nonlocal turns
        ids = chat.encode(so_far, add_generation_prompt=True)
        t0 = time.perf_counter()
        [c] = generate(model, [ids], max_new_tokens=args.max_new_tokens, sampler=sampler, seed=args.seed + turns,
                       stop=stop, decode=tokenizer.decode, chunk=1, mesh=mesh,
                       on_text=(lambda _, text: (sys.stdout.write(text), sys.stdout.flush())) if speaks else None)
        turns += 1
        if speaks:
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(f"[turn {turns}: {len(c.tokens)} tokens in {time.perf_counter() - t0:.1f} s, ended by {c.finish}; "
                  f"step {step} of {args.ckpt}]", file=sys.stderr)
        return c.text

    users = conversation.user_lines(sys.stdin) if args.interactive else ()
    messages = conversation.converse(messages, users, reply)
    if speaks and out is not None:
        storage.write_text(out, json.dumps(messages, indent=1, ensure_ascii=False) + "\n")
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
