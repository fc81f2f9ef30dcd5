"""Causal attention backends behind one call, each checked against `jax.nn.dot_product_attention` and a numpy
reference in tests/test_attention.py (splash: tests/test_splash.py).

Window semantics for every backend: a sliding layer with window W lets query i see keys j with
i - W + 1 <= j <= i (W keys including itself, as `transformers`' `sliding_window`); a global layer is causal.

- "xla": `jax.nn.dot_product_attention`'s XLA implementation: [heads, T, T] scores for every layer, the window a
  mask over them.
- "cudnn": the same call with cuDNN's fused flash attention (GPU only, bf16/fp16; the window is passed to the
  kernel); with documents, cuDNN's packed layout (olmo3eqx.cudnn_packed).
- "cudnn-cp-compiled-only": "cudnn", and with the sequence split over mesh.context cuDNN's kernels for chunks that
  continue a document from an earlier rank (olmo3eqx.cudnn_context); compiled by XLA:GPU, not yet run on a GPU (on
  CPU its parts run in XLA's math: tests), so opt-in: "auto" and "cudnn" split sequences run flash.
- "blocked": window-aware blocks in plain einsums (XLA differentiates them). Queries go in blocks of C positions.
  A sliding layer's block sees only the key blocks that can reach it, T x (W + C) scores instead of T x T;
  a global layer's query block i sees key blocks 0..i, so the masked upper triangle is mostly never computed.
  Heads-major layout, so every matmul is a canonical batched matmul. It computes a fraction of the scores "xla"
  computes, so it is the faster one wherever the window is shorter than the sequence (bench/bench_attention.py
  times both; docs/performance.md). The same algorithm accelerators want.
- "flash": the flash-attention algorithm in plain JAX (olmo3eqx.flash): blocks with an online softmax and a custom
  VJP that recomputes scores from the saved log-sum-exp, so memory grows linearly with the sequence on every
  platform; key blocks outside the causal triangle, the window or the documents are skipped, not masked.
- "pallas": JAX's Pallas GPU flash-attention kernel (Triton; segment ids, causal block skipping) for global layers,
  flash for sliding layers (the kernel has no window); on CPU it runs in Pallas interpret mode (tests). Chosen only
  by name: on an H200 it ran the 1B with documents at 44% of cuDNN's unmasked speed, cuDNN's packed layout at 109%.
- "splash": Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`), the TPU flash kernel
  that skips every all-masked [block_q, block_kv] block: a sliding layer is a LocalMask (W - 1, 0), a global layer
  a CausalMask. Block sizes come from model.attention_block_q/_kv, else the chip generation's default
  (SPLASH_BLOCKS). Under a mesh it runs per shard in a `shard_map` (batch over data x fsdp, heads over tensor),
  since XLA cannot partition a Pallas kernel; on CPU the kernel runs in Pallas interpret mode (slow: for tests).
- "auto": splash on TPU; on GPU cudnn for bf16/fp16 inputs, with or without documents (measured on an H200:
  docs/tpu-gpu.md), flash for float32 (cuDNN has no float32 kernel); on CPU flash with documents (blocked keeps each
  global layer's score blocks for the backward pass: quadratic memory), else blocked up to LONG_SEQUENCE tokens
  (faster there: bench/bench_attention.py) and flash beyond.

Document masking (packed instances): `segment_ids` [*batch, seq] gives each token the index of its document; a query
then sees key j only if causal, inside the window on sliding layers, AND of the same segment. None is plain causal
attention on the unchanged code path. Per backend: "xla" adds the segment mask to jax.nn's `mask`; "blocked" ANDs
it into each block pair's static mask (the same T x (W + C) scores: the memory bound is unchanged); "flash" masks
each visited block and skips blocks that share no document; "splash" passes the kernel `SegmentIds(q, kv)`; "cudnn"
hands cuDNN each row's runs of equal ids as ragged sequences (up to cudnn_packed.MAX_RUNS a row; a batch with more
takes flash, decided on the device).

Which platform a trace compiles for is read from the abstract mesh in context (`sharding.on_mesh`, as the train
step and the evaluator trace), so an ahead-of-time compile for a TPU topology on a CPU host (olmo3eqx.aot) gets
the TPU kernel; without a mesh in context it is the default backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from olmo3eqx import cudnn_context, cudnn_packed
from olmo3eqx.config import SLIDING, SPLASH_LANES, AttentionImpl
from olmo3eqx.context import (context_chunks, context_ranks, keys_for_rank, masked_attention, reach, split_attention,
                               stack_slots, unstack_slots)
from olmo3eqx.specs import CONTEXT
from olmo3eqx.flash import MASKED, BLOCK_PAD_SEGMENT, flash_attention, pallas_gpu_attention

IMPLEMENTATIONS = typing.get_args(AttentionImpl)
CUDNN_CP = "cudnn-cp-compiled-only"
"""The backend value that runs cuDNN on split sequences too (olmo3eqx.cudnn_context): compiled, never yet run."""
GLOBAL_BLOCKS = 4
"""Query blocks of a global layer: block i attends to key blocks 0..i, so (n+1)/2n = 5/8 of T x T is computed."""
SPLASH_BLOCKS = (("tpu7", 2048),)
"""Default splash block (query and key/value) per chip generation, by substring of the lower-cased device kind, as
the MaxText reproduction of OLMo 3 found them: 2048 on TPU v7 (Ironwood); 2048 does not fit v5p's VMEM (the
compiler's own error), so every other chip gets DEFAULT_SPLASH_BLOCK, MaxText's default."""
WIDE_HEAD_SPLASH_BLOCKS = (("tpu7", 1024),)
"""The default for heads wider than 128 (OLMo 3's 16 x 256 variant), where it differs: 2048 x 256 needs 35.5 MiB of
Ironwood's 32 MiB scoped VMEM in the forward kernel (XLA:TPU's CompileTimeScopedVmemOom, 7B step for tpu7x:4x4x4);
1024 compiles. v5p's 512 compiles at 256 as it is."""
DEFAULT_SPLASH_BLOCK = 512
LONG_SEQUENCE = 1024
"""On CPU without documents, "auto" picks blocked up to this many tokens and flash beyond: on this 2-core CPU
(bench/bench_attention.py --lengths, 4 heads x 64, one document, fwd+bwd) blocked is faster at 512 tokens (8 vs
12 ms), even at 1024 (31 vs 24 ms median, 25 vs 24 best), and flash from 2048 on (121 vs 197 ms; 4096: 309 vs
667 ms), with 1/10 to 1/30 of the memory."""
BATCH_AXES = ("data", "fsdp")
"""The mesh axes the batch is split over (sharding.BATCH_AXES; repeated here: sharding imports the model)."""
LOW_PRECISION = (jnp.bfloat16, jnp.float16)


