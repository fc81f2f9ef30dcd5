"""Context parallelism (mesh.context): each sequence split over a `context` axis gives the numbers of the unsplit
run. The tiny model in float32 with packed documents whose boundaries and sliding windows cross the chunk
boundaries, YaRN on its global layer and a label mask, on 8 simulated devices at context 1, 2 and 4 (fsdp takes the
rest), in the balanced layout (rank i holding chunks i and 2N - 1 - i, the default) and the contiguous one: the same
gradients and the same 3 steps of losses, per attention backend that runs on CPU. The sliding layer's 12-token
window reaches 1 previous chunk (context 2, balanced: 16-token chunks) or 2 (context 4: 8-token chunks), fetched by
collective permutes; the global layer all-gathers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from olmo3eqx import aot
from olmo3eqx.config import (FULL, SLIDING, DataConfig, MeshConfig, ModelConfig, OptimConfig, RopeScalingConfig,
                             TrainConfig)
from olmo3eqx.context import Chunks, attention_balance, reach
from olmo3eqx.model import cast_floating
from olmo3eqx.precision import traced_gathering
from olmo3eqx.sharding import batch_sharding, build_layout, on_mesh, sequence_sharding
from olmo3eqx.step import make_gradients, make_train_step

SEQ, BATCH, WINDOW = 64, 8, 12
"""At context 4 a chunk is 16 tokens: a 12-token window reaches into the previous chunk."""
ITEM_BYTES = {"bf16": 2, "f32": 4, "s32": 4, "pred": 1}


def config(context: int, impl: str, seq: int = SEQ, balance: bool = True, data: int = 1) -> TrainConfig:
    model = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        layer_types=(SLIDING, FULL), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        sliding_window=WINDOW, eos_token_id=1, pad_token_id=2, compute_dtype="float32",
                        attention_impl=impl,
                        rope_scaling=RopeScalingConfig(rope_type="yarn", factor=4.0,
                                                       original_max_position_embeddings=16))
    return TrainConfig(steps=3, model=model, data=DataConfig(seq_len=seq, global_batch=BATCH, packing=True),
                       optim=OptimConfig(lr=1e-2, warmup_steps=1),
                       mesh=MeshConfig(data=data, context=context, context_balance=balance,
                                       node_devices=len(jax.devices()) // data))


def batches(steps: int, seq: int) -> list[dict[str, np.ndarray]]:
    """Packed rows: documents of 3..40 tokens (so they cross chunks), the last stretch of some rows padding
    (label mask False), a few more masked labels."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        lengths = [[] for _ in range(BATCH)]
        for row in lengths:
            while sum(row) < seq:
                row.append(int(rng.integers(3, 41)))
        segment_ids = np.stack([np.repeat(np.arange(len(r)), r)[:seq] for r in lengths]).astype(np.int32)
        label_mask = rng.random((BATCH, seq)) > 0.1
        label_mask[::3, -int(rng.integers(5, 20)):] = False
        out.append({"tokens": rng.integers(3, 128, (BATCH, seq)).astype(np.int32),
                    "mask": (rng.random(BATCH) > 0.1).astype(np.float32),
                    "segment_ids": segment_ids, "label_mask": label_mask})
    return out


def run(context: int, impl: str, seq: int = SEQ, balance: bool = True, data: int = 1):
    """(the gradients of the first batch, the 3 steps' losses and gradient norms) at `context` (`data` nodes: the
    step's per-replica region)."""
    cfg = config(context, impl, seq, balance, data)
    layout = build_layout(cfg)
    mesh, fn = layout.mesh, make_gradients(cfg, layout)
    bsh = sequence_sharding(mesh, 2)
    grad = jax.jit(on_mesh(mesh, traced_gathering(cfg.mesh.gather_dtype,
                                                  lambda m, *b: fn(cast_floating(m, jnp.float32), *b)[:3])),
                   in_shardings=(layout.shardings.model, bsh, batch_sharding(mesh, 1), bsh, bsh))
    state = layout.init_state(cfg)
    data = batches(cfg.steps, seq)
    grads = grad(state.model, *layout.put_batch(data[0]))
    step = make_train_step(cfg, layout)
    losses = []
    for batch in data:
        state, metrics = step(state, *layout.put_batch(batch))
        losses.append((float(metrics["train/loss"]), float(metrics["train/z_loss"]), float(metrics["train/grad_norm"])))
    return grads, np.array(losses)


