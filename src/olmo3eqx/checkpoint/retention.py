"""Which checkpoints of a training run survive a save, and the permanence each one is written with.

A checkpoint is permanent or ephemeral from the moment it is written: the decision (Retention.permanent: a multiple of
checkpoint.every, or the run's last step) is recorded in the step's orbax metadata (STEP_METADATA's custom_metadata,
{"permanent": true|false}), committed with the step, locally or in a bucket, and read back by a later launch. Raising
--steps, or changing checkpoint.every, then never turns a permanent checkpoint ephemeral (nor the reverse). A step
written before the record existed has none: its status is decided as it always was, by the current launch's
checkpoint.every and last step.
"""

from __future__ import annotations

import dataclasses

from olmo3eqx.checkpoint.layout import step_custom_metadata
from olmo3eqx.storage import StorePath

PERMANENT = "permanent"
"""The key of a training checkpoint's custom metadata that records its permanence."""


def recorded_permanence(step_dir: StorePath) -> bool | None:
    """The permanence `step_dir` was written with; None when it has no record (a step written before the record
    existed, or a converted checkpoint)."""
    value = step_custom_metadata(step_dir).get(PERMANENT)
    return value if isinstance(value, bool) else None


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which committed steps survive a save (an orbax PreservationPolicy): the newest `keep` permanent steps, every
    multiple of `keep_every`, and the newest step of all. With `permanent_every` (checkpoint.every when ephemeral
    checkpoints are on) only multiples of it and `last_step` are written permanent: any other step (an ephemeral save,
    a preemption's) survives only while it is the newest, so it never pushes a permanent one out of `keep`. 0: every
    step is permanent (orbax's max_to_keep and keep_period). A step's permanence is the one recorded when it was
    written (`record`, read back from `directory`), else decided now. orbax asks after it has listed the step being
    saved, and deletes what this drops only once that step is committed (asynchronously in its finalize thread, after
    the commit): a crash in between leaves the older step too, never no checkpoint."""

    keep: int
    keep_every: int = 0
    permanent_every: int = 0
    last_step: int | None = None
    directory: StorePath | None = None
    """Where the steps are, to read each one's record; None: no step has one."""
    recorded: dict[int, bool] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Each step's permanence, as written by this launch or read back (a step's record never changes)."""

    def permanent(self, step: int) -> bool:
        """Whether a checkpoint of `step` written now is permanent."""
        return not self.permanent_every or step % self.permanent_every == 0 or step == self.last_step

    def record(self, step: int) -> dict:
        """Decide the permanence of `step`, about to be written: orbax's custom metadata to save it with."""
        self.recorded[step] = self.permanent(step)
        return {PERMANENT: self.recorded[step]}

    def is_permanent(self, step: int) -> bool:
        """As recorded when `step` was written; a step without a record (written before the record existed) is
        decided as it always was, by `permanent` now."""
        if step not in self.recorded:
            found = recorded_permanence(self.directory / str(step)) if self.directory is not None else None
            self.recorded[step] = self.permanent(step) if found is None else found
        return self.recorded[step]

    def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
        steps = [info.step for info in checkpoints]
        newest = max(steps, default=None)
        kept = set(sorted(s for s in steps if self.is_permanent(s))[-self.keep:])
        return [s in kept or s == newest or (self.keep_every > 0 and s % self.keep_every == 0) for s in steps]
