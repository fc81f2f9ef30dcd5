"""Chat data -> OLMo-core's SFT token files: token ids and a label mask, assistant tokens only.

    olmo3eqx-prepare chat --input chats.jsonl --tokenizer tokenizer.json --chat-template olmo --out sft/

Rows are `{"messages": [{"role", "content"}, ...]}` objects in Dolci's schema (AI2's OLMo 3 SFT data): a system or
user message may carry `functions` (the tool definitions, a JSON string the templates put in <functions></functions>),
an assistant message `function_calls` (its calls, a string; its `content` may then be null), and a tool's result is an
`environment` turn. They come as JSON Lines (.jsonl, .jsonl.gz; local files, globs or gs:// s3:// https:// URLs), a
Hugging Face `datasets` dataset saved to disk (`save_to_disk`), or a Hub dataset by name
(hf://allenai/Dolci-Instruct-SFT; olmo3eqx.data.hub); `--mix` takes them from a mixture of sources with
open-instruct's per-source amounts (olmo3eqx.data.chat_mix). Each conversation is
rendered with the tokenizer's chat template (a Jinja template, rendered as transformers' `apply_chat_template` renders
it: the same sandboxed environment and variables) and encoded with the `tokenizers` library, special tokens matched as
written, none added. The label mask follows open-instruct's `sft_tulu_tokenize_and_truncate_v1`, which AI2's
`convert_sft_data_for_olmocore.py` applies: every non-assistant message is masked from the length of the rendered
conversation before it to the length with it (with the assistant prompt when an assistant answers it), so labels fall
on the assistant's content and what ends its turn (`<|im_end|>\\n`, or EOS after the last one).

Every conversation ends with EOS (OLMo-core finds document boundaries by EOS): the `olmo` template ends the last
assistant turn with it; a conversation whose template output does not end in EOS gets one, unlabelled. A conversation
longer than --max-seq-len is truncated (its first max_seq_len - 1 tokens, then an unlabelled EOS) or skipped
(--long skip). Rows with no assistant turn, a role the templates do not know, malformed messages, an over-long
conversation under --long skip, or no labelled token left after truncation are counted per reason, the first of each
named, reported, and recorded in metadata.json: never dropped silently.

Output, as open-instruct writes it for OLMo-core's `label_mask_paths`: `token_ids_part_0000.npy` (raw headerless
memmap; uint16 when the vocabulary fits, else uint32) and `labels_mask_part_0000.npy` (np.bool_, one byte per token),
cut at conversation boundaries every --shard-tokens tokens, each token file with its document index
(`token_ids_part_0000.csv.gz`), and `metadata.json` written last.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from olmo3eqx import exits, storage
from olmo3eqx.data import chat_mix, hub
from olmo3eqx.data.documents import INDEX_SUFFIX, scan_index
from olmo3eqx.data.packed import pack_files
from olmo3eqx.data.prepare import BYTES, DEFAULT_SHARD_TOKENS, EOS_TOKEN, tokenizer_info
from olmo3eqx.data.source import METADATA, token_dtype_for_vocab
from olmo3eqx.data.tool_tokens import TOOL_TOKENS
from olmo3eqx.errors import DataError

TEMPLATES = Path(__file__).parent / "chat_templates"
"""Built-in templates by name, kept as data with their sources in sources.json: AI2's olmo3_instruct (the Olmo 3
Instruct tokenizer's, which the Instruct SFT data is tokenized with: no identity system prompt, tool tags) and
olmo_thinker_no_think_7b (the 7B Think SFT data's: no <think> in the generation prompt, so <think> is labelled),
open-instruct's olmo and olmo_thinker byte for byte, and bytes.jinja (plain "User: ... / Assistant: ..." turns for the
byte-level tokenizer)."""
AI2_SFT_EPOCHS = 2
AI2_SFT_BATCH_TOKENS = 1_048_576
"""OLMo 3 7B SFT: 2 epochs of 1,048,576-token batches; prepare prints the steps that makes for the data it wrote."""
KNOWN_ROLES = ("system", "user", "assistant", "environment")
"""The roles the OLMo templates render (any other the olmo template would drop without a word); Dolci's tool results
are environment turns."""
CALL_FIELDS = ("functions", "function_calls")
"""Dolci's tool fields of a message: strings, or null where a `datasets` table fills a field a message lacks."""
END_OF_TURN = "<|im_end|>"
"""What ends an assistant turn that is not the conversation's last (the olmo template); generation stops there too."""
TOKEN_FILE, MASK_FILE = "token_ids_part_{:04d}.npy", "labels_mask_part_{:04d}.npy"
"""open-instruct's output names (convert_sft_data_for_olmocore.py)."""
FORMAT_VERSION = 1
UNSHUFFLED = ".unshuffled"
"""Where --shuffle-seed writes the conversations in input order before writing them shuffled to --out."""
LongPolicy = Literal["truncate", "skip"]

