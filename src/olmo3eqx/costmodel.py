"""XLA:TPU's predicted time of the train step, with every loop counted as often as it runs.

A program compiled for a TPU topology (olmo3eqx.aot) carries XLA:TPU's cost model: `cost_analysis()["optimal_seconds"]`,
the compiler's estimate of one run on one device. It is a model, not a measurement, and as it stands it is not the
step's time:

- a loop body counts once whatever its trip count: the layer scan (32 / 4 = 8 trips for the 7B), the gradient
  accumulation scan, the chunked loss (lax.map over the sequence);
- a Pallas kernel (splash attention: custom call `tpu_custom_call`) counts 0, and some ops it cannot cost count as a
  negative whole number of seconds: -1 for each custom call in UNCOSTED (the PrepareAsyncCall markers, seen around
  Pallas kernels run in interpret mode and in small train steps), -2 for a matmul fused into a reduction to a
  scalar. `optimal_seconds` adds the former back (counted in the compiled HLO) on the libtpu it was seen on
  (UNCOSTED_LIBTPU; on another the figure is the compiler's as it stands, and the prediction says so) and refuses
  a figure still negative.

`predict(cfg, layout, compiled)` therefore compiles the loop bodies alone, over the same devices and shardings, and
adds each as often as it runs beyond the once the step's own figure holds it:

    step = C(step) + (A - 1) U + (A G - 1) B + (A n - 1) K + A L

with A accumulation steps, G scan steps of the layer group, n loss chunks; B one scan step of the layer group
(forward, remat's recomputation, backward, with FSDP's parameter all-gathers and gradient reduce-scatters), K one
loss chunk (forward, recomputation, backward), U = C(step) - O - B - K the rest of a micro-batch (embedding, final
norm, gradient accumulation; O the optimizer update compiled alone, only needed when A > 1), and L the attention
kernels of one micro-batch, which the compiler does not cost (`splash_seconds`): splash's visited blocks at the
chip's bf16 peak, derated by the fraction of the matrix unit a head_dim-wide matmul fills. Only the kernels are
modelled by hand; everything else is the compiler's figure.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
import time
from dataclasses import dataclass

MXU_WIDTH = (("tpu7", 256), ("v6", 256), ("v5", 128), ("v4", 128))
"""Side of the matrix unit's systolic array by device kind (Ironwood and Trillium 256 x 256; v5p, v5e, v4 128 x 128):
a matmul whose contraction or output width is a head_dim narrower than it fills head_dim / width of the unit."""
SPLASH_MATMULS = 9
"""Matmuls splash runs per visited block pair and head: forward QK^T and PV; the dq kernel QK^T, dO V^T and dS K; the
dkv kernel QK^T, P^T dO, dO V^T and dS^T Q (jax's splash_attention_kernel, fused_bwd off as olmo3eqx builds it)."""
UNCOSTED = ("PrepareAsyncCallStart", "PrepareAsyncCallDone", "ConcatBitcast")
"""Custom-call targets XLA:TPU's cost model counts as -1 s each (libtpu 0.0.42.1: a splash forward + backward for 8
rows of 2048 tokens on tpu7x:2x2x1 in interpret mode has 9 + 9 of the first two and optimal_seconds -17.9998; with
16 rows one ConcatBitcast more and -20.9996); tests/test_costmodel.py checks it against the compiler."""
UNCOSTED_LIBTPU = ("0.0.42.1",)
"""The libtpu versions the -1 s per UNCOSTED custom call was seen on: a quirk of the compiler's cost model, so it is
added back only there (another libtpu may count those calls otherwise). `pytest -m tpu` checks it on the installed
libtpu (tests/test_costmodel.py), and fails there until this tuple names the new version."""
CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
PUBLISHED = (7, 1.08, 2.07)
"""(measurements, lowest and highest predicted / measured throughput) of the published runs of dense 7-8B models
that bench/bench_tpu_validate.py predicts at the configurations their sources state (docs/results/
tpu_validation.json, which tests/test_tpu_results.py keeps this equal to): how far a prediction was from real steps,
said beside every prediction."""


class CostModelError(ValueError):
    """The compiler gave no usable figure for a program."""


def libtpu_version() -> str | None:
    """The installed libtpu's version, None without one."""
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def adds_back() -> bool:
    """Whether optimal_seconds adds back the -1 s of each UNCOSTED custom call: only on a libtpu it was seen on."""
    return libtpu_version() in UNCOSTED_LIBTPU


def add_back_note() -> str:
    """What the prediction says about the add-back."""
    if adds_back():
        return f"-1 s per uncosted custom call added back (libtpu {libtpu_version()})"
    return (f"uncosted custom calls NOT added back: libtpu {libtpu_version()} is not the "
            f"{' or '.join(UNCOSTED_LIBTPU)} their -1 s was seen on")


def optimal_seconds(compiled) -> float:
    """XLA:TPU's `optimal_seconds` of a compiled program with the -1 s of each UNCOSTED custom call added back on the
    libtpu that was seen on (see the module doc); CostModelError when the backend has no cost model (XLA:CPU,
    XLA:GPU) or the figure is negative (ops it could not cost)."""
    cost = compiled.cost_analysis()
    raw = cost.get("optimal_seconds") if isinstance(cost, dict) else None
    if raw is None:
        raise CostModelError("this compiler reports no optimal_seconds (XLA:TPU's cost model only)")
    calls = sum(target in UNCOSTED for target in CUSTOM_CALL.findall(compiled.as_text()))
    added = calls if adds_back() else 0
    if raw + added < 0:
        raise CostModelError(f"XLA's optimal_seconds is {raw:.4f} with {calls} uncosted custom calls "
                             f"({add_back_note()}): ops it could not cost remain (a matmul fused into a reduction to a "
                             f"scalar counts -2)")
    return raw + added


def mxu_width(device_kind: str) -> int:
    kind = device_kind.lower()
    return next((w for key, w in MXU_WIDTH if key in kind), 128)


def visited_blocks(seq: int, bq: int, bkv: int, window: int | None) -> int:
    """Block pairs (query block, key block) holding at least one visible (query, key) pair under the causal mask
    (and a window of `window` keys including the query): the pairs splash computes."""
    count = 0
    for i in range(-(-seq // bq)):
        first_q, last_q = i * bq, min(seq, (i + 1) * bq) - 1
        for j in range(-(-seq // bkv)):
            first_k, last_k = j * bkv, min(seq, (j + 1) * bkv) - 1
            if first_k > last_q:
                break
            if window is not None and last_k <= first_q - window:
                continue  # every key of the block is outside every query's window
            count += 1
    return count


def splash_seconds(cfg, rows: int, seq: int, bq: int, bkv: int, heads: int, device_kind: str, peak: float) -> float:
    """The splash kernels' time for `rows` instances of `seq` tokens on one device (`heads` of them there), forward
    and backward over every layer: visited block pairs x SPLASH_MATMULS x 2 bq bkv head_dim FLOPs, at `peak` x
    min(1, head_dim / MXU width). A bound like the compiler's: no pipeline bubbles, softmax on other units."""
    from olmo3eqx.config import SLIDING

    m = cfg.model
    fill = min(1.0, m.head_dim / mxu_width(device_kind))
    pairs = sum(visited_blocks(seq, bq, bkv, m.sliding_window if kind == SLIDING else None)
                for kind in m.resolved_layer_types)
    flops = pairs * SPLASH_MATMULS * 2 * bq * bkv * m.head_dim * heads * rows
    return flops / (peak * fill)


@dataclass(frozen=True)
class Piece:
    """One term of the prediction: a program's predicted seconds and how many times the step adds it."""

    name: str
    seconds: float
    times: int | float


@dataclass(frozen=True)
class Prediction:
    """The step's predicted time on one device (every device runs the same program) and what it is made of."""

    pieces: tuple[Piece, ...]
    tokens_per_device: int
    """Tokens one device trains on per step."""
    model_flops: float
    """Model FLOPs per device and step (olmo3eqx.flops, window-aware)."""
    maxtext_flops: float
    """The same with every layer counted as global, MaxText's convention (the seed's TFLOP/s and MFU use it)."""
    peak: float | None
    attention: str
    """How attention's time was counted."""
    compile_s: float = 0.0
    """Time spent compiling the loop bodies alone."""
    add_back: str = ""
    """Whether the uncosted custom calls' -1 s was added back, and on which libtpu (add_back_note)."""

    @property
    def seconds(self) -> float:
        return sum(p.seconds * p.times for p in self.pieces)

    @property
    def mfu(self) -> float | None:
        return None if not self.peak else self.model_flops / self.seconds / self.peak

    def lines(self) -> list[str]:
        s = self.seconds
        out = [f"predicted step time:   {s:.3f} s per step (XLA:TPU's cost model, not a measurement: "
               f"olmo3eqx.costmodel), {self.tokens_per_device / s:,.0f} tokens/s per device, "
               f"{self.model_flops / s / 1e12:.1f} TFLOP/s per device"
               + (f", MFU {100 * self.mfu:.1f}%" if self.mfu is not None else "")
               + f" ({self.maxtext_flops / s / 1e12:.1f} TFLOP/s"
               + (f", {100 * self.maxtext_flops / s / self.peak:.1f}%" if self.peak else "")
               + " counting every layer as global, as MaxText does)"]
        count, low, high = PUBLISHED
        out.append(f"  against {count} published runs of 7-8B models this model predicted {low:.2f} to {high:.2f} "
                   f"times the throughput they measured" + (": read it as an upper bound" if low > 1 else "")
                   + " (docs/tpu-gpu.md#against-published-measurements)")
        out.append("  made of: " + "; ".join(f"{p.name} {1e3 * p.seconds:.2f} ms x {p.times:g}" for p in self.pieces)
                   + f"; attention counted as {self.attention}; loop bodies compiled alone in {self.compile_s:.0f} s"
                   + (f"; {self.add_back}" if self.add_back else ""))
        return out


def _compile(cfg, fn, mesh, *args, out_shardings=None):
    """`fn` compiled over `mesh` with the XLA:TPU flags the train step compiles with (mesh.tpu_flags)."""
    import jax

    from olmo3eqx.compile_cache import compile_only, uncached
    from olmo3eqx.precision import traced_gathering
    from olmo3eqx.sharding import on_mesh
    from olmo3eqx.step import tpu_compiler_options

    options = tpu_compiler_options(cfg, mesh) or None
    fn = on_mesh(mesh, traced_gathering(cfg.mesh.gather_dtype, fn))  # traced as the step is
    lowered = jax.jit(fn, out_shardings=out_shardings, compiler_options=options).lower(*args)
    with uncached() if compile_only(mesh.devices.flatten()) else contextlib.nullcontext():
        return lowered.compile()


def group_seconds(cfg, layout) -> float:
    """One scan step of the layer group (the layer-scan body) compiled alone: forward, recomputation and backward,
    parameters in float32 sharded as the model's (cast, or gathered, in the compute dtype inside, as the step does), the
    activations [micro-batch, seq, hidden] split over the batch axes."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from olmo3eqx.model import DTYPE, document_positions, for_compute, layer_group, rope_tables, scan_groups
    from olmo3eqx.sharding import batch_sharding, is_leaf_like

    m, mesh = cfg.model, layout.mesh
    period, _ = scan_groups(m)
    kinds = m.resolved_layer_types[:period]
    blocks, static = eqx.partition(layout.abstract.model.blocks, is_leaf_like)
    group = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct((period, *a.shape[1:]), a.dtype, sharding=s),
                         blocks, layout.shardings.model.blocks)
    seq, rows = cfg.data.seq_len, layout.plan.micro_batch
    dtype = DTYPE[m.compute_dtype]
    act = jax.ShapeDtypeStruct((rows, seq, m.hidden_size), dtype, sharding=batch_sharding(mesh, 3))
    seg = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=batch_sharding(mesh, 2)) if layout.packed else None

    def body(params, x, cotangent, segment_ids):
        tables = rope_tables(seq, m)
        if segment_ids is not None:
            positions = document_positions(segment_ids)
            tables = {kind: table.at(positions) for kind, table in tables.items()}
        run = layer_group(m, kinds, tables, segment_ids)
        _, vjp = jax.vjp(lambda p, h: run(h, for_compute(eqx.combine(p, static), dtype, path=("blocks",))), params, x)
        return vjp(cotangent)

    grads = (jax.tree.map(lambda a: a.sharding, group), act.sharding)
    return optimal_seconds(_compile(cfg, body, mesh, group, act, act, seg, out_shardings=grads))


def chunk_plan_on(mesh, rows: int, seq: int, vocab: int) -> tuple[int, int]:
    """(positions per chunk, chunks) the chunked loss takes for [rows, seq] under `mesh` (loss.chunk_plan)."""
    import jax

    from olmo3eqx.loss import chunk_plan

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return chunk_plan(rows, seq, vocab)


def chunk_seconds(cfg, layout) -> tuple[float, int]:
    """(one loss chunk compiled alone, chunks per micro-batch): the chunked loss's lax.map body with the chunk the
    step picks, unembedding (the float32 LM head cast inside, as the step does), cross-entropy and z-loss, forward,
    recomputation (when there are several chunks) and backward."""
    import jax
    import jax.numpy as jnp

    from olmo3eqx.loss import ce_and_z, unembed_then
    from olmo3eqx.model import DTYPE
    from olmo3eqx.sharding import batch_sharding

    m, mesh = cfg.model, layout.mesh
    rows, seq = layout.plan.micro_batch, cfg.data.seq_len
    chunk, chunks = chunk_plan_on(mesh, rows, seq, m.vocab_size)
    weight = layout.abstract.model.lm_head.weight
    head = jax.ShapeDtypeStruct(weight.shape, weight.dtype, sharding=layout.shardings.model.lm_head.weight)
    h = jax.ShapeDtypeStruct((rows, chunk, m.hidden_size), DTYPE[m.compute_dtype], sharding=batch_sharding(mesh, 3))
    ys = jax.ShapeDtypeStruct((rows, chunk), jnp.int32, sharding=batch_sharding(mesh, 2))
    ct = jax.ShapeDtypeStruct((rows, chunk), jnp.float32, sharding=batch_sharding(mesh, 2))

    def body(h, weight, y, cotangent):
        def fn(a, b):
            return unembed_then(ce_and_z(cfg.optim.z_loss), b)(a, y)

        _, vjp = jax.vjp(jax.checkpoint(fn) if chunks > 1 else fn, h, weight)
        return vjp((cotangent, cotangent))

    if chunks > 1 and local_loss(cfg, mesh, rows):
        # the step's loss.per_device: each device's rows against the LM head gathered once, its gradient summed on
        # the device (reduced once a step, outside the chunk loop: part of the step's own figure)
        from jax.sharding import PartitionSpec as P

        from olmo3eqx.sharding import BATCH_AXES

        rows_spec = P(BATCH_AXES)
        body = jax.shard_map(body, mesh=mesh, in_specs=(rows_spec, P(), rows_spec, rows_spec),
                             out_specs=(rows_spec, P()), check_vma=False)
        head = jax.ShapeDtypeStruct(weight.shape, DTYPE[m.compute_dtype],
                                    sharding=jax.sharding.NamedSharding(mesh, P()))
    seconds = optimal_seconds(_compile(cfg, body, mesh, h, head, ys, ct, out_shardings=(h.sharding, head.sharding)))
    return seconds, chunks


def local_loss(cfg, mesh, rows: int) -> bool:
    """Whether the step's chunked loss maps each device's rows on their own (loss.rows_per_device, in cfg's
    mesh.gather_dtype)."""
    import jax

    from olmo3eqx.loss import rows_per_device
    from olmo3eqx.precision import gathering

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), gathering(cfg.mesh.gather_dtype):
        return rows_per_device(rows)


def optimizer_seconds(cfg, layout) -> float:
    """The optimizer update alone (gradient norm, AdamW, the new parameters) on the state's shardings: what a step
    runs once after its micro-batches."""
    import equinox as eqx
    import jax
    import optax

    from olmo3eqx import optim

    state = layout.state_target()
    params = eqx.filter(state.model, lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def body(grads, opt_state, params):
        updates, new_state = layout.optimizer.update(grads, opt_state, params, step=1)
        return optax.apply_updates(params, updates), new_state, optim.global_norm(grads)

    return optimal_seconds(_compile(cfg, body, layout.mesh, params, state.opt_state, params))


def predict(cfg, layout, compiled) -> Prediction:
    """The step's predicted time from its compiled program `compiled` (for a TPU topology) and its loop bodies
    compiled alone (see the module doc)."""
    import jax

    from olmo3eqx import flops
    from olmo3eqx.attention import resolve, shard_spec, splash_blocks
    from olmo3eqx.model import DTYPE, scan_groups

    m, plan, mesh = cfg.model, layout.plan, layout.mesh
    device = mesh.devices.flat[0]
    seq = cfg.data.seq_len
    accum = plan.accum_steps
    _, groups = scan_groups(m)
    start = time.perf_counter()
    step = optimal_seconds(compiled)
    group = group_seconds(cfg, layout) if groups > 1 else 0.0
    chunk, chunks = chunk_seconds(cfg, layout)
    if chunks == 1:
        chunk = 0.0
    rest = 0.0
    optimizer = 0.0
    if accum > 1:
        optimizer = optimizer_seconds(cfg, layout)
        rest = step - optimizer - group - chunk
    pieces = [Piece("step as compiled", step, 1)]
    if accum > 1:
        pieces.append(Piece("rest of a micro-batch", rest, accum - 1))
    if groups > 1:
        pieces.append(Piece(f"layer group ({m.num_hidden_layers // groups} layers)", group, accum * groups - 1))
    if chunks > 1:
        pieces.append(Piece(f"loss chunk ({seq // chunks} positions)", chunk, accum * chunks - 1))
    peak = flops.peak_flops(device)
    tokens = layout.tokens_per_device(seq)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        backend = resolve(m.attention_impl, DTYPE[m.compute_dtype], documents=layout.packed, seq=seq)
        padded, bq, bkv = splash_blocks(seq, m.attention_block_q, m.attention_block_kv, m.head_dim)
    if backend == "splash" and peak:
        spec = shard_spec(mesh, (plan.micro_batch, seq, m.num_attention_heads, m.head_dim), m.num_key_value_heads)
        heads = m.num_attention_heads // (mesh.shape["tensor"] if spec[-2] == "tensor" else 1)
        rows = plan.per_device_batch if spec[0] is not None else plan.micro_batch
        attention = splash_seconds(cfg, rows, padded, bq, bkv, heads, device.device_kind, peak)
        pieces.append(Piece("splash kernels", attention, accum))
        how = (f"splash's visited {bq}x{bkv} blocks, {SPLASH_MATMULS} matmuls each, at the bf16 peak x "
               f"{min(1.0, m.head_dim / mxu_width(device.device_kind)):g} (head_dim {m.head_dim} on a "
               f"{mxu_width(device.device_kind)}-wide matrix unit)")
    else:
        how = "the compiler counts it (XLA attention)"
    per_token = flops.train_flops_per_token(m, seq)
    maxtext = flops.train_flops_per_token(m, seq, window_aware=False)
    return Prediction(tuple(pieces), tokens, per_token * tokens, maxtext * tokens, peak, how,
                      time.perf_counter() - start, add_back_note())
