"""Orbax checkpoints: one `Composite` per saved step, the train state saved and restored as one tree.

The package, one job a module, each importing only those before it:
`layout` (a checkpoint directory's steps and parts, the model config a step stores), `failures` (what an exception in
a checkpoint's write or restore means), `retention` (which steps survive a save), `model` (the model alone: saved for
conversion, loaded for init_from, evaluation, generation and conversion), `checkpointer` (the training checkpointer).
The project's modules import each name from the module that owns it; the names below stay importable from here
(`olmo3eqx.checkpoint.load_model(ckpt_dir) -> (OLMo3, ModelConfig)`, `olmo3eqx.checkpoint.load_any`, ...).
"""

from olmo3eqx.checkpoint.layout import (  # noqa: F401
    STATE, COMMITTED, checkpoint_dir, is_remote, is_complete_step, complete_steps, resolve_step_dir, read_config,
    model_config_from_dict, COMPUTE_ONLY_FIELDS, model_config_mismatch, check_model_config,
)
from olmo3eqx.checkpoint.failures import (  # noqa: F401
    TENSORSTORE_ERRNO, STORAGE_ERRNOS, TENSORSTORE_UNREACHABLE, remote_failure, storage_errno, RESTORE_OUTCOMES,
    TENSORSTORE_STATUS, STATUS_OUTCOMES, OUT_OF_MEMORY, restore_failure, restore_error,
)
from olmo3eqx.checkpoint.retention import Retention  # noqa: F401
from olmo3eqx.checkpoint.model import (  # noqa: F401
    CHUNK_BYTES, save_model, save_model_leaves, saved_parts, restore_parts, VOCAB_AXIS, restore_model, StateReader,
    restore_model_leaf, open_model, load_model, Loaded, speaking_config, load_any, INIT_FROM_CHANGEABLE, init_from,
    pad_vocabulary,
)
from olmo3eqx.checkpoint.checkpointer import (  # noqa: F401
    TRAIN_ITEMS, TORN, UNREADABLE, agreed_steps, agree, tree_bytes, format_bytes, directory_bytes,
    QuietStorageFailures, Checkpointer,
)
