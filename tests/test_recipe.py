"""The OLMo 3 7B presets say AI2's numbers: configs/olmo3-7b-stage1.yaml, -16x256.yaml and -stage2.yaml against the
values written in AI2's official scripts, and the decay groups against OLMo-core's own grouping.

The scripts' values below are copied from allenai/OLMo-core src/scripts/official/OLMo3/ (the scripts are not part
of the ai2-olmo-core package); each names its file and variable. Defaults the scripts rely on are read from the
installed package (SkipStepAdamWConfig, CosWithWarmup).
"""

import dataclasses
import math
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from olmo_core.nn.attention import AttentionBackendName
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import CosWithWarmup, OptimGroupOverride, SkipStepAdamWConfig

from olmo3eqx.config import ModelConfig, load_yaml
from olmo3eqx.model import abstract_model, num_params
from olmo3eqx.optim import decay_mask

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STAGE1_PRESETS = ("olmo3-7b-stage1.yaml", "olmo3-7b-16x256.yaml")

# OLMo-3-1025-7B-pretrain-1.py (stage 1, part 1; part 2, -pretrain-2.py, has the same optimizer and batch)
PRETRAIN_SEQUENCE_LENGTH = 8192  # DEFAULT_SEQUENCE_LENGTH
PRETRAIN_GLOBAL_BATCH_TOKENS = 8192 * 512  # GLOBAL_BATCH_SIZE
PRETRAIN_LR = 3e-4  # LR
PRETRAIN_WARMUP = 2000  # CosWithWarmup(warmup_steps=2000)
PRETRAIN_STEPS = 1413814  # the end of epoch 1, where part 2 (hard_stop=Duration.epochs(1)) stopped: OLMo-3-1025-7B.csv
# OLMo-3-1025-7B-midtrain.py (stage 2)
MIDTRAIN_SEQUENCE_LENGTH = 8192  # DEFAULT_SEQUENCE_LENGTH
MIDTRAIN_GLOBAL_BATCH_TOKENS = 2**21  # GLOBAL_BATCH_SIZE
MIDTRAIN_MAX_TOKENS = 100_000_000_000  # MAX_TOKENS
MIDTRAIN_LR = 0.00020712352850360292  # LR
MIDTRAIN_LOAD_OPTIM_STATE = True  # TrainerConfig(load_optim_state=True)
MIDTRAIN_LOAD_TRAINER_STATE = False  # TrainerConfig(load_trainer_state=False): step and data position start again
# All three scripts: SkipStepAdamWConfig(weight_decay=0.1, betas=(0.9, 0.95),
#   group_overrides=[OptimGroupOverride(params=["embeddings.weight"], opts={"weight_decay": 0.0})]),
#   z_loss_multiplier=1e-5, max_grad_norm=1.0
WEIGHT_DECAY, BETAS, Z_LOSS, MAX_GRAD_NORM = 0.1, (0.9, 0.95), 1e-5, 1.0
AI2_GROUP_OVERRIDES = [OptimGroupOverride(params=["embeddings.weight"], opts={"weight_decay": 0.0})]
# Seeds: the scripts' data-loader seeds (34521 stage 1, 1337 stage 2) are data.seed's; the model init seed is
# TransformerConfig.init_seed (0), checked against run.seed below.


def package_defaults():
    """What the scripts leave to OLMo-core 3.0.0's defaults: eps, the spike window and sigma, the final LR ratio."""
    optim = SkipStepAdamWConfig()
    return {"eps": optim.eps, "spike_window": optim.rolling_interval_length, "spike_sigma": optim.sigma_factor,
            "final_lr_ratio": CosWithWarmup(warmup=1).alpha_f}


def check_optimizer(o, lr):
    defaults = package_defaults()
    assert o.lr == lr
    assert (o.b1, o.b2) == BETAS and o.eps == defaults["eps"]
    assert o.weight_decay == WEIGHT_DECAY and o.no_decay == ("embed",)
    assert o.z_loss == Z_LOSS and o.clip_grad_norm == MAX_GRAD_NORM
    assert o.spike_guard  # SkipStepAdamW, every stage
    assert (o.spike_window, o.spike_sigma) == (defaults["spike_window"], defaults["spike_sigma"])


