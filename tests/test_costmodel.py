"""olmo3eqx.costmodel: the step's predicted time with every loop counted.

On CPU: the block count splash visits against brute force, the kernel model by hand, the loss chunk the step picks
under a mesh, the prediction's arithmetic. Under the `tpu` marker (libtpu, `pytest -m tpu`): XLA:TPU itself is the
reference: the prediction of a program without loops is the compiler's own figure, a layer scan's prediction matches
the unrolled program's figure, and the custom calls the cost model counts as -1 s are the ones UNCOSTED names.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import numpy as np
import pytest

from olmo3eqx import costmodel
from olmo3eqx.config import ModelConfig, TrainConfig
from olmo3eqx.costmodel import Piece, Prediction, splash_seconds, visited_blocks

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")


def brute_force_blocks(seq: int, bq: int, bkv: int, window: int | None) -> int:
    q = np.arange(seq)[:, None]
    k = np.arange(seq)[None, :]
    visible = (k <= q) & ((q - k < window) if window is not None else True)
    nq, nk = -(-seq // bq), -(-seq // bkv)
    return sum(bool(visible[i * bq:(i + 1) * bq, j * bkv:(j + 1) * bkv].any()) for i in range(nq) for j in range(nk))


@pytest.mark.parametrize("seq,bq,bkv,window", [
    (8192, 2048, 2048, None), (8192, 2048, 2048, 4096), (8192, 512, 512, 4096), (8192, 1024, 512, 4096),
    (1000, 128, 256, 300), (1000, 256, 128, 1), (64, 16, 16, 64), (64, 16, 8, 17)])
def test_visited_blocks_match_brute_force(seq, bq, bkv, window):
    assert visited_blocks(seq, bq, bkv, window) == brute_force_blocks(seq, bq, bkv, window)


def test_visited_blocks_by_hand():
    # 8192 tokens in blocks of 2048: a causal layer visits the 10 pairs on and below the diagonal; a 4096-key window
    # drops (3, 0), the only pair whose keys are all more than 4095 positions behind its queries.
    assert visited_blocks(8192, 2048, 2048, None) == 10
    assert visited_blocks(8192, 2048, 2048, 4096) == 9


def test_splash_seconds_by_hand():
    m = ModelConfig(num_hidden_layers=4, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                    head_dim=128, sliding_window=4096, intermediate_size=11008, vocab_size=100352)
    cfg = TrainConfig(model=m)
    peak = 1153.5e12
    # 3 sliding layers (9 pairs) + 1 global (10 pairs), 9 matmuls of 2 x 2048 x 2048 x 128 FLOPs, 32 heads, 4 rows,
    # at half the peak: head_dim 128 fills half of Ironwood's 256-wide unit, all of v5p's 128-wide one.
    flops = (3 * 9 + 10) * 9 * 2 * 2048 * 2048 * 128 * 32 * 4
    assert splash_seconds(cfg, 4, 8192, 2048, 2048, 32, "TPU7x", peak) == pytest.approx(flops / (peak / 2))
    assert splash_seconds(cfg, 4, 8192, 2048, 2048, 32, "TPU v5", peak) == pytest.approx(flops / peak)
    wide = TrainConfig(model=dataclasses.replace(m, num_attention_heads=16, num_key_value_heads=16, head_dim=256))
    assert splash_seconds(wide, 4, 8192, 2048, 2048, 16, "TPU7x", peak) == pytest.approx(flops / peak)


def test_loss_chunk_is_planned_per_device():
    """The logits budget holds per device: the 7B's global micro-batch of 512 rows on 128 devices is 4 rows each,
    unembedded 128 positions at a time (64 chunks), not 1 position at a time as 512 rows on one device would be."""
    from olmo3eqx.loss import chunk_plan

    assert chunk_plan(512, 8192, 100352) == (1, 8192)  # no mesh: the whole batch is on one device
    mesh = jax.sharding.AbstractMesh((1, 128, 1), ("data", "fsdp", "tensor"))
    with jax.sharding.use_abstract_mesh(mesh):
        assert chunk_plan(512, 8192, 100352) == (128, 64)
        assert chunk_plan(100, 8192, 100352) == (4, 2048)  # rows the batch axes do not divide stay whole: 100 rows


def test_prediction_arithmetic():
    p = Prediction((Piece("step", 0.5, 1), Piece("group", 0.25, 7), Piece("kernels", 0.1, 2)), tokens_per_device=1000,
                   model_flops=1e12, maxtext_flops=1.1e12, peak=1e12, attention="by hand")
    assert p.seconds == pytest.approx(0.5 + 1.75 + 0.2)
    assert p.mfu == pytest.approx(1 / 2.45)
    text = "\n".join(p.lines())
    assert "2.450 s per step" in text and "not a measurement" in text and "MFU 40.8%" in text
    assert "group 250.00 ms x 7" in text


def test_cpu_compiler_has_no_cost_model():
    compiled = jax.jit(lambda x: x @ x).lower(jax.ShapeDtypeStruct((8, 8), np.float32)).compile()
    with pytest.raises(costmodel.CostModelError, match="XLA:TPU's cost model only"):
        costmodel.optimal_seconds(compiled)


# --- XLA:TPU -----------------------------------------------------------------------------------------------------


def tiny(**model) -> TrainConfig:
    from olmo3eqx.config import load_yaml

    cfg = load_yaml("configs/tiny.yaml")
    m = dataclasses.replace(cfg.model, compute_dtype="bfloat16", **model)
    return dataclasses.replace(cfg, model=m, mesh=dataclasses.replace(cfg.mesh, max_per_device_batch=2))


def compile_on(cfg: TrainConfig, topology: str):
    from olmo3eqx.aot import topology_devices
    from olmo3eqx.sharding import build_layout
    from olmo3eqx.step import make_train_step

    layout = build_layout(cfg, topology_devices(topology))
    step = make_train_step(cfg, layout)
    return layout, step.lower(layout.state_target(), *layout.batch_target(cfg.data.seq_len)).compile()


@needs_libtpu
@pytest.mark.tpu
@pytest.mark.parametrize("tensor", [1, 2])
def test_a_program_without_loops_is_the_compilers_figure(tensor):
    """Layers unrolled, one loss chunk, no accumulation, XLA's attention: nothing to add; the prediction is
    cost_analysis()'s optimal_seconds itself. A device's tokens (its share of the model FLOPs) are the global
    batch's over all 4 devices, tensor-parallel or not: a row's tensor-parallel devices share its tokens."""
    cfg = tiny(scan_layers=False, attention_impl="xla")
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, max_per_device_batch=16, tensor=tensor))
    layout, compiled = compile_on(cfg, "v5p:2x2x1")
    p = costmodel.predict(cfg, layout, compiled)
    assert [x.name for x in p.pieces] == ["step as compiled"]
    assert p.seconds == compiled.cost_analysis()["optimal_seconds"] > 0
    assert layout.plan.per_device_batch == tensor * cfg.data.global_batch // 4
    assert p.tokens_per_device == cfg.data.global_batch * cfg.data.seq_len // 4


@needs_libtpu
@pytest.mark.tpu
@pytest.mark.parametrize("layers", [8, 16])
def test_a_layer_scan_predicts_what_the_unrolled_program_costs(monkeypatch, layers):
    """The compiler counts a scan's body once (the scanned program's own figure barely moves with depth); the
    prediction, adding the group compiled alone once per further trip, lands on the figure XLA gives the same
    model unrolled, where every layer is in the program."""
    import olmo3eqx.loss as loss_lib

    monkeypatch.setattr(loss_lib, "LOGITS_BUDGET", 1 << 40)  # one loss chunk: the layer scan is the only loop
    scanned = tiny(num_hidden_layers=layers, attention_impl="xla", remat="full")
    scanned = dataclasses.replace(scanned, mesh=dataclasses.replace(scanned.mesh, max_per_device_batch=16))
    layout, compiled = compile_on(scanned, "v5p:2x2x1")
    predicted = costmodel.predict(scanned, layout, compiled)
    assert [x.name for x in predicted.pieces] == ["step as compiled", "layer group (4 layers)"]
    assert predicted.pieces[1].times == layers // 4 - 1
    unrolled = dataclasses.replace(scanned, model=dataclasses.replace(scanned.model, scan_layers=False))
    _, flat = compile_on(unrolled, "v5p:2x2x1")
    assert predicted.seconds == pytest.approx(costmodel.optimal_seconds(flat), rel=0.1)
    assert costmodel.optimal_seconds(compiled) < 0.8 * costmodel.optimal_seconds(flat)  # the raw figure misses groups


@needs_libtpu
@pytest.mark.tpu
def test_splash_counts_zero_and_uncosted_custom_calls_minus_one_second_each():
    """Splash compiled for the TPU (under the mesh, as the step runs it) is one `tpu_custom_call` per kernel, which
    the cost model counts as 0 s; the same kernel traced without the mesh runs in Pallas' interpret mode, whose
    PrepareAsyncCall custom calls the model counts as -1 s each (UNCOSTED): optimal_seconds adds them back."""
    import collections

    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from olmo3eqx.aot import topology_devices
    from olmo3eqx.attention import attention
    from olmo3eqx.sharding import on_mesh

    mesh = Mesh(topology_devices("tpu7x:2x2x1"), ("data",))
    x = jax.ShapeDtypeStruct((8, 2048, 4, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))

    def forward_backward(q, k, v):
        f = lambda q, k, v: attention(q, k, v, window=None, impl="splash", block_q=512, block_kv=512)
        return jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    on_tpu = jax.jit(on_mesh(mesh, forward_backward)).lower(x, x, x).compile()
    targets = collections.Counter(costmodel.CUSTOM_CALL.findall(on_tpu.as_text()))
    assert targets == {"tpu_custom_call": 3}  # forward, dq and dkv kernels
    assert 0 < on_tpu.cost_analysis()["optimal_seconds"] == costmodel.optimal_seconds(on_tpu) < 1e-3

    interpreted = jax.jit(forward_backward).lower(x, x, x).compile()
    raw = interpreted.cost_analysis()["optimal_seconds"]
    uncosted = sum(t in costmodel.UNCOSTED for t in costmodel.CUSTOM_CALL.findall(interpreted.as_text()))
    assert uncosted > 0 and raw < 0
    assert costmodel.optimal_seconds(interpreted) == pytest.approx(raw + uncosted)
    assert 0 <= costmodel.optimal_seconds(interpreted) < 1e-3


@needs_libtpu
@pytest.mark.tpu
def test_accumulation_predicts_what_one_micro_batch_of_all_rows_costs(monkeypatch):
    """4 rows per device as 2 micro-batches of 2 (an accumulation scan the compiler counts once) against the same 4
    rows in one micro-batch (no loop at all): the same work, so the same prediction within the efficiency the
    smaller matmuls lose."""
    import olmo3eqx.loss as loss_lib

    monkeypatch.setattr(loss_lib, "LOGITS_BUDGET", 1 << 40)
    accumulated = tiny(scan_layers=False, attention_impl="xla")
    layout, compiled = compile_on(accumulated, "v5p:2x2x1")
    assert layout.plan.accum_steps == 2
    predicted = costmodel.predict(accumulated, layout, compiled)
    assert [x.name for x in predicted.pieces] == ["step as compiled", "rest of a micro-batch"]
    whole = dataclasses.replace(accumulated, mesh=dataclasses.replace(accumulated.mesh, max_per_device_batch=4))
    _, flat = compile_on(whole, "v5p:2x2x1")
    assert predicted.seconds == pytest.approx(costmodel.optimal_seconds(flat), rel=0.15)
    assert costmodel.optimal_seconds(compiled) < 0.75 * costmodel.optimal_seconds(flat)
