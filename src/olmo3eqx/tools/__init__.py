"""The command-line tools around the trainer, each installed as a console script by `pip install -e .`
(`[project.scripts]` in pyproject.toml) and runnable as `python -m olmo3eqx.tools.<module>`:

- convert (`olmo3eqx-convert`, also `python convert.py`): HF <-> orbax checkpoints, logit parity;
- evaluate (`olmo3eqx-eval`): held-out loss and downstream tasks of a checkpoint or of every kept checkpoint;
- compare (`olmo3eqx-compare`): two runs side by side, with the memorisation verdict;
- lm_eval_adapter: the "olmo3eqx" model of lm-evaluation-harness; lm_eval_cli (`olmo3eqx-lm-eval`): the harness's
  CLI with that model registered;
- supervise (train.py's `--until-done`), hostmem (train.py's host-allocator re-exec on CPU hosts), regenerate_mixes
  (`olmo3eqx-regenerate-mixes`: the shipped mix lists from the installed ai2-olmo-core).

The trainer itself is `olmo3eqx-train` (also `python train.py`), data preparation `olmo3eqx-prepare` (also
`python -m olmo3eqx.data.prepare`). Every command's entry point is wrapped by `olmo3eqx.exits.command`: the project's
errors, a missing file and a missing optional extra end as one sentence and the documented exit code.
"""
