"""The train state: everything a checkpoint saves and a resume restores, as one pytree."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PRNGKeyArray

from olmo3eqx import optim
from olmo3eqx.config import TrainConfig
from olmo3eqx.model import OLMo3, init_model


class TrainState(eqx.Module):
    """Model, AdamW state, the number of updates applied, the spike guard's history. Checkpoints save and restore
    it as one tree (olmo3eqx.checkpoint), so a new field needs no change there."""

    model: OLMo3
    opt_state: optax.OptState
    step: Int[Array, ""]
    spike: optim.SpikeGuardState


def init_state(cfg: TrainConfig, optimizer: optax.GradientTransformation, key: PRNGKeyArray) -> TrainState:
    # The model gets the first half of a split of the run key (legacy uint32 keys: plain arrays orbax can save);
    # the second half once seeded a field nothing read, and the split stays so initialisations do not change.
    model_key, _ = jax.random.split(key)
    model = init_model(cfg.model, model_key)
    # Moments follow the float32 master copy whatever param_dtype is (optim keeps them float32 too).
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    return TrainState(model, opt_state, jnp.zeros((), jnp.int32), optim.SpikeGuardState.init(cfg.optim.spike_window))


def abstract_state(cfg: TrainConfig, optimizer: optax.GradientTransformation) -> TrainState:
    """Shapes and dtypes only (`jax.ShapeDtypeStruct` leaves): nothing is allocated."""
    return eqx.filter_eval_shape(init_state, cfg, optimizer, jax.random.PRNGKey(cfg.run.seed))
