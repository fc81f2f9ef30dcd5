"""AdamW with float32 moments, the OLMo 3 learning-rate schedules, the decay mask and the spike guard.

Step convention (docs/checkpoints.md): step `s` is 1-based and applies update `s`. `lr_schedule(cfg, T)(s)` is the
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

from olmo3eqx.config import OptimConfig
from olmo3eqx.errors import ConfigError

T = TypeVar("T")


# --- learning rate ---------------------------------------------------------------------------------


# AI2's stage-1 run (OLMo-core src/scripts/official/OLMo3/OLMo-3-1025-7B-pretrain-1.py and -pretrain-2.py): planned
# as one cosine over 5T tokens, extended at step 597,046 to a half-cosine ending at 7T tokens, stopped at the end
# of the epoch (step 1,413,814). OLMo-core turns a token duration into steps with ceil(tokens / batch tokens).
OLMO3_STAGE1_BATCH_TOKENS = 512 * 8192
"""GLOBAL_BATCH_SIZE of both stage-1 scripts (tokens per step)."""
OLMO3_STAGE1_PLANNED_TOKENS = 5 * 10**12
"""pretrain-1.py's max_duration: the cosine CosWithWarmup ran over."""
OLMO3_STAGE1_EXTENDED_TOKENS = 7 * 10**12
"""pretrain-2.py's max_duration: the end of the HalfCosWithWarmup that replaced it."""
OLMO3_STAGE1_COSINE_STEPS = -(-OLMO3_STAGE1_PLANNED_TOKENS // OLMO3_STAGE1_BATCH_TOKENS)  # 1,192,093
OLMO3_STAGE1_HALF_COSINE_STEPS = -(-OLMO3_STAGE1_EXTENDED_TOKENS // OLMO3_STAGE1_BATCH_TOKENS)  # 1,668,931


def olmo3_stage1_switch_step(warmup_steps: int) -> int:
    """The step from which AI2's half-cosine applies: pretrain-2.py's HalfCosWithWarmup warmup,
    `original_max_steps // 2 + original_warmup_steps // 2` with original_max_steps = 5T // batch tokens
    (597,046 for a 2000-step warmup): the middle of the original cosine, where both curves are at
    (1 + final_lr_ratio) / 2 of the peak."""
    return (OLMO3_STAGE1_PLANNED_TOKENS // OLMO3_STAGE1_BATCH_TOKENS) // 2 + warmup_steps // 2


def lr_schedule(cfg: OptimConfig, total_steps: int) -> Callable[[Int[ArrayLike, ""]], Float[Array, ""]]:
    """The learning rate of 1-based step `s`, for a run of `total_steps` steps.

    Warmup (W = cfg.warmup_steps, or round(cfg.warmup_fraction * total_steps) as OLMo-core rounds it, > 0):
    `lr * s / W` for s <= W, so step 1 has lr/W and step W the peak.
    Then with progress `p = (s - W) / (total_steps - W)` (clipped to [0, 1]) and `r = cfg.final_lr_ratio`:
      cosine: `lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)`, one half-cosine from lr at step W to r * lr
              at step total_steps;
      linear: `lr * (1 - (1 - r) * p)`, a straight line from lr at step W to r * lr at step total_steps;
      olmo3-stage1: AI2's stage-1 curve, whatever total_steps: OLMo-core's CosWithWarmup over
              OLMO3_STAGE1_COSINE_STEPS before `olmo3_stage1_switch_step(W)`, its HalfCosWithWarmup ending at
              OLMO3_STAGE1_HALF_COSINE_STEPS from there (r * lr after that).
    Stage 2 (W = 0, linear, r = 0): step 1 has lr * (1 - 1/T) and the last step T has exactly 0.
    Steps past the end keep the final value; a run no longer than its warmup ends inside it.
    Accepts a Python int or a traced integer.
    """
    peak, final = cfg.lr, cfg.final_lr_ratio
    warmup = cfg.warmup_steps if cfg.warmup_fraction is None else round(cfg.warmup_fraction * total_steps)
    if cfg.schedule == "olmo3-stage1":
        switch = olmo3_stage1_switch_step(warmup)

        def decay_fraction(s):
            # Before the switch, CosWithWarmup's (1 + cos(pi p)) / 2; from it, HalfCosWithWarmup's second half of a
            # cosine twice as long: (1 + cos(pi (1 + p') / 2)) / 2 = sin(pi q' / 4)^2 with q' = 1 - p' the share
            # of the half-cosine still ahead.
            first = jnp.sin(0.5 * math.pi * steps_ahead(s, OLMO3_STAGE1_COSINE_STEPS, warmup)) ** 2
            second = jnp.sin(0.25 * math.pi * steps_ahead(s, OLMO3_STAGE1_HALF_COSINE_STEPS, switch)) ** 2
            return jnp.where(s < switch, first, second)
    elif cfg.schedule == "cosine":
        def decay_fraction(s):
            return jnp.sin(0.5 * math.pi * steps_ahead(s, total_steps, warmup)) ** 2  # = (1 + cos(pi * p)) / 2
    else:
        def decay_fraction(s):
            return steps_ahead(s, total_steps, warmup)

    def lr_at(step: Int[ArrayLike, ""]) -> Float[Array, ""]:
        s = jnp.asarray(step, jnp.float32)
        decayed = final + (1.0 - final) * decay_fraction(s)
        if warmup > 0:
            decayed = jnp.where(s <= warmup, s / warmup, decayed)
        return (peak * decayed).astype(jnp.float32)

    return lr_at


def steps_ahead(s: Float[Array, ""], end: int, start: int) -> Float[Array, ""]:
    """The fraction of the decay from step `start` to step `end` still ahead at step `s`, clipped to [0, 1]. Taken from
    integer differences (exact in float32 below 2^24 steps), so the last steps of a long run keep their relative
    precision."""
    return jnp.clip((end - s) / max(end - start, 1), 0.0, 1.0)


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


SPIKE_MIN_VALUES = 2
"""OLMo-core 3.0.0's SkipStepOptimizer judges once it holds max(2, window // 2) values, the current one included."""


def spike_min_history(window: int) -> int:
    """Earlier values the guard needs before it judges a step: max(SPIKE_MIN_VALUES, window // 2) - 1, OLMo-core's
    warm-up (skip_step_optimizer.py, get_step_factor) counted without the current value."""
    return max(SPIKE_MIN_VALUES, window // 2) - 1


class SpikeGuardState(eqx.Module):
    """Ring buffers of the last `window` recorded losses and grad norms; `count` values recorded so far. Part of the
    train state, so the history survives a resume (OLMo-core keeps it in memory only and starts its warm-up again)."""

    losses: Float[Array, " window"]
    grad_norms: Float[Array, " window"]
    count: Int[Array, ""]

    @staticmethod
    def init(window: int) -> SpikeGuardState:
        # Two buffers, not one array twice: a train step donates its state, and a buffer cannot be donated twice.
        return SpikeGuardState(losses=jnp.zeros((window,), jnp.float32), grad_norms=jnp.zeros((window,), jnp.float32),
                               count=jnp.zeros((), jnp.int32))


def _outlier(history: Float[Array, " window"], valid: Bool[Array, " window"], n: Int[Array, ""],
             value: Float[Array, ""], sigma: float) -> Bool[Array, ""]:
    """OLMo-core's test, negated: not (value - mean <= sigma * std), std unbiased. With one earlier value the std is
    0/0 = NaN, as torch.std_mean gives, and the step counts as a spike, as it does there."""
    n_f = n.astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, history, 0.0)) / jnp.maximum(n_f, 1.0)
    var = jnp.sum(jnp.where(valid, (history - mean) ** 2, 0.0)) / (n_f - 1.0)
    return ~(value - mean <= sigma * jnp.sqrt(var))


def spike_check(state: SpikeGuardState, loss: Float[Array, ""], grad_norm: Float[Array, ""], *,
                sigma: float, window: int) -> tuple[Bool[Array, ""], SpikeGuardState]:
    """OLMo-core's spike guard (SkipStepOptimizer.get_step_factor) as a pure function: `skip` is True when `loss` or
    `grad_norm` exceeds the mean of the last `window` recorded values by more than `sigma` (unbiased) standard
    deviations. `loss` is the cross-entropy without the z-loss and `grad_norm` the norm before clipping, as there.

    - Warm-up: nothing finite is skipped until `spike_min_history(window)` values are recorded (63 at window 128, 1
      at windows below 6), OLMo-core's max(2, window // 2) counting the current value.
    - Every finite step is recorded, skipped or not, as OLMo-core does: a lasting shift of the loss level
      is accepted after a few steps instead of stalling training forever.
    - A non-finite loss or grad norm is always skipped (also during warm-up) and never recorded, so one NaN neither
      enters the weights nor poisons the statistics (OLMo-core would apply it during warm-up and record it).
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


def guard_update(cfg: OptimConfig, spike: SpikeGuardState, loss: Float[Array, ""], grad_norm: Float[Array, ""],
                 new: T, old: T) -> tuple[Bool[Array, ""], SpikeGuardState, T]:
    """(skipped, the guard's next state, `new` or, for a skipped step, `old` bit for bit): one update judged. A NaN
    or inf loss or grad norm is always skipped; with cfg.spike_guard a spike is too (spike_check). `new`/`old` are
    the trees an update changes (parameters and the whole optimizer state, Adam's count included), so a skipped
    step is an exact no-op for them while the caller's step counter, and with it the learning rate, moves on."""
    if cfg.spike_guard:
        skip, spike = spike_check(spike, loss, grad_norm, sigma=cfg.spike_sigma, window=cfg.spike_window)
    else:
        skip = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm))
    return skip, spike, apply_unless_skipped(skip, new, old)


def apply_unless_skipped(skip: Bool[ArrayLike, ""], new_tree: T, old_tree: T) -> T:
    """`old_tree` where `skip`, else `new_tree`, leaf by leaf (jit-friendly; non-array leaves from new)."""
    return jax.tree.map(lambda n, o: jnp.where(skip, o, n) if eqx.is_array(n) else n, new_tree, old_tree)