REASONS = {
    "malformed": "not a {\"messages\": [{\"role\", \"content\"}, ...]} object of strings (content null only beside "
                 "function_calls)",
    "unknown_role": "with a role other than " + ", ".join(KNOWN_ROLES),
    "no_assistant": "without an assistant turn",
    "too_long": "longer than --max-seq-len (--long skip)",
    "no_labels": "with no labelled token left after truncation",
}
"""Why a row is skipped, as the report says it."""


# --- the template ----------------------------------------------------------------------------------


def load_template(spec: str | None, tokenizer: str) -> str:
    """The chat template's text: `spec` a built-in name (TEMPLATES), a .jinja file, or a tokenizer_config.json with
    a "chat_template"; unset, the tokenizer's own (chat_template.jinja or tokenizer_config.json beside its
    tokenizer.json) or, for the byte-level tokenizer, the bytes template."""
    if spec is None:
        if tokenizer == BYTES:
            spec = BYTES
        else:
            beside = Path(tokenizer).expanduser().parent
            found = [p for p in (beside / "chat_template.jinja", beside / "tokenizer_config.json")
                     if p.is_file() and (p.suffix == ".jinja" or "chat_template" in json.loads(p.read_text()))]
            if not found:
                raise DataError(f"The tokenizer {tokenizer} has no chat template beside it (chat_template.jinja or "
                                f"tokenizer_config.json); pass --chat-template olmo or a .jinja file.")
            spec = str(found[0])
    if (TEMPLATES / f"{spec}.jinja").is_file():
        return (TEMPLATES / f"{spec}.jinja").read_text()
    path = Path(spec).expanduser()
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
        raise DataError(f"Chat template {spec} is neither a built-in ({names}) nor a file; give a .jinja file or a "
                        f"tokenizer_config.json.")
    if path.suffix == ".json":
        template = json.loads(path.read_text()).get("chat_template")
        if not isinstance(template, str):
            raise DataError(f"{spec} has no \"chat_template\" string; give a .jinja file or a built-in name.")
        return template
    return path.read_text()


TEMPLATE_HASH_KEY = "chat_template_sha256"
"""The template hash's key in prepare chat's metadata.json (and in a checkpoint's custom metadata: template_record)."""