_PLANNED: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("planned", default=None)


@contextlib.contextmanager
def planning_for(platform: str, device_kind: str):
    """Trace as if for `platform`'s devices while compiling for this host's (the dry run's GPU node plan on simulated
    CPU devices, olmo3eqx.aot): "auto" resolves as there, and cuDNN, which the CPU compiler cannot build, is planned
    with flash (the same algorithm: blocks, online softmax, recomputation; its memory stands in for cuDNN's)."""
    token = _PLANNED.set((platform, device_kind))
    try:
        yield
    finally:
        _PLANNED.reset(token)


def target_device() -> tuple[str, str]:
    """(platform, device kind) of the devices the traced program compiles for: the abstract mesh in context, else
    the default backend's (or what `planning_for` says)."""
    planned = _PLANNED.get()
    if planned is not None:
        return planned
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    if device is None:
        device = jax.devices()[0]
    return device.platform, device.device_kind


def resolve(impl: str, dtype, documents: bool = False, seq: int = 0) -> str:
    """The backend `impl` names for inputs of `dtype` on the target platform ("auto" decided here); `documents`:
    whether segment ids mask documents (cuDNN through its packed layout on GPU, see the module doc); `seq`: the
    sequence length."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention_impl must be one of {IMPLEMENTATIONS}, got {impl!r}.")
    if impl != "auto":
        return impl
    platform = target_device()[0]
    if platform == "tpu":
        return "splash"
    if platform == "gpu":
        return "cudnn" if jnp.dtype(dtype) in LOW_PRECISION else "flash"
    return "flash" if documents or seq > LONG_SEQUENCE else "blocked"


def attention(
    q: Float[Array, "*batch seq heads dim"], k: Float[Array, "*batch seq kv_heads dim"],
    v: Float[Array, "*batch seq kv_heads dim"], *, window: int | None, impl: str = "auto",
    block_q: int | None = None, block_kv: int | None = None, segment_ids: Int[Array, "*batch seq"] | None = None,
) -> Float[Array, "*batch seq heads dim"]:
    """Causal attention; `window` is W keys including the query itself, None for a global layer. Query head h uses
    kv head h // (heads // kv_heads) (grouped-query attention). Leading batch axes are optional. Output in q's
    dtype. `block_q`/`block_kv` are splash's and flash's blocks (None: their defaults); the others ignore them.
    `segment_ids`: each token's document; keys of another document are masked (None: no document masking)."""
    seq = q.shape[-3]
    backend = resolve(impl, q.dtype, documents=segment_ids is not None, seq=seq)
    if context_ranks() > 1:
        return context_attention(q, k, v, window=window, backend=backend, block_q=block_q, block_kv=block_kv,
                                 segment_ids=segment_ids)
    if window is not None and window >= seq:
        window = None  # a window covering the whole sequence is plain causal attention
    if backend == CUDNN_CP:
        backend = "cudnn"  # whole sequences: the cudnn backend as it has run
    if backend == "cudnn" and _PLANNED.get() is None and partitioned():
        return per_shard(lambda q, k, v, *s: attention(q, k, v, window=window, impl=backend, block_q=block_q,
                                                       block_kv=block_kv, segment_ids=s[0] if s else None),
                         q, k, v, segment_ids)
    if backend == "blocked":
        return blocked_attention(q, k, v, window=window, segment_ids=segment_ids)
    if backend == "pallas" and window is None and _PLANNED.get() is None:
        return pallas_gpu_attention(q, k, v, segment_ids=segment_ids, interpret=target_device()[0] != "gpu")
    if backend in ("flash", "pallas") or backend == "cudnn" and _PLANNED.get() is not None:
        return flash_attention(q, k, v, window=window, segment_ids=segment_ids, block_q=block_q, block_kv=block_kv)
    if backend == "cudnn" and segment_ids is not None:
        *lead, seq, heads, dim = q.shape
        flat = [x.reshape(-1, *x.shape[-3:]) for x in (q, k, v)] + [segment_ids.reshape(-1, seq)]
        fallback = lambda q, k, v, s: flash_attention(  # noqa: E731 - rows of more documents than cuDNN is built for
            q, k, v, window=window, segment_ids=s, block_q=block_q, block_kv=block_kv)
        return cudnn_packed.attention_or(fallback, *flat, window=window).reshape(q.shape)
    if backend == "splash":
        return splash_attention(q, k, v, window=window, block_q=block_q, block_kv=block_kv, segment_ids=segment_ids)
    if q.ndim > 4:
        if segment_ids is None:
            return jax.vmap(lambda a, b, c: attention(a, b, c, window=window, impl=backend))(q, k, v)
        return jax.vmap(lambda a, b, c, s: attention(a, b, c, window=window, impl=backend, segment_ids=s))(
            q, k, v, segment_ids)
    # [*b, 1, T, S]: broadcast over heads (jax.nn ANDs it with the causal and window masks).
    mask = None if segment_ids is None else (segment_ids[..., :, None] == segment_ids[..., None, :])[..., None, :, :]
    # jax.nn's local_window_size=(L, R) allows i - L <= j <= i + R: W keys including self is (W - 1, 0).
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, local_window_size=None if window is None else (window - 1, 0),
        implementation=None if backend == "xla" else backend)


