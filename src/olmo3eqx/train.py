"""The training loop and the dry run, from the same Layout: config -> layout -> state (fresh, resumed or
initialised from a checkpoint) -> steps.

Step numbering (docs/checkpoints.md): step s (1-based) applies update s using global batch s-1
and logs its loss as `step: s`; `checkpoints/N/` holds the state after N updates and a data state that consumed
N batches. Only the standard library is imported at module level, so `--until-done` and the host-allocator
re-exec start without JAX.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from olmo3eqx import exits

if TYPE_CHECKING:
    from olmo3eqx.config import TrainConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny.yaml"

USAGE = """Train OLMo 3 with olmo3eqx. YAML gives the defaults, flags override any field.

Entry flags (before the others):
  --config PATH           YAML preset (default: configs/tiny.yaml)
  --simulated-devices N   run on N simulated CPU devices (for --dry-run planning of large meshes)
  --target TOPOLOGY       with --dry-run: compile for a TPU topology not present (tpu7x:4x4x4, v5p:8x8x2, v5e:16x16,
                          ..., 2xv5p:8x8x1 for two slices) with XLA:TPU on this host (needs the `tpu` extra: libtpu),
                          or for GPU nodes (h100x8, h200x8, b200x8, 16xh100x8 for 16 nodes of 8) with XLA:GPU
                          (needs the `gpu-compile` extra: jax's CUDA plugin; without it, simulated CPU devices and the
                          CPU compiler's memory against the GPUs')
  --until-done            supervise: relaunch this command until it finishes: at once after a preemption (exit 75),
                          after the backoff after a crash or a storage failure (exit 74), never after bad input (2)
                          or optim.max_nonfinite non-finite steps in a row (3); each relaunch logs its exit code
  --retry-backoff S       with --until-done: seconds to wait after a crash or storage failure (default 300)
  --max-restarts N        with --until-done: give up after more than N failures within 24 h; preemptions do not
                          count (default 20)
  --stop-timeout S        with --until-done: a stop signal the supervisor receives (SIGTERM, SIGINT, SIGHUP) is passed
                          on as SIGTERM and nothing is relaunched; seconds to wait for the preemption checkpoint
                          before killing the trainer (default 600)
"""
SUPERVISOR_FLAGS = {"--until-done": 0, "--retry-backoff": 1, "--max-restarts": 1, "--stop-timeout": 1}
DATA_ORDER_DIR = "data_order"
"""Under the run directory: data.order olmo-core's per-epoch global indices, built once, shared by the processes."""


def parse_args(argv: list[str] | None = None):
    """(TrainConfig, entry options): `--config` YAML defaults, then tyro flags over every field."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=str(DEFAULT_CONFIG))
    pre.add_argument("--simulated-devices", type=int, default=0)
    pre.add_argument("--target", default=None)
    pre.add_argument("--until-done", action="store_true")
    pre.add_argument("--retry-backoff", type=float, default=300.0)
    pre.add_argument("--max-restarts", type=int, default=20)
    pre.add_argument("--stop-timeout", type=float, default=600.0)
    opts, rest = pre.parse_known_args(argv)
    from olmo3eqx.aot import GPU_QUIET, cuda_plugin, gpu_node

    node = gpu_node(opts.target)
    if node is not None and cuda_plugin():  # XLA:GPU compiles for the plugin's compile-only GPUs
        for key, value in GPU_QUIET.items():
            os.environ.setdefault(key, value)
    elif node is not None:  # no plugin: the CPU compiler plans on as many simulated devices
        opts.simulated_devices = node.count
    if opts.simulated_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={opts.simulated_devices}")
    if opts.target:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the TPU compiler is loaded for the topology; no TPU is used
    import tyro

    from olmo3eqx.config import TrainConfig, load_yaml

    base = load_yaml(opts.config)  # a ConfigError (a missing file, a URL nothing here reaches) is main's exit 2
    cfg = tyro.cli(TrainConfig, default=base, args=rest, description=USAGE + f"\nDefaults from {opts.config}.")
    return cfg, opts


def child_args(argv: list[str]) -> list[str]:
    """argv without the supervisor's own flags."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in SUPERVISOR_FLAGS:
            skip = SUPERVISOR_FLAGS[name] if "=" not in arg else 0
            continue
        out.append(arg)
    return out


