"""bench/reference_run.py, the reproduction in miniature beside OLMo-core's own Trainer.

Default: the pieces whose mistakes the long run would hide, each against AI2's or grain's own code: the fault reads
what grain's IndexSampler gives a loader that does not shard; OLMo-core's LM evaluator number times the harness's
scale is the mean over predictions our evaluator reports; a resume's replayed steps are found and compared.
Slow: the whole harness at a tiny size (both sides, both stages, the kills and resumes, the fault rerun)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from olmo3eqx.config import DataConfig
from olmo3eqx.data import build_train_iterator

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import reference_fault
    import reference_run

    return reference_run, reference_fault


def test_fault_reads_what_grain_gives_a_sharded_sampler_under_an_unsharded_loader(harness, tmp_path):
    """Each simulated process reads its own records in the order grain's IndexSampler (built with ShardOptions, read
    at every position as a NoSharding loader reads it) hands out record keys: each record `shards` times in a row."""
    from grain.samplers import IndexSampler
    from grain.sharding import ShardOptions

    _, fault = harness
    seq, batch, shards, steps = 4, 8, 4, 24
    path = tmp_path / "tokens.npy"
    np.arange(seq * 16 * batch, dtype=np.uint16).tofile(path)  # 16 global batches of distinct instances
    cfg = DataConfig(paths=(str(path),), order="olmo-core", seed=1, seq_len=seq, global_batch=batch,
                     token_dtype="uint16")
    inner = build_train_iterator(cfg, seq_len=seq, global_batch=batch, seed=1, shard_index=0, shard_count=1,
                                 vocab_size=2**16, index_dir=tmp_path / "order")
    faulty = fault.DoubleSharded(inner, shards)
    local = batch // shards
    rows = np.stack([faulty.ids(r) for r in range(steps)]).reshape(steps, shards, local)
    for s in range(shards):
        # The process's own records in its correct order (sharded once): its slice of each row of the global order.
        own = np.concatenate([inner.order(r)[s * local:(s + 1) * local] for r in range(steps)])
        sampler = IndexSampler(num_records=own.size, shard_options=ShardOptions(s, shards), shuffle=False,
                               num_epochs=1)
        start = sampler[0].record_key  # its first record: grain shards into contiguous pieces
        keys = [sampler[i].record_key - start for i in range(steps * local)]  # a NoSharding loader reads every i
        assert rows[:, s].reshape(-1).tolist() == own[keys].tolist()
    _, counts = np.unique(rows, return_counts=True)
    assert np.all(counts == shards)  # every instance read is read `shards` times, within a few steps
    batches = [next(faulty)["index"] for _ in range(3)]
    assert faulty.get_state()["batches_consumed"] == 3 and np.array_equal(batches[2], faulty.ids(2))


def test_olmo_core_heldout_number_times_the_scale_is_the_mean_over_predictions(harness):
    """OLMo-core's LMEvaluator counts every real token of a document, the last one (no label, loss 0) too; the
    harness's scale turns its number into the mean over the n - 1 predictions that our evaluator reports."""
    torch = pytest.importorskip("torch")
    from olmo_core.eval.lm_evaluator import LMEvaluator

    run, _ = harness
    plan = run.Plan(seq_len=16, heldout_docs=8)
    rng = np.random.default_rng(0)
    ce = rng.uniform(0.5, 4.0, (plan.heldout_docs, plan.seq_len)).astype(np.float32)
    ce[:, -1] = 0.0  # the last position's label is -100: F.cross_entropy gives 0 there
    evaluator = LMEvaluator(name="lm", batches=[], labels=["code"], device=torch.device("cpu"))
    evaluator.update_metrics({"metadata": [{"label": "code"}] * plan.heldout_docs,
                              "label_mask": torch.ones(plan.heldout_docs, plan.seq_len, dtype=torch.bool)},
                             torch.from_numpy(ce), None)
    theirs = float(evaluator.compute_metrics()["code/CE loss"])
    ours = ce[:, :-1].astype(np.float64).mean()
    docs = run.heldout_documents([bytes(rng.integers(0, 256, 4000).astype(np.uint8))], plan)
    assert docs.size == plan.heldout_docs * plan.seq_len
    assert np.all(docs.reshape(plan.heldout_docs, plan.seq_len)[:, -1] == run.EOS)  # every document is full length
    assert theirs * run.olmo_core_heldout_scale(plan) == pytest.approx(ours, rel=1e-6)


def test_a_resume_s_replayed_steps_are_found_and_compared(harness):
    run, _ = harness
    before = [{"step": s, "train/loss": 5.0 - s / 10} for s in range(1, 8)]  # logged up to step 7, then killed
    after = [{"step": 5, "eval/code/loss": 4.5}] + [{"step": s, "train/loss": 5.0 - s / 10} for s in range(5, 11)]
    after[3]["train/loss"] += 1e-3  # step 7's replay differs
    r = run.replay(before + after, killed_at_line=len(before))
    assert r == {"killed_after_step": 7, "resumed_from_step": 4, "steps_replayed": 3,
                 "max_abs_loss_diff": pytest.approx(1e-3), "first_differing_step": 7}
    c = run.curves(before + after, 10, ["code"], len(before))
    assert c.train["train/loss"][6] == pytest.approx(5.0 - 0.7 + 1e-3)  # the last record of a step wins
    assert c.eval_steps.tolist() == [5]
    with pytest.raises(ValueError, match="2 training steps have no record"):
        run.curves(before, 9, ["code"], None)


