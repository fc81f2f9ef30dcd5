"""Which chat template a checkpoint's data was prepared with, kept from `prepare chat` to the exported model.

`olmo3eqx-prepare chat` records its template's sha256 in the metadata.json it writes (KEY); the trainer copies the
hashes found beside its data.label_mask_paths into every checkpoint's custom metadata (`prepared_templates`, saved by
olmo3eqx.checkpoint.Checkpointer); `olmo3eqx-generate --chat` and `convert.py orbax-to-hf --tokenizer` read them back
(`recorded_templates`), default to the template with a recorded hash and refuse one without (`chat_tokenizer`): a
model answers in the format it was fine-tuned on, or not at all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from olmo3eqx import storage
from olmo3eqx.data.chat import TEMPLATE_HASH_KEY, TEMPLATES, ChatTokenizer, load_template, template_sha256
from olmo3eqx.data.source import METADATA, expand_paths
from olmo3eqx.errors import ChatTemplateMismatch, DataError

KEY = TEMPLATE_HASH_KEY
"""The template hash's key, in prepare chat's metadata.json and in a checkpoint's custom metadata (a list there)."""


def prepared_templates(label_mask_paths: Sequence[str]) -> list[str]:
    """The template hashes (sorted, each once) that `prepare chat` recorded beside the label-mask files; [] where no
    directory holds its metadata.json (masks written by another tool)."""
    if not label_mask_paths:
        return []
    directories = sorted({storage.parent(p) for p in expand_paths(label_mask_paths, "data.label_mask_paths")})
    found = set()
    for directory in directories:
        path = storage.join(directory, METADATA)
        if not storage.isfile(path):
            continue
        meta = json.loads(storage.read_text(path))
        if isinstance(meta, dict) and meta.get("kind") == "chat" and isinstance(meta.get(KEY), str):
            found.add(meta[KEY])
    return sorted(found)


def recorded_templates(ckpt: str) -> list[str]:
    """The template hashes a checkpoint's data was prepared with (a training checkpoint's record); [] for an HF
    directory (its own chat template is its record), a converted checkpoint, or a run on data without one."""
    if not storage.is_url(ckpt) and (Path(ckpt) / "config.json").is_file():
        return []
    from olmo3eqx.checkpoint.layout import resolve_step_dir, step_custom_metadata

    root, step = resolve_step_dir(ckpt)
    hashes = step_custom_metadata(root / str(step)).get(KEY) or []
    return [h for h in hashes if isinstance(h, str)]


def own_template(tokenizer: str) -> str | None:
    """The chat template beside a tokenizer.json (chat_template.jinja or tokenizer_config.json's), None without one."""
    try:
        return load_template(None, tokenizer)
    except DataError:
        return None


def _known_templates(tokenizer: str) -> dict[str | None, str]:
    """Template spec -> its text: the tokenizer's own (spec None) when it has one, then every built-in by name."""
    own = own_template(tokenizer)
    known: dict[str | None, str] = {} if own is None else {None: own}
    for path in sorted(TEMPLATES.glob("*.jinja")):
        known[path.stem] = path.read_text()
    return known


def chat_tokenizer(tokenizer: str, spec: str | None, recorded: Sequence[str], where: str,
                   eos_id: int | None = None) -> ChatTokenizer:
    """`tokenizer` with the chat template to use for checkpoint `where`, whose data was prepared with the templates
    hashed in `recorded` ([]: no record, then `spec` or the tokenizer's own, as ChatTokenizer takes them). With a
    record: `spec` when its hash is recorded, else unset the tokenizer's own or a built-in whose hash is; any other
    template is refused (ChatTemplateMismatch, exit 2)."""
    if spec is None and recorded:
        known = [s for s, text in _known_templates(tokenizer).items() if template_sha256(text) in recorded]
        if not known:
            raise ChatTemplateMismatch(
                f"The data of checkpoint {where} was prepared with a chat template (sha256 {', '.join(recorded)}) "
                f"that is neither the tokenizer's own nor a built-in; pass --chat-template with that template's "
                f".jinja file.")
        spec = known[0]
    chat = ChatTokenizer(tokenizer, spec, eos_id)
    if recorded and chat.sha256 not in recorded:
        raise ChatTemplateMismatch(
            f"The chat template {spec or 'beside the tokenizer'} (sha256 {chat.sha256[:12]}...) is not the one the "
            f"data of checkpoint {where} was prepared with (sha256 {', '.join(h[:12] + '...' for h in recorded)}); "
            f"leave --chat-template unset to use that one, or pass its .jinja file.")
    return chat
