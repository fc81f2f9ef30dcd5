"""The `olmo3eqx-prepare` command: text -> token files (olmo3eqx.data.prepare); `olmo3eqx-prepare chat ...`, chat
data -> token ids and assistant-only label masks (olmo3eqx.data.chat); `olmo3eqx-prepare instruct-tokenizer ...`, the
Olmo 3 Instruct tokenizer with its tool tags as single ids (olmo3eqx.data.tool_tokens)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from olmo3eqx.data import chat, prepare, tool_tokens


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["chat"]:
        return chat.cli(argv[1:])
    if argv[:1] == ["instruct-tokenizer"]:
        return tool_tokens.cli(argv[1:])
    return prepare.cli(argv)


if __name__ == "__main__":
    sys.exit(main())
