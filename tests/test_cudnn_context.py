"""The cudnn-cp-compiled-only backend (olmo3eqx.cudnn_context): cuDNN for a chunk of queries that continues a document
from an earlier context rank. On CPU its cuDNN calls run in XLA's math from their runs' masks (`run_mask`, cuDNN's
top-left semantics written out) and give the existing context-parallel attention's numbers on packed documents that
cross chunk boundaries (forward and gradients, per chunk and through the real sharded train step); compiled for
compile-only H100s (jax's CUDA plugin, `-m gpu_small`) every split attention of the train step is cuDNN's kernel
with the mask configuration read from the program. Never run on a GPU here."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx.aot import gpu_spec
from olmo3eqx.context import masked_attention
from olmo3eqx.cudnn_context import Executor, Runs, chunk_attention, run_mask
from olmo3eqx.cudnn_packed import document_runs
from olmo3eqx.cudnn_program import cudnn_attentions

SEQ, WINDOW = 64, 12
CPCO = "cudnn-cp-compiled-only"


def documents(rows: int, seq: int, seed: int = 0) -> np.ndarray:
    """Segment ids of packed rows: documents of 3..40 tokens, so they cross the chunk boundaries."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(rng.integers(3, 41)))
        out.append(np.repeat(np.arange(len(lengths)), lengths)[:seq])
    return np.stack(out).astype(np.int32)


def test_run_masks_are_document_masks():
    """run_mask of cuDNN's packed runs (document_runs) is the same-document causal windowed mask."""
    seg = documents(3, SEQ)
    pos = np.arange(SEQ)
    want = ((seg[:, :, None] == seg[:, None, :]) & (pos[None, :, None] >= pos[None, None, :])
            & (pos[None, :, None] - pos[None, None, :] < WINDOW))

    @jax.jit
    def got(seg):
        seqlens, offsets, _ = document_runs(seg, 16)
        return run_mask(Runs(seqlens, seqlens, offsets, offsets), SEQ, SEQ, True, WINDOW)

    np.testing.assert_array_equal(got(jnp.asarray(seg)), want)


def inputs(rows: int = 3, c: int = 16):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(rows, SEQ, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(rows, SEQ, 2, 8)), jnp.float32) for _ in range(2))
    return q, k, v, jnp.asarray(documents(rows, SEQ)), jnp.asarray(rng.normal(size=(rows, c, 4, 8)), jnp.float32)


def chunk_reference(c: int, window: int | None):
    return lambda q, k, v, q_seg, kv_seg, o: masked_attention(q, k, v, o + jnp.arange(c), jnp.arange(k.shape[1]),
                                                             window, q_seg, kv_seg)


def test_a_chunk_continuing_a_document_gives_the_split_attention_output():
    """The second 16-token chunk of 64 (its first document began in the first chunk; a sliding layer): the output
    of masked_attention at explicit positions (the "xla" backend's split attention); one top-left causal call
    against the keys up to the chunk's end, as cuDNN would run it without the cut, is not."""
    c, window = 16, WINDOW
    q, k, v, seg, _ = inputs(c=c)
    assert bool(jnp.all(seg[:, c] == seg[:, c - 1]))
    args = (q[:, c:2 * c], k, v, seg[:, c:2 * c], seg, jnp.int32(c))
    got = jax.jit(lambda *a: chunk_attention(Executor("xla"), *a, window))(*args)
    np.testing.assert_allclose(got, jax.jit(chunk_reference(c, window))(*args), rtol=1e-5, atol=1e-6)
    rows = q.shape[0]
    top_left = jax.jit(lambda q, k, v: Executor("xla").forward(q, k, v, Runs(
        jnp.full((rows,), c), jnp.full((rows,), 2 * c)), True, window)[0])(q[:, c:2 * c], k[:, :2 * c], v[:, :2 * c])
    assert not np.allclose(top_left, got, atol=1e-3)