@exits.command
def main(argv: list[str] | None = None) -> int:
    """The trainer's command; its errors end as exits.command says (one sentence and the documented exit code)."""
    argv = sys.argv[1:] if argv is None else argv
    cfg, opts = parse_args(argv)
    if opts.until_done:
        from olmo3eqx.tools.supervise import run_until_done

        return run_until_done([sys.executable, "-m", "olmo3eqx.train", *child_args(argv)],
                              backoff_s=opts.retry_backoff, max_restarts=opts.max_restarts,
                              stop_timeout_s=opts.stop_timeout)
    if opts.target and not cfg.dry_run:
        from olmo3eqx.errors import ConfigError

        raise ConfigError(f"--target {opts.target} compiles for devices that are not here; add --dry-run.")
    from olmo3eqx import jaxenv

    host_note = jaxenv.prepare(os.environ)  # before anything imports jax
    precision_note = jaxenv.float32_matmuls(os.environ, cfg.model.compute_dtype)
    host_note = "\n".join(filter(None, [host_note, precision_note])) or None
    from olmo3eqx import distributed

    distributed.check_devices(distributed.initialize(cfg.dist))  # refused (exit 2) unless every chip is used once
    if cfg.dry_run:
        dry_run(cfg, opts.target)
        return exits.OK
    return train(cfg, host_note)


def dry_run(cfg, target: str | None = None) -> None:
    """Plan without building anything on devices: sizes, FLOPs, mesh, batch split, and the compiled step's memory
    per device, FLOPs and compile time from an ahead-of-time compile over abstract arrays, for this host's devices
    or (`target`) for a TPU topology (olmo3eqx.aot)."""
    import dataclasses

    import jax
    import yaml

    from olmo3eqx import aot, flops, jaxenv
    from olmo3eqx.config import chip_remat, for_chip, to_dict
    from olmo3eqx.errors import ConfigError
    from olmo3eqx.sharding import build_layout

    gpu = aot.gpu_node(target)
    if gpu is not None and gpu.nodes > 1:  # the simulated devices fall into nodes: fsdp and tensor kept within one
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, node_devices=gpu.per_node))
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    print("---")
    m, seq = cfg.model, cfg.data.seq_len
    compiled_gpu = gpu is not None and aot.cuda_plugin()
    if compiled_gpu:
        devices = aot.gpu_devices(gpu)
    else:
        devices = aot.topology_devices(target) if target and gpu is None else jax.devices()
    if gpu is not None and not compiled_gpu:
        if len(devices) < gpu.count:
            raise ConfigError(f"--target {target} plans on {gpu.count} simulated devices but JAX has {len(devices)}: "
                              f"JAX started before train.py could ask for them (run train.py as its own process).")
        devices = devices[:gpu.count]
    kind = gpu.device_kind if gpu is not None else devices[0].device_kind
    remat, chip = chip_remat(cfg.model, kind)
    cfg = for_chip(cfg, kind)  # before the layout: its abstract model carries the remat
    layout = build_layout(cfg, devices)
    plan = layout.plan
    per_token, per_token_all_global = flops.train_flops_per_token(m, seq), flops.train_flops_per_token(m, seq, False)
    attention_per_token = 3 * flops.attention_flops_per_token(m, seq)
    device_step_tokens = layout.tokens_per_device(seq)
    print(f"parameters:            {flops.param_count(m):,}")
    print(f"train FLOPs/token:     {per_token:.4e} (sliding windows counted as windowed); "
          f"{per_token_all_global:.4e} (MaxText convention, all layers global)")
    print(f"TFLOP per device-step: {per_token * device_step_tokens / 1e12:,.4g} windowed, of which attention "
          f"{attention_per_token * device_step_tokens / 1e12:,.4g}; "
          f"{per_token_all_global * device_step_tokens / 1e12:,.4g} all-global "
          f"({plan.global_batch} x {seq} tokens over {len(devices)} devices)")
    where = f"topology {target}" if target else f"{jax.process_count()} process(es)"
    print(f"devices:               {len(devices)} x {devices[0].device_kind} ({where})")
    print(f"mesh:                  {dict(layout.mesh.shape)}")
    print(f"batch:                 global {plan.global_batch} = {plan.batch_devices} data-parallel devices x "
          f"{plan.per_device_batch} per device x {plan.accum_steps} accumulation steps")
    print(f"remat:                 {remat}" + (f" (model.remat_by_chip: {chip})" if chip else ""))
    print(f"attention:             {attention_backend(cfg, layout, gpu)}")
    if cfg.mesh.context > 1:
        print(f"context parallel:      {context_line(cfg)}")
    tpu_flags = jaxenv.describe_tpu_flags(cfg.mesh.tpu_flags, kind, os.environ)
    if tpu_flags:
        print(f"XLA:TPU flags:         {tpu_flags}")
    if gpu is not None:
        nodes = (f"{gpu.nodes} nodes of {gpu.per_node}, data across nodes and fsdp/tensor within "
                 f"(mesh.node_devices={gpu.per_node}): " if gpu.nodes > 1 else "")
        if compiled_gpu:
            print(f"GPU nodes:             {nodes}{gpu.count} x {gpu.device_kind} ({gpu.hbm / 2**30:.2f} GiB each), "
                  f"compile-only devices of jax's CUDA plugin: XLA:GPU compiles the step here (nothing runs)")
        else:
            print(f"GPU node plan:         {nodes}{gpu.count} x {gpu.device_kind} ({gpu.hbm / 2**30:.2f} GiB each) on "
                  f"{gpu.count} simulated CPU devices: XLA:CPU's memory stands in for XLA:GPU's, which needs jax's "
                  f"CUDA plugin: {aot.GPU_INSTALL}")
    print("\n".join(aot.compile_step(cfg, layout, gpu).lines()))


