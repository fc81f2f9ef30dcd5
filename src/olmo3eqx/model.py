"""OLMo 3 as pure Equinox modules.

Modules act on one example (`tokens: Int[Array, "seq"]`) or on a batch given as leading axes (`"*batch seq"`),
which the train step and the evaluator use: every projection then runs as one [(batch seq), d] matmul, whose
backward XLA's CPU backend runs without the transposed copies a vmapped [batch, seq, d] contraction costs
(bench/bench_step.py measures the step).
Linear weights are stored [in, out]. Layers are stacked along a leading axis of every block leaf and run
as a `lax.scan` over the repeating period of `layer_types` (OLMo 3: 3 sliding + 1 global), so compile
time does not grow with depth; a pattern with no period shorter than the depth, or one that repeats too few
times for a scan to pay (MAX_UNROLLED_GROUPS), runs as a Python loop.

Packed instances: `segment_ids` ([*batch, seq], each token's document index) masks attention to the token's own
document (attention.py) and restarts RoPE positions at 0 in every document, as OLMo-core does when it is given
cu_doc_lens (olmo_core/nn/rope.py, RotaryEmbedding.forward: "each document's tokens receive positions starting
from 0"), so a packed document computes what it computes alone. None: one document per row, positions 0..seq-1.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray

from olmo3eqx import fp8, precision
from olmo3eqx.attention import attention, target_device
from olmo3eqx.config import FULL, SLIDING, ModelConfig, RopeScalingConfig
from olmo3eqx.context import context_ranks, layout_positions, split_rows

SLIDING_SCOPE, GLOBAL_SCOPE = "sliding_attention", "global_attention"
"""The named scopes (op_name metadata) of each layer kind's attention."""
DTYPE = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

MAX_UNROLLED_GROUPS = {"none": 2}
"""Per remat policy, a pattern that repeats at most this many times is unrolled even with scan_layers (1 for policies
not listed: any repeat scans). Remat none stacks ~50 residuals per layer in a scan, which costs more than a scan
over two periods saves; with dots only the matmul outputs are stacked and the scan pays from two periods on.
bench/bench_compile.py and bench/bench_step.py measure both (docs/performance.md)."""

QKV = ("query_proj", "key_proj", "value_proj")
MINIMAL = (*QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")
SAVED_NAMES = {
    "minimal": MINIMAL,
    "minimal_with_context": (*MINIMAL, "context"),
    "save_dot_with_context_except_mlp": (*QKV, "context", "out_proj"),
    "save_dot_except_mlpwi": (*QKV, "out_proj", "mlpwo"),
    "save_dot_except_mlp": (*QKV, "out_proj"),
    "save_qkv_proj": QKV,
    "save_out_proj": ("out_proj",),
}
"""The named remat policies (MaxText's remat_policy values and names): the activations each keeps for the backward
pass, everything else in the block recomputed. The model names them with `checkpoint_name`: query_proj, key_proj,
value_proj (the q/k/v projections' outputs, before QK-norm and RoPE), context (attention's output, before o_proj),
out_proj (o_proj's output), mlpwi_0 / mlpwi_1 (the MLP's gate and up projections), mlpwo (its down projection)."""
OFFLOADED_NAMES = {"qkv_proj_offloaded": QKV, "minimal_offloaded": MINIMAL}
"""Named policies that keep their activations in host memory (pinned_host) instead of the device's, copied there
in the forward pass and back for the backward pass (save_and_offload_only_these_names)."""


def remat_policy(name: str):
    """The jax.checkpoint policy of model.remat `name` ("none" is no checkpoint at all)."""
    if name in SAVED_NAMES:
        return jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES[name])
    if name in OFFLOADED_NAMES:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(OFFLOADED_NAMES[name]),
            offload_src="device", offload_dst="pinned_host")
    policies = jax.checkpoint_policies
    if name in ("dots", "dots_no_batch"):
        # An FP8 projection's dot sits inside its custom VJP, out of these policies' sight: saved by its name instead
        # (otherwise every FP8 forward GEMM runs again in the backward pass).
        dots = policies.dots_saveable if name == "dots" else policies.dots_with_no_batch_dims_saveable
        return policies.save_from_both_policies(dots, policies.save_only_these_names(fp8.OUTPUT_NAME))
    return {"full": policies.nothing_saveable}[name]


