"""optim.py: the LR schedules at their boundaries (against OLMo-core's schedulers, AI2's stage-1 curve included),
float32 moments (and why), decay mask, clipping, OLMo-core's AdamW update (in numpy), and the spike guard (against
OLMo-core's SkipStepAdamW, and across a checkpoint)."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import torch
from olmo_core.optim import CosWithWarmup, HalfCosWithWarmup, LinearWithWarmup
from olmo_core.optim.adamw import SkipStepAdamW, adamw_step

from olmo3eqx import optim
from olmo3eqx.config import ConfigError, OptimConfig
from olmo3eqx.optim import (SpikeGuardState, apply_unless_skipped, decay_mask, global_norm, guard_update, lr_schedule,
                            make_optimizer, spike_check, spike_min_history)


class Tiny(eqx.Module):
    """Paths as in the real model: `.embed.weight`, `.blocks.w` (stacked), `.norm.weight`."""

    embed: dict
    blocks: dict
    norm: dict


def tiny(dtype=jnp.float32, key=0):
    k1, k2 = jax.random.split(jax.random.key(key))
    return Tiny(embed={"weight": jax.random.normal(k1, (5, 3), dtype)},
                blocks={"w": jax.random.normal(k2, (2, 3, 4), dtype)},
                norm={"weight": jnp.ones((3,), dtype)})


def cfg(**kw):
    return dataclasses.replace(OptimConfig(), **kw)


# --- schedule --------------------------------------------------------------------------------------


def test_cosine_schedule_at_boundaries():
    lr_at = lr_schedule(cfg(lr=1e-3, warmup_steps=10, final_lr_ratio=0.1, schedule="cosine"), 100)
    expected = {
        1: 1e-4,                                                   # lr * 1/10
        9: 9e-4,
        10: 1e-3,                                                  # peak at the last warmup step
        11: 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 90))),
        55: 1e-3 * 0.55,                                           # half way: (0.1 + 1) / 2
        100: 1e-4,                                                 # final_lr_ratio * lr at the last step
        150: 1e-4,                                                 # held past the end
    }
    for step, want in expected.items():
        assert float(lr_at(step)) == pytest.approx(want, rel=1e-6), step


def test_linear_to_zero_stage2():
    lr_at = lr_schedule(cfg(lr=2.0712e-4, warmup_steps=0, final_lr_ratio=0.0, schedule="linear"), 47684)
    assert float(lr_at(1)) == pytest.approx(2.0712e-4 * (1 - 1 / 47684), rel=1e-6)
    assert float(lr_at(23842)) == pytest.approx(2.0712e-4 * 0.5, rel=1e-6)
    assert float(lr_at(47683)) == pytest.approx(2.0712e-4 / 47684, rel=1e-4)
    assert float(lr_at(47684)) == 0.0


def test_linear_with_warmup():
    lr_at = lr_schedule(cfg(lr=1.0, warmup_steps=4, final_lr_ratio=0.2, schedule="linear"), 14)
    got = [float(lr_at(s)) for s in (1, 4, 5, 9, 14)]
    np.testing.assert_allclose(got, [0.25, 1.0, 1 - 0.8 / 10, 1 - 0.8 / 2, 0.2], rtol=1e-6)


# AI2's numbers, as their scripts write them (OLMo-core src/scripts/official/OLMo3/): GLOBAL_BATCH_SIZE = 8192 * 512 and
# LR = 3e-4 in OLMo-3-1025-7B-pretrain-1.py / -pretrain-2.py; CosWithWarmup(warmup_steps=2000) over
# Duration.tokens(int(5e12)) in pretrain-1.py; HalfCosWithWarmup(warmup_steps=original_max_steps // 2 +
# original_warmup_steps // 2) over Duration.tokens(int(7e12)) in pretrain-2.py, original_max_steps = int(5e12) //
# GLOBAL_BATCH_SIZE; the epoch ended at step 1,413,814 (OLMo-3-1025-7B.csv). OLMo-core's Trainer makes a token
# duration ceil(tokens / batch tokens) steps, and its scheduler's `current` is the 1-based step.
AI2_BATCH_TOKENS = 8192 * 512
AI2_LR = 3e-4
AI2_WARMUP = 2000
AI2_STAGE1_END = 1413814


def test_olmo3_stage1_schedule_is_ai2s_at_every_boundary():
    cosine_t_max = math.ceil(int(5e12) / AI2_BATCH_TOKENS)
    half_t_max = math.ceil(int(7e12) / AI2_BATCH_TOKENS)
    switch = (int(5e12) // AI2_BATCH_TOKENS) // 2 + AI2_WARMUP // 2
    assert (cosine_t_max, switch, half_t_max) == (1192093, 597046, 1668931)
    assert optim.olmo3_stage1_switch_step(AI2_WARMUP) == switch
    cosine, half = CosWithWarmup(warmup=AI2_WARMUP), HalfCosWithWarmup(warmup=switch)

    def ai2(step):  # part 1 ran CosWithWarmup, part 2 HalfCosWithWarmup from the switch on
        return (cosine.get_lr(AI2_LR, step, cosine_t_max) if step < switch
                else half.get_lr(AI2_LR, step, half_t_max))

    # `steps` does not bend it: the curve is AI2's whatever the run length.
    lr_at = lr_schedule(cfg(lr=AI2_LR, warmup_steps=AI2_WARMUP, final_lr_ratio=0.1, schedule="olmo3-stage1"), 10)
    boundaries = [1, 2, AI2_WARMUP - 1, AI2_WARMUP, AI2_WARMUP + 1, 100_000, 596_047, 596_048, switch - 1, switch,
                  switch + 1, 1_000_000, cosine_t_max - 1, cosine_t_max, cosine_t_max + 1, AI2_STAGE1_END - 1,
                  AI2_STAGE1_END, half_t_max - 1, half_t_max, half_t_max + 100]
    for step in boundaries:
        assert float(lr_at(step)) == pytest.approx(ai2(step), rel=1e-6), step
    assert float(lr_at(AI2_WARMUP)) == pytest.approx(AI2_LR, rel=1e-7)
    assert float(lr_at(switch)) == pytest.approx(1.65e-4, rel=1e-7)  # both curves meet at (1 + 0.1) / 2 of the peak
    assert float(lr_at(switch - 1)) == pytest.approx(float(lr_at(switch)), rel=1e-5)  # no jump at the switch
    assert float(lr_at(AI2_STAGE1_END)) == pytest.approx(3.93e-5, rel=2e-3)  # stopped above 3e-5, never annealed
    assert float(lr_at(half_t_max)) == pytest.approx(3e-5, rel=1e-6)


def test_cosine_and_linear_are_olmo_cores_schedulers():
    """The stage-1 default (one cosine over the whole run, the reproduction's) is CosWithWarmup with t_max = steps;
    stage 2 is LinearWithWarmup(warmup=0, alpha_f=0) over 47,684 steps."""
    lr_at = lr_schedule(cfg(lr=AI2_LR, warmup_steps=AI2_WARMUP, final_lr_ratio=0.1), AI2_STAGE1_END)
    ref = CosWithWarmup(warmup=AI2_WARMUP)
    for step in (1, AI2_WARMUP - 1, AI2_WARMUP, AI2_WARMUP + 1, 700_000, AI2_STAGE1_END - 1, AI2_STAGE1_END):
        assert float(lr_at(step)) == pytest.approx(ref.get_lr(AI2_LR, step, AI2_STAGE1_END), rel=1e-6), step
    stage2_lr, stage2_steps = 2.0712352850360292e-4, 47684
    lr_at = lr_schedule(cfg(lr=stage2_lr, warmup_steps=0, final_lr_ratio=0.0, schedule="linear"), stage2_steps)
    ref = LinearWithWarmup(warmup=0, alpha_f=0.0)
    for step in (1, 2, 23842, stage2_steps - 1):
        assert float(lr_at(step)) == pytest.approx(ref.get_lr(stage2_lr, step, stage2_steps), rel=1e-6), step
    assert float(lr_at(stage2_steps)) == ref.get_lr(stage2_lr, stage2_steps, stage2_steps) == 0.0


@pytest.mark.parametrize("steps", [50, 1017])
def test_sft_warmup_fraction_is_olmo_core_s(steps):
    """AI2's SFT schedule: LinearWithWarmup(warmup_fraction=0.03, alpha_f=0), the warmup rounded as OLMo-core rounds
    it (1017 steps: 30.51 -> 31; 50: 1.5 -> 2)."""
    lr_at = lr_schedule(cfg(lr=8e-5, warmup_steps=0, warmup_fraction=0.03, final_lr_ratio=0.0, schedule="linear"),
                        steps)
    ref = LinearWithWarmup(warmup_fraction=0.03, alpha_f=0.0)
    for step in range(1, steps + 1):
        assert float(lr_at(step)) == pytest.approx(ref.get_lr(8e-5, step, steps), rel=1e-6, abs=1e-12), step
    with pytest.raises(ConfigError, match="warmup_fraction 0.03 must lie in"):
        cfg(warmup_steps=10, warmup_fraction=0.03)


def test_optimizer_applies_the_logged_lr():
    """With a zero gradient the update is -lr(step) * wd * w exactly: the LR applied is lr_schedule's."""
    c = cfg(lr=1e-2, warmup_steps=10, final_lr_ratio=0.1, weight_decay=0.5, no_decay=(), clip_grad_norm=0.0)
    lr_at = lr_schedule(c, 100)
    params = {"w": jnp.array([2.0, -4.0])}
    opt = make_optimizer(c, 100)
    state = opt.init(params)
    for step in (1, 10, 11, 55, 100):
        updates, state = opt.update({"w": jnp.zeros(2)}, state, params, step=step)
        np.testing.assert_allclose(updates["w"], -float(lr_at(step)) * 0.5 * params["w"], rtol=1e-6)


def test_update_without_step_is_a_clear_error():
    params = {"w": jnp.ones(2)}
    opt = make_optimizer(cfg(no_decay=()), 10)
    with pytest.raises(TypeError, match="step="):
        opt.update(params, opt.init(params), params)


# --- float32 moments -------------------------------------------------------------------------------


def test_bf16_params_get_float32_moments_and_stay_bf16():
    params = tiny(jnp.bfloat16)
    opt = make_optimizer(cfg(), 100)
    state = opt.init(params)
    grads = jax.tree.map(lambda p: (0.01 * p).astype(jnp.bfloat16), params)
    updates, state = jax.jit(lambda g, s, p: opt.update(g, s, p, step=1))(grads, state, params)
    float_leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    mu, nu = optax.tree.get(state, "mu"), optax.tree.get(state, "nu")
    assert len(float_leaves) == 2 * len(jax.tree.leaves(params))  # mu and nu, nothing else
    assert all(x.dtype == jnp.float32 for x in float_leaves)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((mu, nu)))
    new_params = eqx.apply_updates(params, updates)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(new_params))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(optax.apply_updates(params, updates)))