def context_line(cfg) -> str:
    """The dry run's line for mesh.context: each rank's chunks, the keys each layer kind receives, and how evenly
    attention's work falls on the ranks."""
    from olmo3eqx.config import SLIDING
    from olmo3eqx.context import Chunks, attention_balance, reach

    m, seq, ranks = cfg.model, cfg.data.seq_len, cfg.mesh.context
    chunks = Chunks(ranks, cfg.mesh.context_balance)
    chunk = seq // chunks.count
    windows = [m.sliding_window if t == SLIDING else None for t in m.resolved_layer_types]
    back = reach(m.sliding_window if SLIDING in m.resolved_layer_types else None, chunk, chunks)
    keys = "keys and values all-gathered per layer" if back is None else (
        f"keys and values all-gathered per global layer, the {back} previous chunk{'s' * (back > 1)} a sliding "
        f"window reaches by collective permutes")
    held = (f"{chunks.slots} chunks of {chunk:,} tokens (i and {2 * ranks - 1} - i: balanced)" if chunks.balanced
            else f"{chunk:,} contiguous tokens (no causal load balancing)")
    return (f"{ranks} ranks x {held} of each sequence, {keys}; attention FLOPs per rank max/mean "
            f"{attention_balance(windows, seq, ranks, chunks.balanced):.3f}")


