"""AI2's chat templates token for token (olmo3eqx/data/chat_templates, olmo3eqx.data.tool_tokens): the built-in
templates are AI2's bytes (open-instruct's CHAT_TEMPLATES read from AI2's source text in tests/fixtures/ai2, and the
published prefix of the Olmo 3 Instruct SFT tokenizer's template); AI2's own example conversations (think,
multi-turn, tool calls) render to the text and ids that transformers' apply_chat_template gives with AI2's source
text; a template with one byte changed is caught; Dolci's tool-use rows are prepared with the tool tags as single
ids and labels on the assistant's turns only, as open-instruct's rule labels them."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from olmo3eqx.data import chat, tool_tokens

FIXTURES = Path(__file__).parent / "fixtures"
AI2_NAMES = ("olmo", "olmo_thinker", "olmo_thinker_no_think_7b")
"""The templates whose whole source text AI2 publishes in open-instruct."""

# AI2's example conversations: open-instruct's scripts/tokenizers/test_chat_templates.py (SINGLE_TURN_REASONING,
# MULTI_TURN_REASONING, BASIC_CHAT_TRANSCRIPT) and render_chat_template_examples.py (DEFAULT_SAMPLES), verbatim.
SINGLE_TURN_REASONING = [
    {"role": "system", "content": "You are a helpful AI assistant."},
    {"role": "user", "content": "The prompt was asdlkasd"},
    {"role": "assistant", "content": (
        '<think>Okay... user sent "asdlkasd"—probably a test. Stay friendly, invite clarification...</think>\n'
        "It looks like your message might be a bit jumbled! Could you clarify what you're asking about? "
        "I'm here to help with AI, language models, writing, coding—whatever you need.")},
]
MULTI_TURN_REASONING = [
    {"role": "system", "content": "You are a helpful AI assistant."},
    {"role": "user", "content": "The prompt was asdlkasd"},
    {"role": "assistant", "content": (
        "<think>First turn... just restate the prompt and ask what they need.</think>\n"
        'The prompt you shared was "asdlkasd". Did you want me to expand on it or help craft a new one?')},
    {"role": "user", "content": "Please restate it politely so I can show templating."},
    {"role": "assistant", "content": (
        "<think>Second turn... reassure them and keep the tone upbeat...</think>\n"
        "Absolutely! It looked like your message might have been a little jumbled—just let me know what you'd "
        "like to explore and I'm happy to dive in.")},
]
BASIC_CHAT_TRANSCRIPT = [
    {"role": "user", "content": "Hello, how are you?"},
    {"role": "assistant", "content": "I'm doing great. How can I help you today?"},
    {"role": "user", "content": "I'd like to show off how chat templating works!"},
]
MULTI_TURN_INTERLEAVED = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's 2+2?"},
    {"role": "assistant", "content": "<think>Calculate 2 + 2</think>It's 4."},
    {"role": "user", "content": "Now double that and explain."},
    {"role": "assistant", "content": "It's 8.",
     "reasoning_content": "Re-use previous result, multiply by 2, then explain clearly."},
]
DOLCI = [json.loads(line) for line in (FIXTURES / "dolci_tool_use.jsonl").read_text().splitlines()]
EXAMPLES = {"single_reasoning": SINGLE_TURN_REASONING, "multi_reasoning": MULTI_TURN_REASONING,
            "basic_chat": BASIC_CHAT_TRANSCRIPT, "multi_turn_interleaved": MULTI_TURN_INTERLEAVED,
            **{f"dolci_{r['id']}": r["messages"] for r in DOLCI}}


def ai2_source_templates() -> dict[str, str]:
    """AI2's CHAT_TEMPLATES entries, evaluated from the source text as Python evaluates it."""
    table = ast.parse((FIXTURES / "ai2" / "open_instruct_chat_templates.py").read_text()).body[0].value
    return {ast.literal_eval(k): ast.literal_eval(v) for k, v in zip(table.keys, table.values)
            if ast.literal_eval(k) in AI2_NAMES}


