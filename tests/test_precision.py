"""mesh.gather_dtype: weights all-gathered over fsdp in the compute dtype, gradients reduced in float32 (olmo3eqx.precision),
read from the partitioned program, and the numbers it trains with against the compiler's own placement ("xla").

The collectives are read from the program as XLA's SPMD partitioner leaves it, before XLA:CPU's own passes: on CPU,
all-reduce-promotion and float-normalization-bf16 then widen every bfloat16 collective to float32 (the CPU runtime runs
none), so the compiled text of a CPU program says float32 whatever the program asked for. XLA:TPU keeps them: the
default run's step (configs/tiny.yaml, bfloat16 compute) compiled for v5p:2x2x1 has 29 bfloat16 gradient all-reduces
with "xla", as its CPU program has as partitioned, and none with "compute" (docs/design.md).
"""

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx.compile_cache import uncached
from olmo3eqx.config import FULL, SLIDING, ConfigError, DataConfig, MeshConfig, ModelConfig, OptimConfig, TrainConfig
from olmo3eqx.loss import label_weights
from olmo3eqx.model import cast_floating, scan_groups
from olmo3eqx.precision import traced_gathering
from olmo3eqx.sharding import batch_sharding, build_layout, on_mesh
from olmo3eqx.step import make_train_step, micro_batch_loss

MODEL = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    layer_types=(SLIDING, FULL) * 2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    sliding_window=8, eos_token_id=1, pad_token_id=2, compute_dtype="bfloat16")
"""Two periods of (sliding, full): the layers run as a scan of two steps (model.scan_groups), so the per-layer gathers
are the scan body's."""
SEQ, BATCH = 32, 8

COLLECTIVE = re.compile(r"= (?P<type>\([^=]*?\)|\w+\[[\d,]*\]\S*) (?P<op>all-gather|all-reduce|reduce-scatter)"
                        r"(?:-start)?\(.*?replica_groups=(?P<groups>\{[{}\d,]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                        r"|mesh\[[^\]]*\](?:, device_ids=\([^)]*\))? \{[^}]*\})")


def cfg_for(compute: str, gather: str, fsdp: int, tensor: int = 1) -> TrainConfig:
    return TrainConfig(steps=10, model=dataclasses.replace(MODEL, compute_dtype=compute),
                       data=DataConfig(seq_len=SEQ, global_batch=BATCH), optim=OptimConfig(lr=1e-3, warmup_steps=2),
                       mesh=MeshConfig(fsdp=fsdp, tensor=tensor, max_per_device_batch=BATCH, gather_dtype=gather))


def iota(dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(int(np.prod([int(d) for d in dims.split(",")]))).reshape([int(d) for d in dims.split(",")])
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(text: str, n: int) -> list[np.ndarray]:
    """The partition ids of each group of an HLO replica_groups attribute, in any of its three spellings."""
    if text.startswith("{"):
        groups = [np.array([int(i) for i in g.split(",")]) for g in re.findall(r"\{([\d,]+)\}", text)]
        return groups or [np.arange(n)]
    if text.startswith("["):
        g, s, dims, perm = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text).groups()
        return list(iota(dims, perm).reshape(int(g), int(s)))
    sizes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", text.split("]")[0])]
    ids = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", text)
    grid = (iota(*ids.groups()) if ids else np.arange(n)).reshape([s for _, s in sizes])
    moving = [i for i, (name, _) in enumerate(sizes) if f"'{name}'" in text.split("{")[-1]]
    fixed = [i for i in range(len(sizes)) if i not in moving]
    return list(grid.transpose(fixed + moving).reshape(-1, int(np.prod([sizes[i][1] for i in moving]))))


def collectives(hlo: str, mesh) -> list[tuple[str, set[str], set[str]]]:
    """(op, its floating dtypes, the mesh axes its groups span) of every all-gather, all-reduce and reduce-scatter.
    Partition i is the mesh's i-th device in row-major order."""
    out = []
    for m in COLLECTIVE.finditer(hlo):
        dtypes = set(re.findall(r"(bf16|f16|f32|f64)\[", m["type"]))
        axes = set()
        for group in replica_groups(m["groups"], mesh.devices.size):
            coords = np.stack(np.unravel_index(group, mesh.devices.shape))
            axes |= {name for name, c in zip(mesh.axis_names, coords) if len(set(c)) > 1}
        if dtypes:
            out.append((m["op"], dtypes, axes))
    return out


