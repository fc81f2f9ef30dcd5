"""One copy of the weights to speak: checkpoint.load_any restores a checkpoint straight onto the mesh's shardings in
the compute dtype, bit for bit what ml_dtypes' cast of the stored float32 weights gives (orbax checkpoints in both
layouts orbax writes, read across stored chunks that do not line up with the device shards, and HF directories); the
outputs are those of the float32 masters; generation holds no second copy of the weights; the generate and eval
commands run on two processes (jax.distributed on loopback) as on one, writing to a bucket too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from olmo3eqx import hf
from olmo3eqx.checkpoint.model import load_any, save_model, save_model_leaves
from olmo3eqx.config import ConfigError, MeshConfig, ModelConfig
from olmo3eqx.generate import generate
from olmo3eqx.model import init_model
from olmo3eqx.sharding import is_leaf_like, make_mesh, model_shardings

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, sliding_window=5, param_dtype="float32",
                  compute_dtype="bfloat16", eos_token_id=95, pad_token_id=94, max_position_embeddings=256)
TINY_CHUNK = 512
"""Stored chunk bytes for the test checkpoints: every leaf spans many chunks, whose edges the shards of 3 devices cut
through."""


def leaves(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


def with_ties(model):
    """The model with its embedding's first rows made of float32 values exactly halfway between two bfloat16s (both
    parities): a cast that truncates, or rounds ties up, gives other bits than round-to-nearest-even."""
    embed = np.array(model.embed)
    bits = (np.arange(embed[:4].size, dtype=np.uint32) << 16) + np.uint32(0x3F80_8000)
    embed[:4] = bits.view(np.float32).reshape(embed[:4].shape)
    return eqx.tree_at(lambda m: m.embed, model, jnp.asarray(embed))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(float32 model, {layout: checkpoint path}): orbax's StandardSave layout (save_model, zarr2), its partial-save
    layout (save_model_leaves, zarr3, as convert.py writes) and an HF directory, all of the same weights."""
    from olmo3eqx.hf.weights import leaf_of

    root = tmp_path_factory.mktemp("speak")
    model = with_ties(init_model(CFG, jax.random.key(0)))
    mp = pytest.MonkeyPatch()
    mp.setattr("olmo3eqx.checkpoint.model.CHUNK_BYTES", TINY_CHUNK)
    save_model(root / "standard", model, CFG)
    paths = [p for p, _ in hf.weights.leaf_groups(hf.weights.tensor_specs(CFG)).items()]
    save_model_leaves(root / "partial", CFG, ((p, leaf_of(model, p)) for p in paths))
    mp.undo()
    hf.save_hf(model, CFG, root / "hf")
    return model, {"standard": root / "standard", "partial": root / "partial", "hf": root / "hf"}


@pytest.mark.parametrize("layout", ["standard", "partial", "hf"])
def test_load_any_lands_on_the_mesh_in_the_compute_dtype_bit_for_bit(saved, layout):
    model, paths = saved
    want = [x.astype(ml_dtypes.bfloat16).view(np.uint16) for x in leaves(model)]
    for devices in (8, 3):  # 3: shards of 32 rows and of 1/3 of each width, across the stored chunks' edges
        mesh = make_mesh(MeshConfig(), jax.devices()[:devices])
        loaded = load_any(str(paths[layout]), mesh, "bfloat16")
        assert loaded.cfg.param_dtype == loaded.cfg.compute_dtype == "bfloat16"
        got = jax.tree.leaves(eqx.filter(loaded.model, eqx.is_array))
        rule = jax.tree.leaves(model_shardings(loaded.model, mesh))
        assert [x.sharding for x in got] == rule and all(x.dtype == jnp.bfloat16 for x in got)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g).view(np.uint16), w)
    if layout != "hf":
        default = load_any(str(paths[layout]), mesh)  # unset: the checkpoint's compute dtype
        assert default.cfg.compute_dtype == "bfloat16" and default.model.embed.dtype == jnp.bfloat16
        f32 = load_any(str(paths[layout]), mesh, "float32")  # the stored bits, unchanged
        for g, w in zip(leaves(f32.model), leaves(model)):
            np.testing.assert_array_equal(g, w)