def attention_backend(cfg, layout, gpu=None) -> str:
    """The attention backend the compiled step uses on the layout's devices (model.attention_impl resolved for the
    run's batches: documents masked when data.packing), or on the GPU node `gpu` plans for."""
    import contextlib

    import jax
    import jax.numpy as jnp

    from olmo3eqx.attention import CUDNN_CP, planning_for, resolve, splash_blocks, split_backend
    from olmo3eqx.flash import blocks_for
    from olmo3eqx.model import DTYPE

    m, seq = cfg.model, cfg.data.seq_len
    masked = " (documents masked)" if cfg.data.packing else ""
    with (jax.sharding.use_abstract_mesh(layout.mesh.abstract_mesh),
          planning_for("gpu", gpu.device_kind) if gpu is not None else contextlib.nullcontext()):
        backend = resolve(m.attention_impl, jnp.dtype(DTYPE[m.compute_dtype]), documents=cfg.data.packing, seq=seq)
        used, why = split_backend(backend) if cfg.mesh.context > 1 else (backend, None)
        if why is not None:
            return f"{used} in place of {backend} (mesh.context: {why}){masked}"
        if cfg.mesh.context > 1:
            seq //= cfg.mesh.context  # each rank's queries
        if backend == "flash":
            _, bq, bkv = blocks_for(seq, m.attention_block_q, m.attention_block_kv)
            return f"flash, blocks {bq} x {bkv}{masked}"
        if backend == CUDNN_CP and cfg.mesh.context > 1:
            simulated = gpu is not None and layout.mesh.devices.flat[0].platform == "cpu"
            planned = ", planned here with flash's memory" if simulated else ""
            return (f"{CUDNN_CP} (cuDNN on chunks that continue a document; compiled, not yet run on a GPU"
                    f"{planned}){masked}")
        if backend == "cudnn" and gpu is not None and layout.mesh.devices.flat[0].platform == "cpu":
            return "cudnn (planned here with flash's memory: the CPU compiler cannot build cuDNN's kernel)"
        if backend != "splash":
            return backend + masked
        _, bq, bkv = splash_blocks(seq, m.attention_block_q, m.attention_block_kv, m.head_dim)
    return f"splash, blocks {bq} x {bkv}{masked} (Pallas kernels count 0 in XLA's FLOPs)"


class Preemption:
    """SIGTERM/SIGHUP/SIGINT: finish the current step, write a checkpoint, exit with exits.PREEMPTED.

    SIGHUP (the terminal or SSH session that started the trainer went away) is a preemption as SIGTERM is: the
    default action would kill every worker without a checkpoint. A signal may arrive more than once (slurmstepd
    signals every process of the step and `--until-done` passes its own on): SIGTERM and SIGHUP are taken any number
    of times; a second SIGINT (Ctrl-C twice) stops at once.

    With several processes, JAX's own preemption notifier (installed by `jax.distributed`) catches SIGTERM and the
    coordination service picks one step at which every process stops (`reached_preemption_sync_point`); a local
    handler would let processes stop at different steps and deadlock in the next collective. SIGHUP is turned into
    a SIGTERM to this process for that notifier."""

    def __init__(self, multiprocess: bool):
        self.multiprocess = multiprocess
        self.requested = None  # the first stop signal's name
        self._seen = set()
        self._old = {}

    def __enter__(self):
        signals = (signal.SIGINT, signal.SIGHUP) if self.multiprocess else (signal.SIGTERM, signal.SIGINT,
                                                                            signal.SIGHUP)
        for sig in signals:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and (signum in self._seen or self.multiprocess):
            raise KeyboardInterrupt  # a second Ctrl-C (or any Ctrl-C of one process of many) stops at once
        self._seen.add(signum)
        self.requested = self.requested or signal.Signals(signum).name
        if self.multiprocess:  # SIGHUP: JAX's notifier agrees on the step
            os.kill(os.getpid(), signal.SIGTERM)

    def check(self, step: int) -> str | None:
        """The signal to stop on after `step`, agreed by all processes; None to go on."""
        if self.multiprocess:
            from jax.experimental import multihost_utils

            return (self.requested or "SIGTERM") if multihost_utils.reached_preemption_sync_point(step) else None
        return self.requested

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class NonFiniteLoss(Exception):
    """optim.max_nonfinite consecutive steps, `first` to `step`, had a NaN or infinite loss or gradient norm (each
    one's update skipped)."""

    def __init__(self, step: int, first: int, loss: float, grad_norm: float):
        super().__init__(f"{step - first + 1} consecutive steps ({first}-{step}) had a non-finite loss or gradient "
                         f"norm (the last: loss {loss}, grad norm {grad_norm})")
        self.step, self.first = step, first


def train(cfg: TrainConfig, host_note: str | None = None) -> int:
    """Run (or resume) the training `cfg` describes, holding the run directory's lock (olmo3eqx/runlock.py, taken
    before anything is written to it); returns the process exit code. `host_note` (jaxenv.prepare's line on
    the XLA flags) goes into the log."""
    import jax

    from olmo3eqx.runlock import lock_run

    warn = (lambda m: print(m, file=sys.stderr, flush=True)) if jax.process_index() == 0 else (lambda m: None)
    with lock_run(cfg.run_dir, process_index=jax.process_index(), process_count=jax.process_count(),
                  warn=warn) as lock:
        return train_locked(cfg, host_note, lock)