def partitioned_hlo(cfg: TrainConfig, tmp_path) -> tuple[str, object]:
    """The train step's program right after SPMD partitioning (before XLA:CPU widens its collectives), and its mesh."""
    layout = build_layout(cfg)
    step = make_train_step(cfg, layout)
    with uncached():  # a cached executable comes back without the dump
        step.lower(layout.state_target(), *layout.batch_target(SEQ)).compile(
            {"xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "all-reduce-promotion"})
    [dump] = tmp_path.glob("*jit_train_step*before_all-reduce-promotion.txt")
    return dump.read_text(), layout.mesh


def over_batch_axes(found, op: str) -> list[set[str]]:
    return [dtypes for kind, dtypes, axes in found if kind in op.split("|") and axes & {"data", "fsdp"}]


@pytest.mark.parametrize("fsdp,tensor", [(8, 1), (4, 2)])
def test_weights_gather_in_bfloat16_and_gradients_reduce_in_float32(tmp_path, fsdp, tensor):
    found = collectives(*partitioned_hlo(cfg_for("bfloat16", "compute", fsdp, tensor), tmp_path))
    gathers, reductions = over_batch_axes(found, "all-gather"), over_batch_axes(found, "all-reduce|reduce-scatter")
    assert len(gathers) >= 7 and len(reductions) >= 7, found  # at least one layer's seven projections
    assert all(d == {"bf16"} for d in gathers), gathers
    assert all(d == {"f32"} for d in reductions), reductions


def test_the_compiler_alone_reduces_weight_gradients_in_bfloat16(tmp_path):
    """The program mesh.gather_dtype "xla" keeps (today's, to measure against): its weight gradients are summed over
    fsdp in bfloat16, straight after the matmuls that produce them."""
    hlo, mesh = partitioned_hlo(cfg_for("bfloat16", "xla", 8), tmp_path)
    reductions = over_batch_axes(collectives(hlo, mesh), "all-reduce|reduce-scatter")
    assert sum(d == {"bf16"} for d in reductions) >= MODEL.num_hidden_layers, reductions


def batch():
    rng = np.random.default_rng(0)
    return rng.integers(0, MODEL.vocab_size, (BATCH, SEQ)).astype(np.int32), np.ones(BATCH, np.float32)


def step_once(cfg):
    layout = build_layout(cfg)
    state, metrics = make_train_step(cfg, layout)(layout.init_state(cfg), *batch())
    return metrics, [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))]


@pytest.mark.parametrize("compute,fsdp,same", [("float32", 8, True), ("bfloat16", 1, True), ("bfloat16", 8, False)])
def test_without_bfloat16_or_fsdp_it_is_the_same_program(compute, fsdp, same):
    """Float32 compute, or no fsdp axis (data parallel over 8): "compute" adds no op to what "xla" traces (and with
    both, it does)."""

    def lowered(gather):
        cfg = dataclasses.replace(cfg_for(compute, gather, fsdp), mesh=MeshConfig(
            data=8 // fsdp, fsdp=fsdp, max_per_device_batch=BATCH, gather_dtype=gather))
        layout = build_layout(cfg)
        return make_train_step(cfg, layout).lower(layout.state_target(), *layout.batch_target(SEQ)).as_text()

    assert (lowered("compute") == lowered("xla")) == same


def test_the_layers_run_as_a_scan():
    assert scan_groups(MODEL) == (2, 2)


def test_float32_compute_trains_the_same_either_way():
    (m_c, p_c), (m_x, p_x) = (step_once(cfg_for("float32", g, 8)) for g in ("compute", "xla"))
    for key in ("train/loss", "train/grad_norm"):
        np.testing.assert_allclose(float(m_c[key]), float(m_x[key]), rtol=1e-6)
    for a, b in zip(p_c, p_x):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def gradients(cfg):
    """d loss / d float32 parameters as the step takes them, on cfg's mesh with cfg's gather_dtype."""
    layout = build_layout(cfg)
    mesh = layout.mesh

    def grad(model, tokens, mask):
        params = cast_floating(model, jnp.float32)
        total = jnp.sum(label_weights(tokens, mask))
        fn = eqx.filter_grad(lambda p: micro_batch_loss(p, tokens, mask, 0.0, total)[0])
        return eqx.filter(fn(params), eqx.is_array)

    fn = jax.jit(on_mesh(mesh, traced_gathering(cfg.mesh.gather_dtype, grad)),
                 in_shardings=(layout.shardings.model, batch_sharding(mesh, 2), batch_sharding(mesh, 1)),
                 out_shardings=layout.shardings.model)
    return fn(layout.init_state(cfg).model, *batch())


def test_bfloat16_weight_gradients_are_not_rounded_before_their_reduction():
    """At bfloat16 compute "compute" and "xla" agree to bfloat16's rounding, but only "xla"'s projection gradients
    are bfloat16 numbers (each device's partial sum rounded, and the sum): "compute" accumulates and reduces them in
    float32."""
    g_c, g_x = (gradients(cfg_for("bfloat16", g, 8)) for g in ("compute", "xla"))
    for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_x)):
        a, b = np.asarray(a), np.asarray(b)
        # "xla" rounds each device's partial sum and their sum to bfloat16 (8 significant bits); near-cancelling
        # elements carry that error at the partials' scale: seen up to 1.0e-2 of a leaf's largest gradient.
        np.testing.assert_allclose(a, b, atol=2e-2 * np.abs(b).max())
    for name, leaf in (("q_proj", lambda g: g.blocks.attn.q_proj.weight),
                       ("down_proj", lambda g: g.blocks.mlp.down_proj.weight)):
        c, x = np.asarray(leaf(g_c)), np.asarray(leaf(g_x))
        in_bf16 = lambda v: np.mean(v.astype(jnp.bfloat16).astype(np.float32) == v)  # noqa: E731
        assert in_bf16(x) == 1.0, name
        assert in_bf16(c) < 0.1, name


