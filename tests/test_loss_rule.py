"""loss.normalize per_rank against OLMo-core's own SFT step, on simulated ranks with unequal labelled tokens.

OLMo-core's TransformerTrainModule.train_batch divides each rank's summed loss by that rank's labelled tokens
(batch_num_tokens_for_loss, counted over all its micro-batches) and the data-parallel all-reduce averages the ranks'
gradients; its data loader gives rank r instances r, r + ranks, ... of a global batch. Here OLMo-core's train module
runs each rank's share in turn (one instance per micro-batch, so a rank accumulates several) and its gradients are
averaged as that all-reduce averages them (`-m slow` checks that against OLMo-core on real torch.distributed ranks:
gloo processes, DDP); our real jitted step runs the whole global batch on as many simulated devices. The labels are assistant-like spans of very different lengths, so the ranks hold unequal counts and the
rule matters: the global rule misses OLMo-core's loss by the amount a numpy computation over OLMo-core's own
per-token losses predicts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from olmo_core.data.utils import get_labels
from olmo_core.nn.hf import save_hf_model
from olmo_core.optim import SkipStepAdamWConfig
from olmo_core.train.train_module import TransformerTrainModule
from test_olmo_core_step import EOS, VOCAB, StepClock, olmo_core_model, one_torch_thread  # noqa: F401

from olmo3eqx.checkpoint.model import init_from, load_model
from olmo3eqx.config import DataConfig, LossConfig, MeshConfig, OptimConfig, TrainConfig
from olmo3eqx.sharding import build_layout
from olmo3eqx.step import make_train_step, per_replica
from olmo3eqx.tools.convert import hf_to_orbax

SEQ, BATCH = 64, 8
SPANS = (60, 3, 41, 7, 25, 2, 50, 12)
"""Labelled positions at the end of each row (an answer after its prompt): rank counts 2:1 and more apart."""
GATE = 2e-6
"""Relative difference allowed between OLMo-core's and our CE and grad norm (float32 summation order)."""
OPTIM = OptimConfig(lr=5e-5, weight_decay=0.0, warmup_steps=0, z_loss=0.0, schedule="linear", final_lr_ratio=0.0)


def sft_batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ))
    label_mask = np.arange(SEQ)[None, :] >= SEQ - np.array(SPANS)[:, None]
    return tokens, label_mask


@pytest.fixture(scope="module")
def olmo_core(tmp_path_factory, one_torch_thread):  # noqa: F811
    """(OLMo-core's train module (olmo_core_sft_module), our conversion of its initial model; its weights are also
    saved as weights.pt beside the conversion for ddp_rank)."""
    tmp = tmp_path_factory.mktemp("loss_rule")
    module = olmo_core_sft_module()
    save_hf_model(tmp / "hf", module.model.state_dict(), module.model)
    hf_to_orbax(tmp / "hf", tmp / "ckpt", eos_token_id=EOS)
    torch.save(module.model.state_dict(), tmp / "weights.pt")
    return module, tmp / "ckpt"


def olmo_core_sft_module(dp_config=None) -> TransformerTrainModule:
    """OLMo-core's train module with the SFT script's loss settings (no z-loss), one instance per micro-batch."""
    module = TransformerTrainModule(
        olmo_core_model(), optim=SkipStepAdamWConfig(lr=OPTIM.lr, weight_decay=0.0, betas=(OPTIM.b1, OPTIM.b2)),
        rank_microbatch_size=SEQ, max_sequence_length=SEQ, z_loss_multiplier=None, max_grad_norm=1.0,
        dp_config=dp_config, device=torch.device("cpu"))
    module._attach_trainer(StepClock(1))  # what Trainer does with its train module
    module.trainer.global_step = 1
    return module


def olmo_core_step(module: TransformerTrainModule, ranks: int) -> tuple[float, float]:
    """(CE, pre-clip grad norm) of OLMo-core's step over `ranks` data-parallel ranks: each rank's train_batch on its
    share of the global batch, the gradients averaged over ranks (FSDP's all-reduce) and the recorded CE too (what
    train_batch all-reduces and divides by the world size)."""
    tokens, label_mask = sft_batch()
    grads, losses = None, []
    for r in range(ranks):
        module.zero_grads()
        module.trainer.global_step = r + 1
        module.train_batch({"input_ids": torch.from_numpy(tokens[r::ranks]),
                            "label_mask": torch.from_numpy(label_mask[r::ranks])})
        losses.append(module.trainer.metrics[r + 1]["train/CE loss"])
        rank = [p.grad.detach().clone() for p in module.model.parameters()]
        grads = rank if grads is None else [a + b for a, b in zip(grads, rank, strict=True)]
    norm = torch.sqrt(sum(torch.sum((g / ranks).double() ** 2) for g in grads))
    module.zero_grads()
    return float(np.mean(losses)), float(norm)