def train_locked(cfg: TrainConfig, host_note: str | None, lock) -> int:
    import jax

    from olmo3eqx import distributed, flops, jaxenv, metrics, peers, storage
    from olmo3eqx.checkpoint.checkpointer import Checkpointer, tree_bytes
    from olmo3eqx.checkpoint.failures import STORAGE_ERRNOS, storage_errno
    from olmo3eqx.config import chip_remat, dump_yaml, for_chip, to_dict
    from olmo3eqx.profiling import StepProfiler
    from olmo3eqx.sharding import build_layout
    from olmo3eqx.step import make_train_step
    from olmo3eqx.tools import hostmem

    primary = jax.process_index() == 0
    run_dir = str(cfg.run_dir)
    config_dict = storage.redact_tree(to_dict(cfg))  # no credential or signed URL in any file or log
    if primary:
        storage.makedirs(run_dir)
        dump_yaml(cfg, storage.join(run_dir, "config.yaml"))
    log = metrics.MetricsLogger(run_dir, cfg.log, cfg.steps, enabled=primary, config_dict=config_dict,
                                mfu_label=flops.mfu_label(jax.devices()[0]))
    log.print(distributed.describe())
    log.print(hostmem.describe())
    if storage.is_url(run_dir):
        log.print(f"run directory: {storage.redact(run_dir)} ({storage.describe(run_dir)}); OLMo-core's order index, "
                  f"if any, in {order_index_dir(cfg)} on each host")
    if host_note:
        log.print(host_note)
    kind = jax.devices()[0].device_kind
    tpu_flags = jaxenv.describe_tpu_flags(cfg.mesh.tpu_flags, kind, os.environ)
    if tpu_flags:
        log.print(f"XLA:TPU flags: {tpu_flags}")
    remat, chip = chip_remat(cfg.model, kind)
    if chip:  # config.yaml keeps the entries; the step uses this chip's
        cfg = for_chip(cfg, kind)
        log.print(f"remat: {remat} (model.remat_by_chip: {chip} in {kind})")
    layout = build_layout(cfg)
    log.print(layout.describe())
    if not cfg.data.paths and not cfg.data.mix:
        from olmo3eqx.data import corpus

        log.print(corpus.describe(cfg.data.cache_dir))
    ckpt = cfg.checkpoint
    checkpointer = Checkpointer(storage.join(run_dir, "checkpoints"), keep=ckpt.keep, keep_every=ckpt.keep_every,
                                permanent_every=ckpt.every if ckpt.ephemeral_every else 0, last_step=cfg.steps,
                                async_save=ckpt.async_save, record=template_record(cfg, log.print))
    index_log = metrics.IndexLog(run_dir, jax.process_index(), cfg.log.indices)
    skips = metrics.SkipLog(run_dir, primary)
    try:
        start, state, data_state = starting_point(cfg, layout, checkpointer, log.print)
        if start >= cfg.steps:
            log.print(f"checkpoint step {start} already reaches steps={cfg.steps}: nothing to do.")
            return exits.OK
        checkpointer.check_space(tree_bytes(layout.state_target()), warn=log.print)
        data = train_data(cfg, start, data_state)
        evaluator = loop_evaluator(cfg, layout, log)  # held-out sets and task files checked before step 1
        train_step = make_train_step(cfg, layout)
        queue = metrics.MetricsQueue()
        report = Reporter(cfg, log, metrics.ThroughputMeter(
            start_step=start, tokens_per_step=cfg.data.global_batch * cfg.data.seq_len,
            flops_per_token=flops.train_flops_per_token(cfg.model, cfg.data.seq_len),
            num_devices=jax.device_count(), peak_flops=flops.peak_flops(jax.devices()[0])), first_step=start + 1,
            skips=skips)
        if start == 0 and evaluator is not None:
            evaluator.run(0, state.model)  # the start of the held-out curves
        with Preemption(jax.process_count() > 1) as preemption, \
                StepProfiler(cfg.log.profile_range, storage.join(run_dir, "profile"), log.print) as profile:
            for step in range(start + 1, cfg.steps + 1):
                checkpointer.poll()  # a background write that failed stops the run now, not at the next save
                lock.check()  # a lease in a bucket that another trainer took over stops this one
                profile(step, state)
                batch = next(data)
                index_log.write(step, batch["index"])
                report.batch(step, batch["index"])
                state, step_metrics = train_step(state, *layout.put_batch(batch))
                report(queue.push(step, step_metrics))
                stop = preemption.check(step)
                save_due = ckpt.due(step, cfg.steps) or stop is not None
                eval_due = evaluator is not None and evaluator.due(step)
                if save_due or eval_due:
                    report(queue.flush())  # never checkpoint or evaluate a non-finite state
                if eval_due:
                    evaluator.run(step, state.model, report.recent_loss())
                if save_due:
                    log.flush()  # in a bucket, the lines kept so far: every step the checkpoint holds is logged
                    index_log.flush()
                    checkpointer.save(step, state, data.get_state(), config_dict)
                if stop is not None:
                    checkpointer.wait()
                    log.print(f"{stop} received: checkpoint {step} written; exiting to be resumed.")
                    return exits.PREEMPTED
            report(queue.flush())
        if evaluator is not None and evaluator.last_samples is not None:
            at, texts = evaluator.last_samples
            log.print(f"sample at step {at}:\n{texts[0]}")
        return exits.OK
    except NonFiniteLoss as e:
        log.print(f"error: {e}; stopping at optim.max_nonfinite {cfg.optim.max_nonfinite}. "
                  f"{nonfinite_tried(cfg, e, checkpointer, skips, start)}")
        return exits.NONFINITE
    except OSError as e:  # metrics.jsonl, indices: the disk that fills under a save fills under these too
        if storage_errno(e) not in STORAGE_ERRNOS:
            raise
        raise checkpointer.storage_error(f"Writing {e.filename} failed ({e.strerror})", e.errno) from None
    finally:
        failing = sys.exc_info()[1]
        if isinstance(failing, Exception):
            peers.leaving(failing)  # the other processes stop now, not once this one's cleanup is done
        # checkpointer last: it waits for the final write, whose failure (a StorageError) ends the run
        close_all((index_log.close, skips.close, log.close, checkpointer.close), failing=failing is not None)


