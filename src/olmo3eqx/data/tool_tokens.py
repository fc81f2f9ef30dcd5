"""The Olmo 3 Instruct tokenizer: dolma2 with its tool-use tags as single tokens.

    olmo3eqx-prepare instruct-tokenizer --tokenizer dolma2/tokenizer.json --out olmo3-instruct-tokenizer/

AI2's instruct tokenizer (allenai/olmo-3-tokenizer-instruct-dev, which Olmo 3 Instruct's SFT data is tokenized with)
is the dolma2 tokenizer with four unused placeholders, `<|extra_id_1|>` to `<|extra_id_4|>` (ids 100266-100269),
renamed `<functions>`, `</functions>`, `<function_calls>` and `</function_calls>`: the vocabulary keeps its size and
every other id, and each tag encodes to one id where the base tokenizer splits it into several. This writes that
tokenizer.json from a base one and, beside it, the instruct chat template (chat_templates/olmo3_instruct.jinja), so
`olmo3eqx-prepare chat` and `olmo3eqx-generate --chat` given the new tokenizer.json find their template there.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from olmo3eqx import exits
from olmo3eqx.errors import DataError

TOOL_TOKENS = {"<|extra_id_1|>": "<functions>", "<|extra_id_2|>": "</functions>",
               "<|extra_id_3|>": "<function_calls>", "<|extra_id_4|>": "</function_calls>"}
"""dolma2's placeholder -> the tag AI2's instruct tokenizer puts at its id (100266-100269)."""
INSTRUCT_TEMPLATE = "olmo3_instruct"


def add_tool_tokens(spec: dict) -> dict:
    """A tokenizer.json (parsed) with the tool tags in the placeholders' places: the added token and, where the
    model's vocabulary lists it too (dolma2's BPE does), its vocabulary entry, both at the same id. Unchanged when
    the tags are there already."""
    out = copy.deepcopy(spec)
    added = {t["content"]: t for t in out.get("added_tokens", [])}
    if all(tag in added for tag in TOOL_TOKENS.values()):
        return out
    missing = [p for p in TOOL_TOKENS if p not in added]
    if missing:
        raise DataError(f"The tokenizer has no {', '.join(missing)} to rename; give dolma2's tokenizer.json (the "
                        f"base of AI2's instruct tokenizer) or AI2's instruct tokenizer itself.")
    vocab = out.get("model", {}).get("vocab")
    for placeholder, tag in TOOL_TOKENS.items():
        added[placeholder]["content"] = tag
        if isinstance(vocab, dict) and placeholder in vocab:
            vocab[tag] = vocab.pop(placeholder)
    return out


def write_instruct_tokenizer(tokenizer: str, out: str | Path) -> Path:
    """Write `out`/tokenizer.json (the instruct tokenizer made from `tokenizer`) and `out`/chat_template.jinja;
    returns the tokenizer.json's path."""
    from tokenizers import Tokenizer

    src = Path(tokenizer).expanduser()
    if not src.is_file():
        raise DataError(f"Tokenizer {tokenizer} does not exist; give the base tokenizer.json.")
    spec = add_tool_tokens(json.loads(src.read_text()))
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(spec, ensure_ascii=False))
    tok = Tokenizer.from_file(str(tmp))
    split = [t for t in TOOL_TOKENS.values() if len(tok.encode(t, add_special_tokens=False).ids) != 1]
    if split:  # a pre-tokenizer or normalizer that reaches into added tokens would break AI2's ids
        tmp.unlink()
        raise DataError(f"{', '.join(split)} do not encode to one id with {tokenizer}; it is not a dolma2-style "
                        f"tokenizer.")
    os.replace(tmp, path)
    (out / "chat_template.jinja").write_bytes(
        (Path(__file__).with_name("chat_templates") / f"{INSTRUCT_TEMPLATE}.jinja").read_bytes())
    return path


@dataclass(frozen=True)
class Args:
    """Make the Olmo 3 Instruct tokenizer (tool tags as single ids) and its chat template from dolma2's."""

    tokenizer: str
    """The base tokenizer.json (dolma2's, as in allenai/Olmo-3-1025-7B)."""
    out: str
    """Directory for tokenizer.json and chat_template.jinja."""


@exits.command
def cli(argv: Sequence[str] | None = None) -> int:
    """`olmo3eqx-prepare instruct-tokenizer`."""
    import tyro

    args = tyro.cli(Args, args=argv, prog="olmo3eqx-prepare instruct-tokenizer")
    path = write_instruct_tokenizer(args.tokenizer, args.out)
    print(f"Wrote {path} ({', '.join(TOOL_TOKENS.values())} as single ids) and {path.parent}/chat_template.jinja "
          f"({INSTRUCT_TEMPLATE}).", file=sys.stderr)
    return exits.OK