def test_bf16_second_moment_freezes_where_float32_does_not():
    """Why moments stay float32: with a constant gradient of 1 the true second moment climbs to 1 as
    1 - b2^t. A bf16 nu (what optax.adamw keeps for bf16 params) stops moving once the increment
    (1 - b2)(1 - nu) falls under half a bf16 ulp (2^-9 below 1): it freezes ~4% low for good, and the
    update it scales is ~2% too large. Our optimizer keeps climbing."""
    c = cfg(b2=0.95, weight_decay=0.0, clip_grad_norm=0.0, no_decay=())
    params = {"w": jnp.zeros((4,), jnp.bfloat16)}
    grads = {"w": jnp.ones((4,), jnp.bfloat16)}
    ours = make_optimizer(c, 1000)
    ref = optax.adamw(1e-3, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=0.0)

    @jax.jit
    def run(s_ours, s_ref):
        def body(carry, step):
            s_ours, s_ref = carry
            _, s_ours = ours.update(grads, s_ours, params, step=step)
            _, s_ref = ref.update(grads, s_ref, params)
            return (s_ours, s_ref), (optax.tree.get(s_ours, "nu")["w"][0], optax.tree.get(s_ref, "nu")["w"][0])
        return jax.lax.scan(body, (s_ours, s_ref), jnp.arange(1, 201))[1]

    nu_ours, nu_ref = run(ours.init(params), ref.init(params))
    assert nu_ref.dtype == jnp.bfloat16 and nu_ours.dtype == jnp.float32
    assert nu_ref[-1] == nu_ref[-2] == nu_ref[-100]         # frozen: updates no longer change it
    assert float(nu_ref[-1]) < 0.97                          # ...well short of the true 1 - 0.95^200
    assert nu_ours[-1] != nu_ours[-100]                      # float32 keeps moving
    assert float(nu_ours[-1]) == pytest.approx(1 - 0.95 ** 200, abs=1e-6)