def template_record(cfg: TrainConfig, say) -> dict:
    """What every checkpoint records of the chat templates its data was prepared with (olmo3eqx.data.template_record),
    said in the log; {} for data without label masks or without prepare chat's record."""
    from olmo3eqx.data import template_record

    templates = template_record.prepared_templates(cfg.data.label_mask_paths)
    if templates:
        say(f"chat data prepared with the template sha256 {', '.join(templates)}: recorded in each checkpoint "
            f"(olmo3eqx-generate --chat and convert.py orbax-to-hf --tokenizer use that template)")
    return {template_record.KEY: templates} if templates else {}


def nonfinite_tried(cfg: TrainConfig, e: NonFiniteLoss, checkpointer, skips, start: int) -> str:
    """What was already tried when NonFiniteLoss stops a run (launched at checkpoint `start`), and what is left to a
    person."""
    from olmo3eqx import storage

    first = streak_start(e.first, start, skips.path)
    earlier = f": every update since step {first} was skipped, those before step {e.first} by an earlier launch" \
        if first < e.first else ""
    guard = "on" if cfg.optim.spike_guard else "off"
    return (f"Already tried: each of those updates was skipped (the weights are still those of step {first - 1}"
            f"{earlier}; the batches are listed in {storage.redact(skips.path)}); optim.spike_guard is {guard}. A "
            f"relaunch resumes from the newest checkpoint and would replay the same weights, so it is not tried. "
            f"{resume_advice(checkpointer.steps(), first, checkpointer.directory)}")


def streak_start(first: int, start: int, skipped_file: str) -> int:
    """The step the non-finite streak ending this launch began at: `first`, or earlier when this launch resumed inside
    a streak an earlier launch began (its checkpoints written during the streak, its steps in the skip log)."""
    from olmo3eqx import metrics, storage

    if first != start + 1 or not storage.isfile(skipped_file):
        return first
    skipped = {record["step"] for record in metrics.read_metrics(skipped_file)}
    while first - 1 in skipped:
        first -= 1
    return first


