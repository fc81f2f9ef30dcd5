"""The suite's persistent compilation cache (tests/conftest.py) cannot change a result: JAX keys each entry on the
program, so the same program hits and a change to the model's code misses; a compile that reads its own XLA dump skips
the cache (olmo3eqx.compile_cache.uncached); a train.py run, and the README's default run, on a warm cache log the losses of
the same run on a cold one (-m slow: .ci/run's shares run them)."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from olmo3eqx import model as model_module
from olmo3eqx.compile_cache import uncached
from olmo3eqx.config import FULL, SLIDING, ModelConfig
from olmo3eqx.model import init_model
from test_readme_run import EVAL, REPO, TOLERANCE, readme_losses
from test_train import CONFIG, command, env, losses

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    layer_types=(SLIDING, FULL), num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    sliding_window=4, eos_token_id=1, pad_token_id=2, compute_dtype="float32")


class CacheLog(logging.Handler):
    """The persistent cache's hits and misses, by module name, as JAX's compiler logs them (at DEBUG)."""

    PATTERN = re.compile(r"^(Persistent compilation cache hit|PERSISTENT COMPILATION CACHE MISS) for '([^']+)'")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, str]] = []

    def emit(self, record):
        found = self.PATTERN.match(record.getMessage())
        if found:
            self.seen.append(("hit" if found.group(1).endswith("hit") else "miss", found.group(2)))

    def of(self, module: str) -> list[str]:
        return [kind for kind, name in self.seen if name == module]


@pytest.fixture
def cache_log():
    logger = logging.getLogger("jax._src.compiler")
    handler, level = CacheLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def forward(model, tokens):
    return model(tokens)


def compile_forward(model) -> None:
    """Compile the model's forward from scratch: JAX's in-memory caches are dropped first, so the persistent cache is
    asked (its module: jit_forward)."""
    jax.clear_caches()
    jax.jit(forward).lower(model, jax.ShapeDtypeStruct((2, 8), jnp.int32)).compile()


def rotate_half_by_roll(x):
    """The same rotation written differently (a roll and a sign): a change to the model's code that leaves its numbers
    as they were."""
    half = x.shape[-1] // 2
    return jnp.roll(x, half, axis=-1) * jnp.concatenate([-jnp.ones(half, x.dtype), jnp.ones(half, x.dtype)])


def test_the_suite_runs_with_a_fresh_persistent_cache():
    cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert cache == os.environ["OLMO3EQX_SUITE_COMPILATION_CACHE"] and Path(cache).is_dir()
    assert jax.config.jax_compilation_cache_dir == cache and jax.config.jax_persistent_cache_min_compile_time_secs == 0
    # no size limit, so no eviction: JAX's LRU mode would write an access time beside every entry and read them all
    # on every write (quadratic over the suite's thousands of entries; tests/conftest.py has the timings)
    jax.jit(sin_product).lower(jnp.ones((3, 5))).compile()
    assert any(Path(cache).glob("*-cache")) and not any(Path(cache).glob("*-atime")), sorted(os.listdir(cache))[:6]


def test_the_same_program_hits_and_a_change_to_the_model_s_code_misses(cache_log, monkeypatch):
    model = init_model(MODEL, jax.random.key(0))
    compile_forward(model)
    compile_forward(model)
    monkeypatch.setattr(model_module, "rotate_half", rotate_half_by_roll)
    compile_forward(model)
    # the first compile may hit an entry an earlier test left; the second must, the changed code must not
    assert cache_log.of("jit_forward")[1:] == ["hit", "miss"], cache_log.seen


def sin_product(x):
    return jnp.sin(x) @ x.T


def test_a_compile_that_reads_its_dump_skips_the_cache(cache_log, tmp_path):
    x = jnp.ones((16, 16))
    jax.jit(sin_product).lower(x).compile()  # now in the cache
    jax.clear_caches()
    with uncached():
        options = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "all-reduce-promotion"}
        jax.jit(sin_product).lower(x).compile(options)
    assert list(tmp_path.glob("*before_all-reduce-promotion*")), sorted(p.name for p in tmp_path.iterdir())
    jax.clear_caches()
    jax.jit(sin_product).lower(x).compile()
    # compiled (miss or hit), not asked inside the block, asked again (a hit) after it
    assert len(cache_log.of("jit_sin_product")) == 2 and cache_log.of("jit_sin_product")[1] == "hit", cache_log.seen


def entries(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()}


@pytest.mark.slow  # two train.py runs (~25 s); the README run below is the full-size proof
def test_a_warm_cache_logs_the_losses_of_a_cold_one(tmp_path):
    """The same train.py run twice on one fresh cache: the first compiles and writes every program, the second writes
    nothing new (every compile came from the cache) and logs bit-identical losses."""
    cfg = tmp_path / "e2e.yaml"
    cfg.write_text(CONFIG.replace("CACHE", str(tmp_path / "corpus")).replace("steps: 12", "steps: 2"))
    cache = tmp_path / "xla-cache"
    cache.mkdir()
    runs = {}
    written = []
    for name in ("cold", "warm"):
        e = env(4) | {"JAX_COMPILATION_CACHE_DIR": str(cache)}
        p = subprocess.run(command(cfg, tmp_path / name), env=e, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = losses(tmp_path / name)
        written.append(entries(cache))
    assert written[0] and written[1] == written[0], written[1] - written[0]
    assert sorted(runs["cold"]) == [1, 2] and runs["warm"] == runs["cold"], runs



@pytest.mark.slow  # the README's default run twice (~6 minutes on 2 cores)
def test_the_readme_run_prints_the_same_losses_from_a_warm_cache(tmp_path):
    """`python train.py` (the README's default run) on a fresh cache, then again on the cache it filled: the second
    compiles nothing (no entry is added) and prints the first's held-out losses to the last digit, both within the
    README's gate."""
    cache = tmp_path / "xla-cache"
    cache.mkdir()
    printed, written = [], []
    for name in ("cold", "warm"):
        p = subprocess.run([sys.executable, "train.py", "--run.dir", str(tmp_path / name)], cwd=REPO,
                           env=os.environ | {"JAX_COMPILATION_CACHE_DIR": str(cache)}, capture_output=True, text=True,
                           timeout=3600)
        assert p.returncode == 0, p.stderr[-3000:]
        printed.append({int(step): loss for step, loss in EVAL.findall(p.stdout + p.stderr)})
        written.append(entries(cache))
    assert written[0] and written[1] == written[0], written[1] - written[0]
    want = readme_losses()
    assert printed[0].keys() == want.keys() and printed[1] == printed[0], printed
    assert all(abs(float(printed[0][s]) - want[s]) <= TOLERANCE for s in want), (printed[0], want)
