"""Multi-turn chat, the host side of `olmo3eqx-generate --chat --conversation FILE` and `--interactive`: a conversation
read from a file, answered, then continued one user message at a time, each answer generated from the whole
conversation so far rendered by the chat template (as `transformers`' apply_chat_template with the generation prompt
renders it) and added to it as the assistant's message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from olmo3eqx.errors import GenerationError

Messages = list[dict]


def read_conversation(path: str) -> Messages:
    """The messages of a conversation file: a JSON list of {"role", "content", ...} messages, or an object holding
    one under "messages" (a row of chat data); any other key of a message (functions, function_calls) goes to the
    template as it is."""
    from olmo3eqx import storage

    try:
        data = json.loads(storage.read_text(path))
    except json.JSONDecodeError as e:
        raise GenerationError(f"{path} is not JSON ({e}); write the conversation as a JSON list of "
                              f"{{\"role\", \"content\"}} messages.") from None
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 for m in messages):
        raise GenerationError(f"{path} holds no list of messages; write a JSON list of {{\"role\", \"content\"}} "
                              f"objects (or {{\"messages\": [...]}}).")
    return messages


def with_system(messages: Messages, system: str | None) -> Messages:
    """`messages` opened by a system message `system` (None: as they are)."""
    if system is None:
        return list(messages)
    if any(m["role"] == "system" for m in messages):
        raise GenerationError("The conversation already has a system message; drop --system or that message.")
    return [{"role": "system", "content": system}, *messages]


def user_lines(lines: Iterable[str]) -> Iterable[str]:
    """User messages from lines of text (stdin): one a line, blank lines skipped."""
    for line in lines:
        text = line.rstrip("\r\n")
        if text.strip():
            yield text


def converse(messages: Messages, user_turns: Iterable[str], reply: Callable[[Messages], str]) -> Messages:
    """The conversation after answering it: its last message first, unless the assistant spoke last, then each user
    turn in order (read as it is answered). `reply(messages)` is the assistant's answer to the conversation so far."""
    messages = list(messages)
    if messages and messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": reply(messages)})
    for text in user_turns:
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": reply(messages)})
    return messages
