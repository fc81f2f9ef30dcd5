"""`--log.profile-steps A:B`: a jax.profiler trace of those train steps lands in run_dir/profile/, readable by
TensorBoard's profile plugin (xplane.pb) and Perfetto (trace.json.gz); a malformed range stops with exit code 2."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from olmo3eqx.train import main

SMALL = ["--model.num-hidden-layers", "2", "--model.hidden-size", "32", "--model.intermediate-size", "64",
         "--model.num-attention-heads", "2", "--model.num-key-value-heads", "2", "--model.head-dim", "16",
         "--data.seq-len", "32", "--data.global-batch", "8", "--eval.every", "0", "--log.no-progress",
         "--log.no-tensorboard"]


def test_profile_of_the_chosen_steps_is_written(tmp_path, capsys):
    tokens = tmp_path / "tokens.npy"
    np.random.default_rng(0).integers(0, 256, 32 * 8 * 6, dtype=np.uint16).tofile(tokens)
    argv = [*SMALL, "--data.paths", str(tokens), "--run.dir", str(tmp_path), "--run.name", "p", "--steps", "4",
            "--log.profile-steps", "2:3"]
    assert main(argv) == 0
    profile = tmp_path / "p" / "profile"
    assert f"profile of steps 2-3 written to {profile}" in capsys.readouterr().err
    assert list(profile.rglob("*.xplane.pb")), "no TensorBoard profile"
    (trace,) = profile.rglob("*.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    steps = [n for n in names if "train_step" in n]
    assert steps, "the traced steps' executions should be in the trace"


@pytest.mark.parametrize("spec", ["3:2", "0:2", "2", "a:b"])
def test_malformed_range_stops_with_exit_code_2(spec, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:  # tyro reports a config error raised while parsing the flags
        main(["--log.profile-steps", spec, "--run.dir", str(tmp_path)])
    assert stop.value.code == 2
    assert "log.profile_steps must be 'A:B'" in " ".join(capsys.readouterr().err.split())
