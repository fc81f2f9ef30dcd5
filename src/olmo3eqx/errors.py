"""The project's error types, in one module every other can import (standard library and exits.py only, so config,
storage and the data code share them without importing each other).

Each derives from exits.CommandError and carries its exit code (`code`, BAD_INPUT unless it says otherwise), which
`exits.command` turns into one sentence on stderr and that status.
"""

from __future__ import annotations

from olmo3eqx import exits


class ConfigError(exits.CommandError, ValueError):
    """A configuration that contradicts itself or its input; the message names the field and the fix."""


class StorageError(exits.CommandError, RuntimeError):
    """A write to the run's storage failed (disk full, quota, I/O error), its free space cannot hold the next
    checkpoint, a store stayed unreachable past the retries (the run's lease too), or a read stayed short: the
    command stops with exits.STORAGE; the committed checkpoints are intact."""

    code = exits.STORAGE


class DataError(exits.CommandError, ValueError):
    """Bad data or data config; the message names the file or field and the fix."""


class ChatTemplateMismatch(DataError):
    """A chat template other than the one a checkpoint's data was prepared with (olmo3eqx.data.template_record): the
    model would be asked in a format it was not fine-tuned on."""


class TaskError(DataError):
    """A task that cannot be read or scored; the message names the task (or file and line) and the fix."""


class CheckpointLoadError(exits.CommandError, RuntimeError):
    """Every checkpoint in a run directory failed to load: never start from scratch over them."""


class CheckpointOutOfMemory(exits.CommandError):
    """Restoring a checkpoint ran out of device or host memory; the checkpoint is intact and kept. A relaunch on the
    same devices would run out the same way: bad input (more devices, or more memory)."""

    code = exits.BAD_INPUT


class ConversionError(exits.CommandError, ValueError):
    """An HF checkpoint, or a pairing of checkpoints, that cannot be converted; the message names the thing."""


class GenerationError(exits.CommandError, ValueError):
    """Bad input to generation (an empty prompt, an id outside the vocabulary, too long, no tokenizer)."""


class RunLocked(exits.CommandError):
    """Another live trainer holds the run directory, or has taken its lease over (exit code 2: a relaunch would stop
    the same way). A lease lost because the store was away is a StorageError instead (olmo3eqx.runlock)."""