def assert_same(a, b):
    (g_a, ce_a, z_a), losses_a = a
    (g_b, ce_b, z_b), losses_b = b
    np.testing.assert_allclose(losses_a, losses_b, rtol=1e-5)
    np.testing.assert_allclose([float(ce_a), float(z_a)], [float(ce_b), float(z_b)], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * float(np.abs(y).max()))


@pytest.mark.parametrize("impl", ["xla", "flash"])
def test_context_parallel_gives_the_unsplit_numbers(impl):
    one = run(1, impl)
    for context in (2, 4):
        assert_same(run(context, impl), one)
    if impl == "xla":  # the contiguous layout: one chunk a rank, the window's neighbour its predecessor
        assert_same(run(4, impl, balance=False), one)


@pytest.mark.slow  # ~50 s (splash interpreted on CPU): a .ci/run share; xla and flash keep the equality in the default suite
def test_splash_context_parallel_gives_the_unsplit_numbers():
    """Splash (interpreted on CPU) with its mask information split over the context ranks: balanced chunks of 128
    tokens, the lane width each chunk must fill (the global layer's kernel takes the queries at their balanced
    positions; the sliding layer's, each chunk against its span of 2 chunks)."""
    assert_same(run(2, "splash", seq=512), run(1, "splash", seq=512))


@pytest.mark.slow  # ~2 min (splash interpreted on CPU)
def test_splash_context_parallel_across_data_replicas():
    """Splash with context 2 inside the step's per-replica region (data 2, as on several TPU slices), where the data
    axis is manual already: the kernel's mask information still splits over context alone."""
    assert_same(run(2, "splash", seq=512, data=2), run(1, "splash", seq=512))


def test_context_axis_shards_parameters_and_gathers_only_keys_and_values():
    """Parameters sharded over fsdp x context; in the compiled bfloat16 step (as the dry run reads it,
    olmo3eqx.collectives) nothing larger than one layer's keys or values is all-gathered over the context ranks:
    the queries and the hidden states stay split along the sequence."""
    cfg = config(4, "flash")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype="bfloat16"))
    layout = build_layout(cfg)
    assert dict(layout.mesh.shape) == {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}
    up = layout.shardings.model.blocks.mlp.up_proj.weight.spec
    assert ("fsdp", "context") in tuple(up), up
    assert sequence_sharding(layout.mesh, 2).spec == P(("data", "fsdp"), "context")
    assert batch_sharding(layout.mesh, 2).spec == P(("data", "fsdp"), None)  # evaluation keeps whole sequences
    m = cfg.model
    kv_elements = BATCH // 2 * SEQ * m.num_key_value_heads * m.head_dim  # one layer's k on one rank, gathered
    gathers = [c for c in aot.compile_step(cfg, layout, predict_time=False).collectives.collectives
               if c.kind == "all-gather" and c.axes == ("context",)]
    assert gathers
    for c in gathers:
        for dtype, raw in c.raw.items():
            assert raw <= kv_elements * ITEM_BYTES[dtype], (c.name, c.raw)
    assert any(raw == kv_elements * ITEM_BYTES[dtype] for c in gathers for dtype, raw in c.raw.items())