@pytest.mark.slow  # 4-8 s a case on 2 busy cores (the compiles of two gradients)
@pytest.mark.parametrize("window,documents_", [(WINDOW, True), (None, True), (WINDOW, False), (None, False)])
def test_chunks_give_the_split_attention_numbers_and_gradients(window, documents_):
    """Every 16-token chunk of a 64-token sequence at its offset (the chunks of context 2 balanced, context 4
    contiguous), with documents crossing the chunk boundaries and without: output and gradients equal to
    masked_attention's (the merge's own backward: each part's with the merged statistics)."""
    c = 16
    q, k, v, seg, cotangent = inputs(c=c)

    def loss(fn):
        def of(q, k, v, seg, offset):
            q_chunk = jax.lax.dynamic_slice_in_dim(q, offset, c, axis=1)
            q_seg = None if seg is None else jax.lax.dynamic_slice_in_dim(seg, offset, c, axis=1)
            return (fn(q_chunk, k, v, q_seg, seg, offset) * cotangent).sum()
        return jax.jit(jax.value_and_grad(of, argnums=(0, 1, 2)))

    ours = loss(lambda *a: chunk_attention(Executor("xla"), *a, window))
    reference = loss(chunk_reference(c, window))
    segments = seg if documents_ else None
    for offset in range(0, SEQ, c):
        (got, got_grads), (want, want_grads) = (f(q, k, v, segments, jnp.int32(offset)) for f in (ours, reference))
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for a, b in zip(got_grads, want_grads, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


PROGRAM_LINE = (
    '  %dot_product_attention_fwd.243 = (bf16[2,4,128,64]{3,1,2,0}, f32[2,4,128]{2,1,0}, u8[0]{0}) custom-call('
    '%a, %b, %c, %d, %e), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[2,128,4,64]'
    '{3,2,1,0}, bf16[2,512,2,64]{3,2,1,0}, bf16[2,512,2,64]{3,2,1,0}, s32[2]{0}, s32[2]{0}}, '
    'api_version=API_VERSION_STATUS_RETURNING, backend_config={"operation_queue_id": "0", "cudnn_fmha_backend_config":'
    ' {"fmha_scale": 0.125, "is_flash_attention": true, "mask_type": "PADDING", "dropout_rate": 0.0, "seed": 42, '
    '"sliding_window_length": 0, "max_seg_per_batch": 1, "is_paged_attention": false}}\n'
    '  %x = bf16[2,128,4,64]{3,2,1,0} add(%y, %y)\n'
    '  %dot_product_attention_bwd.9 = (bf16[2,128,4,64]{3,2,1,0}, bf16[2,128,2,64]{3,2,1,0}, bf16[2,128,2,64]'
    '{3,2,1,0}, u8[0]{0}) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmaxBackward", '
    'operand_layout_constraints={bf16[2,128,4,64]{3,2,1,0}, bf16[2,128,2,64]{3,2,1,0}, bf16[2,128,2,64]{3,2,1,0}, '
    'f32[32,4,128]{2,1,0}, bf16[2,128,4,64]{3,2,1,0}, bf16[2,128,4,64]{3,2,1,0}, s32[2,16]{1,0}, s32[2,16]{1,0}, '
    's32[2,17]{1,0}, s32[2,17]{1,0}}, api_version=API_VERSION_STATUS_RETURNING, backend_config={'
    '"cudnn_fmha_backend_config": {"mask_type": "PADDING_CAUSAL", "sliding_window_length": 96, '
    '"max_seg_per_batch": 16}}')
"""Two cuDNN calls as XLA:GPU prints them (shortened from the compiled H100 train step's program)."""


def test_cudnn_calls_are_read_from_the_program():
    forward, backward = cudnn_attentions(PROGRAM_LINE)
    assert (forward.target, forward.backward, forward.key, forward.lengths, forward.offsets) == (
        "__cudnn$fmhaSoftmax", False, ("PADDING", None, False), True, False)
    assert (forward.q, forward.kv) == ((2, 128, 4, 64), (2, 512, 2, 64))
    assert (backward.backward, backward.key, backward.runs, backward.lengths, backward.offsets) == (
        True, ("PADDING_CAUSAL", 96, True), 16, True, True)


@pytest.mark.slow  # 110-160 s a layout on 2 busy cores (both runs compile the step and its gradients)
@pytest.mark.parametrize("context,balance", [(2, True), (4, True), (4, False)])
def test_train_step_with_split_sequences_gives_the_unsplit_numbers(context, balance):
    """The real sharded train step (tests/test_context.py's tiny model, packed documents across chunk boundaries) with
    cudnn-cp-compiled-only at context 2 and 4, balanced and contiguous, on CPU (its calls in XLA's math): the same
    gradients and 3 steps of losses as the unsplit run with "xla"."""
    from test_context import assert_same, run

    assert_same(run(context, CPCO, balance=balance), run(1, "xla"))


def h100_devices(count: int):
    """`count` compile-only H100s (jax's CUDA plugin; no GPU needed)."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    topologies = pytest.importorskip("jax.experimental.topologies")
    pytest.importorskip("jax_plugins.xla_cuda12", reason="jax's CUDA plugin is not installed")
    return topologies.get_topology_desc(platform="cuda", target_config=gpu_spec("h100_sxm.txtpb"),
                                        topology=f"1x1x{count}").devices


@pytest.mark.gpu_small
@pytest.mark.parametrize("context,balance", [(2, True), (4, False)])
def test_split_attention_compiles_to_cudnn_with_its_masks(context, balance):
    """The tiny train step (bfloat16, packed documents, a sliding and a global layer) compiled by XLA:GPU for 4
    H100s at context 2 balanced and 4 contiguous: each layer's split attention is cuDNN's fused kernel, forward and
    backward, in the parts cudnn_context cuts it into, read from the program: own first run (PADDING_CAUSAL, the
    sliding window on the sliding layer), history (global: PADDING over the keys before the chunk; sliding:
    PADDING_CAUSAL on the W - 1 reversed, no window), the other runs packed (PADDING_CAUSAL, offsets)."""
    from olmo3eqx.config import FULL, SLIDING, DataConfig, MeshConfig, ModelConfig, OptimConfig, TrainConfig
    from olmo3eqx.cudnn_packed import MAX_RUNS, compute_capability_of
    from olmo3eqx.sharding import build_layout
    from olmo3eqx.step import make_train_step

    devices = h100_devices(4)
    seq, window = 512, 96
    model = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        layer_types=(SLIDING, FULL), num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        sliding_window=window, eos_token_id=1, pad_token_id=2, compute_dtype="bfloat16",
                        attention_impl=CPCO)
    cfg = TrainConfig(steps=1, model=model, data=DataConfig(seq_len=seq, global_batch=4, packing=True),
                      optim=OptimConfig(lr=1e-2, warmup_steps=1),
                      mesh=MeshConfig(context=context, context_balance=balance, node_devices=4))
    layout = build_layout(cfg, devices)
    with compute_capability_of(devices[0]):
        lowered = make_train_step(cfg, layout).lower(layout.state_target(), *layout.batch_target(seq))
    calls = cudnn_attentions(lowered.compile().as_text())
    chunk = seq // (2 * context if balance else context)
    want = {("PADDING_CAUSAL", window, False): (chunk, chunk), ("PADDING_CAUSAL", None, False): (window - 1, window - 1),
            ("PADDING_CAUSAL", window, True): (chunk, chunk), ("PADDING", None, False): (chunk, seq)}
    for backward in (False, True):
        seen = {(c.key, c.q[1], c.kv[1]) for c in calls if c.backward == backward}
        assert {(key, *shape) for key, shape in want.items()} | {(("PADDING_CAUSAL", None, True), chunk, chunk),
                                                                 (("PADDING_CAUSAL", None, False), chunk, chunk)} == seen
    assert all(c.lengths and c.offsets == (c.runs > 1) for c in calls)
    assert {c.runs for c in calls} == {1, MAX_RUNS}