def olmo_core_adamw(params: dict, grads: list[dict], lrs: list[float], *, b1: float, b2: float, eps: float,
                    weight_decay: dict) -> list[dict]:
    """OLMo-core's AdamW update (adamw_step in olmo_core/optim/adamw.py, every step taken) in float64 numpy: the
    parameters after each step. `weight_decay` per leaf (0 for the ones OLMo leaves undecayed)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    out = []
    for t, (g, lr) in enumerate(zip(grads, lrs)):
        for k in p:
            p[k] = p[k] * (1 - lr * weight_decay[k])  # decoupled, before the step, at this step's LR
            m[k] = m[k] + (1 - b1) * (g[k] - m[k])
            v[k] = v[k] * b2 + (1 - b2) * g[k] ** 2
            bc1, bc2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)
            p[k] = p[k] - lr / bc1 * m[k] / (np.sqrt(v[k]) / np.sqrt(bc2) + eps)  # eps outside the square root
        out.append(dict(p))
    return out


def test_matches_olmo_core_adamw_in_numpy():
    """Eight steps with warmup, cosine decay, weight decay (the embedding undecayed) and bias correction, against
    OLMo-core's update written out in float64 numpy (itself checked against OLMo-core's adamw_step). Gradients span
    1e-7 to 1, so epsilon's place counts: inside the square root, |g| = 1e-5 gets a tenth of the step."""
    c = cfg(lr=1e-2, warmup_steps=3, final_lr_ratio=0.1, weight_decay=0.1, no_decay=("embed",), clip_grad_norm=0.0)
    total = 8
    params = tiny()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    rng = np.random.default_rng(0)
    grads = [{k: rng.choice([-1.0, 1.0], x.shape) * 10.0 ** rng.uniform(-7, 0, x.shape)
              for k, (_, x) in zip(names, leaves)} for _ in range(total)]
    # OLMo-core's CosWithWarmup: linear warmup to the peak at step W, then a cosine to final_lr_ratio x lr at step T.
    lrs = [c.lr * s / c.warmup_steps if s <= c.warmup_steps else
           c.lr * (c.final_lr_ratio + (1 - c.final_lr_ratio) * (1 + math.cos(
               math.pi * (s - c.warmup_steps) / (total - c.warmup_steps))) / 2) for s in range(1, total + 1)]
    decay = {k: 0.0 if "embed" in k else c.weight_decay for k in names}
    ref = olmo_core_adamw({k: x for k, (_, x) in zip(names, leaves)}, grads, lrs, b1=c.b1, b2=c.b2, eps=c.eps,
                          weight_decay=decay)

    # The reference is OLMo-core's update: its own adamw_step, in float64 torch, on the first leaf.
    k, first = names[0], np.asarray(leaves[0][1], np.float64)
    w, m, v, step = (torch.tensor(x) for x in (first, np.zeros_like(first), np.zeros_like(first), np.float64(0)))
    for t in range(total):
        adamw_step(w, torch.tensor(grads[t][k]), lr=lrs[t], betas=(c.b1, c.b2), eps=c.eps, weight_decay=decay[k],
                   exp_avg=m, exp_avg_sq=v, step=step, step_factor=torch.tensor(1.0, dtype=torch.float64))
        np.testing.assert_allclose(w.numpy(), ref[t][k], rtol=1e-12)

    opt = make_optimizer(c, total)
    state = opt.init(params)
    update = jax.jit(lambda g, s, p, step: opt.update(g, s, p, step=step))
    for t in range(total):
        g = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(grads[t][k], jnp.float32) for k in names])
        updates, state = update(g, state, params, t + 1)
        params = eqx.apply_updates(params, updates)
        for k, x in zip(names, jax.tree.leaves(params)):
            np.testing.assert_allclose(x, ref[t][k], rtol=1e-6, atol=1e-7, err_msg=f"step {t + 1}, {k}")