SPLIT_FALLBACKS = {
    "blocked": "its block masks take the queries and keys to be the same positions: no query offset",
    "pallas": "the Pallas GPU kernel takes no query offset",
    "cudnn": cudnn_packed.SPLIT_SEQUENCES,
}
"""Why a backend's work runs as flash with the sequence split over context ranks; xla, flash and splash run it
themselves."""
SAID: set[str] = set()
"""The backends whose substitution this process has said (once each: `say_split_backend`)."""


def split_backend(backend: str) -> tuple[str, str | None]:
    """(the backend that runs `backend`'s work on split sequences (mesh.context > 1), why it is another: None when it
    is the same)."""
    reason = SPLIT_FALLBACKS.get(backend)
    return ("flash", reason) if reason is not None else (backend, None)


def say_split_backend(backend: str, ranks: int) -> str:
    """split_backend's backend for this trace; the first time a process substitutes for `backend`, one line on
    stderr (process 0) names the substitute and the reason."""
    import sys

    used, reason = split_backend(backend)
    if reason is not None and backend not in SAID:
        SAID.add(backend)
        if jax.process_index() == 0:
            print(f"attention: {used} in place of {backend} with the sequence split over mesh.context={ranks}: "
                  f"{reason}.", file=sys.stderr, flush=True)
    return used