def ddp_rank(rank: int, ranks: int, port: int, weights: str, out: str) -> None:
    """One rank of OLMo-core's SFT step under torch.distributed (gloo over loopback): its train module wrapped in DDP
    (the CPU's data parallelism; FSDP and HSDP average gradients over the data-parallel ranks alike), the weights
    `weights` holds, train_batch on the rank's share of the global batch; rank 0 writes the all-reduced CE (as
    train_batch records it) and the norm of the all-reduced gradient to `out`."""
    import json
    import os

    import torch.distributed as dist
    from olmo_core.config import DType
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.train.train_module import TransformerDataParallelConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ranks),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    module = olmo_core_sft_module(TransformerDataParallelConfig(name=DataParallelType.ddp,
                                                                param_dtype=DType.float32))
    module.model.load_state_dict(torch.load(weights))
    tokens, label_mask = sft_batch()
    module.train_batch({"input_ids": torch.from_numpy(tokens[rank::ranks]),
                        "label_mask": torch.from_numpy(label_mask[rank::ranks])})
    norm = torch.sqrt(sum(torch.sum(p.grad.double() ** 2) for p in module.model.parameters()))
    if rank == 0:
        Path(out).write_text(json.dumps([module.trainer.metrics[1]["train/CE loss"], float(norm)]))
    dist.destroy_process_group()


def token_losses(module: TransformerTrainModule) -> tuple[np.ndarray, np.ndarray]:
    """(per-token CE, labelled) of the global batch from OLMo-core's own LM-head loss with reduction "none"."""
    tokens, label_mask = sft_batch()
    batch = {"input_ids": torch.from_numpy(tokens), "label_mask": torch.from_numpy(label_mask)}
    labels = get_labels(batch)
    with torch.no_grad():
        out = module.model(batch["input_ids"], labels=labels, loss_reduction="none")
    return out.ce_loss.reshape(BATCH, SEQ).double().numpy(), (labels != -100).numpy()


def our_step(ckpt, devices: int, loss: LossConfig, data: int = 1, context: int = 1) -> tuple[float, float]:
    """(CE, pre-clip grad norm) of our jitted step on `devices` simulated devices (data x fsdp x context; data > 1 as
    that many nodes: the step's per-replica region), one row per device per micro-batch (per context group with a
    context axis), from the converted checkpoint."""
    _, model_cfg = load_model(ckpt)
    mesh = MeshConfig(data=data, fsdp=devices // data // context, context=context, node_devices=devices // data,
                      max_per_device_batch=1)
    cfg = TrainConfig(steps=1, model=model_cfg, data=DataConfig(seq_len=SEQ, global_batch=BATCH, packing=True),
                      optim=OPTIM, loss=loss, init_from=str(ckpt), mesh=mesh)
    layout = build_layout(cfg, jax.devices()[:devices])
    assert layout.plan.accum_steps == BATCH * context // devices and per_replica(layout) == (data > 1)
    state = init_from(cfg.init_from, layout.init_state(cfg), layout.state_target(), with_optimizer=False)
    tokens, label_mask = sft_batch()
    batch = {"tokens": tokens.astype(np.int32), "mask": np.ones(BATCH, np.float32),
             "segment_ids": np.zeros((BATCH, SEQ), np.int32), "label_mask": label_mask}
    _, metrics = make_train_step(cfg, layout)(state, *layout.put_batch(batch))
    return float(metrics["train/loss"]), float(metrics["train/grad_norm"])


def rank_means(ce: np.ndarray, labelled: np.ndarray, ranks: int) -> float:
    """The numpy mean over ranks of each rank's token mean, rank r holding rows r::ranks."""
    return float(np.mean([np.sum(ce[r::ranks] * labelled[r::ranks]) / np.sum(labelled[r::ranks])
                          for r in range(ranks)]))