# --- weight decay and clipping ---------------------------------------------------------------------


def test_decay_mask_paths():
    mask = decay_mask(tiny(), ("embed",))
    assert mask.embed["weight"] is False
    assert mask.blocks["w"] is True and mask.norm["weight"] is True
    with pytest.raises(ConfigError, match="wte"):
        decay_mask(tiny(), ("wte",))


def test_embedding_is_not_decayed():
    c = cfg(lr=0.01, weight_decay=0.1, clip_grad_norm=0.0)  # no_decay = ("embed",), OLMo's
    params = tiny()
    opt = make_optimizer(dataclasses.replace(c, warmup_steps=0), 10)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zeros, opt.init(params), params, step=1)
    new = eqx.apply_updates(params, updates)
    np.testing.assert_array_equal(new.embed["weight"], params.embed["weight"])
    lr1 = float(lr_schedule(dataclasses.replace(c, warmup_steps=0), 10)(1))
    np.testing.assert_allclose(new.blocks["w"], params.blocks["w"] * (1 - lr1 * 0.1), rtol=1e-6)
    np.testing.assert_allclose(new.norm["weight"], params.norm["weight"] * (1 - lr1 * 0.1), rtol=1e-6)


def test_clipping_scales_global_norm_10_to_1():
    """eps = 1 makes Adam's first update g / (|g| + 1), which shows the scale of the clipped gradient:
    g = (6, 8) has norm 10 and clips to (0.6, 0.8)."""
    c = cfg(lr=1.0, warmup_steps=0, final_lr_ratio=1.0, weight_decay=0.0, eps=1.0, clip_grad_norm=1.0,
            no_decay=())  # constant LR 1
    params = {"w": jnp.zeros(2)}
    grads = {"w": jnp.array([6.0, 8.0])}
    assert float(global_norm(grads)) == pytest.approx(10.0)
    updates, _ = make_optimizer(c, 10).update(grads, make_optimizer(c, 10).init(params), params, step=1)
    np.testing.assert_allclose(updates["w"], [-0.6 / 1.6, -0.8 / 1.8], rtol=1e-6)
    unclipped = dataclasses.replace(c, clip_grad_norm=0.0)
    updates, _ = make_optimizer(unclipped, 10).update(grads, make_optimizer(unclipped, 10).init(params),
                                                       params, step=1)
    np.testing.assert_allclose(updates["w"], [-6 / 7, -8 / 9], rtol=1e-6)


