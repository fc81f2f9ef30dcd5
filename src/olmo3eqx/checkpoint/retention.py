"""Which checkpoints of a training run survive a save."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which committed steps survive a save (an orbax PreservationPolicy): the newest `keep` permanent steps, every
    multiple of `keep_every`, and the newest step of all. With `permanent_every` (checkpoint.every when ephemeral
    checkpoints are on) only multiples of it and `last_step` are permanent: any other step (an ephemeral save, a
    preemption's) survives only while it is the newest, so it never pushes a permanent one out of `keep`. 0: every
    step is permanent (orbax's max_to_keep and keep_period). orbax asks after it has listed the step being saved, and
    deletes what this drops only once that step is committed (asynchronously in its finalize thread, after the
    commit): a crash in between leaves the older step too, never no checkpoint."""

    keep: int
    keep_every: int = 0
    permanent_every: int = 0
    last_step: int | None = None

    def permanent(self, step: int) -> bool:
        return not self.permanent_every or step % self.permanent_every == 0 or step == self.last_step

    def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
        steps = [info.step for info in checkpoints]
        newest = max(steps, default=None)
        kept = set(sorted(s for s in steps if self.permanent(s))[-self.keep:])
        return [s in kept or s == newest or (self.keep_every > 0 and s % self.keep_every == 0) for s in steps]
