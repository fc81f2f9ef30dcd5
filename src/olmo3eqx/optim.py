"""AdamW with float32 moments, the OLMo 3 learning-rate schedules, the decay mask and the spike guard.

Step convention (README "Checkpoints and exact resume"): step `s` is 1-based and applies update `s`. `lr_schedule(cfg, T)(s)` is the
learning rate of step `s`, the value the trainer logs as `train/lr` at step `s`, and the optimizer is
handed that same step (`opt.update(grads, state, params, step=s)`), so the applied and the logged LR are
one function of one number. The LR deliberately does not come from a counter inside the optimizer state:
a step skipped by the spike guard leaves the whole optimizer state untouched but still advances the
trainer's step (as in OLMo-core, whose scheduler follows the trainer), and stage 2 resets the step while
keeping stage 1's moments and Adam's bias-correction count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree

from olmo3eqx.config import ConfigError, OptimConfig

T = TypeVar("T")


# --- learning rate ---------------------------------------------------------------------------------


def lr_schedule(cfg: OptimConfig, total_steps: int) -> Callable[[Int[ArrayLike, ""]], Float[Array, ""]]:
    """The learning rate of 1-based step `s`, for a run of `total_steps` steps.

    Warmup (W = cfg.warmup_steps > 0): `lr * s / W` for s <= W, so step 1 has lr/W and step W the peak.
    Then with progress `p = (s - W) / (total_steps - W)` (clipped to [0, 1]) and `r = cfg.final_lr_ratio`:
      cosine: `lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)`, one half-cosine from lr at step W to r * lr
              at step total_steps;
      linear: `lr * (1 - (1 - r) * p)`, a straight line from lr at step W to r * lr at step total_steps.
    Stage 2 (W = 0, linear, r = 0): step 1 has lr * (1 - 1/T) and the last step T has exactly 0.
    Steps past total_steps keep the final value; a run no longer than its warmup ends inside it.
    Accepts a Python int or a traced integer.
    """
    peak, warmup, final = cfg.lr, cfg.warmup_steps, cfg.final_lr_ratio
    decay_steps = max(total_steps - warmup, 1)

    def lr_at(step: Int[ArrayLike, ""]) -> Float[Array, ""]:
        s = jnp.asarray(step, jnp.float32)
        # Fraction of the decay still ahead, from integer differences (exact in float32 below 2^24
        # steps), so the last steps of a long run keep their relative precision.
        q = jnp.clip((total_steps - s) / decay_steps, 0.0, 1.0)
        if cfg.schedule == "cosine":
            decayed = final + (1.0 - final) * jnp.sin(0.5 * math.pi * q) ** 2  # = (1 + cos(pi * p)) / 2
        else:
            decayed = final + (1.0 - final) * q
        if warmup > 0:
            decayed = jnp.where(s <= warmup, s / warmup, decayed)
        return (peak * decayed).astype(jnp.float32)

    return lr_at


def scale_by_step_lr(lr_at: Callable[[Int[ArrayLike, ""]], Float[Array, ""]]) -> optax.GradientTransformationExtraArgs:
    """Multiply updates by `-lr_at(step)`, where `step` (1-based) is an extra argument of `update`."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, step=None, **extra):
        del params, extra
        if step is None:
            raise TypeError("The olmo3eqx optimizer needs the 1-based step: call "
                            "opt.update(grads, opt_state, params, step=s), the step whose LR is logged.")
        lr = lr_at(step)
        return jax.tree.map(lambda u: -lr * u, updates), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --- weight decay mask -----------------------------------------------------------------------------


def decay_mask(params: PyTree, patterns: Sequence[str]) -> PyTree[bool]:
    """True for every leaf to decay: those whose path (`jax.tree_util.keystr`, e.g. `.embed.weight`)
    contains none of `patterns`. A pattern that matches no path is an error (a renamed module would
    otherwise be decayed silently)."""
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    unused = [p for p in patterns if not any(p in path for path in paths)]
    if unused:
        raise ConfigError(f"optim.no_decay patterns {unused} match no parameter path (paths look like "
                          f"{paths[:3]}); fix the patterns or set optim.no_decay to [].")
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(p in jax.tree_util.keystr(path) for p in patterns), params)


# --- the optimizer ---------------------------------------------------------------------------------


