"""Exit codes of the commands (docs/training.md); `--until-done` decides from them whether to relaunch."""

OK = 0
PARITY_FAILED = 1
"""convert.py: the converted model's logits are further from `transformers`' than --max-kl allows."""
BAD_INPUT = 2
"""Bad input (a missing file, a config that contradicts itself or a checkpoint): one sentence on stderr, nothing
lost. A relaunch would fail the same way."""
NONFINITE = 3
"""train.py: a non-finite loss or gradient norm; no checkpoint of the bad state was written."""
STORAGE = 74
"""train.py: a write to the run directory failed (disk full, quota, read-only or failing storage; EX_IOERR), the
free space cannot hold the next checkpoint, or a bucket or web server stayed unreachable past the retries
(olmo3eqx.storage): one sentence names the directory or URL and the last intact checkpoint. `--until-done` relaunches after its backoff, not at once: a relaunch resumes from that checkpoint
and stops again before training while the space is still missing."""
PREEMPTED = 75
"""train.py: stopped by SIGTERM/SIGINT after writing a checkpoint (EX_TEMPFAIL); relaunch to resume."""
