"""Exit 3's advice, followed for real: a finite blow-up (`--optim.lr 1e6`: step 1's update is finite and applied, every
later batch fails on its weights) with a checkpoint every step, then the relaunch with a lower LR a person would try.
The sentence must name the newest checkpoint written before the streak began, never one written during it (a skipped
update leaves the weights as they were, so those hold the weights every batch failed on), and say when the weights
themselves are suspect."""

import re
import subprocess
from pathlib import Path

from olmo3eqx import exits
from olmo3eqx.train import resume_advice
from test_faults import committed, error_lines, shared, train_cmd, trainer_env, write_config  # noqa: F401
from test_train import CONFIG

BLOW_UP = ["--optim.lr", "1e6", "--optim.clip-grad-norm", "0", "--optim.warmup-steps", "0"]


def launch(cfg, run_dir, shared, *extra: str) -> subprocess.CompletedProcess:
    cmd = [*train_cmd(cfg, run_dir), "--steps", "8", "--checkpoint.every", "1", "--checkpoint.keep", "8",
           "--optim.max-nonfinite", "3", *extra]
    return subprocess.run(cmd, env=trainer_env(shared), capture_output=True, text=True, timeout=600)


def named_checkpoints(sentence: str) -> list[int]:
    return [int(s) for s in re.findall(r"checkpoints/(\d+)", sentence)]


def test_exit_3_names_the_checkpoint_before_the_streak_and_says_the_weights_may_be_bad(tmp_path, shared):
    cfg = write_config(tmp_path / "e2e.yaml", CONFIG.replace("eval: {every: 4, batches: 1}", "eval: {every: 0}"),
                       shared)
    ckpt = tmp_path / "e2e" / "checkpoints"
    p = launch(cfg, tmp_path, shared, *BLOW_UP)
    assert p.returncode == exits.NONFINITE, p.stderr[-3000:]
    (error,) = error_lines(p.stderr)
    assert "3 consecutive steps (2-4)" in error and committed(ckpt) == [1, 2, 3], error
    # Checkpoints 2 and 3 were written during the streak: the weights of step 1, which every batch failed on.
    assert named_checkpoints(error) == [1], error
    assert "the very weights every batch failed on" in error and "start over with a lower optim.lr" in error, error

    # What a person tries first: relaunch with a lower LR (the rest of the optimizer as it was). It resumes from
    # checkpoint 3, the newest, and the same weights fail again; the sentence still names checkpoint 1 and says to
    # start over, never 3-5 (all written during the one streak, which began in the first launch).
    p = launch(cfg, tmp_path, shared, *BLOW_UP[2:], "--optim.lr", "1e-3")
    assert p.returncode == exits.NONFINITE, p.stderr[-3000:]
    (error,) = error_lines(p.stderr)
    assert "resumed from" in p.stderr and "3 consecutive steps (4-6)" in error, error
    assert committed(ckpt) == [1, 2, 3, 4, 5], error
    assert "since step 2" in error and named_checkpoints(error) == [1], error
    assert "start over with a lower optim.lr" in error, error


def test_the_advice_never_names_a_checkpoint_written_during_the_streak():
    """Each case of resume_advice on a streak that began at step 10 (checkpoints 10 and later hold the weights of step
    9, which every batch of the streak failed on)."""
    ckpt = Path("runs/r/checkpoints")
    older = resume_advice([4, 8, 10, 11], 10, ckpt)
    assert named_checkpoints(older) == [8] and "move checkpoints 10, 11 out of runs/r/checkpoints and relaunch" in older
    assert "may be bad" not in older and "with a lower optim.lr" in older
    assert "move" not in resume_advice([4, 8], 10, ckpt)  # nothing newer: a relaunch resumes from 8
    suspect = resume_advice([4, 8, 9, 10], 10, ckpt)
    assert named_checkpoints(suspect) == [9, 8] and "the very weights every batch failed on" in suspect, suspect
    assert "move checkpoints 9, 10 out of runs/r/checkpoints and relaunch to resume from the older" in suspect
    alone = resume_advice([9, 12], 10, ckpt)
    assert named_checkpoints(alone) == [9] and "no older checkpoint is kept: start over" in alone, alone
    none = resume_advice([10, 11], 10, ckpt)
    assert named_checkpoints(none) == [] and "No checkpoint was written before the streak began at step 10" in none
