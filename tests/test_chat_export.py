"""A fine-tuned model leaves as a Hugging Face chat model: a tiny model trained here through train.py on chat data
`prepare chat` wrote with OLMo's template and a BPE tokenizer with OLMo's special tokens, exported by
`convert.py orbax-to-hf --tokenizer`, then loaded by `transformers` (AutoModelForCausalLM, AutoTokenizer) from the
export alone: its apply_chat_template + greedy generate holds a multi-turn conversation token for token as
`olmo3eqx-generate --chat` does on the training checkpoint. The template the data was prepared with travels from
prepare's metadata.json through the checkpoint's metadata to the export, and generation refuses another."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
import yaml

from olmo3eqx.data import chat, template_record
from olmo3eqx.tools.convert import main as convert
from olmo3eqx.tools.generate import main as generate_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
"""EOS 0, PAD 1, then the turn markers: OLMo's special tokens at small ids."""
MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=32, max_position_embeddings=512, eos_token_id=0,
             pad_token_id=1, param_dtype="float32", compute_dtype="float32")
"""Smaller than configs/tiny.yaml: compile time dominates the test."""
STEPS = 20
NEW_TOKENS = 16
QUESTIONS = ["What is 3+4?", "And doubled?", "What is 10+2?"]
"""The user's turns of the conversation held with both: the first from the conversation file, the rest on stdin."""


def conversations(n: int = 64) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for a, b in rng.integers(0, 20, (n, 2)):
        rows.append({"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                                  {"role": "assistant", "content": f"The answer is {a + b}."},
                                  {"role": "user", "content": "And doubled?"},
                                  {"role": "assistant", "content": f"That is {2 * (a + b)}."}]})
    return rows


def tokenizer_dir(path, rows):
    """A byte-level BPE trained on the rendered conversations, saved as an HF tokenizer directory without a chat
    template (a base tokenizer: the template comes from the data's record)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [chat.ChatTokenizer("bytes", "olmo").render(r["messages"]) for r in rows]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}))
    return path


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """(root, run directory, tokenizer directory): STEPS steps of fine-tuning on OLMo-template chat data."""
    from olmo3eqx.train import main as train

    root = tmp_path_factory.mktemp("chat_export")
    rows = conversations()
    tok = tokenizer_dir(root / "tok", rows)
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat.prepare_chat([str(root / "chats.jsonl")], tokenizer=str(tok / "tokenizer.json"), chat_template="olmo",
                      out=root / "sft", max_seq_len=256, progress=False)
    cfg = {"run": {"name": "sft", "dir": str(root / "runs"), "seed": 0}, "steps": STEPS, "model": MODEL,
           "data": {"paths": [str(root / "sft" / "token_ids_part_*.npy")],
                    "label_mask_paths": [str(root / "sft" / "labels_mask_part_*.npy")], "packing": True,
                    "source_group_size": 1, "seq_len": 256, "global_batch": 8, "cache_dir": str(root / "cache")},
           "optim": {"lr": 2e-2, "warmup_steps": 2}, "mesh": {"max_per_device_batch": 8},
           "checkpoint": {"every": STEPS}, "eval": {"every": 0, "samples": []},
           "log": {"every": STEPS, "tensorboard": False}}
    (root / "sft.yaml").write_text(yaml.safe_dump(cfg))
    assert train(["--config", str(root / "sft.yaml")]) == 0
    return root, root / "runs" / "sft", tok


def hf_conversation(export, questions, new_tokens):
    """transformers' side, from the export alone: each user turn added to the conversation, apply_chat_template with
    the generation prompt, greedy generate (the generation config's stop ids), the reply decoded up to its stop id
    and added as the assistant's message. Returns the messages and each turn's (prompt ids, generated ids)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(export))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    stops = model.generation_config.eos_token_id
    stops = stops if isinstance(stops, list) else [stops]
    messages, turns = [], []
    for q in questions:
        messages.append({"role": "user", "content": q})
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                         return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                 do_sample=False)
        new = out[0, prompt.shape[1]:].tolist()
        reply = new[:-1] if new and new[-1] in stops else new
        messages.append({"role": "assistant", "content": tok.decode(reply, skip_special_tokens=False)})
        turns.append((prompt[0].tolist(), new))
    return messages, turns


