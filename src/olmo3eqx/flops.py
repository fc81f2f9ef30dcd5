"""Exact parameter count, training FLOPs per token (sliding-window attention counted as windowed, and the
MaxText all-global convention beside it), and MFU against a per-device peak."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from olmo3eqx.config import SLIDING, ModelConfig


def param_count(cfg: ModelConfig) -> int:
    d, n, k, h, f, v = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    attn = d * n * h + 2 * d * k * h + n * h * d + n * h + k * h  # q, k, v, o projections; q/k norms
    block = attn + 3 * d * f + 2 * d  # SwiGLU; the two post-sublayer norms
    return cfg.num_hidden_layers * block + 2 * v * d + d  # untied embedding and LM head; final norm


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights every token multiplies by (the embedding lookup and norms are not matmuls)."""
    d, n, k, h, f, v = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    return cfg.num_hidden_layers * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f) + d * v


def mean_keys(seq_len: int, window: int | None) -> float:
    """Average keys a query attends to under a causal mask: seq/2 globally (the usual convention), and
    W - W^2 / (2 seq) for a window of W keys shorter than the sequence (which meets seq/2 at W = seq)."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, window_aware: bool = True) -> float:
    """Forward QK^T and PV: 2 matmuls x 2 FLOPs x heads x head_dim x keys attended, summed over layers."""
    total = 0.0
    for t in cfg.resolved_layer_types:
        window = cfg.sliding_window if (window_aware and t == SLIDING) else None
        total += 4 * cfg.num_attention_heads * cfg.head_dim * mean_keys(seq_len, window)
    return total


def train_flops_per_token(cfg: ModelConfig, seq_len: int, window_aware: bool = True) -> float:
    """3 x forward (backward = 2 x forward)."""
    forward = 2 * matmul_params_per_token(cfg) + attention_flops_per_token(cfg, seq_len, window_aware)
    return 3 * forward


# Dense bf16 peak FLOP/s per device, matched by substring of `jax.Device.device_kind` (lower case).
PEAK_FLOPS = (
    ("h200", 989e12),
    ("h100", 989e12),
    ("gh200", 989e12),
    ("a100", 312e12),
    # Ironwood: 2,307 TFLOP/s bf16 per chip, and JAX shows each chip as two devices (one per TensorCore); the
    # reproduction's 44.5% MFU at 510-513 TFLOP/s per device is against this half. XLA:TPU's cost model agrees: an
    # 8192^3 bf16 matmul on 4 tpu7x devices predicts 880 TFLOP/s per device (76%; v5p: 79% of 459).
    ("tpu7", 1153.5e12),
    ("tpu v7", 1153.5e12),
    ("v6 lite", 918e12),
    ("v6e", 918e12),
    ("v5p", 459e12),
    ("v5 lite", 197e12),
    ("v5e", 197e12),
    ("tpu v5", 459e12),
    ("tpu v4", 275e12),
)


def measure_matmul_flops(n: int = 2048, repeats: int = 20, min_seconds: float = 2.0) -> float:
    """Best float32 n x n x n matmul FLOP/s of JAX's CPU device over at least `repeats` runs and `min_seconds`.
    The best run, not the mean: load from other processes only ever slows a run down."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best, runs, start = float("inf"), 0, time.perf_counter()
    while runs < repeats or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
        runs += 1
    return 2 * n**3 / best


def cpu_peak_flops(cache_dir: str | os.PathLike = "~/.cache/olmo3eqx", n: int = 2048, refresh: bool = False) -> float:
    """Measured float32 matmul FLOP/s of this CPU (all cores, as JAX uses them), cached per host; `refresh`
    measures again and keeps the higher of the new and the cached figure (a loaded machine measures low).
    To start over, delete ~/.cache/olmo3eqx/cpu_peak_*.json and run when `uptime` shows an idle machine."""
    path = Path(cache_dir).expanduser() / f"cpu_peak_{os.uname().nodename}_{os.cpu_count()}.json"
    cached = float(json.loads(path.read_text())["flops"]) if path.is_file() else None
    if cached is not None and not refresh:
        return cached
    flops = measure_matmul_flops(n)
    if cached is None or flops > cached:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"flops": flops, "n": n}))
    return flops if cached is None else max(flops, cached)


def mfu_label(device) -> str:
    """What the progress bar calls perf/mfu on `device`: 'mfu' over an accelerator's bf16 peak; on the CPU
    'mfu_vs_matmul', since the peak there is the best fp32 2048^3 matmul this machine measured, not a hardware peak."""
    return "mfu_vs_matmul" if device.platform == "cpu" else "mfu"


def peak_flops(device) -> float | None:
    """Peak FLOP/s of one device: the bf16 table for accelerators, a measured fp32 peak for the CPU."""
    if device.platform == "cpu":
        return cpu_peak_flops()
    kind = device.device_kind.lower()
    for key, value in PEAK_FLOPS:
        if key in kind:
            return value
    return None


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int, peak_per_device: float | None) -> float | None:
    if not peak_per_device:
        return None
    return tokens_per_s * flops_per_token / (num_devices * peak_per_device)
