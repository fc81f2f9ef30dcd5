"""olmo3eqx.costmodel: the step's predicted time with every loop counted.

On CPU: the block count splash visits against brute force; the splash model's FLOPs against XLA's count of a
reference blocked attention (splash's three kernels written in JAX over the block pairs a brute-force mask visits,
checked against dense attention's gradients); the loss chunk the step picks under a mesh; the prediction's
arithmetic; the -1 s add-back only on the libtpu it was seen on. Under the `tpu` marker (libtpu, `pytest -m tpu`):
XLA:TPU itself is the reference: the prediction of a program without loops is the compiler's own figure, a layer
scan's prediction matches the unrolled program's figure, and the custom calls the cost model counts as -1 s are the
ones UNCOSTED names, on the installed libtpu.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
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


def visible_mask(seq: int, window: int | None) -> np.ndarray:
    """[query, key]: causal, and within `window` keys including the query itself."""
    q, k = np.arange(seq)[:, None], np.arange(seq)[None, :]
    return (k <= q) & ((q - k < window) if window is not None else True)


def reference_splash_kernels(seq: int, bq: int, bkv: int, window: int | None):
    """Splash's three kernels (jax's splash_attention_kernel, fused backward off, as olmo3eqx builds it) written in
    JAX over the block pairs that hold a visible (query, key) pair, by brute force: the forward (scores, online
    softmax, PV), the dq kernel (scores and dO V^T recomputed, dS K) and the dkv kernel (scores and dO V^T
    recomputed, P^T dO, dS^T Q). Arrays are [batch x heads, seq, head_dim]. Three functions, compiled apart as the
    kernels run apart, so XLA cannot share the recomputed scores between them."""
    visible = visible_mask(seq, window)
    pairs = [(i, j) for i in range(seq // bq) for j in range(seq // bkv)
             if visible[i * bq:(i + 1) * bq, j * bkv:(j + 1) * bkv].any()]
    rows = lambda x, i: x[:, i * bq:(i + 1) * bq]
    cols = lambda x, j: x[:, j * bkv:(j + 1) * bkv]

    def scores(q, k, i, j):
        s = jnp.einsum("nqd,nkd->nqk", rows(q, i), cols(k, j)) * q.shape[-1] ** -0.5
        return jnp.where(visible[i * bq:(i + 1) * bq, j * bkv:(j + 1) * bkv], s, -jnp.inf)

    def forward(q, k, v):
        out, lse = [], []
        for i in range(seq // bq):
            m = jnp.full(rows(q, i).shape[:2], -jnp.inf)
            total, acc = jnp.zeros(m.shape), jnp.zeros(rows(q, i).shape)
            for j in (j for a, j in pairs if a == i):
                s = scores(q, k, i, j)
                new = jnp.maximum(m, s.max(-1))
                p, shrink = jnp.exp(s - new[..., None]), jnp.exp(m - new)
                total = total * shrink + p.sum(-1)
                acc = acc * shrink[..., None] + jnp.einsum("nqk,nkd->nqd", p, cols(v, j))
                m = new
            out.append(acc / total[..., None])
            lse.append(m + jnp.log(total))
        return jnp.concatenate(out, 1), jnp.concatenate(lse, 1)

    def grad_scores(q, k, v, do, lse, delta, i, j):
        p = jnp.exp(scores(q, k, i, j) - rows(lse, i)[..., None])
        dp = jnp.einsum("nqd,nkd->nqk", rows(do, i), cols(v, j))
        return p, p * (dp - rows(delta, i)[..., None]) * q.shape[-1] ** -0.5

    def dq_kernel(q, k, v, do, lse, delta):
        dq = []
        for i in range(seq // bq):
            acc = jnp.zeros(rows(q, i).shape)
            for j in (j for a, j in pairs if a == i):
                _, ds = grad_scores(q, k, v, do, lse, delta, i, j)
                acc = acc + jnp.einsum("nqk,nkd->nqd", ds, cols(k, j))
            dq.append(acc)
        return jnp.concatenate(dq, 1)

    def dkv_kernel(q, k, v, do, lse, delta):
        dk, dv = [], []
        for j in range(seq // bkv):
            acc_k = acc_v = jnp.zeros(cols(k, j).shape)
            for i in (i for i, b in pairs if b == j):
                p, ds = grad_scores(q, k, v, do, lse, delta, i, j)
                acc_v = acc_v + jnp.einsum("nqk,nqd->nkd", p, rows(do, i))
                acc_k = acc_k + jnp.einsum("nqk,nqd->nkd", ds, rows(q, i))
            dk.append(acc_k)
            dv.append(acc_v)
        return jnp.concatenate(dk, 1), jnp.concatenate(dv, 1)

    return forward, dq_kernel, dkv_kernel


def reference_flops_checked(seq: int, bq: int, bkv: int, window: int | None, n: int, head_dim: int) -> float:
    """XLA's FLOPs (cost analysis of the compiled programs) of the reference kernels' forward and backward, after
    checking their output and gradients against dense attention's."""
    forward, dq_kernel, dkv_kernel = reference_splash_kernels(seq, bq, bkv, window)
    q, k, v, do = (jnp.asarray(x, jnp.float32) for x in np.random.default_rng(0).normal(size=(4, n, seq, head_dim)))
    fwd = jax.jit(forward).lower(q, k, v).compile()
    out, lse = fwd(q, k, v)
    delta = (out * do).sum(-1)
    bwd = [jax.jit(f).lower(q, k, v, do, lse, delta).compile() for f in (dq_kernel, dkv_kernel)]
    dq, (dk, dv) = (f(q, k, v, do, lse, delta) for f in bwd)

    def dense(q, k, v):
        s = jnp.einsum("nqd,nkd->nqk", q, k) * head_dim ** -0.5
        return jnp.einsum("nqk,nkd->nqd", jax.nn.softmax(jnp.where(visible_mask(seq, window), s, -jnp.inf)), v)

    want, vjp = jax.vjp(dense, q, k, v)
    for got, ref in zip((out, dq, dk, dv), (want, *vjp(do)), strict=True):
        np.testing.assert_allclose(got, ref, atol=2e-5)
    return sum(c.cost_analysis()["flops"] for c in (fwd, *bwd))