def test_exported_model_chats_in_transformers_as_generate_chat(sft, tmp_path, capsys, monkeypatch):
    """The issue's proof: export with --tokenizer (the template: the one the data was prepared with, found by the
    hash the checkpoint recorded), then a three-turn conversation in transformers equals olmo3eqx-generate --chat
    (--conversation for the first turn, --interactive on stdin for the rest): each prompt's ids and each reply's
    ids, and the conversation --out writes."""
    from olmo3eqx.checkpoint.model import load_model
    from olmo3eqx.generate import generate
    from olmo3eqx.tasks import Tokenizer

    root, run, tok = sft
    olmo = (chat.TEMPLATES / "olmo.jinja").read_text()
    assert template_record.recorded_templates(str(run)) == [hashlib.sha256(olmo.encode()).hexdigest()]
    export = tmp_path / "hf"
    assert convert(["orbax-to-hf", "--ckpt", str(run), "--out", str(export), "--tokenizer", str(tok)]) == 0
    assert (export / "chat_template.jinja").read_text() == olmo
    assert json.loads((export / "tokenizer_config.json").read_text())["chat_template"] == olmo
    assert (export / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == [0, SPECIALS.index(
        "<|im_end|>")]
    want, hf_turns = hf_conversation(export, QUESTIONS, NEW_TOKENS)
    assert any(new[-1] == SPECIALS.index("<|im_end|>") for _, new in hf_turns)  # a reply ended by its end of turn

    # ours, token by token: the prompt ids the template gives and the ids generate gives, on the checkpoint
    ours = template_record.chat_tokenizer(str(tok / "tokenizer.json"), None,
                                          template_record.recorded_templates(str(run)), str(run))
    model, _ = load_model(str(run))
    decode = Tokenizer.load(str(tok / "tokenizer.json")).decode
    for k, (prompt, new) in enumerate(hf_turns):
        assert ours.encode(want[:2 * k + 1], add_generation_prompt=True) == prompt
        [c] = generate(model, [prompt], max_new_tokens=NEW_TOKENS, stop=ours.end_of_turn, decode=decode, chunk=1)
        assert c.tokens + ([0] if c.finish == "eos" else []) == new, k

    # and the command: the first question in a conversation file, the others typed on stdin
    (tmp_path / "c.json").write_text(json.dumps(want[:1]))
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(q + "\n" for q in QUESTIONS[1:])))
    assert generate_cli(["--ckpt", str(run), "--tokenizer", str(tok / "tokenizer.json"), "--chat", "--conversation",
                         str(tmp_path / "c.json"), "--interactive", "--max-new-tokens", str(NEW_TOKENS),
                         "--out", str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text()) == want
    assert capsys.readouterr().out == "".join(m["content"] + "\n" for m in want if m["role"] == "assistant")


def test_another_template_is_refused(sft, tmp_path, capsys):
    """A template whose hash the checkpoint did not record: generate --chat and the export refuse it in one sentence
    (exit 2), the export writing nothing."""
    _, run, tok = sft
    olmo = (chat.TEMPLATES / "olmo.jinja").read_text()
    other = tmp_path / "other.jinja"
    other.write_text(olmo.replace("You are OLMo", "You are OLMO", 1))  # one byte
    assert len(other.read_text()) == len(olmo) and other.read_text() != olmo
    args = ["--ckpt", str(run), "--tokenizer", str(tok / "tokenizer.json"), "--chat", "What is 1+1?"]
    for template in ("olmo_thinker", str(other)):
        assert generate_cli([*args, "--chat-template", template]) == 2
        err = capsys.readouterr().err.strip()
        assert "is not the one the data of checkpoint" in err and len(err.splitlines()) == 1, err
    assert convert(["orbax-to-hf", "--ckpt", str(run), "--out", str(tmp_path / "hf"), "--tokenizer", str(tok),
                    "--chat-template", str(other)]) == 2
    assert "is not the one the data" in capsys.readouterr().err and not (tmp_path / "hf").exists()


def test_export_without_a_record(tmp_path):
    """A checkpoint of the model alone (as convert.py writes one) records no template: --tokenizer alone writes the
    tokenizer without one (a base model), --chat-template adds it, and transformers renders it as here; a tokenizer
    with more ids than the model's rows, or without its PAD id, is refused."""
    import jax

    from olmo3eqx.checkpoint.model import save_model
    from olmo3eqx.config import ModelConfig
    from olmo3eqx.errors import ConversionError
    from olmo3eqx.hf import tokenizer as hf_tokenizer
    from olmo3eqx.model import init_model

    tok = tokenizer_dir(tmp_path / "tok", conversations(8))
    cfg = ModelConfig(**MODEL)
    save_model(tmp_path / "ckpt", init_model(cfg, jax.random.key(0)), cfg)
    assert convert(["orbax-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "base"), "--tokenizer",
                    str(tok)]) == 0
    config = json.loads((tmp_path / "base" / "tokenizer_config.json").read_text())
    assert "chat_template" not in config and not (tmp_path / "base" / "chat_template.jinja").exists()
    assert config["eos_token"] == "<|endoftext|>" and config["pad_token"] == "<|pad|>"
    assert json.loads((tmp_path / "base" / "generation_config.json").read_text())["eos_token_id"] == 0
    assert convert(["orbax-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "chat"), "--tokenizer",
                    str(tok / "tokenizer.json"), "--chat-template", "olmo"]) == 0
    assert (tmp_path / "chat" / "chat_template.jinja").read_text() == (chat.TEMPLATES / "olmo.jinja").read_text()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "chat"))
    assert hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == chat.ChatTokenizer(
        str(tok / "tokenizer.json"), "olmo").render([{"role": "user", "content": "hi"}])
    with pytest.raises(ConversionError, match="embedding rows"):
        hf_tokenizer.tokenizer_config(tok / "tokenizer.json", ModelConfig(**{**MODEL, "vocab_size": 256}), None,
                                      print)
    with pytest.raises(ConversionError, match="no id 511"):
        hf_tokenizer.tokenizer_config(tok / "tokenizer.json", ModelConfig(**{**MODEL, "pad_token_id": 511}), None,
                                      print)


@pytest.mark.parametrize("args, conversation, words", [
    (["--conversation", "c.json"], "not json", "is not JSON"),
    (["--conversation", "c.json"], {"turns": []}, "holds no list of messages"),
    (["--conversation", "c.json"], [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     "nothing to answer"),
    (["--conversation", "c.json", "--system", "s"], [{"role": "system", "content": "x"},
                                                     {"role": "user", "content": "q"}], "already has a system"),
    (["--conversation", "c.json", "hello"], [{"role": "user", "content": "q"}], "one-turn chats"),
    (["--interactive"], None, "add --chat"),
])
def test_conversation_errors_are_one_sentence_before_the_model_loads(tmp_path, monkeypatch, capsys, args,
                                                                      conversation, words):
    monkeypatch.chdir(tmp_path)
    if conversation is not None:
        (tmp_path / "c.json").write_text(conversation if isinstance(conversation, str) else json.dumps(conversation))
    chat_flag = [] if words == "add --chat" else ["--chat"]
    assert generate_cli(["--ckpt", str(tmp_path / "none"), *chat_flag, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
