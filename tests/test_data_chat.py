"""Chat data -> OLMo-core's SFT files (olmo3eqx.data.chat): the byte template's tokens and masks against hand-built
expectations, OLMo's template against transformers' apply_chat_template and open-instruct's masking rule computed
with it, bad rows counted in one sentence, truncation, and a saved `datasets` dataset read like its JSON Lines."""

import gzip
import json

import numpy as np
import pytest

from olmo3eqx.data import chat
from olmo3eqx.data.prepare import BYTE_EOS
from olmo3eqx.errors import DataError

E = BYTE_EOS
ONE_TURN = {"messages": [{"role": "user", "content": "What is 12+7?"},
                         {"role": "assistant", "content": "The answer is 19."}]}
TWO_TURNS = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                          {"role": "assistant", "content": "2."}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4."}]}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def read_out(out, k=0):
    tokens = np.fromfile(out / chat.TOKEN_FILE.format(k), np.uint16)
    mask = np.fromfile(out / chat.MASK_FILE.format(k), np.bool_)
    assert tokens.size == mask.size
    return tokens, mask


def b(text):
    return list(text.encode())


def test_bytes_template_hand_built(tmp_path):
    """Assistant content and what ends its turn are labelled, every prompt and header is not, each conversation
    ends in EOS, written as open-instruct's two files with OLMo-core's document index."""
    src = write_jsonl(tmp_path / "c.jsonl", [ONE_TURN, TWO_TURNS])
    meta = chat.prepare_chat([src], tokenizer="bytes", out=tmp_path / "out", progress=False)
    tokens, mask = read_out(tmp_path / "out")
    want = [(b("User: What is 12+7?\nAssistant: "), False), (b("The answer is 19.") + [E], True),
            (b("System: Be brief.\nUser: 1+1?\nAssistant: "), False), (b("2.\n"), True),
            (b("User: 2+2?\nAssistant: "), False), (b("4.") + [E], True)]
    assert tokens.tolist() == sum((ids for ids, _ in want), [])
    assert mask.tolist() == sum(([m] * len(ids) for ids, m in want), [])
    assert meta["conversations"] == 2 and meta["labelled_tokens"] == int(mask.sum()) and not meta["skipped"]
    rows = gzip.decompress((tmp_path / "out" / "token_ids_part_0000.csv.gz").read_bytes()).decode().split()
    first = len(b("User: What is 12+7?\nAssistant: The answer is 19.")) + 1
    assert rows == [f"0,{first}", f"{first},{tokens.size}"]


