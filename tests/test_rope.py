"""RoPE per layer type against AI2's own code: OLMo-core's YaRN (olmo_core/nn/rope.py) is the reference for the
frequencies, the attention factor and the rotation; `transformers`' YaRN is compared with it to show where the two
libraries part (the ramp's upper clamp). The logit-level proof against `transformers` is in test_hf.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx.config import FULL, SLIDING, ConfigError, ModelConfig, RopeScalingConfig, from_dict, load_yaml, to_dict
from olmo3eqx.model import RopeTable, abstract_model, num_params, rope, rope_frequencies, rope_tables, yarn_ramp_bounds

torch = pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]
olmo_rope = pytest.importorskip("olmo_core.nn.rope")

# (head_dim, theta, factor, original_max_position_embeddings, beta_fast, beta_slow)
YARN_CASES = {
    "olmo3-7b": (128, 500000.0, 8.0, 8192, 32, 1),  # the released model's full-attention layers
    "small-window": (16, 500000.0, 8.0, 64, 32, 1),  # test_hf.py's parity configs
    "gqa-scan": (32, 10000.0, 4.0, 128, 16, 2),
    "clamped": (16, 100.0, 8.0, 8192, 32, 1),  # ceil(index(beta_slow)) = 13 > dim/2 - 1: OLMo-core clamps to 7
}


def olmo_core_yarn(dim, theta, factor, old, beta_fast, beta_slow):
    return olmo_rope.YaRNRoPEScalingConfig(factor=factor, beta_fast=beta_fast, beta_slow=beta_slow,
                                           old_context_len=old)


def olmo_core_rotary(dim: int, theta: float, yarn: tuple | None):
    """OLMo-core's RotaryEmbedding, YaRN-scaled by the YARN_CASES entry `yarn` (None: plain)."""
    return olmo_rope.RotaryEmbedding(head_size=dim, theta=int(theta),
                                     scaling=None if yarn is None else olmo_core_yarn(*yarn))


def ours(dim, theta, factor, old, beta_fast, beta_slow) -> RopeScalingConfig:
    return RopeScalingConfig(rope_type="yarn", factor=factor, original_max_position_embeddings=old,
                             beta_fast=float(beta_fast), beta_slow=float(beta_slow))


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_frequencies_and_attention_factor_match_olmo_core(case):
    dim, theta, *_ = args = YARN_CASES[case]
    want, want_factor = olmo_core_yarn(*args).compute_scaled_inv_freq(theta=theta, dim=dim, device=torch.device("cpu"))
    got, got_factor = rope_frequencies(dim, theta, ours(*args))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=3e-7, atol=0)
    assert got_factor == want_factor == pytest.approx(0.1 * math.log(args[2]) + 1)
    plain = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    assert not np.allclose(np.asarray(got), plain, rtol=1e-3), "YaRN should move some frequencies"


def test_transformers_yarn_differs_from_olmo_core_only_past_the_clamp():
    """Both libraries truncate the ramp (floor/ceil); OLMo-core clamps its top to dim/2 - 1, transformers to dim - 1.
    Equal wherever ceil(index(beta_slow)) < dim/2 (OLMo 3 7B: 35 < 64); ours follows OLMo-core where they differ."""
    from transformers import Olmo3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def hf_yarn(dim, theta, factor, old, beta_fast, beta_slow):
        yarn = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": old,
                "beta_fast": float(beta_fast), "beta_slow": float(beta_slow)}
        config = Olmo3Config(hidden_size=dim * 2, num_attention_heads=2, head_dim=dim, num_hidden_layers=4,
                             max_position_embeddings=int(old * factor),
                             rope_parameters={FULL: yarn, SLIDING: {"rope_type": "default", "rope_theta": theta}})
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"), layer_type=FULL)
        return inv_freq.numpy(), factor

    for case, args in YARN_CASES.items():
        dim, theta = args[:2]
        hf_freq, hf_factor = hf_yarn(*args)
        got, _ = rope_frequencies(dim, theta, ours(*args))
        agree = np.allclose(np.asarray(got), hf_freq, rtol=3e-7, atol=0)
        assert hf_factor == pytest.approx(0.1 * math.log(args[2]) + 1)
        assert agree == (case != "clamped"), case
    assert yarn_ramp_bounds(128, 500000.0, ours(*YARN_CASES["olmo3-7b"])) == (18, 17)  # the ramp spans dims 18..35


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "yarn"])
def test_rotation_matches_olmo_core_past_the_original_length(scaled):
    """q and k rotated by OLMo-core's RotaryEmbedding (its sin/cos cache, its rotate-half) and by ours, at positions up
    to 1.5 x OLMo 3's original 8192, head_dim 128, theta 5e5."""
    seq, heads, dim, theta = 12288, 2, 128, 500000.0
    args = YARN_CASES["olmo3-7b"]
    ref = olmo_core_rotary(dim, theta, args if scaled else None)
    q = np.random.default_rng(0).normal(size=(1, seq, heads, dim)).astype(np.float32)
    k = np.random.default_rng(1).normal(size=(1, seq, heads, dim)).astype(np.float32)
    want_q, want_k = ref(torch.from_numpy(q), torch.from_numpy(k), head_first=False)
    table = RopeTable.build(seq, dim, theta, ours(*args) if scaled else None)
    for x, want in ((q, want_q), (k, want_k)):
        got = np.asarray(rope(jnp.asarray(x[0]), table))
        # sin/cos of angles up to ~1.2e4 rad in float32: both sides round the same products, their sin/cos may differ
        # by an ulp or two of the argument reduction.
        np.testing.assert_allclose(got, want.numpy()[0], rtol=0, atol=2e-5 * np.abs(x).max())