def test_gates_read_the_steps_both_sides_updated_alike(harness):
    """A skip decision the two sides disagree on ends the part of the run the gates read; it passes the skips gate only
    where OLMo-core's resumed run disagreed with its own uninterrupted run at that step (its guard's history lost)."""
    run, _ = harness
    steps = np.arange(1, 11)

    def side(loss, skipped, heldout):
        train = {k: np.ones(10) for k in run.TRAIN} | {"train/loss": loss, "train/skipped": skipped}
        return run.Curves(steps, train, np.array([0, 5, 10]), {"code": heldout})

    ref_loss = np.linspace(3.0, 2.0, 10)
    ours_loss = ref_loss * (1 + 1e-7)
    ours_loss[6:] += 0.01  # from step 7 on: the weights differ after step 6's update
    ref_skips = np.zeros(10)
    ref_skips[5] = 1  # OLMo-core skipped step 6, ours did not
    g = run.gaps(side(ours_loss, np.zeros(10), np.array([3.0, 2.5, 2.1])),
                 side(ref_loss, ref_skips, np.array([3.0, 2.5 + 1e-7, 2.0])))
    s = g["summary"]
    assert s["skip_disagreements"] == [6] and s["same_updates_through"] == 6
    assert s["train_loss_rel_max"] == pytest.approx(1e-7, rel=1e-3) and s["train_loss_rel_max_all"] > 3e-3
    assert s["heldout_max"]["code"] == pytest.approx(1e-7, abs=1e-9)  # the evaluation at step 10 is left out
    explained = run.check_gates({2: g}, {2: {"first_differing_step": 6}}, None)
    assert all(gate["holds"] for gate in explained.values())
    assert not run.check_gates({2: g}, {2: {"first_differing_step": None}}, None)["skips"]["holds"]


def test_the_fault_gate_holds_only_when_compare_names_the_faulty_run(harness, tmp_path):
    """The fault as the full run showed it (docs/reproduction.md): the faulty run trains lower for its first ~100
    steps while its held-out loss is already worse, then falls behind in both. With a window per evaluation,
    olmo3eqx-compare names its signature in the first window and rates OLMo-core's run better in the last; judged
    on one window only it would merely rate OLMo-core's better, and the gate does not hold on that."""
    run, _ = harness
    steps, evals = np.arange(1, 401), np.arange(0, 401, 50)

    def side(loss, heldout):
        train = {k: np.ones(400) for k in run.TRAIN} | {"train/loss": loss, "train/skipped": np.zeros(400)}
        return run.Curves(steps, train, evals, {"code": heldout, "prose": heldout + 0.2})

    ref = 2.0 + 3.0 * np.exp(-steps / 80)
    ref_held = 2.1 + 3.0 * np.exp(-evals / 80)
    fault = ref + np.where(steps <= 100, -0.05, 0.3)
    fault_held = ref_held + np.where(evals == 0, 0.0, np.where(evals <= 100, 0.03, 0.3))
    a = run.as_run_dir(side(fault, fault_held), tmp_path / "fault")
    b = run.as_run_dir(side(ref, ref_held), tmp_path / "olmo-core")
    named = run.verdict(a, b, tmp_path / "8.png", windows=8)
    assert named["earlier_flagged"] == ["A"] and named["flagged"] is None and named["better"] == "B", named
    assert named["earlier"][0].startswith("earlier, MEMORISATION SIGNATURE in run A in window 1 (1-50.88): run A")
    unnamed = run.verdict(a, b, tmp_path / "1.png", windows=1)
    assert unnamed["earlier_flagged"] == [] and unnamed["better"] == "B", unnamed
    clean = {1: run.gaps(side(ref, ref_held), side(ref, ref_held))}
    gap = run.gaps(side(fault, fault_held), side(ref, ref_held))
    gate = lambda v: run.check_gates(clean, {1: {}}, {"gaps": {1: gap}, "verdicts": {"1": v}})  # noqa: E731
    assert gate(named)["fault_verdict"]["holds"] and gate(named)["fault_heldout"]["holds"]
    assert not gate(unnamed)["fault_verdict"]["holds"]