def test_bad_rows_are_counted_in_one_sentence(tmp_path, capsys):
    rows = [ONE_TURN, {"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
            "not json", {"messages": [{"role": "user"}]}, {"text": "no messages"}, ONE_TURN]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    meta = chat.prepare_chat([src], tokenizer="bytes", out=tmp_path / "out", progress=False)
    assert meta["rows"] == 7 and meta["conversations"] == 2
    assert {r: v["count"] for r, v in meta["skipped"].items()} == {"no_assistant": 1, "unknown_role": 1,
                                                                   "malformed": 3}
    assert meta["skipped"]["malformed"]["first"] == f"{src} line 4"
    err = capsys.readouterr().err
    assert ("2 of 7 conversations kept" in err and "1 without an assistant turn (first: " + src + " line 2)" in err
            and "3 not a" in err)
    with pytest.raises(DataError, match="No conversation to write: 0 of 1"):
        chat.prepare_chat([write_jsonl(tmp_path / "bad.jsonl", ["{}"])], tokenizer="bytes", out=tmp_path / "o2",
                          progress=False)


def test_cli_exit_code_and_sentence(tmp_path, capsys):
    from olmo3eqx.tools.prepare import main as cli

    src = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    assert cli(["chat", "--input", src, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "error: No conversation to write: 0 of 1 conversations kept" in capsys.readouterr().err


def test_a_template_that_cannot_render_a_tool_call_row_is_one_sentence(tmp_path):
    """A Dolci tool-call row (assistant content null) through a template written for plain text: one sentence naming
    the row, not the template engine's TypeError."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    row = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": None, "function_calls": "get_weather()"}]}
    src = write_jsonl(tmp_path / "tools.jsonl", [row])
    with pytest.raises(DataError, match=f"cannot render {src} line 1: .*--chat-template"):
        chat.prepare_chat([src], tokenizer="bytes", chat_template=str(template), out=tmp_path / "out",
                          progress=False)


def test_long_conversations_truncated_or_skipped(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [ONE_TURN, {"messages": [{"role": "user", "content": "x" * 40},
                                                                      {"role": "assistant", "content": "y"}]}])
    n = len(b("User: What is 12+7?\nAssistant: The answer is 19.")) + 1
    meta = chat.prepare_chat([src], tokenizer="bytes", out=tmp_path / "t", max_seq_len=n - 3, progress=False)
    tokens, mask = read_out(tmp_path / "t")
    assert tokens.tolist() == b("User: What is 12+7?\nAssistant: The answer is ") + [E]  # cut, then EOS
    assert mask.tolist() == [False] * 31 + [True] * 14 + [False]
    assert meta["truncated"] == 1 and meta["skipped"]["no_labels"]["count"] == 1  # the x's leave no label
    meta = chat.prepare_chat([src], tokenizer="bytes", out=tmp_path / "s", max_seq_len=n, long="skip",
                             progress=False)
    assert meta["conversations"] == 1 and meta["skipped"]["too_long"]["count"] == 1 and meta["truncated"] == 0
    assert read_out(tmp_path / "s")[0].size == n


def test_saved_dataset_equals_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [ONE_TURN, TWO_TURNS]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    chat.prepare_chat([str(tmp_path / "ds")], tokenizer="bytes", out=tmp_path / "a", progress=False)
    chat.prepare_chat([write_jsonl(tmp_path / "c.jsonl", rows)], tokenizer="bytes", out=tmp_path / "b",
                      progress=False)
    for x, y in zip(read_out(tmp_path / "a"), read_out(tmp_path / "b")):
        np.testing.assert_array_equal(x, y)


def test_jsonl_over_https_equals_local(tmp_path):
    """A JSON Lines file behind a URL (olmo3eqx.storage; gzip'd too) gives the files its local copy gives."""
    from stores import HttpServer, free_port

    (tmp_path / "www").mkdir()
    rows = [ONE_TURN, TWO_TURNS, {"messages": []}]
    write_jsonl(tmp_path / "www" / "c.jsonl", rows)
    (tmp_path / "www" / "c.jsonl.gz").write_bytes(gzip.compress((tmp_path / "www" / "c.jsonl").read_bytes()))
    server = HttpServer(tmp_path / "www", free_port())
    try:
        meta = chat.prepare_chat([f"{server.url}/c.jsonl", f"{server.url}/c.jsonl.gz"], tokenizer="bytes",
                                 out=tmp_path / "url", progress=False)
    finally:
        server.stop()
    chat.prepare_chat([str(tmp_path / "www" / "c.jsonl")] * 2, tokenizer="bytes", out=tmp_path / "local",
                      progress=False)
    assert meta["skipped"]["malformed"] == {"count": 2, "first": f"{server.url}/c.jsonl line 3"}
    for x, y in zip(read_out(tmp_path / "url"), read_out(tmp_path / "local")):
        np.testing.assert_array_equal(x, y)


def chat_tokenizer(path):
    """A byte-level BPE with OLMo's special tokens (EOS <|endoftext|>, <|im_start|>, <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [chat.ChatTokenizer("bytes", "olmo").render(r["messages"]) for r in (ONE_TURN, TWO_TURNS)] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(path))
    return str(path)


def open_instruct_tokenize(hf_tok, messages):
    """open-instruct's sft_tulu_tokenize_and_truncate_v1 (no truncation), on transformers' apply_chat_template."""
    def ids(msgs, gen=False):
        out = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    input_ids = ids(messages)
    labels = list(input_ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            start = 0 if i == 0 else len(ids(messages[:i]))
            end = len(ids(messages[:i + 1], i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"))
            labels[start:end] = [-100] * (end - start)
    return input_ids, [x != -100 for x in labels]


def test_olmo_template_equals_transformers(tmp_path):
    """OLMo's template rendered here equals transformers' apply_chat_template (text and ids, with and without the
    generation prompt), and the masks equal open-instruct's rule computed with transformers."""
    transformers = pytest.importorskip("transformers")
    path = chat_tokenizer(tmp_path / "tokenizer.json")
    ours = chat.ChatTokenizer(path, "olmo")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|endoftext|>",
                                                  pad_token="<|pad|>")
    hf_tok.chat_template = ours.template
    assert ours.end_of_turn == ("<|im_end|>",)
    for row in (ONE_TURN, TWO_TURNS):
        msgs = row["messages"]
        for gen in (False, True):
            assert ours.render(msgs, gen) == hf_tok.apply_chat_template(msgs, tokenize=False,
                                                                        add_generation_prompt=gen)
        want_ids, want_mask = open_instruct_tokenize(hf_tok, msgs)
        got_ids, got_mask = ours.tokenize(msgs)
        assert got_ids.tolist() == want_ids and got_mask.tolist() == want_mask
        labelled = hf_tok.decode([t for t, m in zip(got_ids, got_mask) if m])
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        # open-instruct's rule measures a turn's start by the conversation before it rendered alone, which ends its
        # last answer in one EOS token where the full rendering has <|im_end|> and a newline: the newline is masked
        assert labelled == "<|im_end|>".join(answers) + "<|endoftext|>"


def test_template_from_tokenizer_config(tmp_path):
    """The tokenizer's own template is found beside its tokenizer.json; a template file or config is taken too."""
    path = chat_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match="no chat template beside it"):
        chat.ChatTokenizer(path)
    olmo = (chat.TEMPLATES / "olmo.jinja").read_text()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": olmo}))
    assert chat.ChatTokenizer(path).template == olmo
    (tmp_path / "mine.jinja").write_text("{{ messages[0]['content'] }}")
    assert chat.ChatTokenizer("bytes", str(tmp_path / "mine.jinja")).render([{"role": "user", "content": "q"}]) == "q"
    with pytest.raises(DataError, match="neither a built-in"):
        chat.ChatTokenizer("bytes", "nonesuch")


def test_prepared_chat_trains_as_olmo_core_reads_it(tmp_path):
    """The files prepare writes, packed: our batches (tokens, label masks, document lengths) equal OLMo-core's
    NumpyPackedFSLDataset with label_mask_paths on them, and prepare's packed-instance count is the pipeline's."""
    pytest.importorskip("olmo_core")
    from olmo_core.data import DataCollator, NumpyDataLoaderBase, NumpyPackedFSLDatasetConfig, TokenizerConfig

    from olmo3eqx.config import DataConfig
    from olmo3eqx.data import BYTE_PAD, build_train_iterator

    rng = np.random.default_rng(0)
    rows = [{"messages": [{"role": "user", "content": "q" * int(rng.integers(1, 90))},
                          {"role": "assistant", "content": "a" * int(rng.integers(1, 90))}]} for _ in range(120)]
    seq, batch = 128, 4
    meta = chat.prepare_chat([write_jsonl(tmp_path / "c.jsonl", rows)], tokenizer="bytes", out=tmp_path / "sft",
                             max_seq_len=seq, shard_tokens=4000, progress=False)
    tokens = sorted(str(p) for p in (tmp_path / "sft").glob("token_ids_part_*.npy"))
    masks = sorted(str(p) for p in (tmp_path / "sft").glob("labels_mask_part_*.npy"))
    assert len(tokens) == len(masks) > 1 and meta["truncated"] > 0
    dataset = NumpyPackedFSLDatasetConfig(
        paths=tokens, label_mask_paths=masks, sequence_length=seq, generate_doc_lengths=True,
        tokenizer=TokenizerConfig(vocab_size=258, eos_token_id=E, pad_token_id=BYTE_PAD),
        work_dir=str(tmp_path / "oc")).build()
    dataset.prepare()
    loader = NumpyDataLoaderBase.wrap_numpy_dataset(dataset, global_batch_size=batch * seq, seed=7, num_threads=0,
                                                    collator=DataCollator(pad_token_id=BYTE_PAD),
                                                    work_dir=str(tmp_path / "oc"))
    loader.reshuffle(epoch=1)
    want = [{k: b[k].numpy() for k in ("input_ids", "label_mask", "doc_lens")} for b in loader]
    data = DataConfig(paths=(str(tmp_path / "sft" / "token_ids_part_*.npy"),), packing=True, order="olmo-core",
                      label_mask_paths=(str(tmp_path / "sft" / "labels_mask_part_*.npy"),), seed=7, seq_len=seq,
                      global_batch=batch, cache_dir=str(tmp_path / "cache"))
    it = build_train_iterator(data, seq_len=seq, global_batch=batch, seed=7, shard_index=0, shard_count=1,
                              vocab_size=258, index_dir=tmp_path / "order", eos_id=E, pad_id=BYTE_PAD)
    assert it.num_instances == len(dataset) == meta["packed_instances"]
    for w in want:
        g = next(it)
        np.testing.assert_array_equal(g["tokens"], w["input_ids"])
        np.testing.assert_array_equal(g["label_mask"], w["label_mask"])
        np.testing.assert_array_equal(g["doc_lens"], w["doc_lens"])
    assert 0 < sum(int(w["label_mask"].sum()) for w in want) < sum(int((w["input_ids"] != BYTE_PAD).sum())
                                                                   for w in want)