def _to_float32(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Run `inner` entirely in float32: its state is initialised from float32 copies of the params (so
    every moment is float32, whatever the param dtype), gradients and params are upcast on the way in,
    and the updates are cast back to each param's dtype on the way out (so `eqx.apply_updates` and
    `optax.apply_updates` keep bf16 params bf16)."""
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return inner.init(_to_float32(params))

    def update_fn(updates, state, params=None, **extra):
        like = updates if params is None else params
        new, state = inner.update(_to_float32(updates), state,
                                  None if params is None else _to_float32(params), **extra)
        return jax.tree.map(lambda u, p: u.astype(p.dtype), new, like), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformationExtraArgs:
    """OLMo's AdamW: clip by global norm (cfg.clip_grad_norm; 0 disables), Adam with float32 moments,
    decoupled weight decay `lr * wd * w` on every parameter whose path contains none of cfg.no_decay,
    LR from `lr_schedule`. Update with `opt.update(grads, state, params, step=s)`, s the 1-based step."""
    parts = []
    if cfg.clip_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_grad_norm))
    parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
    if cfg.weight_decay > 0:
        parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=lambda p: decay_mask(p, cfg.no_decay)))
    parts.append(scale_by_step_lr(lr_schedule(cfg, total_steps)))
    return in_float32(optax.chain(*parts))


def global_norm(tree: PyTree) -> Float[Array, ""]:
    """L2 norm of all floating leaves, accumulated in float32 (the `train/grad_norm`, before clipping)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)).astype(jnp.float32)


# --- spike guard -----------------------------------------------------------------------------------


def spike_min_history(window: int) -> int:
    """Earlier values the guard needs before it judges a step: OLMo-core judges once its list, which
    includes the current value, holds max(20, window // 2) values."""
    return max(20, window // 2) - 1


class SpikeGuardState(eqx.Module):
    """Ring buffers of the last `window` recorded losses and grad norms; `count` values recorded so far."""

    losses: Float[Array, " window"]
    grad_norms: Float[Array, " window"]
    count: Int[Array, ""]

    @staticmethod
    def init(window: int) -> SpikeGuardState:
        zeros = jnp.zeros((window,), jnp.float32)
        return SpikeGuardState(losses=zeros, grad_norms=zeros, count=jnp.zeros((), jnp.int32))


def _outlier(history: Float[Array, " window"], valid: Bool[Array, " window"], n: Int[Array, ""],
             value: Float[Array, ""], sigma: float) -> Bool[Array, ""]:
    n_f = n.astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, history, 0.0)) / jnp.maximum(n_f, 1.0)
    var = jnp.sum(jnp.where(valid, (history - mean) ** 2, 0.0)) / jnp.maximum(n_f - 1.0, 1.0)
    return value - mean > sigma * jnp.sqrt(var)


def spike_check(state: SpikeGuardState, loss: Float[Array, ""], grad_norm: Float[Array, ""], *,
                sigma: float, window: int) -> tuple[Bool[Array, ""], SpikeGuardState]:
    """OLMo-core's spike guard as a pure function: `skip` is True when `loss` or `grad_norm` exceeds the
    mean of the last `window` recorded values by more than `sigma` (unbiased) standard deviations.

    - Warm-up: nothing finite is skipped until `spike_min_history(window)` values are recorded (63 at
      window 128, 19 at window <= 40), OLMo-core's max(20, window // 2) counting the current value.
    - Every finite step is recorded, skipped or not, as OLMo-core does: a lasting shift of the loss level
      is accepted after a few steps instead of stalling training forever.
    - A non-finite loss or grad norm is always skipped (also during warm-up) and never recorded, so one
      NaN neither enters the weights nor poisons the statistics.
    """
    if state.losses.shape != (window,):
        raise ConfigError(f"Spike guard state holds {state.losses.shape[0]} values but optim.spike_window is "
                          f"{window}; build it with SpikeGuardState.init(optim.spike_window).")
    loss = loss.astype(jnp.float32)
    grad_norm = grad_norm.astype(jnp.float32)
    n = jnp.minimum(state.count, window)
    valid = jnp.arange(window) < n
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    spike = (_outlier(state.losses, valid, n, loss, sigma)
             | _outlier(state.grad_norms, valid, n, grad_norm, sigma))
    skip = ~finite | ((n >= spike_min_history(window)) & spike)
    slot = state.count % window
    recorded = SpikeGuardState(
        losses=state.losses.at[slot].set(loss),
        grad_norms=state.grad_norms.at[slot].set(grad_norm),
        count=state.count + 1,
    )
    return skip, apply_unless_skipped(~finite, recorded, state)


def apply_unless_skipped(skip: Bool[ArrayLike, ""], new_tree: T, old_tree: T) -> T:
    """`old_tree` where `skip`, else `new_tree`, leaf by leaf (jit-friendly; non-array leaves from new)."""
    return jax.tree.map(lambda n, o: jnp.where(skip, o, n) if eqx.is_array(n) else n, new_tree, old_tree)
