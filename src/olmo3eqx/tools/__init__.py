"""The command-line tools around the trainer: checkpoint conversion (convert), checkpoint evaluation (evaluate,
`python -m olmo3eqx.eval`), run comparison (compare, `python -m olmo3eqx.compare`), the lm-evaluation-harness
adapter (lm_eval_adapter), the `--until-done` supervisor (supervise) and the CPU host allocator re-exec
(hostmem)."""