def template_sha256(text: str) -> str:
    """A chat template's hash as prepare chat records it and a checkpoint keeps it: sha256 of its utf-8 text."""
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=8)
def compiled(template: str):
    """The template compiled as transformers compiles it (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
    loop controls, raise_exception and tojson): nothing in a template can reach the host."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise DataError(f"The chat template refused the conversation: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise DataError(f"The chat template does not parse: {e}.") from None


class ChatTokenizer:
    """A tokenizer ('bytes' or a tokenizer.json) with a chat template: messages -> token ids (and label masks)."""

    def __init__(self, tokenizer: str, template: str | None = None, eos_id: int | None = None):
        info = tokenizer_info(tokenizer, eos_id)
        self.spec, self.eos_id, self.vocab_size = tokenizer, info["eos_id"], info["vocab_size"]
        self.template = load_template(template, tokenizer)
        if tokenizer == BYTES:
            self._tok = None
            self.eos_token = EOS_TOKEN  # the byte tokenizer's EOS written as text; encode_text maps it back
        else:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(Path(tokenizer).expanduser()))
            self.eos_token = self._tok.id_to_token(self.eos_id)
        has_end = self._tok is not None and self._tok.token_to_id(END_OF_TURN) is not None
        self.end_of_turn = (END_OF_TURN,) if has_end else ()
        self.sha256 = template_sha256(self.template)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for `messages`, as transformers' apply_chat_template(tokenize=False) gives it: with
        `tools` None as transformers passes it (the instruct template tests `tools is none`); Dolci's tool
        definitions travel in the messages' `functions`."""
        return compiled(self.template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                              tools=None, eos_token=self.eos_token, bos_token="", pad_token="")

    def encode_text(self, text: str) -> list[int]:
        """Ids of rendered text, special tokens matched where written and none added (bytes: utf-8 bytes, the EOS
        text as the EOS id)."""
        if self._tok is not None:
            return self._tok.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for i, piece in enumerate(text.split(self.eos_token)):
            ids += ([self.eos_id] if i else []) + list(piece.encode("utf-8"))
        return ids

    def encode(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> list[int]:
        return self.encode_text(self.render(messages, add_generation_prompt))

    def tokenize(self, messages: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, label mask) of a conversation, ending in EOS; labels by open-instruct's rule (module doc)."""
        ids = self.encode(messages)
        mask = np.ones(len(ids), bool)
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                continue
            start = len(self.encode(messages[:i])) if i else 0
            answered = i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"
            mask[start:len(self.encode(messages[:i + 1], add_generation_prompt=answered))] = False
        if not ids or ids[-1] != self.eos_id:
            ids, mask = ids + [self.eos_id], np.append(mask, False)
        return np.asarray(ids, np.int64), mask


def well_formed(message) -> bool:
    """Whether `message` is one of Dolci's: a role, string content (or null on an assistant turn that calls
    functions), and tool fields that are strings or null."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    if not all(message.get(k) is None or isinstance(message.get(k), str) for k in CALL_FIELDS):
        return False
    content = message.get("content")
    return isinstance(content, str) or (content is None and message["role"] == "assistant"
                                        and isinstance(message.get("function_calls"), str))


def check_row(row) -> str | None:
    """Why a row cannot be a conversation (a key of REASONS), or None."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages or not all(well_formed(m) for m in messages):
        return "malformed"
    if any(m["role"] not in KNOWN_ROLES for m in messages):
        return "unknown_role"
    if not any(m["role"] == "assistant" for m in messages):
        return "no_assistant"
    return None


def fit(ids: np.ndarray, mask: np.ndarray, max_len: int | None, long: LongPolicy,
        eos_id: int) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(ids, mask, reason to skip or None) of a conversation under max_len: truncated to max_len - 1 tokens and an
    unlabelled EOS, or skipped."""
    if max_len is None or ids.size <= max_len:
        return ids, mask, None
    if long == "skip":
        return ids, mask, "too_long"
    ids, mask = np.append(ids[:max_len - 1], eos_id), np.append(mask[:max_len - 1], False)
    return ids, mask, None if mask.any() else "no_labels"


# --- inputs ----------------------------------------------------------------------------------------


def is_saved_dataset(path: str) -> bool:
    """Whether a local directory is a `datasets` save_to_disk output (a Dataset or a DatasetDict)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def iter_rows(inputs: Sequence[str], split: str = "train") -> Iterator[tuple[str, object]]:
    """(where, row) of every input row in argument order: JSON Lines files (local, globs or URLs) and saved
    `datasets` directories (`split` of a DatasetDict). A line that is not JSON is given as None."""
    for arg in inputs:
        if hub.is_hub(arg):
            yield from _hub_rows(arg, split)
            continue
        arg = storage.check(arg, "--input")
        if not storage.is_url(arg) and is_saved_dataset(os.path.expanduser(arg)):
            yield from _dataset_rows(os.path.expanduser(arg), split)
            continue
        files = sorted(storage.glob(arg)) if any(c in arg for c in "*?[") else [arg]
        if not files or not all(storage.isfile(f) for f in files):
            raise DataError(f"Input {storage.redact(arg)} is neither a JSON Lines file, a glob of them, nor a saved "
                            f"datasets directory; fix --input.")
        for path in files:
            yield from _jsonl_rows(path, storage.redact(path))


def _jsonl_rows(path: str, where: str) -> Iterator[tuple[str, object]]:
    data = storage.read_bytes(path)
    if path.endswith(".gz"):
        data = gzip.decompress(data)
    for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            yield f"{where} line {n}", row


def _hub_rows(spec: str, split: str) -> Iterator[tuple[str, object]]:
    """The rows of a Hub dataset's split (olmo3eqx.data.hub), file by file."""
    repo, _ = hub.parse(spec)
    for path in hub.data_files(spec, split):
        where = f"{hub.SCHEME}{repo} {path.name}"
        yield from (hub.parquet_rows(path, where) if path.suffix == ".parquet" else _jsonl_rows(str(path), where))


def _dataset_rows(path: str, split: str) -> Iterator[tuple[str, object]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path} is a saved datasets directory; reading it needs `pip install datasets`.") from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path} has splits {', '.join(ds)}, not {split!r}; pass --split.")
        ds = ds[split]
    for i, row in enumerate(ds):
        yield f"{path} row {i}", row


