"""End to end: `python train.py` runs, logs, checkpoints, and resumes bit-identically after SIGKILL/SIGTERM,
on another device count, over a torn checkpoint; refuses what it must refuse; stage-2 initialisation."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from olmo3eqx import exits
from olmo3eqx.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
CONFIG = """
run: {name: e2e, seed: 0}
steps: 12
model: {vocab_size: 384, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 4, num_attention_heads: 4,
        num_key_value_heads: 2, head_dim: 16, sliding_window: 16, eos_token_id: 256, pad_token_id: 257,
        compute_dtype: float32}
data: {seq_len: 64, global_batch: 8, cache_dir: "CACHE"}
optim: {lr: 3.0e-3, warmup_steps: 2}
mesh: {max_per_device_batch: 8}
checkpoint: {every: 4, keep: 3}
eval: {every: 4, batches: 1}
log: {every: 1, progress: false}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e")
    cfg = base / "e2e.yaml"
    cfg.write_text(CONFIG.replace("CACHE", str(base / "cache")))  # the default corpus, prepared for this module
    return base, cfg


def command(cfg: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--config", str(cfg), "--run.dir", str(run_dir), *extra]


def env(devices: int = 4) -> dict:
    e = dict(os.environ)
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    e["JAX_PLATFORMS"] = "cpu"
    return e


def run(cfg, run_dir, *extra, devices=4, check=True):
    p = subprocess.run(command(cfg, run_dir, *extra), env=env(devices), capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py exited {p.returncode}:\n{p.stderr[-4000:]}")
    return p


def losses(run_dir: Path) -> dict[int, float]:
    """train/loss by step, the last line of each step winning (a resumed run re-logs steps after its checkpoint)."""
    out = {}
    for rec in read_metrics(run_dir / "e2e"):
        if "train/loss" in rec:
            out[rec["step"]] = rec["train/loss"]
    return out


def wait_for(predicate, proc, timeout=300):
    t = time.time()
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"train.py exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if time.time() - t > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.05)


def logged_step(run_dir: Path) -> int:
    path = run_dir / "e2e" / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]
    return max(steps, default=0)


def committed(run_dir: Path, step: int) -> bool:
    return (run_dir / "e2e" / "checkpoints" / str(step) / "commit_success.txt").is_file()


def final_params(run_dir: Path):
    from olmo3eqx.checkpoint.model import load_model

    model, _ = load_model(run_dir / "e2e" / "checkpoints" / str(STEPS))
    return [np.asarray(x) for x in jax.tree.leaves(model)]


@pytest.fixture(scope="module")
def reference(setup):
    base, cfg = setup
    run_dir = base / "uninterrupted"
    run(cfg, run_dir)
    return run_dir


def assert_same_run(run_dir, reference_dir, exact=True):
    got, want = losses(run_dir), losses(reference_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        if exact:
            assert got[s] == want[s], f"step {s}: {got[s]!r} != {want[s]!r}"
        else:
            assert got[s] == pytest.approx(want[s], rel=2e-5), f"step {s}"


def test_run_directory_metrics_and_checkpoints(reference):
    run_dir = reference / "e2e"
    assert (run_dir / "config.yaml").is_file()
    assert any((run_dir / "tb").iterdir())
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8, 12]
    records = read_metrics(run_dir)
    assert all(isinstance(r["step"], int) and r["time"] > 1e9 for r in records)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert train[-1]["train/tokens"] == STEPS * 8 * 64
    assert all(k in train[-1] for k in ("train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu"))
    evals = {r["step"]: r["eval/heldout/loss"] for r in records if "eval/heldout/loss" in r}
    assert sorted(evals) == [0, 4, 8, 12]  # step 0: the untrained model, the start of the held-out curve
    assert evals[12] < evals[4] < evals[0]
    assert evals[0] == pytest.approx(np.log(384), rel=0.05)
    assert train[-1]["train/loss"] < train[0]["train/loss"] - 0.5


def test_sigkill_after_a_checkpoint_resumes_bit_identically(setup, reference):
    base, cfg = setup
    run_dir = base / "killed"
    proc = subprocess.Popen(command(cfg, run_dir), env=env(), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: logged_step(run_dir) >= 6 and committed(run_dir, 4), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = logged_step(run_dir)
    assert killed_at < STEPS
    run(cfg, run_dir)
    assert_same_run(run_dir, reference)
    for a, b in zip(final_params(run_dir), final_params(reference)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # 30 s; the default suite keeps SIGTERM -> 75 on S3 and kill -9 -> bit-identical resume on GCS
def test_sigterm_checkpoints_exits_75_and_resumes_bit_identically(setup, reference):
    base, cfg = setup
    run_dir = base / "preempted"
    proc = subprocess.Popen(command(cfg, run_dir), env=env(), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: logged_step(run_dir) >= 5, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    saved = max(int(p.name) for p in (run_dir / "e2e" / "checkpoints").iterdir() if p.name.isdigit())
    assert 5 <= saved < STEPS and committed(run_dir, saved)
    assert "SIGTERM" in err
    run(cfg, run_dir)
    assert_same_run(run_dir, reference)


@pytest.mark.slow  # 28 s; the default suite resumes on another device count in test_remote_run's S3 run
def test_resume_on_another_device_count(setup, reference):
    base, cfg = setup
    run_dir = base / "resized"
    proc = subprocess.Popen(command(cfg, run_dir), env=env(4), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: logged_step(run_dir) >= 5, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 75
    # the resumed run also takes another remat for this chip (model.remat_by_chip; a compute-only field)
    p = run(cfg, run_dir, "--model.remat-by-chip", "v5p=full", "cpu=save_qkv_proj", devices=2)
    assert "'fsdp': 2" in p.stderr
    assert "remat: save_qkv_proj (model.remat_by_chip: cpu in cpu)" in p.stderr
    assert "cpu=save_qkv_proj" in (run_dir / "e2e" / "config.yaml").read_text()  # the run's config keeps the entries
    assert_same_run(run_dir, reference, exact=False)


def keep_metrics_until(run_dir, step: int) -> None:
    """Drop the metrics lines after `step`, so the replayed steps are the only ones logged after it."""
    metrics = run_dir / "e2e" / "metrics.jsonl"
    metrics.write_text("".join(l + "\n" for l in metrics.read_text().splitlines() if json.loads(l)["step"] <= step))


FAIL_READS = """
import errno, sys
from orbax.checkpoint._src.serialization import serialization

async def unreadable(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error (test: the disk fails under the restore)")

serialization.async_deserialize = unreadable
from olmo3eqx.train import main
sys.exit(main(sys.argv[1:]))
"""
"""train.py with every array read of orbax's restore failing as a failing disk fails it (EIO)."""


def stops_on_the_failing_reads(cfg: Path, run_dir: Path, step_dir: Path) -> None:
    """A launch under FAIL_READS stops at `step_dir`'s restore with exit 74 and one sentence, nothing set aside."""
    before = sorted(q.name for q in step_dir.parent.iterdir())
    p = subprocess.run([sys.executable, "-c", FAIL_READS, *command(cfg, run_dir)[2:]], env=env(), capture_output=True,
                       text=True, timeout=600)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert p.returncode == exits.STORAGE and len(errors) == 1, p.stderr[-3000:]
    assert f"Checkpoint {step_dir} could not be read (OSError: [Errno 5]" in errors[0], errors
    assert "nothing was set aside" in errors[0] and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert sorted(q.name for q in step_dir.parent.iterdir()) == before


def test_torn_newest_checkpoint_is_skipped_but_never_while_the_storage_fails(setup, reference):
    """Checkpoint 12's data torn. A launch whose reads fail (EIO) stops with exit 74 and one sentence and sets nothing
    aside, not even the torn step; the relaunch skips 12 (renamed whole, for inspection), resumes from 8 and replays
    bit-identically."""
    base, cfg = setup
    run_dir = base / "torn"
    shutil.copytree(reference, run_dir)
    ckpt = run_dir / "e2e" / "checkpoints"
    for f in (ckpt / "12" / "state" / "ocdbt.process_0" / "d").iterdir():
        f.write_bytes(b"")  # torn array data (its metadata intact: orbax reads both at once, and a second failure
        # beside the EIO would be echoed by asyncio as an exception never retrieved)
    keep_metrics_until(run_dir, 8)
    stops_on_the_failing_reads(cfg, run_dir, ckpt / "12")  # not skipped

    p = run(cfg, run_dir)
    assert f"checkpoint {ckpt / '12'} is incomplete or damaged" in p.stderr and "falling back" in p.stderr
    assert f"resumed from {ckpt / '8'}" in p.stderr
    assert_same_run(run_dir, reference)
    set_aside = [q.name for q in ckpt.iterdir() if q.name.startswith("12.unreadable-")]
    assert len(set_aside) == 1 and (ckpt / set_aside[0] / "state").is_dir()  # kept whole, for inspection


def test_an_outage_under_the_restore_of_an_intact_newest_checkpoint_then_the_relaunch_resumes_it(setup, reference):
    """The newest checkpoint (8, once 12 is gone) intact and the storage failing under its restore: exit 74, one
    sentence, nothing set aside; the relaunch, the storage back, resumes that same newest step and replays the rest
    bit-identically."""
    base, cfg = setup
    run_dir = base / "outage"
    shutil.copytree(reference, run_dir)
    ckpt = run_dir / "e2e" / "checkpoints"
    shutil.rmtree(ckpt / "12")
    keep_metrics_until(run_dir, 8)
    stops_on_the_failing_reads(cfg, run_dir, ckpt / "8")

    p = run(cfg, run_dir)
    assert f"resumed from {ckpt / '8'}" in p.stderr and "damaged" not in p.stderr
    assert_same_run(run_dir, reference)
    for a, b in zip(final_params(run_dir), final_params(reference)):
        np.testing.assert_array_equal(a, b)


def test_kill_during_a_checkpoint_write_resumes_from_the_previous_one(setup, reference):
    """What SIGKILL in the middle of a save leaves: an uncommitted `<step>.orbax-checkpoint-tmp-*` directory."""
    base, cfg = setup
    run_dir = base / "killed-while-saving"
    shutil.copytree(reference, run_dir)
    ckpt = run_dir / "e2e" / "checkpoints"
    (ckpt / "12" / "commit_success.txt").unlink()
    (ckpt / "12").rename(ckpt / "12.orbax-checkpoint-tmp-1796000000")
    keep_metrics_until(run_dir, 8)
    p = run(cfg, run_dir)
    assert "resumed from" in p.stderr and "checkpoints/8" in p.stderr
    assert_same_run(run_dir, reference)


def test_refusals_unreadable_checkpoints_config_mismatch_and_done(setup, reference):
    base, cfg = setup
    done = run(cfg, reference)
    assert done.returncode == 0 and "nothing to do" in done.stderr

    mismatch = run(cfg, reference, "--model.intermediate-size", "96", check=False)
    assert mismatch.returncode != 0
    assert "intermediate_size" in mismatch.stderr and "Traceback" not in mismatch.stderr

    broken = base / "broken"
    shutil.copytree(reference, broken)
    for step_dir in (broken / "e2e" / "checkpoints").iterdir():
        if step_dir.name.isdigit():
            shutil.rmtree(step_dir / "state")
    lines = (broken / "e2e" / "metrics.jsonl").read_text()
    p = run(cfg, broken, check=False)
    assert p.returncode != 0 and "refusing to start from scratch" in p.stderr
    assert "Traceback" not in p.stderr
    assert (broken / "e2e" / "metrics.jsonl").read_text() == lines  # nothing trained over them


def test_checkpoint_n_resumes_on_global_batch_n(setup, reference):
    """The reproduction's off-by-one: checkpoint N must continue with global batch N (0-based)."""
    from olmo3eqx.checkpoint.checkpointer import Checkpointer
    from olmo3eqx.config import load_yaml
    from olmo3eqx.data import build_train_iterator

    _, cfg_path = setup
    cfg = load_yaml(cfg_path)
    ck = Checkpointer(reference / "e2e" / "checkpoints", keep=3)
    data_state = ck.manager.restore(8, args=__import__("orbax.checkpoint").checkpoint.args.Composite(
        data=__import__("orbax.checkpoint").checkpoint.args.JsonRestore()))["data"]
    ck.close()
    kw = dict(seq_len=64, global_batch=8, seed=0, shard_index=0, shard_count=1)
    resumed = build_train_iterator(cfg.data, state=data_state, **kw)
    fresh = build_train_iterator(cfg.data, **kw)
    batches = [next(fresh)["index"] for _ in range(9)]
    assert data_state["batches_consumed"] == 8
    np.testing.assert_array_equal(next(resumed)["index"], batches[8])


def test_init_from_carries_weights_and_moments_resets_step_and_data(setup, reference):
    base, cfg = setup
    run_dir = base / "stage2"
    run(cfg, run_dir, "--init-from", str(reference / "e2e" / "checkpoints"), "--init-optimizer", "--steps", "4",
        "--optim.schedule", "linear", "--optim.warmup-steps", "0", "--optim.final-lr-ratio", "0")
    stage2 = read_metrics(run_dir / "e2e")
    stage1 = read_metrics(reference / "e2e")
    first2 = next(r for r in stage2 if r.get("step") == 1 and "train/loss" in r)
    first1 = next(r for r in stage1 if r.get("step") == 1 and "train/loss" in r)
    # Step counter reset (step 1, LR of a fresh linear anneal) and weights carried (far below a fresh init's loss).
    assert first2["train/lr"] == pytest.approx(3e-3 * (1 - 1 / 4))
    assert first2["train/loss"] < first1["train/loss"] - 0.5

    from olmo3eqx.checkpoint.checkpointer import Checkpointer
    import orbax.checkpoint as ocp

    ck = Checkpointer(run_dir / "e2e" / "checkpoints", keep=3)
    data = ck.manager.restore(4, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    ck.close()
    assert data["batches_consumed"] == 4  # data position reset, not continued from stage 1's 12

    # The moments themselves: init_from with the optimizer carries stage 1's AdamW state leaf for leaf.
    from olmo3eqx.checkpoint.model import init_from
    from olmo3eqx.config import load_yaml
    from olmo3eqx.sharding import build_layout

    tcfg = load_yaml(cfg)
    layout = build_layout(tcfg)
    fresh = layout.init_state(tcfg)
    src = reference / "e2e" / "checkpoints"
    carried = init_from(src, fresh, layout.state_target(), with_optimizer=True)
    saved = Checkpointer(src, keep=3)
    _, want = saved.restore_latest(layout.state_target(), tcfg.model)[:2]
    saved.close()
    assert int(carried.step) == 0
    for a, b in zip(jax.tree.leaves(carried.opt_state), jax.tree.leaves(want.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(carried.model), jax.tree.leaves(want.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    weights_only = init_from(src, fresh, layout.state_target(), with_optimizer=False)
    assert all(float(np.abs(np.asarray(x)).max()) == 0 for x in jax.tree.leaves(weights_only.opt_state[1].mu))


HF_ROWS = 300
"""The trimmed vocabulary of the HF model below: the e2e config's 384 rows are it padded to a multiple of 128, as
OLMo-core pads the dolma2 tokenizer's 100,278 ids to the 100,352 rows it trains (and AI2's HF export keeps 100,278)."""


@pytest.fixture(scope="module")
def trimmed_hf(setup):
    """(HF directory, converted checkpoint): a tiny transformers Olmo3 shaped as the e2e model but with HF_ROWS
    vocabulary rows, saved and converted by convert.py hf-to-orbax."""
    pytest.importorskip("transformers")
    from olmo3eqx.tools.convert import main as convert, save_tiny_hf_model

    base, _ = setup
    hf_dir, ckpt = base / "hf-trimmed", base / "hf-trimmed-orbax"
    plain = {"rope_type": "default", "rope_theta": 500000.0}
    save_tiny_hf_model(hf_dir, vocab_size=HF_ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                       eos_token_id=256, pad_token_id=257,
                       rope_parameters={"full_attention": plain, "sliding_attention": plain})
    assert convert(["hf-to-orbax", "--hf-dir", str(hf_dir), "--out", str(ckpt), "--skip-parity"]) == 0
    return hf_dir, ckpt


@pytest.mark.slow  # ~20 s: one of .ci/run's shares (.ci/share.py)
def test_init_from_a_smaller_vocabulary_pads_it_and_trains(setup, trimmed_hf):
    """Stage 2 from AI2's released weights, in small: a converted HF checkpoint of 300 rows starts a 384-row run. Its
    rows and every other weight arrive exactly; the padding rows are this run's own initialisation (OLMo-core's
    distribution); the log says so in one line and the run trains."""
    from safetensors.numpy import load_file

    from olmo3eqx.checkpoint.model import init_from, load_model
    from olmo3eqx.config import load_yaml
    from olmo3eqx.model import init_model
    from olmo3eqx.sharding import build_layout

    base, cfg = setup
    hf_dir, ckpt = trimmed_hf
    run_dir = base / "padded"
    p = run(cfg, run_dir, "--init-from", str(ckpt), "--steps", "2", "--eval.every", "0", "--checkpoint.every", "2")
    said = [line for line in p.stderr.splitlines() if "padded the vocabulary" in line]
    assert len(said) == 1 and f"from {HF_ROWS} to 384 rows" in said[0], p.stderr[-2000:]
    assert sorted(losses(run_dir)) == [1, 2] and all(np.isfinite(list(losses(run_dir).values())))

    # The start itself, on this process's 8 devices: 384 rows in shards of 48, so one shard holds rows 288-335,
    # part read from the checkpoint's 300 and part padding.
    tcfg = load_yaml(cfg)
    layout = build_layout(tcfg)
    notes = []
    state = init_from(ckpt, layout.init_state(tcfg), layout.state_target(), with_optimizer=False,
                                 note=notes.append)
    assert len(notes) == 1 and said[0].endswith(notes[0])
    hf = load_file(hf_dir / "model.safetensors")
    embed, head = np.asarray(state.model.embed), np.asarray(state.model.lm_head.weight)
    assert embed.shape == (384, 64) and head.shape == (64, 384)
    np.testing.assert_array_equal(embed[:HF_ROWS], hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(head[:, :HF_ROWS], hf["lm_head.weight"].T)
    converted, _ = load_model(ckpt)
    for name in ("blocks", "norm"):
        for a, b in zip(jax.tree.leaves(getattr(state.model, name)), jax.tree.leaves(getattr(converted, name))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The padding: the rows a fresh model of this config gets from run.seed (state.init_state's model key), compiled
    # as the run compiles its init (eager ops round the truncated normal differently in the last bit).
    key = jax.random.split(jax.random.PRNGKey(tcfg.run.seed))[0]
    fresh = jax.jit(lambda k: init_model(tcfg.model, k))(key)
    np.testing.assert_array_equal(embed[HF_ROWS:], np.asarray(fresh.embed)[HF_ROWS:])
    np.testing.assert_array_equal(head[:, HF_ROWS:], np.asarray(fresh.lm_head.weight)[:, HF_ROWS:])
    assert all(float(np.abs(np.asarray(m)).max()) == 0 for m in jax.tree.leaves(state.opt_state[1].mu))

    # ... and OLMo-core's own initialisation of the same matrices (OLMo 3 7B: InitMethod.normal, init_std 0.02 for
    # the embedding and the LM head alike, truncated at 3 std): the same bounds, mean and spread.
    torch = pytest.importorskip("torch")
    from olmo_core.nn.transformer.config import TransformerConfig
    from olmo_core.nn.transformer.init import InitMethod

    std = TransformerConfig.__dataclass_fields__["init_std"].default
    assert TransformerConfig.__dataclass_fields__["init_method"].default == InitMethod.normal
    pad = 384 - HF_ROWS
    olmo_embed, olmo_head = torch.nn.Embedding(pad, 64), torch.nn.Linear(64, pad, bias=False)
    gen = torch.Generator().manual_seed(0)
    InitMethod.normal.init_embeddings(olmo_embed, d_model=64, std=std, generator=gen)
    InitMethod.normal.init_final_w_out(olmo_head, d_model=64, std=std, generator=gen)
    for ours, theirs in ((embed[HF_ROWS:], olmo_embed.weight), (head[:, HF_ROWS:], olmo_head.weight)):
        theirs = theirs.detach().numpy()
        assert np.abs(ours).max() <= 3 * std and np.abs(theirs).max() <= 3 * std
        assert abs(ours.mean()) < 4 * std / ours.size ** 0.5
        assert ours.std() == pytest.approx(theirs.std(), rel=0.08)  # each within ~1.5% of the truncated std


def test_init_from_refuses_any_other_shape_difference(setup, trimmed_hf):
    """A padded vocabulary is the one shape difference init_from accepts: another field, a larger checkpoint
    vocabulary and moments carried into padding rows each stop with one sentence and exit 2."""
    import dataclasses

    from olmo3eqx.checkpoint.model import init_from
    from olmo3eqx.config import load_yaml
    from olmo3eqx.errors import ConfigError
    from olmo3eqx.sharding import build_layout

    _, cfg = setup
    _, ckpt = trimmed_hf
    base = load_yaml(cfg)

    def refusal(with_optimizer=False, **model) -> str:
        tcfg = dataclasses.replace(base, model=dataclasses.replace(base.model, **model))
        target = build_layout(tcfg).state_target()  # refused before any array is built: no fresh state needed
        with pytest.raises(ConfigError) as e:
            init_from(ckpt, target, target, with_optimizer=with_optimizer)
        code, sentence = exits.exit_code(e.value)
        assert code == exits.BAD_INPUT and sentence.count(". ") == 0 and sentence.endswith(".")
        return sentence

    other = refusal(intermediate_size=96)
    assert "in intermediate_size (checkpoint 128, config 96);" in other and "vocab_size" not in other
    larger = refusal(vocab_size=288)
    assert f"in vocab_size (checkpoint {HF_ROWS}, config 288);" in larger
    moments = refusal(with_optimizer=True)
    assert f"has {HF_ROWS} vocabulary rows and the config 384" in moments and "drop --init-optimizer" in moments


def test_a_run_that_only_produces_nans_stops_after_max_nonfinite_saying_what_was_tried(setup):
    """LR 1e6 unclipped: step 1's update blows the weights up, and every later batch's loss is non-finite. Steps 2-4
    are skipped and listed; the third in a row stops the run, before checkpoint 4 would be written."""
    base, cfg = setup
    p = run(cfg, base / "nan", "--optim.lr", "1e6", "--optim.clip-grad-norm", "0", "--optim.warmup-steps", "0",
            "--optim.max-nonfinite", "3", check=False)
    assert p.returncode == exits.NONFINITE, p.stderr[-2000:]
    (error,) = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert "3 consecutive steps (2-4) had a non-finite loss or gradient norm" in error, error
    assert "the weights are still those of step 1" in error and "optim.spike_guard is off" in error, error
    assert "No checkpoint was written before the streak began at step 2" in error, error
    assert "skipped_batches.jsonl" in error, error
    assert "Traceback" not in p.stderr
    run_dir = base / "nan" / "e2e"
    assert [json.loads(line)["step"] for line in (run_dir / "skipped_batches.jsonl").read_text().splitlines()] == \
        [2, 3, 4]
    assert {r["step"]: r["train/skipped"] for r in read_metrics(run_dir) if "train/loss" in r} == \
        {1: 0, 2: 1, 3: 1, 4: 1}
    assert not (run_dir / "checkpoints" / "4").exists()


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except FileNotFoundError:
        return []


@pytest.mark.slow  # 28 s; test_supervise covers the relaunch decisions in the default suite
def test_until_done_relaunches_a_killed_run_to_the_end(setup, reference):
    base, cfg = setup
    run_dir = base / "supervised"
    sup = subprocess.Popen(command(cfg, run_dir, "--until-done", "--retry-backoff", "0"), env=env(),
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: logged_step(run_dir) >= 6 and committed(run_dir, 4), sup)
    for child in children(sup.pid):
        os.kill(child, signal.SIGKILL)
    _, err = sup.communicate(timeout=300)
    assert sup.returncode == 0, err[-3000:]
    assert "relaunching" in err and "launch 2" in err and "run finished" in err
    assert "taking over the lock" in err  # the killed child's run-directory lock, taken by its relaunch
    assert_same_run(run_dir, reference)