def test_global_norm_accumulates_in_float32():
    g = {"a": jnp.full((1000,), 3.0, jnp.bfloat16), "b": jnp.full((1,), 4.0, jnp.bfloat16)}
    norm = global_norm(g)
    assert norm.dtype == jnp.float32
    assert float(norm) == pytest.approx(math.sqrt(9000 + 16), rel=1e-6)


def test_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="optim.b2"):
        OptimConfig(b2=1.0)
    with pytest.raises(ConfigError, match="optim.final_lr_ratio"):
        OptimConfig(final_lr_ratio=1.5)


# --- spike guard -----------------------------------------------------------------------------------


def run_guard(values, window=128, sigma=6.0, state=None):
    state = SpikeGuardState.init(window) if state is None else state
    check = jax.jit(lambda s, l, g: spike_check(s, l, g, sigma=sigma, window=window))
    skips = []
    for loss, gn in values:
        skip, state = check(state, jnp.float32(loss), jnp.float32(gn))
        skips.append(bool(skip))
    return skips, state


def normal_history(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(3.0 + 0.01 * rng.standard_normal(), 1.0 + 0.01 * rng.standard_normal()) for _ in range(n)]


def test_spike_is_skipped_and_normal_value_is_not():
    history = normal_history(100)
    skips, state = run_guard(history)
    assert not any(skips)
    losses = np.array([l for l, _ in history])
    spike = float(losses.mean() + 10 * losses.std(ddof=1))
    assert run_guard([(spike, 1.0)], state=state)[0] == [True]             # loss spike
    assert run_guard([(3.0, 1.0 + 10 * 0.01 * 3)], state=state)[0] == [True]  # grad-norm spike
    assert run_guard([(3.005, 1.005)], state=state)[0] == [False]
    assert run_guard([(float("nan"), 1.0)], state=state)[0] == [True]