@pytest.mark.parametrize("preset", STAGE1_PRESETS)
def test_stage1_presets_are_pretrain_scripts(preset):
    cfg = load_yaml(CONFIGS / preset)
    check_optimizer(cfg.optim, PRETRAIN_LR)
    assert cfg.optim.warmup_steps == PRETRAIN_WARMUP
    assert cfg.optim.final_lr_ratio == package_defaults()["final_lr_ratio"]
    # The single cosine over the run is the reproduction's (the design card's); `olmo3-stage1` is AI2's own curve.
    assert cfg.optim.schedule == "cosine"
    assert cfg.data.seq_len == PRETRAIN_SEQUENCE_LENGTH
    assert cfg.data.seq_len * cfg.data.global_batch == PRETRAIN_GLOBAL_BATCH_TOKENS
    assert cfg.steps == PRETRAIN_STEPS
    assert cfg.run.seed == TransformerConfig.init_seed == 0
    assert cfg.init_from is None and not cfg.init_optimizer


def test_stage2_preset_is_midtrain_script():
    cfg = load_yaml(CONFIGS / "olmo3-7b-stage2.yaml")
    check_optimizer(cfg.optim, MIDTRAIN_LR)
    # LinearWithWarmup(warmup=0, alpha_f=0.0) over Duration.tokens(MAX_TOKENS)
    assert (cfg.optim.schedule, cfg.optim.warmup_steps, cfg.optim.final_lr_ratio) == ("linear", 0, 0.0)
    assert cfg.data.seq_len == MIDTRAIN_SEQUENCE_LENGTH
    assert cfg.data.seq_len * cfg.data.global_batch == MIDTRAIN_GLOBAL_BATCH_TOKENS
    assert cfg.steps == math.ceil(MIDTRAIN_MAX_TOKENS / MIDTRAIN_GLOBAL_BATCH_TOKENS) == 47684
    # load_path=.../stage1/step1413814: the last stage-1 checkpoint, moments included; init_from (unlike a resume)
    # starts the step, the data position and the spike history again, as load_trainer_state=False does.
    assert cfg.init_from == "runs/olmo3-7b-stage1/checkpoints"
    assert cfg.init_optimizer == MIDTRAIN_LOAD_OPTIM_STATE and not MIDTRAIN_LOAD_TRAINER_STATE
    stage1 = load_yaml(CONFIGS / "olmo3-7b-stage1.yaml")
    # the same model carries over (each stage's remat plan per chip is its own: a compute-only field)
    assert dataclasses.replace(cfg.model, remat_by_chip=()) == dataclasses.replace(stage1.model, remat_by_chip=())


