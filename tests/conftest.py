"""Suite-wide setup: 8 simulated CPU devices (set before jax initialises), jaxtyping runtime checks through
pytest's --jaxtyping-packages (pyproject addopts).

The suite is dominated by XLA compile time, not by running tiny models, so XLA's backend optimisation is
turned down (3-4x faster compiles on this CPU). Tests compare computations compiled under the same flags.
"""

import os

os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