def context_attention(q, k, v, *, window: int | None, backend: str, block_q: int | None, block_kv: int | None,
                      segment_ids):
    """`attention` with the sequence split over the mesh's context axis (olmo3eqx.context): each rank's queries
    against the keys they can see (all, or a sliding window's neighbour chunks), at explicit positions. "xla" masks
    them so, flash takes the queries' offset, splash splits its kernel's mask with the queries, cudnn-cp-compiled-only
    cuts each chunk into parts cuDNN's top-left masks compute exactly (cudnn_context; flash for a batch of more
    document runs than its packed layout is built for); the other backends run as flash (split_backend, said once)."""
    seq = q.shape[-3]
    if window is not None and window >= seq:
        window = None

    backend = say_split_backend(backend, context_ranks())
    if backend == "splash":
        return splash_context(q, k, v, window=window, block_q=block_q, block_kv=block_kv, segment_ids=segment_ids)
    if backend == CUDNN_CP and _PLANNED.get() is not None:
        backend = "flash"  # the CPU compiler cannot build cuDNN's kernel: planned with flash, as "cudnn" is
    executor = cudnn_context.Executor("cudnn" if target_device()[0] == "gpu" else "xla")

    def local(q, k, v, q_seg, kv_seg, offset):
        if backend == CUDNN_CP:
            cudnn = lambda *a: cudnn_context.chunk_attention(executor, *a, window)  # noqa: E731
            if q_seg is None:
                return cudnn(q, k, v, q_seg, kv_seg, offset)
            flash = lambda q, k, v, q_seg, kv_seg, offset: flash_attention(  # noqa: E731 - rows of too many runs
                q, k, v, window=window, segment_ids=q_seg, block_q=block_q, block_kv=block_kv, q_offset=offset,
                kv_segment_ids=kv_seg)
            return jax.lax.cond(cudnn_context.fits(q_seg), cudnn, flash, q, k, v, q_seg, kv_seg, offset)
        if backend == "xla":
            q_pos = offset + jnp.arange(q.shape[1], dtype=jnp.int32)
            return masked_attention(q, k, v, q_pos, jnp.arange(k.shape[1], dtype=jnp.int32), window, q_seg, kv_seg)
        return flash_attention(q, k, v, window=window, segment_ids=q_seg, block_q=block_q, block_kv=block_kv,
                               q_offset=offset, kv_segment_ids=kv_seg)

    spec = shard_spec(jax.sharding.get_abstract_mesh(), q.shape, k.shape[-2])
    return split_attention(local, q, k, v, segment_ids, P(spec[0], CONTEXT, spec[2], None), window)