# --- output ----------------------------------------------------------------------------------------


@dataclass
class Report:
    """What prepare made of the rows: conversations kept, rows skipped per reason (and the first of each)."""

    rows: int = 0
    kept: int = 0
    truncated: int = 0
    tokens: int = 0
    labelled: int = 0
    skipped: dict = field(default_factory=dict)
    first: dict = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.first.setdefault(reason, where)

    def sentence(self) -> str:
        """One sentence: what was kept and what was skipped, and why."""
        out = (f"{self.kept:,} of {self.rows:,} conversations kept ({self.tokens:,} tokens, {self.labelled:,} "
               f"labelled; {self.truncated:,} truncated)")
        if self.skipped:
            out += "; skipped " + ", ".join(f"{n:,} {REASONS[r]} (first: {self.first[r]})"
                                            for r, n in self.skipped.items())
        return out + "."


def _write(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    array.tofile(tmp)
    os.replace(tmp, path)


class Shards:
    """Conversations written to `out` as OLMo-core's SFT files (token ids, label mask, document index), cut at
    conversation boundaries every `shard_tokens` tokens; `files` and each file's conversation `spans` so far."""

    def __init__(self, out: Path, dtype, eos_id: int, shard_tokens: int):
        self.out, self.dtype, self.eos_id, self.shard_tokens = out, dtype, eos_id, shard_tokens
        out.mkdir(parents=True, exist_ok=True)
        self.files: list[list[str]] = []
        self.spans: list[np.ndarray] = []
        self._ids: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._pending = 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        if self._pending and self._pending + ids.size > self.shard_tokens:
            self.flush()
        self._ids.append(ids)
        self._masks.append(mask)
        self._pending += ids.size

    def flush(self) -> None:
        if not self._pending:
            return
        k = len(self.files)
        tokens = np.concatenate(self._ids).astype(self.dtype)
        _write(self.out / TOKEN_FILE.format(k), tokens)
        _write(self.out / MASK_FILE.format(k), np.concatenate(self._masks).astype(np.bool_))
        (self.out / TOKEN_FILE.format(k).replace(".npy", INDEX_SUFFIX)).write_bytes(scan_index(tokens, self.eos_id))
        self.files.append([TOKEN_FILE.format(k), MASK_FILE.format(k)])
        sizes = [x.size for x in self._ids]
        ends = np.cumsum(sizes)
        self.spans.append(np.stack([ends - sizes, ends], axis=1).astype(np.int64))
        self._ids, self._masks, self._pending = [], [], 0


def shuffled(src: Shards, out: Path, seed: int) -> Shards:
    """`src`'s conversations rewritten to `out` in the order `datasets`' Dataset.shuffle(seed=seed) puts rows
    (numpy's default_rng(seed).permutation), as open-instruct shuffles the tokenized set before writing it; `src`'s
    directory is removed."""
    where = [(k, int(a), int(b)) for k, spans in enumerate(src.spans) for a, b in spans]
    tokens = [np.memmap(src.out / t, dtype=src.dtype, mode="r") for t, _ in src.files]
    masks = [np.memmap(src.out / m, dtype=np.bool_, mode="r") for _, m in src.files]
    dst = Shards(out, src.dtype, src.eos_id, src.shard_tokens)
    for i in np.random.default_rng(seed).permutation(len(where)):
        k, a, b = where[i]
        dst.add(np.array(tokens[k][a:b]), np.array(masks[k][a:b]))
    dst.flush()
    del tokens, masks
    shutil.rmtree(src.out)
    return dst


def prepare_chat(inputs: Sequence[str], *, tokenizer: str, out: str | Path, chat_template: str | None = None,
                 eos_id: int | None = None, max_seq_len: int | None = None, long: LongPolicy = "truncate",
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, split: str = "train", progress: bool = True,
                 mix: str | None = None, shuffle_seed: int | None = None) -> dict:
    """Tokenize chat rows into OLMo-core's SFT files under local directory `out`; returns the metadata written.
    `mix` (olmo3eqx.data.chat_mix) takes the rows from a mixture's sources instead of `inputs`; `shuffle_seed`
    writes the kept conversations in the order open-instruct's `shuffle(seed)` gives them (shuffled)."""
    if bool(mix) == bool(inputs):
        raise DataError("Give either --input (files, globs, URLs, hf://OWNER/NAME) or --mix (a mixture), not both "
                        "and not neither.")
    mix_stats: list[dict] = []
    if mix:
        mix_name, sources = chat_mix.read_mix(mix)
        inputs = [s.spec for s in sources]
        rows = chat_mix.mix_rows(sources, split, lambda spec: iter_rows([spec], split), mix_stats)
    else:
        rows = iter_rows(inputs, split)
    if storage.is_url(str(out)):
        raise storage.UnsupportedPath(f"--out {storage.redact(str(out))} is a URL; write the token files to local "
                                      f"disk, then copy the directory to the bucket.")
    if max_seq_len is not None and max_seq_len < 2:
        raise DataError(f"--max-seq-len must be at least 2 (a token and EOS), got {max_seq_len}.")
    if shard_tokens <= 0:
        raise DataError(f"--shard-tokens must be positive, got {shard_tokens}.")
    chat = ChatTokenizer(tokenizer, chat_template, eos_id)
    pieces = [t for t in TOOL_TOKENS.values() if t in chat.template and len(chat.encode_text(t)) > 1]
    if pieces and tokenizer != BYTES:
        print(f"note: {tokenizer} splits the template's {', '.join(pieces)} into several ids each; AI2's instruct "
              f"tokenizer gives each one id (olmo3eqx-prepare instruct-tokenizer).", file=sys.stderr)
    dtype = token_dtype_for_vocab(chat.vocab_size)
    out = Path(out).expanduser()
    if (out / METADATA).is_file():
        raise DataError(f"{out} already holds prepared files; choose another --out or delete {out}.")
    out.mkdir(parents=True, exist_ok=True)
    report = Report()
    shards = Shards(out / UNSHUFFLED if shuffle_seed is not None else out, dtype, chat.eos_id, shard_tokens)

    from tqdm import tqdm

    for where, row in tqdm(rows, desc="tokenize", unit=" rows", file=sys.stderr,
                           disable=not progress, delay=2.0):
        report.rows += 1
        reason = check_row(row)
        if reason is None:
            try:
                full, mask = chat.tokenize(row["messages"])
            except (TypeError, ValueError) as e:  # a template that cannot render a row it was not written for
                raise DataError(f"The chat template cannot render {where}: {e}; choose a template for this data "
                                "(--chat-template).") from None
            ids, mask, reason = fit(full, mask, max_seq_len, long, chat.eos_id)
            if reason is None and not mask.any():
                reason = "no_labels"
        if reason is not None:
            report.skip(reason, where)
            continue
        if int(ids.max()) >= chat.vocab_size:
            raise DataError(f"{where} encodes to id {int(ids.max())} >= the tokenizer's {chat.vocab_size} ids.")
        report.kept += 1
        report.truncated += ids.size < full.size
        report.tokens += ids.size
        report.labelled += int(mask.sum())
        shards.add(ids, mask)
    shards.flush()
    if not report.kept:
        raise DataError(f"No conversation to write: {report.sentence()}")
    if shuffle_seed is not None:
        shards = shuffled(shards, out, shuffle_seed)
    files, spans = shards.files, shards.spans
    meta = {"format": FORMAT_VERSION, "kind": "chat", "tokenizer": chat.spec if chat.spec == BYTES else
            Path(chat.spec).name, "vocab_size": chat.vocab_size, "eos_id": chat.eos_id, "dtype": str(dtype),
            TEMPLATE_HASH_KEY: chat.sha256, "max_seq_len": max_seq_len, "long": long,
            "shard_tokens": shard_tokens, "inputs": [storage.redact(i) for i in inputs], "files": files,
            "rows": report.rows, "conversations": report.kept, "truncated": report.truncated,
            "tokens": report.tokens, "labelled_tokens": report.labelled,
            "skipped": {r: {"count": n, "first": report.first[r]} for r, n in report.skipped.items()},
            "shuffle_seed": shuffle_seed}
    if mix:
        meta["mix"] = {"name": mix_name, "sources": mix_stats}
    if max_seq_len is not None and not max_seq_len & (max_seq_len - 1):
        meta["packed_instances"] = int(pack_files(spans, seq_len=max_seq_len, group_size=1)[1].size - 1)
    (out / METADATA).write_text(json.dumps(meta, indent=1) + "\n")
    print(report.sentence() if report.skipped else f"{report.sentence()[:-1]}; no row skipped.", file=sys.stderr)
    if "packed_instances" in meta:
        n, per = meta["packed_instances"], max(1, AI2_SFT_BATCH_TOKENS // max_seq_len)
        print(f"data.packing makes {n:,} instances of {max_seq_len:,} tokens (data.source_group_size 1); AI2's "
              f"{AI2_SFT_EPOCHS} epochs of {per} instances a batch: --steps {AI2_SFT_EPOCHS * (n // per)}.",
              file=sys.stderr)
    print(f"Wrote {len(files)} token file(s) and label mask(s) to {out}: data.paths={out}/token_ids_part_*.npy "
          f"data.label_mask_paths={out}/labels_mask_part_*.npy", file=sys.stderr)
    return meta


@dataclass(frozen=True)
class Args:
    """Tokenize chat data into OLMo-core's SFT files: token ids and an assistant-only label mask per file."""

    out: str
    """Output directory (local)."""
    input: tuple[str, ...] = ()
    """JSON Lines of {"messages": [{"role", "content"}, ...]} (files, globs or gs:// s3:// https:// URLs; .jsonl.gz
    too), directories a `datasets` dataset was saved to (save_to_disk), or Hugging Face Hub datasets by name
    (hf://allenai/Dolci-Instruct-SFT; fetched into the Hugging Face cache, HF_HUB_OFFLINE=1 reads the cache)."""
    mix: str | None = None
    """A mixture instead of --input: dolci-instruct-sft, dolci-think-sft-7b, olmo-hybrid-think-sft (AI2's mixer lists,
    data/sft_mixes/) or a file of 'SOURCE AMOUNT' lines (open-instruct's --dataset_mixer_list)."""
    tokenizer: str = BYTES
    """A tokenizer.json or 'bytes' (id = byte, EOS 256)."""
    chat_template: str | None = None
    """A built-in template (olmo3_instruct, olmo_thinker_no_think_7b, olmo, olmo_thinker, bytes), a .jinja file or
    a tokenizer_config.json; unset: the tokenizer's own
    (chat_template.jinja or tokenizer_config.json beside it), the bytes template for 'bytes'."""
    eos_id: int | None = None
    """EOS id of a tokenizer.json; default: its <|endoftext|> token."""
    max_seq_len: int | None = None
    """Longest conversation in tokens (data.seq_len of the run); unset: no limit (OLMo-core truncates)."""
    long: LongPolicy = "truncate"
    """A conversation over --max-seq-len: truncate (first max-seq-len - 1 tokens, then EOS) or skip (counted)."""
    split: str = "train"
    """The split of a saved DatasetDict or of a Hub dataset."""
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    """Most tokens a file holds (cut at conversation boundaries)."""
    shuffle_seed: int | None = None
    """Write the kept conversations shuffled as open-instruct does before writing them for OLMo-core (`datasets`'
    shuffle with this seed; its convert script's default is 42); unset: in input order."""
    quiet: bool = False
    """No progress bar."""


def main(argv: Sequence[str] | None = None) -> dict:
    import tyro

    args = tyro.cli(Args, args=argv, prog="olmo3eqx-prepare chat")
    return prepare_chat(args.input, tokenizer=args.tokenizer, out=args.out, chat_template=args.chat_template,
                        eos_id=args.eos_id, max_seq_len=args.max_seq_len, long=args.long,
                        shard_tokens=args.shard_tokens, split=args.split, progress=not args.quiet, mix=args.mix,
                        shuffle_seed=args.shuffle_seed)


@exits.command
def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m olmo3eqx.data.chat` and `olmo3eqx-prepare chat`."""
    main(argv)
    return exits.OK


if __name__ == "__main__":
    sys.exit(cli())