def test_sliding_layers_fetch_only_the_neighbour_chunks_their_window_reaches():
    """Sliding layers only, context 4 balanced (8 chunks of 8 tokens, the 12-token window reaching 2 back): in the
    compiled bfloat16 step no layer's keys, values or segment ids are all-gathered over the context ranks (only the
    row's segment ids once, for the per-document RoPE positions: a cumulative max along the sequence), and each
    collective permute carries at most one chunk of one layer's keys (float32 on the way back)."""
    cfg = config(4, "flash")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype="bfloat16",
                                                             layer_types=(SLIDING, SLIDING)))
    m = cfg.model
    chunk = BATCH // 2 * SEQ // 8 * m.num_key_value_heads * m.head_dim  # one chunk of one layer's k on one rank
    over_context = [c for c in aot.compile_step(cfg, build_layout(cfg), predict_time=False).collectives.collectives
                    if c.axes == ("context",)]
    gathers = [(c.raw, c.count) for c in over_context if c.kind == "all-gather"]
    assert gathers in ([], [({"s32": BATCH // 2 * SEQ * 4}, 1)]), gathers
    permutes = [c for c in over_context if c.kind == "collective-permute"]
    assert any(c.raw == {"bf16": chunk * 2} for c in permutes), [c.raw for c in permutes]
    for c in permutes:
        assert sum(c.raw.values()) <= chunk * 4, (c.name, c.raw)


def test_a_window_fetches_the_chunks_it_reaches_unless_the_all_gather_moves_fewer():
    """AI2's stage 3 (65,536 tokens, context 8): a 4,096 window over 8,192-token chunks, or over the balanced
    4,096-token ones, reaches one previous chunk; a window that reaches (nearly) every chunk all-gathers, and so do
    global layers."""
    assert reach(4096, 8192, Chunks(8, False)) == 1
    assert reach(4096, 4096, Chunks(8, True)) == 1
    assert reach(4098, 4096, Chunks(8, True)) == 2
    assert reach(7 * 8192, 8192, Chunks(8, False)) is None  # 7 chunks back: the all-gather's 7 chunks a rank
    assert reach(None, 4096, Chunks(8, True)) is None
    assert reach(12, 16, Chunks(2, True)) == 1  # the equality test's context 2: one chunk sent a rank, not 2


def test_dry_run_reports_how_evenly_causal_attention_falls_on_the_ranks():
    """Contiguous chunks: a global layer's last rank attends (2N - 1)/N times the mean rank's keys; balanced (chunks
    i and 2N - 1 - i) every rank the same; a 4,096 window over 8,192-token chunks is even but for the first chunk's
    short windows."""
    assert attention_balance([None], 65536, 8, balanced=False) == pytest.approx(15 / 8, rel=1e-3)
    assert attention_balance([None], 65536, 8, balanced=True) == pytest.approx(1.0, abs=1e-9)
    assert attention_balance([4096, 4096, 4096, None], 65536, 8, balanced=True) == pytest.approx(1.0, abs=0.01)
    assert attention_balance([4096], 65536, 8, balanced=False) == pytest.approx(1.0, abs=0.04)
    assert attention_balance([None], 64, 1, balanced=True) == 1.0
    from olmo3eqx.train import context_line

    line = context_line(config(4, "xla"))
    assert line.startswith("4 ranks x 2 chunks of 8 tokens (i and 7 - i: balanced) of each sequence, keys and values "
                           "all-gathered per global layer, the 2 previous chunks a sliding window reaches"), line
    assert line.endswith(f"max/mean {attention_balance([WINDOW, None], SEQ, 4, balanced=True):.3f}"), line


def test_sizes_that_do_not_split_are_one_sentence():
    from olmo3eqx.errors import ConfigError

    with pytest.raises(ConfigError, match="data.seq_len=60 does not split into mesh.context=8"):
        build_layout(dataclasses.replace(config(8, "xla"), data=DataConfig(seq_len=60, global_batch=BATCH)))
    with pytest.raises(ConfigError, match="mesh.context=3 does not divide the 8 devices"):
        build_layout(dataclasses.replace(config(3, "xla"), data=DataConfig(seq_len=48, global_batch=BATCH)))
    with pytest.raises(ConfigError, match="data.seq_len=24 does not split into the 16 equal chunks of mesh.context=8"):
        build_layout(dataclasses.replace(config(8, "xla"), data=DataConfig(seq_len=24, global_batch=BATCH)))
    with pytest.raises(ConfigError, match="mesh.context must be positive"):
        MeshConfig(context=0)