def resume_advice(kept: list[int], first: int, directory) -> str:
    """Where to go on from after a non-finite streak that began at step `first`, given the checkpoints `kept`: the
    newest written before it. A skipped update leaves the weights as they were, so every checkpoint written during
    the streak (steps >= first) holds the weights each of its batches failed on, with a later data position: never
    those; and checkpoint first-1 holds those weights too, so then the weights themselves are suspect."""
    before = [s for s in kept if s < first]
    if not before:
        return (f"No checkpoint was written before the streak began at step {first} (any written since holds the "
                f"weights every batch failed on): start over with a lower optim.lr under another run.name, or inspect "
                f"those batches.")
    newest = before[-1]

    def move(after: int) -> str:  # a relaunch resumes from the newest checkpoint
        later = [str(s) for s in kept if s > after]
        return f"move checkpoints {', '.join(later)} out of {directory} and " if later else ""

    if newest < first - 1:
        return (f"The newest checkpoint written before the streak began at step {first} is {directory / str(newest)}: "
                f"{move(newest)}relaunch to resume from it with a lower optim.lr, or inspect those batches and raise "
                f"optim.max_nonfinite.")
    older = before[:-1]
    retry = (f": {move(older[-1])}relaunch to resume from the older {directory / str(older[-1])} with a lower "
             f"optim.lr, or" if older else ", and no older checkpoint is kept:")
    return (f"Checkpoint {directory / str(newest)}, the newest written before the streak began at step {first}, holds "
            f"the very weights every batch failed on, so the weights themselves may be bad{retry} start over with a "
            f"lower optim.lr under another run.name, or inspect those batches.")


def close_all(closers, failing: bool) -> None:
    """Call every closer; the first failure is raised once all have run, unless the run is already stopping on an
    error: that one stays the error reported (a store that failed under the restore fails the sinks' last flush
    too, and the sentence must name what stopped the run, not its echo)."""
    first = None
    for close in closers:
        try:
            close()
        except Exception as e:  # noqa: BLE001 - raised below
            first = first or e
    if first is not None and not failing:
        raise first


def starting_point(cfg: TrainConfig, layout, checkpointer, note):
    """(steps done, train state, data-iterator state or None): resumed from the newest checkpoint that loads, else
    fresh (with init_from's weights, and moments with init_optimizer)."""
    import olmo3eqx.checkpoint.model as checkpoint
    from olmo3eqx import storage

    resumed = checkpointer.restore_latest(layout.state_target(), cfg.model, warn=note)
    if resumed is not None:
        start, state, data_state = resumed
        note(f"resumed from {checkpointer.directory / str(start)}")
    else:
        start, state, data_state = 0, layout.init_state(cfg), None
        if cfg.init_from:
            state = checkpoint.init_from(cfg.init_from, state, layout.state_target(),
                                         with_optimizer=cfg.init_optimizer, note=note)
            parts = "weights + moments" if cfg.init_optimizer else "weights"
            note(f"initialised from {storage.redact(cfg.init_from)} ({parts})")
    return start, state, data_state


def train_data(cfg: TrainConfig, start: int, data_state: dict | None):
    """This process's iterator over the global batches, positioned at batch `start`."""
    import jax

    from olmo3eqx.data import build_train_iterator
    from olmo3eqx.errors import DataError

    data = build_train_iterator(
        cfg.data, seq_len=cfg.data.seq_len, global_batch=cfg.data.global_batch, seed=cfg.data_seed,
        shard_index=jax.process_index(), shard_count=jax.process_count(), vocab_size=cfg.token_vocab_size,
        state=data_state, index_dir=order_index_dir(cfg), eos_id=cfg.model.eos_token_id,
        pad_id=cfg.model.pad_token_id)
    if data.batches_consumed != start:
        raise DataError(f"The data state of checkpoint {start} has consumed {data.batches_consumed} batches instead "
                        f"of {start}; the checkpoint is inconsistent.")
    return data


