"""`--log.profile-steps A:B`: a `jax.profiler` trace of train steps A..B (1-based, inclusive) in run_dir/profile/,
on every backend. Open it in TensorBoard's profile plugin (`tensorboard --logdir runs/NAME/profile`, with
`pip install tensorboard-plugin-profile`) or load the `*.trace.json.gz` it writes on ui.perfetto.dev. With the run
directory in a bucket the trace is written to a local temporary directory and uploaded when it stops."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from olmo3eqx import storage


class StepProfiler:
    """Call with (step, state) before step `step` runs: it starts the trace before step A (once the state that step
    reads is computed, so earlier steps stay out of it) and stops it before step B + 1, or when the `with` block
    ends inside the range."""

    def __init__(self, steps: tuple[int, int] | None, directory: str | Path, note):
        self.steps, self.directory, self.note = steps, str(directory), note
        self.active = False
        self._local: str | None = None

    def __enter__(self):
        return self

    def __call__(self, step: int, state) -> None:
        if self.steps is None:
            return
        import jax

        first, last = self.steps
        if step == first:
            jax.block_until_ready(state)
            self._local = tempfile.mkdtemp(prefix="olmo3eqx-profile-") if storage.is_url(self.directory) else None
            jax.profiler.start_trace(self._local or self.directory, create_perfetto_trace=True)
            self.active = True
        elif step == last + 1 and self.active:
            jax.block_until_ready(state)
            self._stop()

    def _stop(self) -> None:
        import jax

        jax.profiler.stop_trace()
        self.active = False
        if self._local is not None:
            storage.upload_tree(self._local, self.directory)
            shutil.rmtree(self._local, ignore_errors=True)
            self._local = None
        self.note(f"profile of steps {self.steps[0]}-{self.steps[1]} written to {self.directory}")

    def __exit__(self, *exc):
        if self.active:  # the run ended inside the range; its last metrics were fetched, so the device work is done
            self._stop()