def test_tables_per_layer_kind():
    """Sliding layers get plain RoPE whatever rope_scaling says; full layers get it; one table per kind in use."""
    yarn = RopeScalingConfig(rope_type="yarn", original_max_position_embeddings=64)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, sliding_window=8, eos_token_id=0, rope_scaling=yarn)
    tables = rope_tables(100, cfg)
    assert sorted(tables) == [FULL, SLIDING]
    plain, scaled = RopeTable.build(100, 16, cfg.rope_theta, None), RopeTable.build(100, 16, cfg.rope_theta, yarn)
    np.testing.assert_array_equal(np.asarray(tables[SLIDING].cos), np.asarray(plain.cos))
    np.testing.assert_array_equal(np.asarray(tables[FULL].sin), np.asarray(scaled.sin))
    assert not np.allclose(np.asarray(plain.cos), np.asarray(scaled.cos))
    assert sorted(rope_tables(100, dataclasses.replace(cfg, layer_types=(SLIDING,) * 4))) == [SLIDING]


def test_rope_scaling_config_is_checked_and_round_trips():
    r = RopeScalingConfig(rope_type="yarn")
    assert r.attention_factor == 1.2079441541679836  # the released config.json's value, from 0.1 * ln(8) + 1
    assert from_dict(RopeScalingConfig, to_dict(r)) == r
    for bad, words in [({"factor": 0.5}, "factor must be at least 1"), ({"beta_fast": 1.0}, "must exceed beta_slow"),
                       ({"original_max_position_embeddings": 0}, "original_max_position_embeddings must be positive")]:
        with pytest.raises(ConfigError, match=words):
            RopeScalingConfig(**bad)


def test_final_preset_is_the_released_architecture():
    cfg = load_yaml(REPO / "configs" / "olmo3-7b-final.yaml").model
    assert cfg.max_position_embeddings == 65536 and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScalingConfig(rope_type="yarn", factor=8.0, original_max_position_embeddings=8192,
                                                 beta_fast=32.0, beta_slow=1.0, attention_factor=1.2079441541679836)
    # The stage-1 count less the 74 padding rows of the embedding and of the LM head.
    assert num_params(abstract_model(cfg)) == 7_298_617_344 - 2 * 74 * 4096


def test_cpu_table_is_a_constant_of_the_program_and_olmo_cores_to_the_ulp(monkeypatch):
    """On a CPU target a table up to CONSTANT_TABLE_ELEMENTS is computed at trace time, op by op as OLMo-core computes
    its sin/cos cache (no sin/cos left in the program for XLA:CPU to fuse into every consumer): equal to OLMo-core's to
    an ulp. Above the limit, or for another platform, it stays in the graph, where XLA rewrites the angle's arithmetic
    (seen here: up to 4e-6 off OLMo-core's at seq 256)."""
    import jax

    from olmo3eqx import model as model_module

    seq, dim, theta = 256, 64, 10000.0
    yarn = YARN_CASES["small-window"]

    def primitives(fn) -> set[str]:
        return {e.primitive.name for e in jax.make_jaxpr(fn)().eqns}

    def table(scaled: bool, length: int = seq):
        t = RopeTable.build(length, dim, theta, ours(*yarn) if scaled else None)
        return t.cos, t.sin

    def olmo_core(scaled: bool):
        ref = olmo_core_rotary(dim, theta, yarn if scaled else None)
        sin, cos = ref._get_rotary_embedding(seq, torch.device("cpu"))
        return cos.numpy(), sin.numpy()

    over = model_module.CONSTANT_TABLE_ELEMENTS // dim + 1
    assert {"sin", "cos"} <= primitives(lambda: table(False, over))
    for scaled in (False, True):
        assert not {"sin", "cos"} & primitives(lambda: table(scaled))
        for got, want in zip(jax.jit(lambda: table(scaled))(), olmo_core(scaled)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1.2e-7)
    monkeypatch.setattr(model_module, "target_device", lambda: ("tpu", "TPU v5p"))
    for scaled in (False, True):
        assert {"sin", "cos"} <= primitives(lambda: table(scaled))  # a new function each time: make_jaxpr caches
        for got, want in zip(jax.jit(lambda: table(scaled))(), olmo_core(scaled)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=5e-6)