def small_tokenizer(path: Path) -> str:
    """A byte-level BPE with dolma2's special tokens that matter here (EOS <|endoftext|>, <|pad|>, <|im_start|>,
    <|im_end|>, and the unused <|extra_id_1..4|> the instruct tokenizer renames), as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [json.dumps(m) for m in EXAMPLES.values()] * 10
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>",
                                        *tool_tokens.TOOL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(path))
    return str(path)


@pytest.fixture
def instruct_tokenizer(tmp_path) -> str:
    """The test tokenizer made an instruct tokenizer the way a user makes one: `olmo3eqx-prepare
    instruct-tokenizer`."""
    from olmo3eqx.tools.prepare import main as cli

    base = small_tokenizer(tmp_path / "base.json")
    assert cli(["instruct-tokenizer", "--tokenizer", base, "--out", str(tmp_path / "instruct")]) == 0
    return str(tmp_path / "instruct" / "tokenizer.json")


def hf_tokenizer(path: str, template: str):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|endoftext|>", pad_token="<|pad|>")
    hf.chat_template = template
    return hf


def hf_ids(hf, messages, gen=False) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def disagreements(template: str, reference: str, tokenizer: str) -> list[str]:
    """Where `template` rendered here differs from `reference` rendered by transformers' apply_chat_template: the
    example names (text or ids, with and without the generation prompt)."""
    ours, hf = chat.ChatTokenizer(tokenizer, template), hf_tokenizer(tokenizer, reference)
    bad = []
    for name, messages in EXAMPLES.items():
        for gen in (False, True):
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            if ours.render(messages, gen) != text or ours.encode(messages, gen) != hf_ids(hf, messages, gen):
                bad.append(f"{name}{' +gen' if gen else ''}")
    return bad


def test_built_in_templates_are_ai2s_bytes():
    """Each built-in template is AI2's text byte for byte, its sidecar's sha256 names those bytes, and the instruct
    template begins with the bytes AI2 published for the Olmo 3 7B Instruct SFT tokenizer."""
    ai2 = ai2_source_templates()
    sources = json.loads((chat.TEMPLATES / "sources.json").read_text())
    for name in AI2_NAMES:
        assert (chat.TEMPLATES / f"{name}.jinja").read_bytes() == ai2[name].encode(), name
    for name, source in sources.items():
        assert hashlib.sha256((chat.TEMPLATES / f"{name}.jinja").read_bytes()).hexdigest() == source["sha256"], name
    assert sorted(sources) == sorted(p.stem for p in chat.TEMPLATES.glob("*.jinja"))
    prefix = json.loads((FIXTURES / "ai2" / "olmo3_instruct_sft_prefix.json").read_text())["prefix"]
    assert (chat.TEMPLATES / "olmo3_instruct.jinja").read_text().startswith(prefix)


def test_ai2_examples_render_token_for_token(instruct_tokenizer):
    """AI2's examples (think, multi-turn, tool calls) rendered by our built-in templates give the text and ids that
    transformers gives with AI2's source text, with and without the generation prompt; the instruct template
    equals transformers on its own text (AI2's whole instruct template is not published where this test can read
    it: test_built_in_templates_are_ai2s_bytes pins its published part)."""
    ai2 = ai2_source_templates()
    for name in AI2_NAMES:
        assert disagreements(name, ai2[name], instruct_tokenizer) == [], name
    instruct = (chat.TEMPLATES / "olmo3_instruct.jinja").read_text()
    assert disagreements("olmo3_instruct", instruct, instruct_tokenizer) == []


def one_byte_changed(text: str) -> str:
    """The template with the newline after the first <|im_start|>system turned into a space: one byte."""
    at = text.index("<|im_start|>system") + len("<|im_start|>system")
    assert text[at] == "\n"
    return text[:at] + " " + text[at + 1:]


def test_one_byte_changed_is_caught(instruct_tokenizer, tmp_path):
    """The comparisons above fail on a template with one byte changed: AI2's rendering no longer agrees, and the
    instruct template's published prefix no longer matches."""
    ai2 = ai2_source_templates()
    for name in AI2_NAMES:
        mutant = tmp_path / f"{name}.jinja"
        mutant.write_text(one_byte_changed(ai2[name]))
        assert mutant.read_bytes() != ai2[name].encode()
        assert disagreements(str(mutant), ai2[name], instruct_tokenizer), name
    prefix = json.loads((FIXTURES / "ai2" / "olmo3_instruct_sft_prefix.json").read_text())["prefix"]
    assert not one_byte_changed((chat.TEMPLATES / "olmo3_instruct.jinja").read_text()).startswith(prefix)