def splash_blocks(seq: int, block_q: int | None, block_kv: int | None, head_dim: int = 128
                  ) -> tuple[int, int, int]:
    """(padded sequence, query block, key/value block): the configured blocks (else the chip's default for this head
    width), no longer than the sequence rounded up to the lane width, and the sequence padded to a multiple of both."""
    kind = target_device()[1].lower()
    default = next((b for key, b in SPLASH_BLOCKS if key in kind), DEFAULT_SPLASH_BLOCK)
    if head_dim > 128:
        default = next((b for key, b in WIDE_HEAD_SPLASH_BLOCKS if key in kind), default)
    padded = -(-seq // SPLASH_LANES) * SPLASH_LANES
    bq, bkv = (min(b or default, padded) for b in (block_q, block_kv))
    step = math.lcm(bq, bkv)
    return -(-padded // step) * step, bq, bkv


def splash_kernel(seq: int, heads: int, window: int | None, bq: int, bkv: int, interpret: bool, q_shards: int = 1,
                  q_positions=None, kv_seq: int | None = None):
    """The splash kernel for one example's [heads, seq, dim] queries against [heads, kv_seq (default seq), dim] keys.
    Built per trace: its mask information becomes arrays of that trace (the numpy work behind them is cached by the
    Pallas package). `q_shards`: the query sequence split that many ways (context ranks: the kernel's mask
    information is then split with it, splash_context); `q_positions`: the queries' positions among the keys
    (int32 [seq], default 0..seq-1: the balanced layout's order, as MaxText's LoadBalancedCausalMask; or a neighbour
    span's queries, its last `seq` of kv_seq keys)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (seq, kv_seq or seq)
    if window is None:
        mask = sm.CausalMask(shape)
    else:  # LocalMask (left, right) allows i - left <= j <= i + right: W keys including the query is (W - 1, 0)
        mask = sm.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    if q_positions is not None:
        mask.q_sequence = np.asarray(q_positions, np.int32)
    blocks = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                           block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    return sk.make_splash_mha(sm.MultiHeadMask([mask] * heads), block_sizes=blocks, head_shards=1,
                              q_seq_shards=q_shards, mask_value=MASKED, interpret=interpret)


def splash_attention(
    q: Float[Array, "*batch seq heads dim"], k: Float[Array, "*batch seq kv_heads dim"],
    v: Float[Array, "*batch seq kv_heads dim"], *, window: int | None, block_q: int | None = None,
    block_kv: int | None = None, segment_ids: Int[Array, "*batch seq"] | None = None,
) -> Float[Array, "*batch seq heads dim"]:
    """The "splash" backend (see the module doc). The sequence is padded at the end to the blocks (padding is never
    seen by a real query: causality; its segment is BLOCK_PAD_SEGMENT); q is scaled by 1/sqrt(dim) before the kernel,
    which does not scale. Segment ids go to the kernel as SegmentIds(q, kv), ANDed with its static mask."""
    *lead, seq, heads, dim = q.shape
    padded, bq, bkv = splash_blocks(seq, block_q, block_kv, dim)
    if padded != seq:
        pad = [(0, 0)] * len(lead) + [(0, padded - seq), (0, 0), (0, 0)]
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, pad[:-2], constant_values=BLOCK_PAD_SEGMENT)
    q = (q.astype(jnp.float32) / math.sqrt(dim)).astype(q.dtype)
    interpret = target_device()[0] == "cpu"

    def per_shard(q, k, v, *segments):
        from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

        kernel = splash_kernel(padded, q.shape[-2], window, bq, bkv, interpret)
        if segments:
            kernel = (lambda f: lambda q, k, v, s: f(q, k, v, segment_ids=SegmentIds(q=s, kv=s)))(kernel)
        for _ in lead:
            kernel = jax.vmap(kernel)
        heads_major = [jnp.swapaxes(x, -3, -2) for x in (q, k, v)]  # [*b, T, H, D] -> the kernel's [*b, H, T, D]
        return jnp.swapaxes(kernel(*heads_major, *segments), -3, -2)

    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids.astype(jnp.int32))
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        spec = shard_spec(mesh, q.shape, k.shape[-2])
        specs = (spec,) * 3 + ((P(spec[0]),) if segment_ids is not None else ())  # segments split as the batch
        auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)  # nested in the step's per-replica region
        per_shard = jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=spec, axis_names=auto,
                                  check_vma=False)
    return per_shard(*args)[..., :seq, :, :]


def splash_context(
    q: Float[Array, "b seq heads dim"], k: Float[Array, "b seq kv_heads dim"], v: Float[Array, "b seq kv_heads dim"],
    *, window: int | None, block_q: int | None, block_kv: int | None, segment_ids: Int[Array, "b seq"] | None,
) -> Float[Array, "b seq heads dim"]:
    """The "splash" backend with the sequence split over the context axis (olmo3eqx.context), as MaxText runs it,
    in the shard_map that splits the batch and heads. With the all-gather: one kernel for the whole [seq, seq] mask
    built with q_seq_shards = the context ranks and the queries at their layout's positions (balanced: MaxText's
    LoadBalancedCausalMask), its mask information split over the ranks with the queries (the kernel's
    manual_sharding_spec), keys, values and their segment ids gathered in the natural order. With neighbour spans
    (a sliding window that reaches few chunks): one kernel for a chunk's queries, the last of its span's keys, run on
    each rank's chunks stacked as rows. Each chunk must be a multiple of the blocks (no padding inside a split
    sequence)."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    from olmo3eqx.errors import ConfigError

    chunks = context_chunks()
    ranks, slots = chunks.ranks, chunks.slots
    seq, dim = q.shape[1], q.shape[-1]
    chunk = seq // chunks.count
    padded, bq, bkv = splash_blocks(chunk, block_q, block_kv, dim)
    if padded != chunk:
        layout = f" in {chunks.count} balanced chunks (mesh.context_balance)" if chunks.balanced else ""
        raise ConfigError(f"model.attention_impl 'splash' with mesh.context={ranks}{layout} needs each chunk's "
                          f"{chunk} tokens to be a multiple of its blocks ({bq} x {bkv}); make data.seq_len / "
                          f"{chunks.count} one.")
    mesh = jax.sharding.get_abstract_mesh()
    spec = shard_spec(mesh, q.shape, k.shape[-2])
    heads = q.shape[-2] // (mesh.shape["tensor"] if spec[-2] == "tensor" else 1)
    interpret = target_device()[0] == "cpu"
    back = reach(window, chunk, chunks)
    if back is None:
        kernel = splash_kernel(seq, heads, window, bq, bkv, interpret, q_shards=ranks,
                               q_positions=chunks.positions(seq) if chunks.balanced else None)
        # Its mask information split over context alone, reckoned on a mesh of that axis: on the step's mesh inside
        # the per-replica region (data manual) splash's shard_shape fails ("Unhandled OpSharding type ... manual").
        kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(
            jax.sharding.AbstractMesh((ranks,), (CONTEXT,)), P(None, CONTEXT)))
    else:
        span = (back + 1) * chunk
        kernel = splash_kernel(chunk, heads, window, bq, bkv, interpret, kv_seq=span,
                               q_positions=np.arange(span - chunk, span))
        kernel_spec = jax.tree.map(lambda _: P(), kernel)
    spec = P(spec[0], CONTEXT, spec[2], None)
    seg_spec = P(spec[0], CONTEXT)
    q = (q.astype(jnp.float32) / math.sqrt(dim)).astype(q.dtype)

    def run(kernel, q, k, v, q_seg, kv_seg):
        heads_major = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
        if q_seg is None:
            return jnp.swapaxes(jax.vmap(kernel)(*heads_major), 1, 2)
        out = jax.vmap(lambda q, k, v, s, t: kernel(q, k, v, segment_ids=SegmentIds(q=s, kv=t)))(
            *heads_major, q_seg, kv_seg)
        return jnp.swapaxes(out, 1, 2)

    def per_shard(kernel, q, k, v, *segments):
        k, v, q_seg, kv_seg = keys_for_rank(k, v, segments[0] if segments else None, chunks, back)
        if back is None:
            return run(kernel, q, k, v, q_seg, kv_seg)
        return unstack_slots(run(kernel, stack_slots(q, slots), k, v, q_seg, kv_seg), slots)

    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids.astype(jnp.int32))
    specs = (kernel_spec, spec, spec, spec) + ((seg_spec,) if segment_ids is not None else ())
    auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    return jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=spec, axis_names=auto,
                         check_vma=False)(kernel, *args)


