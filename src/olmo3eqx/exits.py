"""Exit codes of the commands (README "Exit codes"); `--until-done` decides from them whether to relaunch."""

OK = 0
PARITY_FAILED = 1
"""convert.py: the converted model's logits are further from `transformers`' than --max-kl allows."""
BAD_INPUT = 2
"""Bad input (a missing file, a config that contradicts itself or a checkpoint): one sentence on stderr, nothing
lost. A relaunch would fail the same way."""
NONFINITE = 3
"""train.py: a non-finite loss or gradient norm; no checkpoint of the bad state was written."""
PREEMPTED = 75
"""train.py: stopped by SIGTERM/SIGINT after writing a checkpoint (EX_TEMPFAIL); relaunch to resume."""