@pytest.mark.parametrize("window, need", [(128, 63), (40, 19), (8, 3), (5, 1), (2, 1)])
def test_spike_guard_warm_up(window, need):
    """OLMo-core 3.0.0 judges once its list holds max(2, window // 2) values, the current one included."""
    assert spike_min_history(window) == need
    skips, state = run_guard(normal_history(need - 1), window)
    assert run_guard([(1000.0, 1000.0)], window, state=state)[0] == [False]  # too little history
    skips, state = run_guard(normal_history(need), window)
    assert run_guard([(1000.0, 1000.0)], window, state=state)[0] == [True]


def test_spike_guard_records_finite_values_even_when_skipped():
    """As OLMo-core: a lasting jump of the loss level is skipped for a few steps, then accepted."""
    skips, state = run_guard(normal_history(40), window=40)
    skips, state = run_guard([(4.0, 1.0)] * 6, window=40, state=state)
    assert skips[0] and not skips[-1]
    assert int(state.count) == 46
    _, after_nan = run_guard([(float("nan"), 1.0)], window=40, state=state)
    assert int(after_nan.count) == 46  # non-finite values are not recorded
    np.testing.assert_array_equal(after_nan.losses, state.losses)


def test_apply_unless_skipped():
    old = {"a": jnp.zeros(3), "n": jnp.int32(1)}
    new = {"a": jnp.ones(3), "n": jnp.int32(2)}
    kept = apply_unless_skipped(jnp.bool_(True), new, old)
    taken = apply_unless_skipped(jnp.bool_(False), new, old)
    np.testing.assert_array_equal(kept["a"], old["a"])
    assert int(kept["n"]) == 1
    np.testing.assert_array_equal(taken["a"], new["a"])
    assert int(taken["n"]) == 2


# --- the spike skip against OLMo-core's SkipStepAdamW ----------------------------------------------


