"""Suite-wide setup: 8 simulated CPU devices (set before jax initialises), float32 default, jaxtyping
runtime checks through pytest's --jaxtyping-packages (pyproject addopts)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