def test_weights_held_in_the_compute_dtype_give_the_float32_masters_logits(saved):
    """The forward casts every weight to the compute dtype before using it: loading them cast changes no output."""
    model, paths = saved
    loaded = load_any(str(paths["partial"]), make_mesh(MeshConfig(), jax.devices()[:1]))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 24)), jnp.int32)
    forward = eqx.filter_jit(lambda m, t: m(t))
    np.testing.assert_array_equal(np.asarray(forward(loaded.model, tokens)), np.asarray(forward(model, tokens)))


def test_a_bad_dtype_is_one_sentence(saved):
    with pytest.raises(ConfigError, match="dtype 'float64' is not one of float32, bfloat16, float16"):
        load_any(str(saved[1]["partial"]), make_mesh(MeshConfig(), jax.devices()[:1]), "float64")


def test_generation_holds_no_second_copy_of_the_weights():
    """While tokens stream out, the arrays generation made besides the model are its KV cache and a few rows."""
    from olmo3eqx.decode import cache_bytes

    cfg = ModelConfig(**{**CFG.__dict__, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
                         "eos_token_id": 511, "pad_token_id": 510, "compute_dtype": "float32"})
    model = init_model(cfg, jax.random.key(1))
    weights = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    before = jax.live_arrays()  # held, so no new array can take one of their ids
    ids = {id(x) for x in before}
    extra = []

    def seen(_row, _text):
        extra.append(sum(x.nbytes for x in jax.live_arrays() if id(x) not in ids))

    [c] = generate(model, [[1, 2, 3]], max_new_tokens=24, eos_id=-1, decode=lambda ids: "x" * len(ids), chunk=4,
                   on_text=seen)
    assert len(c.tokens) == 24 and extra
    cache = cache_bytes(cfg, 1, 16 + 24)  # the prompt's bucket (16) and the chunked new tokens
    assert max(extra) < cache + weights // 10, (max(extra), cache, weights)


def test_speaking_flags_join_the_users_and_leave_a_scheduler_they_chose():
    from olmo3eqx import jaxenv

    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    jaxenv.prepare_speaking(env)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", *jaxenv.SPEAKING_XLA_FLAGS]
    jaxenv.prepare_speaking(env)  # once is enough
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", *jaxenv.SPEAKING_XLA_FLAGS]
    mine = {"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"}
    jaxenv.prepare_speaking(mine)
    assert mine["XLA_FLAGS"] == "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    empty = {}
    jaxenv.prepare_speaking(empty)
    assert empty["XLA_FLAGS"].split() == list(jaxenv.SPEAKING_XLA_FLAGS)


def test_the_commands_start_xla_with_the_speaking_flags():
    """Run as commands (JAX not yet imported), each main adds SPEAKING_XLA_FLAGS before JAX starts."""
    from olmo3eqx import jaxenv

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = []
    for module, args in [("olmo3eqx.tools.generate", ["--ckpt", "nowhere", "x"]),
                         ("olmo3eqx.tools.evaluate", ["--list-tasks"])]:
        script = f"import os; from {module} import main; main({args!r}); print('XLA_FLAGS=' + os.environ['XLA_FLAGS'])"
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=300)
        flags = [line.split("=", 1)[1] for line in out.splitlines() if line.startswith("XLA_FLAGS=")]
        assert flags == [" ".join(jaxenv.SPEAKING_XLA_FLAGS)], (p.args[-1], err[-2000:])


# --- the commands on two processes --------------------------------------------------------------