def trunc_normal(key: PRNGKeyArray, shape: tuple[int, ...], std: float, dtype) -> Array:
    """OLMo init: normal(0, std) truncated at +-3 std."""
    return (jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32) * std).astype(dtype)


class Linear(eqx.Module):
    weight: Float[Array, "din dout"]
    gather_spec: jax.sharding.PartitionSpec | None = eqx.field(static=True, default=None)
    """None: `weight` is used as it is (already in the compute dtype). A spec: `weight` is a float32 master sharded as
    the spec, gathered in the activations' dtype when called (precision.dense; set by for_compute)."""
    fp8: str = eqx.field(static=True, default="none")
    """model.fp8's recipe for this projection's GEMMs (olmo3eqx.fp8; set by with_fp8), "none": the compute dtype."""

    @staticmethod
    def init(din: int, dout: int, cfg: ModelConfig, *, key: PRNGKeyArray) -> Linear:
        return Linear(trunc_normal(key, (din, dout), cfg.initializer_range, DTYPE[cfg.param_dtype]))

    def __call__(self, x: Float[Array, "*batch din"]) -> Float[Array, "*batch dout"]:
        # One 2-D matmul whatever the leading axes (see the module doc).
        x2 = x.reshape(-1, x.shape[-1])
        split = context_ranks() > 1 and x.ndim == 3  # [rows, seq, din] with the sequence over context
        if split:
            x2 = split_rows(x2, precision.row_axes())
        if self.gather_spec is not None:
            y = precision.dense(x2, self.weight, self.gather_spec, self.fp8)
        else:
            y = x2 @ self.weight if self.fp8 == "none" else fp8.matmul(x2, self.weight, self.fp8)
        if split:
            y = split_rows(y, precision.row_axes())
        return y.reshape(*x.shape[:-1], self.weight.shape[1])


class RMSNorm(eqx.Module):
    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    @staticmethod
    def init(dim: int, cfg: ModelConfig) -> RMSNorm:
        return RMSNorm(jnp.ones((dim,), DTYPE[cfg.param_dtype]), cfg.rms_norm_eps)

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        # Statistics in float32 whatever the compute dtype; cast back after the weight (as OLMo/HF do).
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (self.weight.astype(jnp.float32) * y).astype(x.dtype)