def order_index_dir(cfg: TrainConfig) -> Path:
    """Where OLMo-core's order keeps its per-epoch index: the run directory's data_order/, or with the run directory
    in a bucket this host's data.cache_dir/data_order/ (a memory-mapped file must be local; the file names say
    which data, seed and epoch they index, so runs can share them, as OLMo-core's work_dir is shared)."""
    from olmo3eqx import storage

    if storage.is_url(cfg.run.dir):
        return Path(os.path.expanduser(cfg.data.cache_dir)) / DATA_ORDER_DIR
    return cfg.run_dir / DATA_ORDER_DIR


def loop_evaluator(cfg: TrainConfig, layout, log):
    """The in-loop evaluator of eval.*, or None when eval.every is 0."""
    if not cfg.eval.every:
        return None
    from olmo3eqx.evaluator import LoopEvaluator, Samples, build_evaluator
    from olmo3eqx.tasks import Tokenizer

    evaluator = build_evaluator(
        cfg.eval, cfg.data, cfg.model, mesh=layout.mesh, model_shardings=layout.shardings.model,
        batch_size=layout.plan.micro_batch, seq_len=cfg.data.seq_len,
        max_instances=cfg.eval.batches * cfg.data.global_batch)
    samples = Samples(cfg.eval.samples, Tokenizer.load(cfg.eval.tokenizer), cfg.eval.sample_tokens,
                      cfg.eval.sample_temperature, layout.mesh) if cfg.eval.samples else None
    return LoopEvaluator(evaluator, every=cfg.eval.every, last_step=cfg.steps, gap=cfg.eval.memorisation_gap, log=log,
                         samples=samples)


class Reporter:
    """Takes each step's fetched metrics: logs every log.every steps (and the first and last step) with train/tokens
    and the throughput since the last log line, and keeps the recent losses the memorisation watch compares with
    held-out loss. A step with a NaN/inf loss or gradient norm (its update skipped by the step) is logged whatever
    log.every says, its batch goes to the SkipLog, and optim.max_nonfinite of them in a row raise NonFiniteLoss."""

    RECENT = 20
    """Steps whose mean is the recent train loss."""

    def __init__(self, cfg: TrainConfig, log, meter, first_step: int, skips):
        self.log, self.meter, self.first_step, self.skips = log, meter, first_step, skips
        self.every, self.last_step = cfg.log.every, cfg.steps
        self.max_nonfinite = cfg.optim.max_nonfinite
        self.tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
        self.losses: collections.deque[float] = collections.deque(maxlen=self.RECENT)
        self.batches: collections.deque = collections.deque(maxlen=2)  # the metrics come one step late
        self.nonfinite_since: int | None = None

    def batch(self, step: int, index) -> None:
        """The global instance ids this process holds of step `step`'s batch (for the SkipLog)."""
        self.batches.append((step, index))

    def __call__(self, fetched: tuple[int, dict] | None) -> None:
        if fetched is None:
            return
        step, values = fetched
        loss, grad_norm = values["train/loss"], values["train/grad_norm"]
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.nonfinite_since = None
            self.losses.append(loss)
        else:
            from olmo3eqx import storage

            self.nonfinite_since = self.nonfinite_since or step
            self.skips.write(step, dict(self.batches)[step], loss, grad_norm)
            self.log.print(f"warning: step {step} had a non-finite loss ({loss}) or gradient norm ({grad_norm}); "
                           f"its update was skipped and its batch listed in {storage.redact(self.skips.path)} "
                           f"({step - self.nonfinite_since + 1} in a row; optim.max_nonfinite {self.max_nonfinite}).")
        if not finite or step % self.every == 0 or step == self.last_step or step == self.first_step:
            values["train/tokens"] = step * self.tokens_per_step
            self.log.log(step, {**values, **self.meter.measure(step)})
        if not finite and step - self.nonfinite_since + 1 >= self.max_nonfinite:
            raise NonFiniteLoss(step, self.nonfinite_since, loss, grad_norm)

    def recent_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None


def cli() -> int:
    """The `olmo3eqx-train` console script, `python train.py` and `python -m olmo3eqx.train`: on CPU hosts one
    re-exec with a caching host allocator first (olmo3eqx/tools/hostmem.py), before anything imports jax."""
    from olmo3eqx.tools.hostmem import reexec_with_caching_malloc

    reexec_with_caching_malloc()
    return main()


if __name__ == "__main__":
    sys.exit(cli())
