"""The sharded, accumulating train step: same numbers on any mesh, the loss by hand, fp32 moments."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx import loss as loss_lib, optim, state as state_lib
from olmo3eqx.config import MeshConfig, ModelConfig, OptimConfig, TrainConfig, DataConfig
from olmo3eqx.sharding import build_layout, is_leaf_like, make_mesh, partition_spec, plan_batch
from olmo3eqx.step import make_train_step

MODEL = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                    eos_token_id=1, pad_token_id=2, compute_dtype="float32")
SEQ, BATCH = 32, 8


def make_cfg(**model_overrides) -> TrainConfig:
    return TrainConfig(steps=10, model=dataclasses.replace(MODEL, **model_overrides),
                       data=DataConfig(seq_len=SEQ, global_batch=BATCH),
                       optim=OptimConfig(lr=1e-3, warmup_steps=2))


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, MODEL.vocab_size, (BATCH, SEQ)).astype(np.int32), np.ones(BATCH, np.float32)


def run(cfg, mesh_cfg, num_devices, steps=2):
    layout = build_layout(dataclasses.replace(cfg, mesh=mesh_cfg), jax.devices()[:num_devices])
    state = layout.init_state(cfg)
    fn = make_train_step(cfg, layout)
    losses = []
    for i in range(steps):
        state, m = fn(state, *batch(i))
        losses.append(float(m["train/loss"]))
    return layout.plan, state, losses, layout.mesh


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


@pytest.fixture(scope="module")
def reference():
    return run(make_cfg(), MeshConfig(max_per_device_batch=BATCH), 1)


@pytest.mark.parametrize("mesh_cfg,devices,accum", [
    (MeshConfig(fsdp=4, max_per_device_batch=2), 4, 1),
    (MeshConfig(data=2, fsdp=2, max_per_device_batch=2), 4, 1),
    (MeshConfig(max_per_device_batch=2), 1, 4),  # accumulation 4 x 2 against 1 x 8
    (MeshConfig(data=2, fsdp=4, max_per_device_batch=1), 8, 1),
    (MeshConfig(data=2, fsdp=2, max_per_device_batch=1), 4, 2),  # per data replica, reduced once (step.per_replica)
    # the same with a tensor split (on the partitioner's path, before, its first loss was 4.8537 against 4.8608)
    (MeshConfig(data=2, fsdp=2, tensor=2, max_per_device_batch=1), 8, 2),
])
def test_sharded_and_accumulated_step_equals_one_device(reference, mesh_cfg, devices, accum):
    ref_plan, ref_state, ref_losses, _ = reference
    plan, state, losses, _ = run(make_cfg(), mesh_cfg, devices)
    assert plan.accum_steps == accum and ref_plan.accum_steps == 1
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    # Two Adam steps at lr 1e-3: reassociation noise in near-zero gradients is amplified by g / sqrt(v), so a
    # rare element moves by ~1e-5; a different computation would differ by O(lr) = 1e-3 in many elements.
    for a, b in zip(host(state.model), host(ref_state.model)):
        np.testing.assert_allclose(a, b, atol=1e-4)
        assert np.mean(np.abs(a - b)) < 1e-6
    # The moments carry the same reassociation noise unamplified: near-zero elements are sums of terms at the leaf's
    # gradient scale, so the absolute noise follows that scale (seen: up to 1.2e-4 of max|mu| over data=2 x fsdp=4
    # at optimisation level 0), and the mean difference stays far below the leaf's mean.
    for a, b in zip(host(state.opt_state), host(ref_state.opt_state)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=max(1e-7, 5e-4 * float(np.abs(b).max())))
        assert np.mean(np.abs(a - b)) <= 1e-3 * np.mean(np.abs(b)) + 1e-12


def test_param_and_moment_shardings_follow_the_rule():
    cfg = make_cfg()
    _, state, _, mesh = run(cfg, MeshConfig(fsdp=4, max_per_device_batch=2), 4, steps=1)
    up = state.model.blocks.mlp.up_proj.weight  # [layers, hidden, intermediate]: fsdp on the largest dim
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, None, "fsdp")
    checked = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(eqx.filter(state, eqx.is_array))[0]:
        assert leaf.sharding.spec == partition_spec(path, leaf.shape, mesh), jax.tree_util.keystr(path)
        checked += 1
    adam = state.opt_state[1]  # chain(clip, adam, decay, lr)
    assert adam.mu.blocks.mlp.up_proj.weight.sharding.spec == up.sharding.spec
    assert adam.nu.embed.sharding.spec == state.model.embed.sharding.spec
    assert checked > 20


def test_tensor_parallel_rule_splits_columns_and_rows():
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2), jax.devices()[:4])
    abstract = state_lib.abstract_state(make_cfg(), optim.make_optimizer(make_cfg().optim, 10))
    specs = jax.tree_util.tree_map_with_path(lambda p, x: partition_spec(p, x.shape, mesh),
                                             eqx.filter(abstract.model, is_leaf_like))
    P = jax.sharding.PartitionSpec
    assert specs.blocks.attn.q_proj.weight == P(None, "fsdp", "tensor")
    assert specs.blocks.attn.o_proj.weight == P(None, "tensor", "fsdp")
    assert specs.blocks.mlp.down_proj.weight == P(None, "tensor", "fsdp")
    assert specs.lm_head.weight == P("fsdp", "tensor")


def reference_loss(model, tokens, mask, z_coef):
    """numpy CE + z-loss from the model's full float32 logits: mean over labelled tokens of kept instances."""
    logits = np.asarray(jax.vmap(model)(jnp.asarray(tokens)), np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    labels = tokens[:, 1:]
    picked = np.take_along_axis(logits[:, :-1], labels[..., None], -1)[..., 0]
    ce = (lse[:, :-1] - picked) * mask[:, None]
    z = z_coef * lse[:, :-1] ** 2 * mask[:, None]
    n = mask.sum() * (tokens.shape[1] - 1)
    return ce.sum() / n, z.sum() / n


@pytest.mark.parametrize("budget", [loss_lib.LOGITS_BUDGET, 4 * 128])
def test_loss_matches_numpy_and_chunking_and_masking(monkeypatch, budget):
    monkeypatch.setattr(loss_lib, "LOGITS_BUDGET", budget)  # 4*128: chunks of 1 position for batch 4
    cfg = make_cfg()
    model = state_lib.init_state(cfg, optim.make_optimizer(cfg.optim, 10), jax.random.PRNGKey(0)).model
    tokens, _ = batch(3)
    tokens = tokens[:4]
    mask = np.array([1, 0, 1, 1], np.float32)
    if budget != loss_lib.LOGITS_BUDGET:
        assert loss_lib.loss_chunk(4, SEQ, MODEL.vocab_size) == 1
    weights = loss_lib.label_weights(jnp.asarray(tokens), jnp.asarray(mask))
    ce_sum, z_sum = jax.jit(loss_lib.loss_sums, static_argnums=3)(model, jnp.asarray(tokens), weights, 1e-2)
    n = mask.sum() * (SEQ - 1)
    ce_ref, z_ref = reference_loss(model, tokens, mask, 1e-2)
    np.testing.assert_allclose(float(ce_sum) / n, ce_ref, rtol=1e-5)
    np.testing.assert_allclose(float(z_sum) / n, z_ref, rtol=1e-5)
    # The masked instance has no influence: changing its tokens leaves the loss unchanged.
    tokens2 = tokens.copy()
    tokens2[1] = (tokens2[1] + 7) % MODEL.vocab_size
    ce2, _ = loss_lib.loss_sums(model, jnp.asarray(tokens2), weights, 1e-2)
    assert float(ce2) == pytest.approx(float(ce_sum), rel=1e-6)


def test_bf16_params_keep_float32_moments_and_grads():
    cfg = make_cfg(param_dtype="bfloat16", compute_dtype="bfloat16")
    _, state, losses, _ = run(cfg, MeshConfig(fsdp=2, max_per_device_batch=2), 2, steps=2)
    assert all(np.isfinite(losses))
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))} == {jnp.dtype(jnp.bfloat16)}
    moments = [x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert moments and all(x.dtype == jnp.float32 for x in moments)


def test_a_nonfinite_step_is_skipped_and_the_next_one_trains():
    """A batch with one instance weighted NaN (its loss and every gradient NaN) leaves the parameters and the whole
    optimizer state bit for bit as they were and says train/skipped 1 with the spike guard off (test_optim has it on,
    for guard_update itself); the step counter moves on and the next batch trains."""
    cfg = make_cfg()
    layout = build_layout(dataclasses.replace(cfg, mesh=MeshConfig(max_per_device_batch=BATCH)), jax.devices()[:1])
    fn = make_train_step(cfg, layout)
    state, m = fn(layout.init_state(cfg), *batch(0))
    assert float(m["train/skipped"]) == 0
    before = host((state.model, state.opt_state))
    tokens, mask = batch(1)
    mask[3] = np.nan
    state, m = fn(state, tokens, mask)
    assert np.isnan(float(m["train/loss"])) and float(m["train/skipped"]) == 1 and int(state.step) == 2
    for a, b in zip(host((state.model, state.opt_state)), before, strict=True):
        np.testing.assert_array_equal(a, b)
    state, m = fn(state, *batch(2))
    assert np.isfinite(float(m["train/loss"])) and float(m["train/skipped"]) == 0
    assert not np.array_equal(host(state.model)[0], before[0])


def test_plan_batch_keeps_the_global_batch():
    for n, max_pd, expect in [(1, 4, (4, 8)), (8, 4, (4, 1)), (8, 2, (2, 2)), (2, 3, (2, 8)), (4, 16, (8, 1))]:
        mesh = make_mesh(MeshConfig(), jax.devices()[:n])
        plan = plan_batch(32, mesh, max_pd)
        assert (plan.per_device_batch, plan.accum_steps) == expect
        assert plan.per_device_batch * plan.accum_steps * plan.batch_devices == 32
    with pytest.raises(ValueError, match="not divisible"):
        plan_batch(30, make_mesh(MeshConfig(), jax.devices()[:4]), 4)
    with pytest.raises(ValueError, match="devices"):
        make_mesh(MeshConfig(data=3, fsdp=1), jax.devices()[:4])