def test_gather_dtype_is_checked():
    cfg = MeshConfig()
    object.__setattr__(cfg, "gather_dtype", "bf16")  # past the suite's own type check of the constructor
    with pytest.raises(ConfigError, match=r"mesh.gather_dtype must be one of \('compute', 'xla'\), got 'bf16'"):
        cfg.__post_init__()


def test_a_chunked_loss_reduces_the_lm_head_gradient_once(monkeypatch):
    """With the loss unembedded a few positions at a time (a small LOGITS_BUDGET: 16 chunks here, as the 7B's 64),
    "xla" reduces the LM head's gradient over the batch axes in every chunk; "compute" maps each device's rows on
    their own (loss.per_device) and reduces it once: the float32 bytes reduced per step are then 4 x the parameters,
    counted from their shapes, each gradient once. Every gradient stays that of "xla" (float32 compute) to float32
    rounding (summed in another order); test_step checks the chunked loss against numpy."""
    from olmo3eqx import aot
    from olmo3eqx import loss as loss_lib

    def reduced_bytes(cfg):
        layout = build_layout(cfg)
        traffic = aot.compile_step(cfg, layout).collectives
        return sum(c.count * c.raw.get("f32", 0) for c in traffic.collectives
                   if c.kind in ("all-reduce", "reduce-scatter"))

    monkeypatch.setattr(loss_lib, "LOGITS_BUDGET", 1 << 10)  # 1 row x 128 vocab a device: chunks of 8 positions
    assert loss_lib.loss_chunk(1, SEQ, MODEL.vocab_size) == 8
    params = sum(x.size for x in jax.tree.leaves(build_layout(cfg_for("float32", "xla", 8)).abstract.model))
    head = MODEL.vocab_size * MODEL.hidden_size
    assert 4 * params <= reduced_bytes(cfg_for("float32", "compute", 8)) < 4 * (params + head)
    assert reduced_bytes(cfg_for("float32", "xla", 8)) >= 4 * (params + (SEQ // 8 - 1) * head)
    g_c, g_x = (jax.tree.leaves(gradients(cfg_for("float32", g, 8))) for g in ("compute", "xla"))
    for a, b in zip(g_c, g_x, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))


@pytest.mark.slow  # ~20 s: tests/test_accumulation.py measures the bytes across nodes in the default suite
def test_on_two_nodes_only_data_crosses_and_the_gradients_stay(monkeypatch):
    """Two nodes of 4 devices (mesh.node_devices 4, data 2 x fsdp 4), bfloat16 compute, the loss in chunks: every
    weight's gathers and gradient reduce-scatters stay within a node, and across nodes only the data axis runs,
    save what is replicated, which every data-parallel step sums over all devices (loss sums, the norm weights'
    gradients: no more bytes than those leaves hold). Left to the partitioner the embedding's and LM head's gradients were reduced over every
    device at once (loss.per_device, precision.hierarchical). The gradients are "xla"'s to bfloat16's rounding."""
    from olmo3eqx import aot
    from olmo3eqx import loss as loss_lib

    monkeypatch.setattr(loss_lib, "LOGITS_BUDGET", 1 << 10)

    def on_two_nodes(gather):
        cfg = cfg_for("bfloat16", gather, 4)
        return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data=2, node_devices=4))

    cfg = on_two_nodes("compute")
    layout = build_layout(cfg)
    traffic = aot.compile_step(cfg, layout).collectives
    assert traffic.total(True) > 0
    replicated = sum(leaf.size for leaf, s in zip(jax.tree.leaves(layout.abstract.model),
                                                  jax.tree.leaves(layout.shardings.model))
                     if "fsdp" not in jax.tree.leaves(tuple(s.spec)))
    spanning = sum(c.count * sum(c.raw.values()) for c in traffic.collectives if c.across and set(c.axes) - {"data"})
    assert spanning <= 4 * replicated + 1024, traffic.lines()  # the replicated leaves' gradients and a few scalars
    assert all(r.axes == ("fsdp",) for r in traffic.rows if r.kind in ("all-gather", "reduce-scatter")), \
        traffic.lines()
    g_c, g_x = (jax.tree.leaves(gradients(on_two_nodes(g))) for g in ("compute", "xla"))
    for a, b in zip(g_c, g_x, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-2 * float(np.abs(np.asarray(b)).max()))