def test_splash_model_counts_the_flops_of_a_reference_blocked_attention():
    """The splash model's FLOPs (its seconds x the peak it divides by) equal XLA's count of the reference kernels'
    forward and backward for the same layers, rows and heads, within the softmax's elementwise work (~1%). The
    window of 129 keys puts a block edge on the mask's boundary: counting the block two behind the diagonal, an
    off-by-one in the visited set, would add a sixth pair to the sliding layers' 5; 8 matmuls per pair instead of 9
    would be 11% short."""
    seq, bq, bkv, rows, heads, head_dim, window = 384, 128, 128, 2, 2, 128, 129
    m = ModelConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=heads, num_key_value_heads=heads,
                    head_dim=head_dim, sliding_window=window, intermediate_size=512, vocab_size=512, eos_token_id=0,
                    pad_token_id=1)
    sliding, full = (reference_flops_checked(seq, bq, bkv, w, rows * heads, head_dim) for w in (window, None))
    peak = 1e12  # a v5 device: head_dim 128 fills its 128-wide matrix unit, so the model's time is FLOPs / peak
    model = splash_seconds(TrainConfig(model=m), rows, seq, bq, bkv, heads, "TPU v5", peak) * peak
    assert model == pytest.approx(3 * sliding + full, rel=0.02)  # OLMo's pattern at 4 layers: 3 sliding, 1 global


def test_splash_time_derates_heads_narrower_than_the_matrix_unit():
    """head_dim 128 fills half of Ironwood's 256-wide matrix unit and all of v5p's 128-wide one: the same FLOPs take
    twice the time on Ironwood at the same peak; 16 heads of 256 (the same FLOPs) fill both."""
    m = ModelConfig(num_hidden_layers=4, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                    head_dim=128, sliding_window=4096, intermediate_size=11008, vocab_size=100352)
    wide = dataclasses.replace(m, num_attention_heads=16, num_key_value_heads=16, head_dim=256)
    seconds = {(kind, cfg.model.head_dim): splash_seconds(cfg, 4, 8192, 2048, 2048, cfg.model.num_attention_heads,
                                                          kind, 1e15)
               for kind in ("TPU7x", "TPU v5") for cfg in (TrainConfig(model=m), TrainConfig(model=wide))}
    assert seconds["TPU7x", 128] == pytest.approx(2 * seconds["TPU v5", 128])
    assert seconds["TPU7x", 256] == pytest.approx(seconds["TPU v5", 256]) == pytest.approx(seconds["TPU v5", 128])


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
    count, low, high = costmodel.PUBLISHED
    assert f"against {count} published runs of 7-8B models this model predicted {low:.2f} to {high:.2f}" in text
    assert "group 250.00 ms x 7" in text


class CompiledStandIn:
    """What optimal_seconds reads of a compiled program: its cost analysis and its HLO text."""

    def __init__(self, seconds: float, custom_calls: list[str]):
        self.seconds, self.text = seconds, "\n".join(f'custom_call_target="{t}"' for t in custom_calls)

    def cost_analysis(self):
        return {"optimal_seconds": self.seconds}

    def as_text(self):
        return self.text