def launch(module: str, args: list[str], processes: int, logs: Path) -> list[tuple[int, str, str]]:
    """`python -m module args` as `processes` jax.distributed processes on loopback, 2 CPU devices each; their
    (exit code, stdout, stderr)."""
    from test_multihost import base_env, free_port

    port = free_port()
    procs = []
    for i in range(processes):
        env = base_env(2)
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(i))
        out, err = (open(logs / f"{module}.{i}.{name}", "w+") for name in ("out", "err"))
        procs.append((subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=out, stderr=err), out,
                      err))
    results = []
    for p, out, err in procs:
        p.wait(timeout=600)
        results.append((p.returncode, *(f.seek(0) or f.read() for f in (out, err))))
        out.close()
        err.close()
    return results


@pytest.fixture(scope="module")
def byte_ckpt(tmp_path_factory):
    """convert.py's output of a model over the byte vocabulary, prompts, a held-out set."""
    from olmo3eqx.tools.convert import main as convert, save_tiny_hf_model

    root = tmp_path_factory.mktemp("bytes2")
    save_tiny_hf_model(root / "hf", seed=1, vocab_size=258, eos_token_id=256, pad_token_id=257)
    assert convert(["hf-to-orbax", "--hf-dir", str(root / "hf"), "--out", str(root / "ckpt"), "--skip-parity"]) == 0
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                                                ["def fib(n):", "import os", "class A:"]))
    rng = np.random.default_rng(0)
    np.concatenate([np.append(rng.integers(0, 256, rng.integers(1, 60)), 256) for _ in range(24)]).astype(
        np.uint16).tofile(root / "heldout.npy")
    return root


@pytest.mark.slow  # over 25 s: one of .ci/run's shares (.ci/share.py); the default suite keeps CI under ~20 min
def test_generate_on_two_processes_writes_what_one_process_writes(byte_ckpt, stores, tmp_path):
    """Each process restores its own shards (a restore onto the first device fails on process 1, which holds none of
    it); process 0 alone writes, here to a bucket."""
    from olmo3eqx import storage
    from olmo3eqx.tools.generate import main

    args = ["--ckpt", str(byte_ckpt / "ckpt"), "--tokenizer", "bytes", "--file", str(byte_ckpt / "prompts.jsonl"),
            "--max-new-tokens", "8", "--batch-size", "2"]  # float32: 4 devices and 8 split sums alike
    assert main([*args, "--out", str(tmp_path / "one.jsonl")]) == 0
    url = stores.url("gs", f"gen-{uuid.uuid4().hex[:6]}") + "/two.jsonl"
    results = launch("olmo3eqx.tools.generate", [*args, "--out", url], 2, tmp_path)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert results[0][2].count(" prompts") == 2 and " prompts" not in results[1][2]  # 3 prompts, 2 at a time
    assert storage.read_text(url) == (tmp_path / "one.jsonl").read_text()


@pytest.mark.slow  # 2 processes, ~1 min on 2 cores; the generate test keeps the multi-process restore in the default run
def test_eval_on_two_processes_scores_what_one_process_scores(byte_ckpt, tmp_path):
    from olmo3eqx.tools.evaluate import main

    fixture = ROOT / "tests" / "fixtures" / "tasks" / "tiny_mc.jsonl"
    args = ["--ckpt", str(byte_ckpt / "ckpt"), "--tokenizer", "bytes", "--tasks", str(fixture), "--heldout",
            f"code={byte_ckpt / 'heldout.npy'}", "--seq-len", "32", "--batch-size", "8"]
    assert main([*args, "--out", str(tmp_path / "one.json")]) == 0
    results = launch("olmo3eqx.tools.evaluate", [*args, "--out", str(tmp_path / "two.json")], 2, tmp_path)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert "wrote" in results[0][1] and "code" in results[0][1]
    assert "wrote" not in results[1][1] and "code" not in results[1][1]  # gloo's own lines aside, it printed nothing
    one, two = (json.loads((tmp_path / f"{n}.json").read_text())["metrics"] for n in ("one", "two"))
    assert set(one) == set(two) and len(one) > 2
    for k in one:
        assert two[k] == pytest.approx(one[k], rel=1e-5), k