def partitioned() -> bool:
    """Whether the trace is under a mesh of several devices with some axes left to the partitioner."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1 and set(mesh.manual_axes) != set(mesh.axis_names)


def per_shard(fn, q, k, v, segment_ids=None):
    """`fn(q, k, v[, segment_ids])` on each device's shard: batch and heads split as shard_spec says, every mesh axis
    manual. cuDNN's attention runs so under a mesh: jax 0.10.2's custom partitioning of its call fails in the step's
    per-replica region (data manual: in lowering, "'AbstractMesh' object has no attribute '_flat_devices_tuple'";
    under the mesh's context XLA's SPMD partitioner aborts on a device-group check), and for packed documents with
    heads split over tensor its Shardy rule fails verification ("dim mapping can't have a factor of size 1 if there
    are multiple factors"), while with every axis manual it lowers the call as it stands (each seen compiling the 7B
    or tiny train step for compile-only H100s, olmo3eqx.aot)."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = shard_spec(mesh, q.shape, k.shape[-2])
    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
    specs = (spec,) * 3 + ((P(spec[0]),) if segment_ids is not None else ())
    auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=spec, axis_names=auto, check_vma=False)(*args)


def shard_spec(mesh, shape: tuple[int, ...], kv_heads: int) -> P:
    """How splash's inputs [*batch, seq, heads, dim] are split under `mesh`: the first batch axis over the mesh's
    data-parallel axes (those not manual already: in the step's per-replica region the rows are one data replica's)
    and the heads over `tensor`, where they divide; the rest is whole on every device."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    manual = set(getattr(mesh, "manual_axes", ()))
    batch_axes = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1 and a not in manual)
    spec: list = [None] * len(shape)
    if len(shape) > 3 and batch_axes and shape[0] % math.prod(sizes[a] for a in batch_axes) == 0:
        spec[0] = batch_axes
    tensor = sizes.get("tensor", 1)
    if tensor > 1 and shape[-2] % tensor == 0 and kv_heads % tensor == 0:
        spec[-2] = "tensor"
    return P(*spec)


SCORE_SAVING_REMAT = ("none", "dots")
"""Remat policies that keep the attention scores of every layer for the backward pass (dots_saveable keeps every
matmul's output, the score einsums included); the others recompute one layer's at a time."""


def blocked_score_bytes(model, seq: int, batch: int, heads: int | None = None) -> int:
    """Bytes of float32 attention scores the "blocked" backend holds at once in a train step of `batch` rows of `seq`
    tokens (`heads` per device, default all): every layer's under a remat policy that saves them
    (SCORE_SAVING_REMAT), else one layer's (the largest); a lower bound on what the step needs for attention."""
    heads = heads or model.num_attention_heads
    per_layer = []
    for kind in model.resolved_layer_types:
        window = model.sliding_window if kind == SLIDING else None
        if window is None or window >= seq:
            block = -(-seq // GLOBAL_BLOCKS)
            n = -(-seq // block)
            scores = block * block * n * (n + 1) // 2
        else:
            block = sliding_block(seq, window)
            n = -(-seq // block)
            scores = n * block * (min(n - 1, -(-(window - 1) // block)) + 1) * block
        per_layer.append(4 * batch * heads * scores)
    return sum(per_layer) if model.remat in SCORE_SAVING_REMAT else max(per_layer)


def sliding_block(seq: int, window: int) -> int:
    """Query block of a sliding layer: about W/2, so each block reads 1.5 W keys (W/4 would read 1.25 W in smaller,
    slower matmuls); never longer than the sequence."""
    return max(1, min(seq, (window + 1) // 2))


def blocked_attention(
    q: Float[Array, "*batch seq heads dim"], k: Float[Array, "*batch seq kv_heads dim"],
    v: Float[Array, "*batch seq kv_heads dim"], *, window: int | None,
    segment_ids: Int[Array, "*batch seq"] | None = None,
) -> Float[Array, "*batch seq heads dim"]:
    """The "blocked" backend (see the module doc). Leading batch axes are handled natively (no vmap). Scores and
    softmax in float32, probabilities cast to v's dtype for the PV matmul (as `jax.nn.dot_product_attention` does).
    `segment_ids` (None: none) mask each block pair's scores to same-document pairs, on top of the static mask.

    Layout: q is transposed once to [*batch, kv_heads, blocks, groups * C, dim] and k, v to [*batch, kv_heads, seq,
    dim], so both matmuls are canonical batched matmuls (batch axes leading, the contraction last or second to
    last) that XLA's CPU backend runs without per-matmul transposed copies; one transpose back at the end."""
    *lead, seq, heads, dim = q.shape
    kv_heads = k.shape[-2]
    groups = heads // kv_heads
    if window is None or window >= seq:
        block = -(-seq // GLOBAL_BLOCKS)
    else:
        block = sliding_block(seq, window)
    n = -(-seq // block)
    padded = n * block
    nb = len(lead)
    if padded != seq:  # padding at the end is never seen by a real query (causality)
        pad = [(0, 0)] * nb + [(0, padded - seq), (0, 0), (0, 0)]
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, pad[:-2], constant_values=BLOCK_PAD_SEGMENT)
    # q: [*b, n*C, K*G, D] -> [*b, K, n, G*C, D]; k, v: [*b, T, K, D] -> [*b, K, T, D]
    b_axes = tuple(range(nb))
    qb = q.reshape(*lead, n, block, kv_heads, groups, dim).transpose(*b_axes, nb + 2, nb, nb + 3, nb + 1, nb + 4)
    qb = qb.reshape(*lead, kv_heads, n, groups * block, dim)
    kh, vh = (x.transpose(*b_axes, nb + 1, nb, nb + 2) for x in (k, v))
    scale = 1.0 / math.sqrt(dim)
    if window is None or window >= seq:
        out = _triangle(qb, kh, vh, block, groups, scale, segment_ids)
    else:
        out = _band(qb, kh, vh, block, groups, window, scale, segment_ids)
    # [*b, K, n, G*C, D] -> [*b, n*C, K*G, D]
    out = out.reshape(*lead, kv_heads, n, groups, block, dim).transpose(*b_axes, nb + 1, nb + 3, nb, nb + 2, nb + 4)
    return out.reshape(*lead, padded, heads, dim)[..., :seq, :, :]


def _same_segment(query_ids: Array, key_ids: Array, groups: int, head_axis: int) -> Array:
    """Boolean [..., G*C, S]: query row (group, position) and key share a segment, with a kv-head axis of size 1
    inserted at `head_axis` (negative) to broadcast against the scores. query_ids [..., C], key_ids [..., S]."""
    rows = jnp.tile(query_ids, (1,) * (query_ids.ndim - 1) + (groups,))  # group-major rows, as the scores'
    return jnp.expand_dims(rows[..., :, None] == key_ids[..., None, :], head_axis)


def _iota(shape: tuple[int, ...], axis: int) -> Array:
    """int32 positions along `axis`, built in the graph: the static masks are computed from iotas inside the fused
    select rather than baked in as numpy constants (a 65K step's masks would be ~4 GB of constants in the HLO)."""
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _softmax_pv(scores: Float[Array, "*b q s"], mask, v_dtype, scale: float):
    scores = jnp.where(mask, scores * scale, MASKED)
    return jax.nn.softmax(scores, axis=-1).astype(v_dtype)


def _band(qb, k, v, block: int, groups: int, window: int, scale: float, segment_ids):
    """Sliding layer: query block b sees key blocks b-P..b, P = ceil((W-1)/C), as one batched matmul over
    (batch, kv head, block)."""
    n = qb.shape[-3]
    prev = min(n - 1, -(-(window - 1) // block))

    def key_blocks(x):  # [*b, K, n*C, D] -> [*b, K, n, (P+1)*C, D]: block b holds positions (b-P)*C .. (b+1)*C - 1
        pad = [(0, 0)] * (x.ndim - 2) + [(prev * block, 0), (0, 0)]
        xp = jnp.pad(x, pad).reshape(*x.shape[:-2], n + prev, block, x.shape[-1])
        return jnp.concatenate([xp[..., p:p + n, :, :] for p in range(prev + 1)], axis=-2)

    shape = (n, groups * block, (prev + 1) * block)  # rows are (group, position) pairs, group-major
    blocks = _iota(shape, 0)
    i = blocks * block + _iota(shape, 1) % block
    j = (blocks - prev) * block + _iota(shape, 2)
    mask = (j >= 0) & (j <= i) & (i - j < window)  # j < 0 is the front padding
    if segment_ids is not None:  # [*b, n, C] queries against [*b, n, (P+1)C] keys -> [*b, 1, n, G*C, (P+1)C]
        key_ids = key_blocks(segment_ids[..., None])[..., 0]  # the front padding is masked by j >= 0 already
        query_ids = segment_ids.reshape(*segment_ids.shape[:-1], n, block)
        mask = mask & _same_segment(query_ids, key_ids, groups, head_axis=-4)
    s = jnp.einsum("...nmd,...nsd->...nms", qb, key_blocks(k), preferred_element_type=jnp.float32)
    p = _softmax_pv(s, mask, v.dtype, scale)
    return jnp.einsum("...nms,...nsd->...nmd", p, key_blocks(v))


def _triangle(qb, k, v, block: int, groups: int, scale: float, segment_ids):
    """Global layer: query block b sees keys 0..(b+1)*C - 1 (a static Python loop over the few blocks)."""
    n = qb.shape[-3]
    outs = []
    for b in range(n):
        keys = (b + 1) * block
        shape = (groups * block, keys)  # rows are (group, position) pairs, group-major
        mask = _iota(shape, 0) % block + b * block >= _iota(shape, 1)
        if segment_ids is not None:  # [*b, 1, G*C, keys]
            query_ids = segment_ids[..., b * block:(b + 1) * block]
            mask = mask & _same_segment(query_ids, segment_ids[..., :keys], groups, head_axis=-3)
        s = jnp.einsum("...md,...sd->...ms", qb[..., b, :, :], k[..., :keys, :], preferred_element_type=jnp.float32)
        p = _softmax_pv(s, mask, v.dtype, scale)
        outs.append(jnp.einsum("...ms,...sd->...md", p, v[..., :keys, :]))
    return jnp.stack(outs, axis=-3)
