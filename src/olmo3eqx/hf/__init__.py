"""`transformers` Olmo3 checkpoints <-> OLMo3: the Python API (load_hf, save_hf, logit_parity), in three parts.

- `olmo3eqx.hf.config_json`: config.json (every form it has carried) and the token ids beside it <-> ModelConfig;
- `olmo3eqx.hf.weights`: the safetensors tensors streamed one model leaf at a time, both ways (load_hf, save_hf);
- `olmo3eqx.hf.parity`: our logits against `transformers`' own Olmo3 forward (logit_parity; imports torch only
  when called).

The names below are the contract users and tools rely on (`from olmo3eqx.hf import load_hf`).
"""

from olmo3eqx.hf.config_json import read_hf_config
from olmo3eqx.errors import ConversionError
from olmo3eqx.hf.parity import logit_parity
from olmo3eqx.hf.weights import load_hf, save_hf

__all__ = ["ConversionError", "load_hf", "logit_parity", "read_hf_config", "save_hf"]
