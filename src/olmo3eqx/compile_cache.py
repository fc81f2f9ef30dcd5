"""JAX's persistent compilation cache, where a compile must not use it (below aot and costmodel, which both compile
for compile-only topologies)."""

from __future__ import annotations

import contextlib


def compile_only(devices) -> bool:
    """`devices` are a compile-only topology's (libtpu's or the CUDA plugin's, jax.experimental.topologies): JAX's
    persistent compilation cache can store their executables but not load one back (there is no client to load it
    into: JAX warns "PjRtCompiler must be constructed with a Client" and compiles again), so their compiles skip it."""
    return type(devices[0].client).__name__ == "CompileOnlyPyClient"


@contextlib.contextmanager
def uncached():
    """Compiles inside this block skip JAX's persistent compilation cache (jax_compilation_cache_dir: the test suite
    sets one, a user may): its key leaves out XLA's dump options, so a cached executable would come back without the
    dump a compile asks for (CPU_DUMP). A compile that reads its own dump runs here."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if not jax.config.jax_enable_compilation_cache:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is used; ask it again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()