def spiky_series(steps: int, spikes: dict[int, tuple[float, float]], seed: int = 0) -> list[tuple[float, float]]:
    """(CE, pre-clip grad norm) per 1-based step: a slowly falling loss with noise, `spikes` {step: (loss
    offset, grad-norm offset)} added on top."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(1, steps + 1):
        dl, dg = spikes.get(s, (0.0, 0.0))
        out.append((3.0 - 0.002 * s + 0.01 * rng.standard_normal() + dl, 1.0 + 0.02 * rng.standard_normal() + dg))
    return out


SPIKE_SERIES = {
    # window: (steps, {step: (loss offset, grad-norm offset)})
    # Judged from step 2, which has one earlier value: its std is NaN (torch.std_mean) and the step is skipped, even
    # with both values below the first.
    4: (24, {2: (-0.5, -0.5), 3: (1.0, 0.0), 9: (0.0, 2.0), 10: (0.0, 2.0), 17: (2.0, 3.0)}),
    # Judged from step 4; the spike of step 3 (warm-up) stays in the window and hides that of step 4.
    8: (40, {3: (5.0, 0.0), 4: (5.0, 0.0), 12: (0.0, 1.0), 13: (0.5, 0.0), 30: (0.3, 0.5)}),
    # Judged from step 20 (19 earlier values, where our old warm-up agreed); 21 hides behind 15 and 20; 80 is too small.
    40: (90, {15: (2.0, 2.0), 20: (6.0, 0.0), 21: (0.0, 1.0), 65: (0.5, 0.0), 66: (0.0, 0.5), 80: (0.05, 0.05)}),
    # AI2's window: judged from step 64; 195 and 196 come after 64 and 65 left the window.
    128: (200, {50: (2.0, 2.0), 64: (6.0, 0.0), 65: (0.0, 1.0), 195: (1.0, 0.0), 196: (0.0, 0.5)}),
}


@pytest.mark.parametrize("window", list(SPIKE_SERIES))
def test_spike_skip_is_skip_step_adamws(window):
    """Same decision on the same (CE, grad norm) series as OLMo-core's SkipStepAdamW, and the same parameters, moments
    and Adam count after every step; a skipped step leaves parameters and the whole optimizer state bit for bit as
    they were, while the LR follows the step (the schedule advances over skipped steps)."""
    steps, spikes = SPIKE_SERIES[window]
    series = spiky_series(steps, spikes)
    c = cfg(lr=1e-2, warmup_steps=3, no_decay=(), clip_grad_norm=0.0, spike_guard=True, spike_window=window)
    lr_at = lr_schedule(c, steps)
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal((6, 5)).astype(np.float32)
    grads = [rng.standard_normal((6, 5)).astype(np.float32) * 0.1 for _ in range(steps)]

    w = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    ref = SkipStepAdamW([w], lr=c.lr, betas=(c.b1, c.b2), eps=c.eps, weight_decay=c.weight_decay,
                        rolling_interval_length=window, sigma_factor=int(c.spike_sigma), foreach=True)

    opt = make_optimizer(c, steps)
    params = {"w": jnp.asarray(w0)}
    opt_state, spike = opt.init(params), SpikeGuardState.init(window)

    @jax.jit
    def our_step(params, opt_state, spike, g, s, loss, gnorm):
        updates, new_opt_state = opt.update({"w": g}, opt_state, params, step=s)
        new = (optax.apply_updates(params, updates), new_opt_state)
        skip, spike, (params, opt_state) = guard_update(c, spike, loss, gnorm, new, (params, opt_state))
        return skip, params, opt_state, spike

    ours_skipped, ref_skipped = [], []
    for s, ((loss, gnorm), g) in enumerate(zip(series, grads), start=1):
        ref.latest_loss, ref.latest_grad_norm = torch.tensor(loss), torch.tensor(gnorm)
        w.grad = torch.from_numpy(g.copy())
        ref.param_groups[0]["lr"] = float(lr_at(s))  # what OLMo-core's scheduler sets before optim.step()
        before = w.detach().clone()
        ref.step()
        ref_skipped.append(bool(ref.step_skipped))
        if ref_skipped[-1]:
            assert torch.equal(w.detach(), before)

        old_params, old_state = params, opt_state
        skip, params, opt_state, spike = our_step(params, opt_state, spike, jnp.asarray(g), s, jnp.float32(loss),
                                                  jnp.float32(gnorm))
        ours_skipped.append(bool(skip))
        if ours_skipped[-1]:
            for a, b in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((old_params, old_state))):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(params["w"], w.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"step {s}")

    assert ours_skipped == ref_skipped
    assert sum(ours_skipped) >= 3, "the series must make the guard skip"
    assert not all(ours_skipped[s - 1] for s, (dl, dg) in spikes.items() if dl > 0 or dg > 0), \
        "and must also hold spikes it does not skip"
    state = ref.state[w]
    np.testing.assert_allclose(optax.tree.get(opt_state, "mu")["w"], state["exp_avg"].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(optax.tree.get(opt_state, "nu")["w"], state["exp_avg_sq"].numpy(), rtol=1e-5, atol=1e-9)
    assert int(optax.tree.get(opt_state, "count")) == int(state["step"]) == steps - sum(ref_skipped)


@pytest.mark.parametrize("spike_guard", [False, True])
@pytest.mark.parametrize("loss,grad_norm", [(math.nan, 1.0), (math.inf, 1.0), (1.0, math.nan), (1.0, math.inf)])
def test_a_nonfinite_loss_or_grad_norm_is_skipped_whatever_the_spike_guard(spike_guard, loss, grad_norm):
    """A NaN/inf loss or grad norm keeps the old trees bit for bit, with the guard off and inside its warm-up; a
    finite step there is applied."""
    c = cfg(spike_guard=spike_guard, spike_window=8)
    new, old = {"w": jnp.ones(3)}, {"w": jnp.zeros(3)}
    for (l, g), skipped in (((1.0, 1.0), False), ((loss, grad_norm), True)):
        skip, spike, out = guard_update(c, SpikeGuardState.init(8), jnp.float32(l), jnp.float32(g), new, old)
        assert bool(skip) == skipped
        np.testing.assert_array_equal(out["w"], (old if skipped else new)["w"])
        assert int(spike.count) == (1 if spike_guard and not skipped else 0)  # a non-finite value is never recorded


def test_spike_history_survives_a_resume(tmp_path):
    """The guard's history is part of the train state: a run saved and resumed makes the decisions of an uninterrupted
    one. OLMo-core's lives in memory: after a restart its warm-up starts again and would let this spike through."""
    from olmo3eqx.checkpoint.checkpointer import Checkpointer
    from olmo3eqx.config import DataConfig, MeshConfig, ModelConfig, TrainConfig
    from olmo3eqx.sharding import build_layout
    from olmo3eqx.step import make_train_step

    model = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, head_dim=16, sliding_window=8, eos_token_id=0, compute_dtype="float32")
    c = TrainConfig(steps=8, model=model, data=DataConfig(seq_len=16, global_batch=4), mesh=MeshConfig(fsdp=1),
                    optim=cfg(lr=1e-3, warmup_steps=2, spike_guard=True, spike_window=8))  # judges from step 4
    spike_at, save_at = 6, 3
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 64, (4, 16)).astype(np.int32) for _ in range(c.steps)]
    batches[spike_at - 1] = np.full((4, 16), 5, np.int32)  # one repeated token: a gradient norm far above the rest
    mask = np.ones(4, np.float32)
    layout = build_layout(c, jax.devices()[:1])
    train_step = make_train_step(c, layout)

    def run(state, steps):
        skipped = []
        for s in steps:
            state, m = train_step(state, *layout.put_batch({"tokens": batches[s - 1], "mask": mask}))
            skipped.append(bool(m["train/skipped"]))
        return state, skipped

    _, uninterrupted = run(layout.init_state(c), range(1, c.steps + 1))
    assert uninterrupted == [s == spike_at for s in range(1, c.steps + 1)]

    state, first = run(layout.init_state(c), range(1, save_at + 1))
    ckpt = Checkpointer(tmp_path / "ckpt", keep=1, async_save=False)
    ckpt.save(save_at, state, {}, {})
    ckpt.wait()
    restored, _ = ckpt.restore(save_at, layout.state_target())
    assert int(restored.spike.count) == save_at
    _, resumed = run(restored, range(save_at + 1, c.steps + 1))  # (the step donates the state it is given)
    assert first + resumed == uninterrupted

    restored, _ = ckpt.restore(save_at, layout.state_target())
    ckpt.close()
    fresh_guard = eqx.tree_at(lambda s: s.spike, restored, SpikeGuardState.init(c.optim.spike_window))
    _, forgetful = run(fresh_guard, range(save_at + 1, c.steps + 1))
    assert not any(forgetful)  # what a guard that forgets at a restart does: step 6 has 2 values of history, needs 3