def test_decay_groups_are_olmo_cores():
    """OLMo-core's groups with AI2's overrides: the embedding alone without decay, every other tensor (each RMSNorm and
    QK-norm weight included) with it; ours on the same architecture decays the same tensors, element for element."""
    oc = TransformerConfig.olmo3_14M(vocab_size=1024, attn_backend=AttentionBackendName.torch).build(init_device="meta")
    groups = SkipStepAdamWConfig(group_overrides=AI2_GROUP_OVERRIDES).build_groups(oc)
    names = {id(p): n for n, p in oc.named_parameters()}
    no_decay = [g for g in groups if g.get("weight_decay") == 0.0]
    decayed = [g for g in groups if "weight_decay" not in g]  # the optimizer's weight_decay=0.1
    assert [names[id(p)] for g in no_decay for p in g["params"]] == ["embeddings.weight"]
    assert any("norm" in names[id(p)] for g in decayed for p in g["params"])

    ours = abstract_model(ModelConfig(vocab_size=1024, hidden_size=oc.d_model, num_hidden_layers=oc.n_layers,
                                      num_attention_heads=8, num_key_value_heads=8, head_dim=oc.d_model // 8,
                                      intermediate_size=oc.blocks["0"].feed_forward.hidden_size, eos_token_id=0))
    params = eqx.filter(ours, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    mask = decay_mask(params, load_yaml(CONFIGS / "olmo3-7b-stage1.yaml").optim.no_decay)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    sizes = {jax.tree_util.keystr(path): int(np.prod(x.shape)) for path, x in flat}
    decided = dict(zip(sizes, jax.tree.leaves(mask)))
    assert [path for path, decay in decided.items() if not decay] == [".embed"]
    assert sum(size for path, size in sizes.items() if decided[path]) == sum(
        p.numel() for g in decayed for p in g["params"])
    assert sum(sizes.values()) == sum(p.numel() for p in oc.parameters())


# OLMo-3-1025-7B-long-context.py (stage 3; ../shared/OLMO_CORE.md section 3) and AI2's internal
# src/scripts/train/OLMo3/OLMo3-7B-long-context.py, whose MAX_TOKENS = 50e9 is the real run's length
LONG_SEQUENCE_LENGTH = 65536  # SEQUENCE_LENGTH
LONG_GLOBAL_BATCH_TOKENS = 64 * 65536  # GLOBAL_BATCH_SIZE
LONG_MAX_TOKENS = 50_000_000_000  # internal MAX_TOKENS (the published max_duration is stage 1's, copy-pasted)
LONG_LR = 2.0712e-4  # LR
LONG_WARMUP = 200  # LinearWithWarmup(warmup=200, alpha_f=0.0)
LONG_DATA_SEED = 4123  # internal script (the published one says 34521)
LONG_SOURCE_GROUP_SIZE, LONG_PERMUTATION_SEED = 8, 123  # NumpyPackedFSLDatasetConfig
LONG_YARN = dict(factor=8.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=8192)
LONG_CP_DEGREE = 8  # TransformerContextParallelConfig.llama3(degree=8, head_stride=4)
LONG_SHARD_DEGREE = 1  # TransformerDataParallelConfig(hsdp, shard_degree=1): weights over the CP ranks only
LONG_RANK_MICROBATCH_TOKENS = 65536  # rank_microbatch_size=sequence_length: one instance a CP group


def test_stage3_preset_is_long_context_script():
    from olmo_core.optim import LinearWithWarmup

    from olmo3eqx.optim import lr_schedule

    cfg = load_yaml(CONFIGS / "olmo3-7b-stage3.yaml")
    check_optimizer(cfg.optim, LONG_LR)
    assert cfg.data.seq_len == LONG_SEQUENCE_LENGTH
    assert cfg.data.seq_len * cfg.data.global_batch == LONG_GLOBAL_BATCH_TOKENS
    assert cfg.steps == math.ceil(LONG_MAX_TOKENS / LONG_GLOBAL_BATCH_TOKENS) == 11921
    assert (cfg.data.mix, cfg.data.packing, cfg.data.order) == ("OLMo-longmino-mix-0625", True, "olmo-core")
    assert (cfg.data.source_group_size, cfg.data.source_permutation_seed) == (LONG_SOURCE_GROUP_SIZE,
                                                                              LONG_PERMUTATION_SEED)
    assert cfg.data.seed == LONG_DATA_SEED
    # AI2's mesh on one node (fsdp -1 = 8 / context 8 = its shard degree) and on N nodes with --mesh.data N
    assert (cfg.mesh.context, cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (LONG_CP_DEGREE, 1, -1, 1)
    assert 8 // cfg.mesh.context == LONG_SHARD_DEGREE
    assert cfg.mesh.max_per_device_batch * cfg.data.seq_len == LONG_RANK_MICROBATCH_TOKENS
    assert cfg.init_from == "runs/olmo3-7b-stage2/checkpoints" and cfg.init_optimizer
    r = cfg.model.rope_scaling
    assert r.rope_type == "yarn" and {k: getattr(r, k) for k in LONG_YARN} == LONG_YARN
    assert r.attention_factor == pytest.approx(0.1 * math.log(8) + 1)
    stage2 = load_yaml(CONFIGS / "olmo3-7b-stage2.yaml")
    # stage 3 keeps remat full everywhere (not planned): only YaRN is new, and the per-chip remat entries gone
    assert cfg.model == dataclasses.replace(stage2.model, rope_scaling=r, remat_by_chip=())
    # The LR of step s (OLMo-core's `current` = s) against OLMo-core's own scheduler.
    ours = lr_schedule(cfg.optim, cfg.steps)
    ref = LinearWithWarmup(warmup=LONG_WARMUP, alpha_f=0.0)
    for s in (1, 100, 199, 200, 201, 5000, 11920, 11921):
        assert float(ours(s)) == pytest.approx(float(ref.get_lr(LONG_LR, s, cfg.steps)), rel=1e-5, abs=1e-12), s


# OLMo-3-1025-32B-pretrain.py (stage 1 of the 32B): TransformerConfig.olmo3_32B(vocab_size=dolma2's padded 100352)
PRETRAIN_32B_GLOBAL_BATCH_TOKENS = 8 * 1024 * 1024  # GLOBAL_BATCH_SIZE
PRETRAIN_32B_LR = 6e-4  # LR
EPOCH_INSTANCES = PRETRAIN_STEPS * PRETRAIN_GLOBAL_BATCH_TOKENS // PRETRAIN_SEQUENCE_LENGTH  # max_duration: 1 epoch


def test_32b_preset_is_olmo_cores_olmo3_32b_and_its_pretrain_script():
    cfg = load_yaml(CONFIGS / "olmo3-32b-stage1.yaml")
    oc = TransformerConfig.olmo3_32B(vocab_size=100352)
    m, attn = cfg.model, oc.block.sequence_mixer
    assert (m.vocab_size, m.hidden_size, m.num_hidden_layers) == (100352, oc.d_model, oc.n_layers)
    assert (m.num_attention_heads, m.num_key_value_heads, m.head_dim) == (attn.n_heads, attn.n_kv_heads,
                                                                          oc.d_model // attn.n_heads)
    assert m.intermediate_size == oc.block.feed_forward.hidden_size and m.rope_theta == attn.rope.theta
    # OLMo-core's per-layer window: the pattern repeated, the last layer forced global
    window = attn.sliding_window
    windows = [window.pattern[i % len(window.pattern)] for i in range(oc.n_layers)]
    if window.force_full_attention_on_last_layer:
        windows[-1] = -1
    assert [w == -1 for w in windows] == [t == "full_attention" for t in m.resolved_layer_types]
    assert {w for w in windows if w != -1} == {m.sliding_window}
    assert num_params(abstract_model(m)) == oc.num_params == 32_234_279_936
    check_optimizer(cfg.optim, PRETRAIN_32B_LR)
    assert cfg.optim.warmup_steps == PRETRAIN_WARMUP and cfg.optim.schedule == "cosine"
    assert cfg.optim.final_lr_ratio == package_defaults()["final_lr_ratio"]
    assert cfg.data.seq_len * cfg.data.global_batch == PRETRAIN_32B_GLOBAL_BATCH_TOKENS
    assert cfg.steps * cfg.data.global_batch == EPOCH_INSTANCES  # one epoch, as the 7B's
    assert cfg.data.mix == load_yaml(CONFIGS / "olmo3-7b-stage1.yaml").data.mix


# src/scripts/train/sft/Olmo-3-7B-SFT.py (OLMo-core) and open-instruct's scripts/train/olmo3/ (../shared/OLMO_CORE.md)
SFT_LR = {"olmo3-7b-sft-instruct.yaml": 8e-5, "olmo3-7b-sft-think.yaml": 5e-5}
SFT_SEQUENCE_LENGTH, SFT_GLOBAL_BATCH_TOKENS = 32768, 1_048_576
SFT_WARMUP_FRACTION = 0.03  # LinearWithWarmup(warmup_fraction=0.03, alpha_f=0.0)
SFT_DATA_SEED = 34521  # NumpyDataLoaderConfig(seed=34521)
# open-instruct's scripts/train/olmo3/7b_think_sft.sh and 7b_instruct_sft.sh, and the OLMo-core scripts at the commits
# they name (Think: OLMo2-7B-sft.py at 38f66526; Instruct: OLMo-sft.py at 9e974710)
SFT_INIT_SEED = {"olmo3-7b-sft-think.yaml": 53184, "olmo3-7b-sft-instruct.yaml": 543210}  # SFTConfig init_seed
SFT_NODES = {"olmo3-7b-sft-think.yaml": 8, "olmo3-7b-sft-instruct.yaml": 4}  # --num_nodes (x --launch.num_gpus=8)
GPUS_PER_NODE, MAX_RANK_MICROBATCH_SIZE_TOKENS = 8, 16_384  # the scripts' constants


def sft_data_parallel_ranks(nodes: int, seq_len: int) -> int:
    """The scripts' BatchSizeConfig: a sequence over MAX_RANK_MICROBATCH_SIZE_TOKENS takes the smallest power-of-two
    context-parallel degree that fits it; the data-parallel ranks are the GPUs over that degree."""
    cp = 1
    while seq_len // cp > MAX_RANK_MICROBATCH_SIZE_TOKENS:
        cp *= 2
    return nodes * GPUS_PER_NODE // cp


@pytest.mark.parametrize("preset", sorted(SFT_LR))
def test_sft_presets_are_ai2s_sft_script(preset):
    from olmo_core.optim import LinearWithWarmup

    from olmo3eqx.optim import lr_schedule

    cfg = load_yaml(CONFIGS / preset)
    o = cfg.optim
    assert o.lr == SFT_LR[preset] and (o.b1, o.b2) == BETAS and o.weight_decay == 0.0 and o.z_loss == 0.0
    assert o.clip_grad_norm == MAX_GRAD_NORM and o.spike_guard and o.schedule == "linear" and o.final_lr_ratio == 0
    assert (cfg.data.seq_len, cfg.data.seq_len * cfg.data.global_batch) == (SFT_SEQUENCE_LENGTH,
                                                                            SFT_GLOBAL_BATCH_TOKENS)
    assert (cfg.data.packing, cfg.data.source_group_size, cfg.data.source_permutation_seed) == (True, 1, None)
    assert cfg.data.seed == SFT_DATA_SEED and cfg.data.order == "olmo-core" and cfg.data.label_mask_paths
    assert cfg.run.seed == SFT_INIT_SEED[preset]
    assert cfg.loss.normalize == "per_rank"  # TransformerTrainModule.train_batch: tests/test_loss_rule.py
    assert cfg.loss.ranks == sft_data_parallel_ranks(SFT_NODES[preset], SFT_SEQUENCE_LENGTH)
    assert cfg.loss.ranks == {"olmo3-7b-sft-think.yaml": 32, "olmo3-7b-sft-instruct.yaml": 16}[preset]
    # BatchSizeConfig: the smallest power-of-2 CP degree that brings a rank to 16,384 tokens; HSDP shard degree
    # GPUS_PER_NODE // cp_degree within a node: fsdp -1 on one node of 8 (--mesh.data N on N nodes)
    cp = SFT_NODES[preset] * GPUS_PER_NODE // sft_data_parallel_ranks(SFT_NODES[preset], SFT_SEQUENCE_LENGTH)
    assert (cfg.mesh.context, cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (cp, 1, -1, 1) == (2, 1, -1, 1)
    assert cfg.mesh.max_per_device_batch == 1
    stage3 = load_yaml(CONFIGS / "olmo3-7b-stage3.yaml")
    assert cfg.model == stage3.model  # TransformerConfig.olmo3_7B with YaRN(8, 32, 1, 8192): the stage-3 model
    ref = LinearWithWarmup(warmup_fraction=SFT_WARMUP_FRACTION, alpha_f=0.0)
    ours = lr_schedule(o, cfg.steps)
    for s in (1, 29, 30, 31, 500, cfg.steps - 1, cfg.steps):
        assert float(ours(s)) == pytest.approx(float(ref.get_lr(o.lr, s, cfg.steps)), rel=1e-5, abs=1e-12), s


def test_sft_chain_base_then_think_then_instruct_with_think_moments():
    """Think starts from the converted stage-3 base (a Hugging Face release: weights only, so fresh moments); Instruct
    from the Think run's checkpoints with its AdamW state, as the OLMo-core script's load_checkpoint(checkpoint,
    load_trainer_state=False) loads it, into an optimizer state of the same structure (init_from restores it leaf for
    leaf: tests/test_train.py test_init_from_carries_weights_and_moments_resets_step_and_data)."""
    from olmo3eqx.optim import make_optimizer

    think, instruct = (load_yaml(CONFIGS / f"olmo3-7b-sft-{name}.yaml") for name in ("think", "instruct"))
    assert think.init_from == "ckpt/olmo3-7b-base" and not think.init_optimizer
    assert instruct.init_from == f"{think.run.dir}/{think.run.name}/checkpoints" and instruct.init_optimizer
    assert instruct.model == think.model

    def opt_state(cfg):
        params = eqx.filter(abstract_model(cfg.model), eqx.is_array)
        return jax.eval_shape(make_optimizer(cfg.optim, cfg.steps).init, params)

    assert jax.tree.structure(opt_state(instruct)) == jax.tree.structure(opt_state(think))
    assert jax.tree.leaves(opt_state(instruct)) == jax.tree.leaves(opt_state(think))