def test_uncosted_calls_are_added_back_only_on_the_libtpu_they_were_seen_on(monkeypatch):
    calls = ["PrepareAsyncCallStart", "PrepareAsyncCallDone", "ConcatBitcast", "tpu_custom_call"]  # 3 uncosted
    seen = costmodel.UNCOSTED_LIBTPU[0]
    monkeypatch.setattr(costmodel, "libtpu_version", lambda: seen)
    assert costmodel.optimal_seconds(CompiledStandIn(-2.5, calls)) == pytest.approx(0.5)
    assert "added back" in costmodel.add_back_note() and "NOT" not in costmodel.add_back_note()
    monkeypatch.setattr(costmodel, "libtpu_version", lambda: "0.0.99")
    assert costmodel.optimal_seconds(CompiledStandIn(0.75, calls)) == 0.75  # the compiler's figure as it stands
    with pytest.raises(costmodel.CostModelError, match=r"-2\.5000 with 3 uncosted custom calls \(uncosted custom "
                                                       r"calls NOT added back: libtpu 0\.0\.99 is not"):
        costmodel.optimal_seconds(CompiledStandIn(-2.5, calls))
    p = Prediction((Piece("step", 1.0, 1),), 1000, 1e12, 1e12, 1e12, "by hand", add_back=costmodel.add_back_note())
    assert "NOT added back: libtpu 0.0.99" in "\n".join(p.lines())


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
    from olmo3eqx.compile_cache import uncached
    from olmo3eqx.sharding import build_layout
    from olmo3eqx.step import make_train_step

    layout = build_layout(cfg, topology_devices(topology))
    step = make_train_step(cfg, layout)
    with uncached():  # a compile-only topology's executable cannot be loaded back from the cache (compile_cache.compile_only)
        return layout, step.lower(layout.state_target(), *layout.batch_target(cfg.data.seq_len)).compile()


@needs_libtpu
@pytest.mark.tpu
@pytest.mark.tpu_small
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
@pytest.mark.tpu_small
def test_splash_counts_zero_and_uncosted_custom_calls_minus_one_second_each():
    """Splash compiled for the TPU (under the mesh, as the step runs it) is one `tpu_custom_call` per kernel, which
    the cost model counts as 0 s; the same kernel traced without the mesh runs in Pallas' interpret mode, whose
    PrepareAsyncCall custom calls the model counts as -1 s each (UNCOSTED) on the installed libtpu, one of
    UNCOSTED_LIBTPU: optimal_seconds adds them back. On another libtpu this test fails first, naming it."""
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

    assert costmodel.adds_back(), (f"libtpu {costmodel.libtpu_version()}: if the assertions below hold on it, add it "
                                   f"to costmodel.UNCOSTED_LIBTPU")
    interpreted = jax.jit(forward_backward).lower(x, x, x).compile()
    raw = interpreted.cost_analysis()["optimal_seconds"]
    uncosted = sum(t in costmodel.UNCOSTED for t in costmodel.CUSTOM_CALL.findall(interpreted.as_text()))
    assert uncosted > 0 and raw < 0
    assert costmodel.optimal_seconds(interpreted) == pytest.approx(raw + uncosted)
    assert 0 <= costmodel.optimal_seconds(interpreted) < 1e-3


@needs_libtpu
@pytest.mark.tpu
@pytest.mark.tpu_small
def test_accumulation_predicts_what_one_micro_batch_of_all_rows_costs(monkeypatch):
    """4 rows per device as 2 micro-batches of 2 (an accumulation scan the compiler counts once) against the same 4
    rows in one micro-batch (no loop at all): the same work, so the same prediction within the efficiency the
    smaller matmuls lose and the embedding gradient's second reduction."""
    import olmo3eqx.loss as loss_lib

    monkeypatch.setattr(loss_lib, "LOGITS_BUDGET", 1 << 40)
    accumulated = tiny(scan_layers=False, attention_impl="xla")
    layout, compiled = compile_on(accumulated, "v5p:2x2x1")
    assert layout.plan.accum_steps == 2
    predicted = costmodel.predict(accumulated, layout, compiled)
    assert [x.name for x in predicted.pieces] == ["step as compiled", "rest of a micro-batch"]
    whole = dataclasses.replace(accumulated, mesh=dataclasses.replace(accumulated.mesh, max_per_device_batch=4))
    _, flat = compile_on(whole, "v5p:2x2x1")
    # rel 0.2: besides the smaller matmuls, each micro-batch reduces its embedding gradient (the whole table's, as
    # FSDP does per micro-batch: precision.hierarchical), which the one-micro-batch program does once (seen: +16%)
    assert predicted.seconds == pytest.approx(costmodel.optimal_seconds(flat), rel=0.2)
    assert costmodel.optimal_seconds(compiled) < 0.75 * costmodel.optimal_seconds(flat)