def rotate_half(x: Float[Array, "*b d"]) -> Float[Array, "*b d"]:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def yarn_ramp_bounds(dim: int, theta: float, scaling: RopeScalingConfig) -> tuple[int, float]:
    """(low, span) of YaRN's ramp over the dim/2 frequency indices, as OLMo-core computes them (nn/rope.py,
    YaRNRoPEScalingConfig): the index where a frequency turns `beta` rotations over original_max_position_embeddings,
    truncated (floor for beta_fast, ceil for beta_slow) and clamped to [0, dim/2 - 1]. transformers clamps the upper
    bound to dim - 1 instead: the two agree whenever ceil(index(beta_slow)) < dim/2, which includes OLMo 3 7B (35 < 64)."""

    def index(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(index(scaling.beta_fast)), 0)
    high = min(math.ceil(index(scaling.beta_slow)), dim // 2 - 1)
    return low, float(max(high - low, 1e-3))  # OLMo-core's guard against a zero-width ramp


def rope_frequencies(dim: int, theta: float, scaling: RopeScalingConfig | None) -> tuple[Float[Array, " half"], float]:
    """(inverse frequencies in float32, attention factor): plain RoPE for `scaling` None or rope_type default, else
    YaRN as OLMo-core's YaRNRoPEScalingConfig: the plain frequencies blended into plain / factor by a linear ramp
    (0 keeps a frequency, 1 interpolates it fully), sin and cos then scaled by the attention factor."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if scaling is None or scaling.rope_type == "default":
        return inv_freq, 1.0
    low, span = yarn_ramp_bounds(dim, theta, scaling)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / span, 0.0, 1.0)
    inv_freq = (inv_freq / scaling.factor) * ramp + inv_freq * (1.0 - ramp)
    return inv_freq, scaling.attention_factor


CONSTANT_TABLE_ELEMENTS = 1 << 20
"""On a CPU target, a RoPE table of at most this many elements per array (4 MiB of float32: seq 8192 at head_dim 128)
is a constant of the compiled program. Traced, XLA:CPU fuses cos and sin into every consumer and evaluates them once
per element of each [batch, seq, heads, dim] fusion (51 sine ops in bench_step's tiny step, each table element
computed batch x heads times per use); RoPE removed altogether ran that step 10-12% faster, the constant table
6-12% (interleaved A/B, docs/performance.md). Larger tables, and every TPU/GPU target, stay in the graph (a 65K
table would be 32 MiB of constants per array)."""


class RopeTable(eqx.Module):
    """cos and sin of every position's rotation angles, float32, [seq, head_dim] (or [*batch, seq, head_dim] once
    gathered at per-document positions): computed once per layer kind (OLMo3.hidden) and shared by every layer of
    that kind."""

    cos: Float[Array, "*batch seq dim"]
    sin: Float[Array, "*batch seq dim"]

    def at(self, positions: Int[Array, "*batch seq"]) -> RopeTable:
        """The rows of `positions` (every position < the table's length)."""
        return RopeTable(self.cos[positions], self.sin[positions])

    @staticmethod
    def build(seq: int, dim: int, theta: float, scaling: RopeScalingConfig | None) -> RopeTable:
        """The table; on a CPU target, up to CONSTANT_TABLE_ELEMENTS per array, computed when the program is traced
        and baked into it as constants (see CONSTANT_TABLE_ELEMENTS)."""
        if target_device()[0] == "cpu" and seq * dim <= CONSTANT_TABLE_ELEMENTS:
            with jax.ensure_compile_time_eval():
                return RopeTable.compute(seq, dim, theta, scaling)
        return RopeTable.compute(seq, dim, theta, scaling)

    @staticmethod
    def compute(seq: int, dim: int, theta: float, scaling: RopeScalingConfig | None) -> RopeTable:
        inv_freq, attention_factor = rope_frequencies(dim, theta, scaling)
        freqs = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        return RopeTable(cos, sin)


def rope_tables(seq: int, cfg: ModelConfig) -> dict[str, RopeTable]:
    """One table per layer kind in use: sliding layers plain RoPE, full layers RoPE with cfg.rope_scaling."""
    kinds = {SLIDING: None, FULL: cfg.rope_scaling}
    return {kind: RopeTable.build(seq, cfg.head_dim, cfg.rope_theta, kinds[kind])
            for kind in sorted(set(cfg.resolved_layer_types))}


def document_positions(segment_ids: Int[Array, "*batch seq"]) -> Int[Array, "*batch seq"]:
    """Each token's position within its document: its index minus the index where its segment begins (a segment
    begins wherever the id differs from the previous token's)."""
    seq = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), segment_ids.shape)
    first = jnp.ones((*segment_ids.shape[:-1], 1), bool)
    begins = jnp.concatenate([first, segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
    return index - jax.lax.cummax(jnp.where(begins, index, 0), axis=segment_ids.ndim - 1)


def rope(x: Float[Array, "*batch seq heads dim"], table: RopeTable) -> Float[Array, "*batch seq heads dim"]:
    """Rotary embedding, NeoX rotate-half layout, the rotation in float32."""
    x32 = x.astype(jnp.float32)
    cos, sin = table.cos[..., :, None, :], table.sin[..., :, None, :]
    return (x32 * cos + rotate_half(x32) * sin).astype(x.dtype)


class Attention(eqx.Module):
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: RMSNorm
    k_norm: RMSNorm

    @staticmethod
    def init(cfg: ModelConfig, *, key: PRNGKeyArray) -> Attention:
        kq, kk, kv, ko = jax.random.split(key, 4)
        d, q_width, kv_width = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
            cfg.num_key_value_heads * cfg.head_dim
        return Attention(
            q_proj=Linear.init(d, q_width, cfg, key=kq),
            k_proj=Linear.init(d, kv_width, cfg, key=kk),
            v_proj=Linear.init(d, kv_width, cfg, key=kv),
            o_proj=Linear.init(q_width, d, cfg, key=ko),
            q_norm=RMSNorm.init(q_width, cfg),
            k_norm=RMSNorm.init(kv_width, cfg),
        )

    def project(self, x: Float[Array, "*batch seq hidden"], cfg: ModelConfig, table: RopeTable
                ) -> tuple[Float[Array, "*batch seq heads dim"], Float[Array, "*batch seq kv_heads dim"],
                           Float[Array, "*batch seq kv_heads dim"]]:
        """q, k, v with QK-norm and RoPE applied: what attention (and a KV cache, olmo3eqx.decode) takes."""
        lead = x.shape[:-1]
        # QK-norm over the full projections, before splitting heads and before RoPE.
        q = self.q_norm(checkpoint_name(self.q_proj(x), "query_proj"))
        k = self.k_norm(checkpoint_name(self.k_proj(x), "key_proj"))
        v = checkpoint_name(self.v_proj(x), "value_proj")
        q = q.reshape(*lead, cfg.num_attention_heads, cfg.head_dim)
        k = k.reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
        v = v.reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
        return rope(q, table), rope(k, table), v

    def output(self, out: Float[Array, "*batch seq heads dim"], cfg: ModelConfig) -> Float[Array, "*batch seq hidden"]:
        out = checkpoint_name(out, "context")
        return checkpoint_name(self.o_proj(out.reshape(*out.shape[:-2], cfg.num_attention_heads * cfg.head_dim)),
                               "out_proj")

    def __call__(self, x: Float[Array, "*batch seq hidden"], cfg: ModelConfig, sliding: bool, table: RopeTable,
                 segment_ids: Int[Array, "*batch seq"] | None = None) -> Float[Array, "*batch seq hidden"]:
        q, k, v = self.project(x, cfg, table)
        # A causal window of W keys including the query itself: i-(W-1) <= j <= i. The scope names the attention's
        # instructions in a compiled program (olmo3eqx.gpu_program reads which kernel each runs).
        with jax.named_scope(SLIDING_SCOPE if sliding else GLOBAL_SCOPE):
            out = attention(q, k, v, window=cfg.sliding_window if sliding else None, impl=cfg.attention_impl,
                            block_q=cfg.attention_block_q, block_kv=cfg.attention_block_kv, segment_ids=segment_ids)
        return self.output(out, cfg)


class MLP(eqx.Module):
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear

    @staticmethod
    def init(cfg: ModelConfig, *, key: PRNGKeyArray) -> MLP:
        kg, ku, kd = jax.random.split(key, 3)
        return MLP(
            gate_proj=Linear.init(cfg.hidden_size, cfg.intermediate_size, cfg, key=kg),
            up_proj=Linear.init(cfg.hidden_size, cfg.intermediate_size, cfg, key=ku),
            down_proj=Linear.init(cfg.intermediate_size, cfg.hidden_size, cfg, key=kd),
        )

    def __call__(self, x: Float[Array, "*batch seq hidden"]) -> Float[Array, "*batch seq hidden"]:
        gate = checkpoint_name(self.gate_proj(x), "mlpwi_0")
        up = checkpoint_name(self.up_proj(x), "mlpwi_1")
        return checkpoint_name(self.down_proj(jax.nn.silu(gate) * up), "mlpwo")


class Block(eqx.Module):
    """OLMo's reordered-norm block: norms on the sublayer outputs, none on the inputs."""

    attn: Attention
    post_attention_norm: RMSNorm
    mlp: MLP
    post_feedforward_norm: RMSNorm

    @staticmethod
    def init(cfg: ModelConfig, *, key: PRNGKeyArray) -> Block:
        ka, km = jax.random.split(key)
        return Block(
            attn=Attention.init(cfg, key=ka),
            post_attention_norm=RMSNorm.init(cfg.hidden_size, cfg),
            mlp=MLP.init(cfg, key=km),
            post_feedforward_norm=RMSNorm.init(cfg.hidden_size, cfg),
        )

    def __call__(self, x: Float[Array, "*batch seq hidden"], cfg: ModelConfig, sliding: bool, table: RopeTable,
                 segment_ids: Int[Array, "*batch seq"] | None = None) -> Float[Array, "*batch seq hidden"]:
        h = x + self.post_attention_norm(self.attn(x, cfg, sliding, table, segment_ids))
        return h + self.post_feedforward_norm(self.mlp(h))


def layer_period(layer_types: tuple[str, ...]) -> int:
    """Shortest p dividing the depth with layer_types[i] == layer_types[i % p] (the depth if none)."""
    n = len(layer_types)
    for p in range(1, n + 1):
        if n % p == 0 and all(layer_types[i] == layer_types[i % p] for i in range(n)):
            return p
    return n


def cast_floating(tree, dtype):
    """Cast every floating array leaf of `tree` to `dtype` (inside jit: fused with the first use)."""
    return jax.tree.map(
        lambda a: a.astype(dtype) if eqx.is_array(a) and jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def for_compute(tree, dtype, *, path: tuple[str, ...] = (), layer: bool = False):
    """`tree` (the model, or its part at `path`) ready to compute in `dtype`. Where this trace gathers weights
    explicitly (precision.explicit: mesh.gather_dtype "compute" under a mesh with fsdp > 1), each float32 weight is
    gathered in `dtype` where it is used (olmo3eqx.precision): a Linear is marked to gather its weight when called,
    the embedding is left for `precision.take_rows`, the layer-stacked blocks for the layer scan (`layer`: `tree` is
    one layer's slice of them), and any other floating leaf (norm weights) is gathered now. Elsewhere: cast_floating.
    Leaves already in `dtype` stay as they are (float32 compute adds no op)."""
    if not precision.explicit():
        return cast_floating(tree, dtype)

    def one(leaf_path, node):
        keys = (getattr(k, "name", None) or getattr(k, "key", None) for k in leaf_path)
        names = (*path, *(k for k in keys if isinstance(k, str)))
        stacked = "blocks" in names and not layer
        if isinstance(node, Linear):
            if stacked or node.weight.dtype == dtype:
                return node
            return Linear(node.weight, precision.param_spec((*names, "weight"), node.weight.shape, layer=layer))
        if not eqx.is_array(node) or not jnp.issubdtype(node.dtype, jnp.floating) or node.dtype == dtype:
            return node
        if stacked or names == ("embed",):
            return node
        return precision.gather_for_compute(node, dtype, precision.param_spec(names, node.shape, layer=layer))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda n: isinstance(n, Linear))


def with_fp8(tree, recipe: str):
    """`tree` with every Linear whose weight dimensions are multiples of fp8.MULTIPLE marked to run its GEMMs in FP8
    by `recipe` (model.fp8), as OLMo-core's Float8Config converts the linears it can; "none" leaves `tree` as it is.
    Applied to the blocks only: the LM head is unembedded by the loss (OLMo-core ignores it too)."""
    if recipe == "none":
        return tree

    def mark(node):
        if isinstance(node, Linear) and all(d % fp8.MULTIPLE == 0 for d in node.weight.shape):
            return Linear(node.weight, node.gather_spec, recipe)
        return node

    return jax.tree.map(mark, tree, is_leaf=lambda n: isinstance(n, Linear))


class OLMo3(eqx.Module):
    """The whole model. `blocks` leaves carry a leading layer axis of size num_hidden_layers."""

    embed: Float[Array, "vocab hidden"]
    blocks: Block
    norm: RMSNorm
    lm_head: Linear
    cfg: ModelConfig = eqx.field(static=True)

    @staticmethod
    def init(cfg: ModelConfig, *, key: PRNGKeyArray) -> OLMo3:
        ke, kb, kh = jax.random.split(key, 3)
        block_keys = jax.random.split(kb, cfg.num_hidden_layers)
        blocks = eqx.filter_vmap(lambda k: Block.init(cfg, key=k))(block_keys)
        return OLMo3(
            embed=trunc_normal(ke, (cfg.vocab_size, cfg.hidden_size), cfg.initializer_range, DTYPE[cfg.param_dtype]),
            blocks=blocks,
            norm=RMSNorm.init(cfg.hidden_size, cfg),
            lm_head=Linear.init(cfg.hidden_size, cfg.vocab_size, cfg, key=kh),
            cfg=cfg,
        )

    def hidden(self, tokens: Int[Array, "*batch seq"], segment_ids: Int[Array, "*batch seq"] | None = None,
               positions: Int[Array, "*batch seq"] | None = None) -> Float[Array, "*batch seq hidden"]:
        """Final-normed hidden states in the compute dtype (the loss unembeds them in chunks). `segment_ids`: each
        token's document in a packed instance (see the module doc); None: one document per row. `positions`: each
        token's RoPE position, given where the sequence is not in its natural order (the train step's balanced
        context chunks, olmo3eqx.context); None: computed here (per document with `segment_ids`)."""
        cfg = self.cfg
        # In the compute dtype; under a mesh with mesh.gather_dtype "compute" each weight is gathered in it where it
        # is used, the stacked blocks a layer at a time inside the scan (layer_group): olmo3eqx.precision.
        dtype = DTYPE[cfg.compute_dtype]
        model = for_compute(self, dtype)
        x = precision.embed_rows(model.embed, tokens) if model.embed.dtype == dtype else \
            precision.take_rows(model.embed, tokens, dtype, precision.param_spec(("embed",), model.embed.shape))
        types = cfg.resolved_layer_types
        period, groups = scan_groups(cfg)
        # Outside the scan: each kind's table is computed once, not once per layer.
        tables = rope_tables(tokens.shape[-1], cfg)
        if positions is None and segment_ids is not None:
            positions = document_positions(segment_ids)
        if positions is None:
            positions = layout_positions(tokens.shape[-1])  # one document a row, the sequence balanced (or None)
        if positions is not None:
            tables = {kind: table.at(positions) for kind, table in tables.items()}

        run_group = layer_group(cfg, types[:period], tables, segment_ids)
        stacked = jax.tree.map(lambda a: a.reshape(groups, period, *a.shape[1:]), model.blocks)
        if groups > 1:
            x, _ = jax.lax.scan(lambda h, g: (run_group(h, g), None), x, stacked)
        else:
            x = run_group(x, jax.tree.map(lambda a: a[0], stacked))
        return model.norm(x)

    def __call__(self, tokens: Int[Array, "*batch seq"],
                 segment_ids: Int[Array, "*batch seq"] | None = None) -> Float[Array, "*batch seq vocab"]:
        """Logits in float32."""
        h = self.hidden(tokens, segment_ids)
        return jnp.matmul(h, self.head_weight(h.dtype), preferred_element_type=jnp.float32)

    def head_weight(self, dtype) -> Float[Array, "hidden vocab"]:
        """The LM head's weight in `dtype` (the hidden states'), gathered as `hidden` gathers the rest (for_compute)."""
        w = self.lm_head.weight
        if not precision.explicit() or w.dtype == dtype:
            return w.astype(dtype)
        return precision.gather_for_compute(w, dtype, precision.param_spec(("lm_head", "weight"), w.shape))


def scan_groups(cfg: ModelConfig) -> tuple[int, int]:
    """(layers per scan step, scan steps): the layers run as a scan over `groups` repeats of `period` layers, or,
    with groups == 1, as one unrolled group (a pattern without a shorter period, too few repeats for a scan to pay:
    MAX_UNROLLED_GROUPS, or scan_layers off)."""
    period = layer_period(cfg.resolved_layer_types) if cfg.scan_layers else cfg.num_hidden_layers
    if cfg.num_hidden_layers // period <= MAX_UNROLLED_GROUPS.get(cfg.remat, 1):
        period = cfg.num_hidden_layers  # too few repeats for a scan to pay (see MAX_UNROLLED_GROUPS)
    return period, cfg.num_hidden_layers // period


def layer_group(cfg: ModelConfig, kinds: tuple[str, ...], tables: dict, segment_ids: Array | None
                ) -> Callable[[Array, Block], Array]:
    """run(x, group) -> x after one period of layers (`kinds`, each checkpointed with cfg.remat's policy); `group`:
    the period's blocks stacked on a leading axis. The body of the layer scan, and what olmo3eqx.costmodel compiles
    alone to count it once per trip."""
    block_fns: list[Callable] = []
    dtype = DTYPE[cfg.compute_dtype]
    for kind in kinds:
        def f(blk: Block, h: Array, table: RopeTable, seg: Array | None, s: bool = kind == SLIDING) -> Array:
            # The layer's weights gathered in the compute dtype (a no-op when OLMo3.hidden has cast them): inside the
            # remat, so a checkpointed layer gathers them again for its backward pass instead of keeping them.
            blk = with_fp8(for_compute(blk, dtype, path=("blocks",), layer=True), cfg.fp8)
            return blk(h, cfg, s, table, seg)
        if cfg.remat != "none":
            f = jax.checkpoint(f, policy=remat_policy(cfg.remat))
        block_fns.append(f)

    def run_group(x: Array, group: Block) -> Array:
        for j, (f, kind) in enumerate(zip(block_fns, kinds)):
            x = f(jax.tree.map(lambda a: a[j], group), x, tables[kind], segment_ids)
        return x

    return run_group


def init_model(cfg: ModelConfig, key: PRNGKeyArray) -> OLMo3:
    return OLMo3.init(cfg, key=key)


def abstract_model(cfg: ModelConfig) -> OLMo3:
    """Shapes and dtypes only (`jax.ShapeDtypeStruct` leaves): a 7B model is never materialised."""
    return eqx.filter_eval_shape(init_model, cfg, jax.random.key(0))


def num_params(model: OLMo3) -> int:
    leaves = jax.tree.leaves(eqx.filter(model, lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)))
    return sum(math.prod(x.shape) for x in leaves)