@pytest.mark.parametrize("ranks", [2, 4])
def test_per_rank_loss_is_olmo_core_sft_loss(olmo_core, ranks):
    module, ckpt = olmo_core
    ref_ce, ref_norm = olmo_core_step(module, ranks)
    ce, labelled = token_losses(module)
    counts = [int(labelled[r::ranks].sum()) for r in range(ranks)]
    assert len(set(counts)) == ranks, counts  # every rank a different count

    hand_global = float(np.sum(ce * labelled) / np.sum(labelled))
    hand_per_rank = rank_means(ce, labelled, ranks)
    np.testing.assert_allclose(hand_per_rank, ref_ce, rtol=GATE)  # the hand computation is OLMo-core's rule

    per_rank = our_step(ckpt, ranks, LossConfig(normalize="per_rank"))
    np.testing.assert_allclose(per_rank, (ref_ce, ref_norm), rtol=GATE)

    glob = our_step(ckpt, ranks, LossConfig())
    np.testing.assert_allclose(glob[0], hand_global, rtol=GATE)
    expected = hand_per_rank - hand_global
    print(f"\n{ranks} ranks, labelled tokens {counts}: OLMo-core CE {ref_ce:.6f}, per_rank {per_rank[0]:.6f}, "
          f"global {glob[0]:.6f} (per_rank - global {per_rank[0] - glob[0]:+.6f}, numpy {expected:+.6f}); grad "
          f"norm OLMo-core {ref_norm:.6f}, global {glob[1]:.6f}")
    np.testing.assert_allclose(per_rank[0] - glob[0], expected, rtol=1e-3)
    assert abs(expected) > 100 * GATE * ref_ce  # the rules differ well beyond the gate...
    assert abs(glob[1] - ref_norm) > 100 * GATE * ref_norm  # ...in the gradient as well


def test_loss_ranks_reproduce_olmo_core_ranks_on_any_mesh(olmo_core):
    """loss.ranks 4 on 2 devices, one per node (data 2: the per-replica region): OLMo-core's 4-rank loss, whatever
    our own sharding and accumulation."""
    module, ckpt = olmo_core
    ref = olmo_core_step(module, 4)
    ours = our_step(ckpt, 2, LossConfig(normalize="per_rank", ranks=4), data=2)
    np.testing.assert_allclose(ours, ref, rtol=GATE)


def test_per_rank_loss_holds_with_the_sequence_split_over_context(olmo_core):
    """The SFT presets' shape in miniature: loss.ranks 4 on data 2 x fsdp 1 x context 2 (each sequence split in
    balanced chunks, reordered at the step's start after the per-row factor is put in the mask): OLMo-core's
    4-rank loss."""
    module, ckpt = olmo_core
    ref = olmo_core_step(module, 4)
    ours = our_step(ckpt, 4, LossConfig(normalize="per_rank", ranks=4), data=2, context=2)
    np.testing.assert_allclose(ours, ref, rtol=GATE)


def test_loss_ranks_must_split_the_batch():
    from olmo3eqx.errors import ConfigError

    with pytest.raises(ConfigError, match="loss.ranks 3 must divide data.global_batch 8"):
        TrainConfig(data=DataConfig(global_batch=8), loss=LossConfig(normalize="per_rank", ranks=3))
    with pytest.raises(ConfigError, match="applies to loss.normalize per_rank only"):
        LossConfig(ranks=4)
    assert dataclasses.replace(LossConfig(), normalize="per_rank").ranks == 0


@pytest.mark.slow  # ~3 min on 2 cores: six processes importing torch and OLMo-core
@pytest.mark.parametrize("ranks", [2, 4])
def test_per_rank_loss_is_olmo_core_under_torch_distributed(olmo_core, ranks, tmp_path):
    """OLMo-core's step on `ranks` real processes (torch.distributed, gloo, DDP's all-reduce) gives the numbers the
    in-process ranks above give, and ours."""
    import socket

    import torch.multiprocessing as mp

    module, ckpt = olmo_core
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp.json"
    mp.spawn(ddp_rank, args=(ranks, port, str(ckpt.parent / "weights.pt"), str(out)), nprocs=ranks)
    ddp = tuple(json.loads(out.read_text()))
    print(f"\n{ranks} DDP ranks: CE {ddp[0]:.7f}, grad norm {ddp[1]:.7f}")
    np.testing.assert_allclose(olmo_core_step(module, ranks), ddp, rtol=GATE)
    np.testing.assert_allclose(our_step(ckpt, ranks, LossConfig(normalize="per_rank")), ddp, rtol=GATE)
