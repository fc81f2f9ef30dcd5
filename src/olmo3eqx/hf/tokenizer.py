"""The tokenizer files and generation_config.json of an exported HF model, so it chats in `transformers` and vLLM as
it does here (`convert.py orbax-to-hf --tokenizer`).

Written, beside the weights: tokenizer.json as given (its vocabulary and added tokens byte for byte);
tokenizer_config.json, the given one (or a bare one) with eos_token / pad_token naming the model's ids, the added
tokens listed (added_tokens_decoder, which readers older than transformers 5 take the special tokens from) and the
chat template; chat_template.jinja, where transformers since 4.49 saves a template and which it reads before the
config's copy (both hold the same text); generation_config.json, whose eos_token_id lists every id generation stops at
(the model's EOS first, then the template's end of turn where that is one token, as AI2's Instruct models list
<|im_end|> and <|endoftext|>).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from olmo3eqx.config import ModelConfig
from olmo3eqx.errors import ConversionError
from olmo3eqx.hf.config_json import GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where transformers saves a single chat template (tokenization_utils_base.save_chat_templates) and reads it first."""
BARE_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None}
"""tokenizer_config.json for a tokenizer.json given alone: a fast tokenizer (transformers 5 maps the class to its
TokenizersBackend), no BOS (OLMo 3 has none)."""
SPECIAL = ("eos_token", "pad_token")
"""The special tokens the model's config names by id: tokenizer_config.json names them by text."""


def tokenizer_json(spec: str) -> Path:
    """The tokenizer.json of `spec`: an HF tokenizer directory or the tokenizer.json itself (its companions are read
    from its directory)."""
    path = Path(spec).expanduser()
    if spec == "bytes":
        raise ConversionError("The byte-level tokenizer has no Hugging Face files; export with a tokenizer.json or a "
                              "directory holding one.")
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"--tokenizer {spec} is neither a directory holding {TOKENIZER_FILE} nor such a file; "
                                f"pass the tokenizer the data was prepared with.")
    return file


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_config(source: Path, cfg: ModelConfig, template: str | None, say: Callable[[str], None]) -> dict:
    """tokenizer_config.json of the export: the one beside `source` (a tokenizer.json) or BARE_CONFIG, naming the
    model's EOS and PAD (a different one given is replaced, and `say` says so), the added tokens and `template`.
    A tokenizer with more ids than the model's rows, or without its EOS or PAD id, is refused (ConversionError)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(source))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > cfg.vocab_size:
        raise ConversionError(f"The tokenizer {source} has {vocab:,} ids, the model {cfg.vocab_size:,} embedding rows; "
                              f"export with the tokenizer the model was trained with.")
    given = source.parent / TOKENIZER_CONFIG_FILE
    config = json.loads(given.read_text()) if given.is_file() else dict(BARE_CONFIG)
    for name, token_id in zip(SPECIAL, (cfg.eos_token_id, cfg.pad_token_id)):
        text = tok.id_to_token(token_id)
        if text is None:
            raise ConversionError(f"The tokenizer {source} has no id {token_id}, the model's {name}_id; export with "
                                  f"the tokenizer the model was trained with.")
        if config.get(name) is not None and _token_text(config[name]) != text:
            say(f"note: {given.name}'s {name} {_token_text(config[name])!r} written as {text!r}, the model's "
                f"{name}_id {token_id}")
        config[name] = text
    if "added_tokens_decoder" not in config:
        config["added_tokens_decoder"] = {
            str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in json.loads(source.read_text()).get("added_tokens") or []}
    config.setdefault("model_max_length", cfg.max_position_embeddings)
    config.setdefault("clean_up_tokenization_spaces", False)  # text decoded as tokenizers decodes it, as here
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def write_tokenizer(out: Path, source: Path, config: dict) -> None:
    """tokenizer.json (`source`, copied), tokenizer_config.json (`config`, as tokenizer_config made it) and, where
    the config holds a chat template, chat_template.jinja into `out`."""
    shutil.copyfile(source, out / TOKENIZER_FILE)
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if config.get("chat_template") is not None:
        (out / CHAT_TEMPLATE_FILE).write_text(config["chat_template"])


def write_generation_config(out: Path, cfg: ModelConfig, end_of_turn: Sequence[int] = ()) -> None:
    """generation_config.json: the model's EOS first (what olmo3eqx.hf.config_json reads back), then every other id
    a reply ends at; the model's PAD; no BOS."""
    stops = [cfg.eos_token_id] + [i for i in end_of_turn if i != cfg.eos_token_id]
    config = {"bos_token_id": None, "eos_token_id": stops if len(stops) > 1 else stops[0],
              "pad_token_id": cfg.pad_token_id}
    (out / GENERATION_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def end_of_turn_ids(chat) -> list[int]:
    """The ids of a ChatTokenizer's end-of-turn strings that are one token of its tokenizer (<|im_end|>): generation
    stops at them as at the EOS."""
    return [ids[0] for ids in map(chat.encode_text, chat.end_of_turn) if len(ids) == 1]
