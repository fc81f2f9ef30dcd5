"""The named remat policies (MaxText's remat_policy values; model.SAVED_NAMES, model.OFFLOADED_NAMES): each gives
the loss and gradients of `none`, and a block checkpointed with it keeps, besides its inputs, exactly the activations
the policy names (jax's own account of the residuals a checkpointed function saves)."""

from __future__ import annotations

import dataclasses
import re
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from olmo3eqx.config import ConfigError, RematPolicy, TrainConfig, chip_remat, for_chip
from olmo3eqx.model import OFFLOADED_NAMES, SAVED_NAMES, RopeTable, init_model, remat_policy
from test_attention import MODEL

NAMED = [*SAVED_NAMES, *OFFLOADED_NAMES]
NAMES = {"query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo"}


def test_every_named_policy_is_a_config_value():
    assert set(NAMED) <= set(typing.get_args(RematPolicy))
    assert set().union(*SAVED_NAMES.values(), *OFFLOADED_NAMES.values()) == NAMES


def test_remat_by_chip_resolves_by_the_chip_users_name():
    """JAX's device kinds (as libtpu's topologies and CUDA report them) map to the names users give the chips; the first
    matching entry wins; other chips keep model.remat; a bad entry is one sentence naming the field."""
    model = dataclasses.replace(MODEL, remat="full", remat_by_chip=("v5p=save_dot_except_mlp", "tpu7x=save_qkv_proj",
                                                                    "h100=dots", "v5e=minimal", "v5p=none"))
    kinds = {"TPU v5": ("save_dot_except_mlp", "v5p"), "TPU7x": ("save_qkv_proj", "tpu7x"),
             "TPU v5 lite": ("minimal", "v5e"), "NVIDIA H100 80GB HBM3": ("dots", "h100"),
             "TPU v6 lite": ("full", None), "cpu": ("full", None)}
    for kind, want in kinds.items():
        assert chip_remat(model, kind) == want, kind
    resolved = for_chip(TrainConfig(model=model), "TPU v5").model
    assert (resolved.remat, resolved.remat_by_chip) == ("save_dot_except_mlp", ())
    for bad in ("v5p", "v5p=most", "=full"):
        with pytest.raises(ConfigError, match=r"model.remat_by_chip entry .* must be 'chip=policy'"):
            dataclasses.replace(MODEL, remat_by_chip=(bad,))


def saved_names(policy: str) -> tuple[set[str], int, list[str]]:
    """(names of the activations saved on the device, how many went to host memory, descriptions of the other
    residuals) of one sliding block under `policy`."""
    model = init_model(MODEL, jax.random.key(0))
    block = jax.tree.map(lambda x: x[0], model.blocks)  # the first layer (a sliding one)
    x = jax.random.normal(jax.random.key(1), (2, 16, MODEL.hidden_size))
    table = RopeTable.build(16, MODEL.head_dim, MODEL.rope_theta, None)
    fn = jax.checkpoint(lambda b, x: b(x, MODEL, True, table), policy=remat_policy(policy))
    named, host, other = set(), 0, []
    for aval, where in saved_residuals(fn, block, x):
        found = re.match(r"named '([^']+)'", where)
        if found:
            named.add(found.group(1))
        elif "<host>" in str(aval):  # offloaded: jax describes it as a device_put to host memory
            host += 1
        else:
            other.append(where)
    return named, host, other


@pytest.mark.parametrize("policy", NAMED)
def test_a_block_saves_only_what_its_policy_names(policy):
    named, host, other = saved_names(policy)
    if policy in SAVED_NAMES:
        assert named == set(SAVED_NAMES[policy]) and host == 0
    else:
        assert named == set() and host == len(OFFLOADED_NAMES[policy])
    # nothing unnamed is kept: only the block's inputs (weights, x) and the RoPE table (constants of the trace)
    assert all(w.startswith("from the argument") or w == "from a constant" for w in other), other
    if policy == "save_out_proj":  # the comparison can fail: a wider policy keeps more
        assert saved_names("minimal")[0] > named
    if policy == "minimal_offloaded":
        assert saved_names("qkv_proj_offloaded")[1] < host


@pytest.mark.parametrize("policies", [
    ["minimal", "save_out_proj", "minimal_offloaded"],
    pytest.param([p for p in NAMED if p not in ("minimal", "save_out_proj", "minimal_offloaded")],
                 marks=pytest.mark.slow),  # the rest (20 s): the same mechanism with other names
], ids=["default", "rest"])
def test_named_policies_give_the_loss_and_gradients_of_none(policies):
    """A sliding and a global layer, each policy against none (offloading included: CPUs have pinned host memory)."""
    tokens = jax.random.randint(jax.random.key(1), (2, 13), 0, MODEL.vocab_size)

    def loss(m):
        return jnp.mean(jax.nn.logsumexp(m(tokens), axis=-1))

    def grads(policy):
        cfg = dataclasses.replace(MODEL, remat=policy, num_hidden_layers=2, layer_types=("sliding_attention",
                                                                                        "full_attention"))
        model = init_model(cfg, jax.random.key(0))
        return eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)

    want_loss, want = grads("none")
    for policy in policies:
        got_loss, got = grads(policy)
        np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