def test_tool_tags_are_single_ids(instruct_tokenizer, tmp_path, capsys):
    """The instruct tokenizer keeps every id and gives each tool tag one: the ids of the placeholders it renames
    (100266-100269 in dolma2); the base tokenizer splits them, and prepare says so; a tokenizer without the
    placeholders is refused."""
    from tokenizers import Tokenizer

    from olmo3eqx.errors import DataError

    base, instruct = Tokenizer.from_file(str(tmp_path / "base.json")), Tokenizer.from_file(instruct_tokenizer)
    assert base.get_vocab_size() == instruct.get_vocab_size()
    for placeholder, tag in tool_tokens.TOOL_TOKENS.items():
        assert instruct.encode(tag, add_special_tokens=False).ids == [base.token_to_id(placeholder)]
        assert len(base.encode(tag, add_special_tokens=False).ids) > 1
    text = "<|im_start|>system\nS <functions>[]</functions><|im_end|>\n"
    assert instruct.decode(instruct.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text
    assert (Path(instruct_tokenizer).parent / "chat_template.jinja").read_text() == \
        (chat.TEMPLATES / "olmo3_instruct.jinja").read_text()
    assert tool_tokens.add_tool_tokens(json.loads(Path(instruct_tokenizer).read_text())) == \
        json.loads(Path(instruct_tokenizer).read_text())  # already an instruct tokenizer: unchanged
    chat.prepare_chat([str(FIXTURES / "dolci_tool_use.jsonl")], tokenizer=str(tmp_path / "base.json"),
                      chat_template="olmo3_instruct", out=tmp_path / "split", progress=False)
    assert "base.json splits the template's <functions>, </functions>, <function_calls>, </function_calls>" in \
        capsys.readouterr().err
    spec = json.loads((tmp_path / "base.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|extra_id_3|>"]
    with pytest.raises(DataError, match="no <\\|extra_id_3\\|>"):
        tool_tokens.add_tool_tokens(spec)


def test_dolci_tool_rows_prepare_with_assistant_labels(instruct_tokenizer, tmp_path):
    """Dolci's tool-use rows (function definitions in the system turn, assistant content null with function_calls,
    results as environment turns) are kept, rendered by the template found beside the instruct tokenizer, with
    labels on the calls, the answers and what ends each assistant turn only, equal to open-instruct's rule."""
    from test_data_chat import open_instruct_tokenize

    meta = chat.prepare_chat([str(FIXTURES / "dolci_tool_use.jsonl")], tokenizer=instruct_tokenizer,
                             out=tmp_path / "sft", progress=False)
    assert meta["conversations"] == 3 and not meta["skipped"]
    tokens = np.fromfile(tmp_path / "sft" / chat.TOKEN_FILE.format(0), np.uint16)
    mask = np.fromfile(tmp_path / "sft" / chat.MASK_FILE.format(0), np.bool_)
    hf = hf_tokenizer(instruct_tokenizer, (chat.TEMPLATES / "olmo3_instruct.jinja").read_text())
    start = 0
    for row in DOLCI:
        want_ids, want_mask = open_instruct_tokenize(hf, row["messages"])
        end = start + len(want_ids)
        assert tokens[start:end].tolist() == want_ids and mask[start:end].tolist() == want_mask, row["id"]
        start = end
    assert start == tokens.size
    loop = DOLCI[0]["messages"]
    first = len(open_instruct_tokenize(hf, loop)[0])
    labelled = hf.decode([int(t) for t, m in zip(tokens[:first], mask[:first]) if m])
    assert labelled == (f"<function_calls>{loop[2]['function_calls']}</function_calls><|im_end|>"
                        f"{loop[4]['content']}<function_calls>{loop[4]['function_calls']}</function_calls><|im_end|>"
                        f"{loop[6]['content']}<|endoftext|>")
    ids = set(tokens.tolist())
    assert {hf.convert_tokens_to_ids(t) for t in tool_tokens.TOOL_TOKENS.values()} <= ids


def test_think_template_labels_think():
    """olmo_thinker_no_think_7b (AI2's 7B Think SFT template) labels the assistant's opening <think>;
    olmo_thinker, whose generation prompt holds <think>, leaves it out of the labels (the masking open-instruct's
    docs/olmo3.md describes). Bytes tokenizer: <think> is seven ids either way."""
    for name, labelled in (("olmo_thinker_no_think_7b", True), ("olmo_thinker", False)):
        tok = chat.ChatTokenizer("bytes", name)
        ids, mask = tok.tokenize(SINGLE_TURN_REASONING)
        text = bytes(int(t) for t, m in zip(ids, mask) if m and t < 256).decode()
        assert text.startswith("<think>Okay") is labelled, name
        assert "Okay..." in text and "whatever you need." in text