def test_data_is_the_default_corpus_split_into_the_stages_mixes_and_held_out_sets(harness, tmp_path):
    """The data step reads the archive the package ships (it once read a function the corpus no longer has, and
    only the slow end-to-end run and CI's reference run found out)."""
    run, _ = harness
    from olmo3eqx.data.corpus import HELDOUT_FRACTION
    from olmo3eqx.data.prepare import is_heldout

    code, heldout_code, prose, heldout_prose = run.documents()
    assert len(code) + len(heldout_code) == 733 and len(heldout_code) > 0  # 734 files less the language reference
    assert is_heldout("pydoc_data/topics.py", 1.0) and HELDOUT_FRACTION < 1
    assert len(prose) > len(heldout_prose) > 0
    plan = run.Plan(steps=8, stage2_steps=8, heldout_docs=16)
    data = run.prepare_data(plan, tmp_path)
    batch = plan.seq_len * plan.global_batch
    for stage in (1, 2):
        sizes = [Path(f).stat().st_size // np.dtype(run.TOKEN_DTYPE).itemsize for _, f in data.files[stage]]
        assert sum(sizes) == 8 * batch, (stage, sizes)
        assert data.mixes[stage].read_text().count("{TOKENIZER}") == len(sizes)
    for name in run.HELDOUT_SETS:
        held = np.fromfile(data.heldout[name], run.TOKEN_DTYPE).reshape(16, plan.seq_len)
        assert (held[:, -1] == run.EOS).all() and (held[:, :-1] != run.EOS).all()


def test_bad_input_is_one_sentence_and_exit_2(harness, tmp_path, capsys):
    run, _ = harness
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "left").write_text("")
    for args, says in ((["--heldout-docs", "12"], "multiple of the global batch"),
                       (["--steps", "4"], "at least 8"),
                       (["--work", str(tmp_path / "work")], "is not empty")):
        with pytest.raises(SystemExit) as e:
            run.main([*args, "--out", str(tmp_path / "out")])
        assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.slow  # ~10 min on 2 busy cores: eight processes, each compiling or building its side
def test_the_harness_runs_both_sides_both_stages_with_kills_and_the_fault(harness, tmp_path, capsys):
    run, _ = harness
    out = tmp_path / "out"
    code = run.main(["--steps", "48", "--stage2-steps", "24", "--eval-every", "8", "--heldout-docs", "16",
                     "--out", str(out), "--work", str(tmp_path / "work")])
    printed = capsys.readouterr().out
    report = json.loads((out / "reference_run.json").read_text())
    for side in ("ours", "olmo-core"):
        for stage in ("1", "2"):
            r = report["resumes"][side][stage]
            assert r["steps_replayed"] >= 1 and r["max_abs_loss_diff"] == 0.0, (side, stage, r)
    for stage in ("1", "2"):
        s = report["clean"][stage]["summary"]
        assert s["lr_rel_max"] < 1e-6 and s["skipped"]["ours"] == s["skipped"]["olmo_core"]
        assert s["train_loss_rel_max"] <= run.GATES["train_loss_rel"]
        assert report["verdicts"]["clean"][stage]["flagged"] is None
        assert report["verdicts"]["clean"][stage]["earlier_flagged"] == []
    assert all(report["gates"][g]["holds"] for g in ("train_loss_rel", "heldout", "skips"))
    assert code == (0 if all(g["holds"] for g in report["gates"].values()) else 1)
    assert "gate train_loss_rel: holds" in printed and (out / "reference_run.png").stat().st_size > 50_000


def test_the_stored_figure_is_drawn_again_from_the_stored_json_alone(harness, tmp_path, monkeypatch):
    """`--replot` redraws docs/reproduction's figure from its JSON (no training): the gaps it recomputes from the
    stored curves are the stored ones (to the JSON's 8 digits), and the PNG has every panel."""
    run, _ = harness
    stored = BENCH.parent / "docs" / "reproduction" / "reference_run.json"
    (tmp_path / "reference_run.json").write_bytes(stored.read_bytes())
    drawn = {}
    real_plot = run.plot
    monkeypatch.setattr(run, "plot", lambda sides, clean, fault, out: drawn.update(clean=clean, fault=fault)
                        or real_plot(sides, clean, fault, out))
    assert run.main(["--replot", "--out", str(tmp_path)]) == 0
    d = json.loads(stored.read_text())
    for stage in (1, 2):
        mine, theirs = drawn["clean"][stage]["summary"], d["clean"][str(stage)]["summary"]
        assert mine["same_updates_through"] == theirs["same_updates_through"]
        assert mine["train_loss_rel_max"] == pytest.approx(theirs["train_loss_rel_max"], rel=0.01)
        assert mine["grad_norm_rel_max"] == pytest.approx(theirs["grad_norm_rel_max"], rel=0.01)
        fault = drawn["fault"]["gaps"][stage]["summary"]
        assert fault["heldout_final"] == pytest.approx(d["fault"]["gaps"][str(stage)]["summary"]["heldout_final"],
                                                       rel=1e-3)
    png = (tmp_path / "reference_run.png").read_bytes()
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width == 20 * 72 and height > 1400  # 20 inches at 72 dpi; six rows of panels
    with pytest.raises(SystemExit):
        run.main(["--replot", "--out", str(tmp_path / "none")])
