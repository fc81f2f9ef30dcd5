"""The benchmark scripts run end to end at toy sizes on CPU (the GPU one so it is ready when a GPU is lent), and
bench_step picks its contenders and its torch baseline as documented. No timing is asserted; the tests check that
every variant ran and the table and JSON came out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def gpu_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu

    return gpu


@pytest.mark.slow  # bench/gpu.py at tiny size, 35 variants; -m slow
def test_gpu_script_runs_every_variant_at_tiny_size(gpu_module, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_module.main(["--tiny", "--steps", "1", "--repeats", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    variants = gpu_module.variants(tiny=True)
    names = [name for name, *_ in variants]
    # tiny, 1b and 7b-2l; the 1b and 7b-2l at both head shapes; each with cudnn, blocked, flash and pallas, the three
    # that take documents also with packed documents
    assert len(names) == 5 * 7 and all(name in table for name in names)
    assert "failed" not in table and "time budget" not in table
    results = json.loads(out.read_text())["results"]
    assert set(results) == set(names)
    on_gpu = jax.default_backend() == "gpu"
    for name, model, seq, batch, packed in variants:
        r = results[name]
        assert r.get("packed", packed) == packed and name.endswith(" docs") == packed
        if model.attention_impl in ("cudnn", "pallas") and not on_gpu:
            assert f"{model.attention_impl} needs a GPU" in r["skipped"]
            continue
        assert r["tokens_per_s"] > 0 and r["flops_per_token"] > 0 and r["compile_s"] > 0 and r["compiled_bytes"] > 0
        assert 0 < r["loss"] < 20 and r["model"]["compute_dtype"] == "bfloat16"
    # The head shapes keep parameters and FLOPs identical, as in the 7B recipe's 32x128 vs 16x256.
    for tag in ("1b", "7b-2l"):
        (narrow, m1, *_), (wide, m2, *_) = [v for v in variants if v[0].startswith(tag) and v[0].endswith("blocked")]
        assert m1.num_attention_heads == 2 * m2.num_attention_heads and m2.head_dim == 2 * m1.head_dim
        assert results[narrow]["params"] == results[wide]["params"]
        assert results[narrow]["flops_per_token"] == pytest.approx(results[wide]["flops_per_token"])
    seven = next(m for name, m, *_ in variants if name.startswith("7b-2l"))
    assert seven.resolved_layer_types == ("sliding_attention", "full_attention")
    assert "MFU" in table and sys.modules["gpu"] is gpu_module


@pytest.mark.slow  # 75 s: bench_step's worker processes; -m slow
def test_step_bench_times_each_contender_in_its_own_worker(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_step

    monkeypatch.setattr(bench_step.flops, "cpu_peak_flops", lambda refresh=False: 1e11)  # no 2048^3 matmul, no cache
    out = tmp_path / "step.json"
    argv = ["--configs", "tiny", "--no-torch", "--malloc", "glibc,hugetlb", "--repeats", "1", "--steps", "1",
            "--warmup", "1", "--ablate", "attention", "--json", str(out)]
    assert bench_step.main(argv) == 0
    table = capsys.readouterr().out
    written = json.loads(out.read_text())
    results = written["results"]
    assert written["warmup_steps"] == 1
    ablated = "tiny/olmo3eqx (auto, no attention: diagnostic)"
    assert set(results) == {"tiny/olmo3eqx (auto)", "tiny/olmo3eqx (auto, hugetlb)", ablated,
                            "tiny/olmo3eqx (auto, hugetlb, no attention: diagnostic)"}
    for r in results.values():
        assert len(r["tokens_per_s"]) == 1 and r["tokens_per_s"][0] > 0 and r["compile_s"] > 0
    # the huge-page contender, and only it, ran under the tunable (a worker process of its own)
    assert results["tiny/olmo3eqx (auto, hugetlb)"]["env"]["GLIBC_TUNABLES"].endswith("glibc.malloc.hugetlb=1")
    assert "hugetlb" not in (results["tiny/olmo3eqx (auto)"]["env"]["GLIBC_TUNABLES"] or "")
    assert "olmo3eqx (auto, hugetlb)" in table and "ceiling at 100% MFU" in table
    # the diagnostic worker compiled the step without the attention's matmuls, and only it
    # (2 forward, 4 backward per band: one band on each of the 3 sliding layers, 4 query blocks on the global one)
    assert results[ablated]["dots"] == results["tiny/olmo3eqx (auto)"]["dots"] - 6 * (3 + 4)
    assert "tiny: attention takes" in table and "of olmo3eqx (auto, hugetlb)'s step" in table


def test_step_bench_ablation_keeps_the_projections_and_drops_the_attention(monkeypatch):
    """`--ablate attention`'s stand-in: q + k + v with kv head h serving query heads h*G .. h*G + G - 1 (the grouping
    olmo3eqx.attention uses), differentiable in all three, and nothing of the attention left in the jaxpr."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_step
    import numpy as np

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 5, 6, 4)), jnp.float32)  # 6 query heads over 3 kv heads
    k, v = (jnp.asarray(rng.standard_normal((2, 5, 3, 4)), jnp.float32) for _ in range(2))
    out = bench_step.without_attention(q, k, v, window=None, impl="auto")
    np.testing.assert_allclose(out[:, :, 3], q[:, :, 3] + k[:, :, 1] + v[:, :, 1], rtol=1e-6)
    grads = jax.grad(lambda q, k, v: jnp.sum(bench_step.without_attention(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
    assert all(float(jnp.abs(g).sum()) > 0 for g in grads)
    jaxpr = str(jax.make_jaxpr(bench_step.without_attention)(q, k, v))
    assert "dot_general" not in jaxpr and "exp" not in jaxpr


def test_step_bench_times_ours_and_torch_under_every_allocator_and_leaves_out_what_is_missing(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_step

    monkeypatch.setattr(bench_step.hostmem, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.setattr(bench_step.ctypes.util, "find_library", lambda name: None)  # no jemalloc here
    args = argparse.Namespace(malloc="glibc,tcmalloc,jemalloc", attention="auto", unrolled=False, no_torch=False,
                              cpu_devices="1,2", ablate=None)
    specs = bench_step.contender_specs(args, {"LD_PRELOAD": "/opt/libother.so"})
    assert list(specs) == ["olmo3eqx (auto)", "olmo3eqx (auto, 2 CPU devices)", "transformers+torch",
                           "olmo3eqx (auto, tcmalloc)", "olmo3eqx (auto, tcmalloc, 2 CPU devices)",
                           "transformers+torch (tcmalloc)"]
    two = specs["olmo3eqx (auto, 2 CPU devices)"]
    assert two[0]["devices"] == 2 and two[1]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert "--malloc jemalloc: not installed here" in capsys.readouterr().out
    assert specs["olmo3eqx (auto)"][1]["LD_PRELOAD"] == "/opt/libother.so"
    for name in ("olmo3eqx (auto, tcmalloc)", "transformers+torch (tcmalloc)"):
        assert specs[name][1]["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/opt/libother.so"


def test_step_bench_warms_every_contender_up_before_the_timed_repeats(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_step

    class Fake:
        def __init__(self):
            self.calls = []

        def run(self, steps):
            self.calls.append(steps)
            return 0.5

    workers = {"a": Fake(), "b": Fake()}
    rates = bench_step.measure(workers, tokens_per_step=100, steps=2, repeats=3, warmup=6)
    assert [w.calls for w in workers.values()] == [[6, 2, 2, 2]] * 2
    assert rates == {"a": [400.0] * 3, "b": [400.0] * 3}  # the warm-up is not among the timed rates


def test_step_bench_tuned_hugetlb_allocator_is_the_tuned_glibc_plus_huge_pages(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_step

    env = bench_step.malloc_env("glibc-tuned-hugetlb", {"PATH": "/b"})
    assert bench_step.hostmem.tunables(env) == {**bench_step.hostmem.GLIBC_TUNED, "glibc.malloc.hugetlb": "1"}
    assert env["PATH"] == "/b"


def test_step_bench_compares_with_the_fastest_torch_contender(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_step

    results = {"tiny/olmo3eqx (auto)": {"median": 9.0}, "tiny/transformers+torch": {"median": 5.0},
               "tiny/transformers+torch (tcmalloc)": {"median": 6.0}, "small/transformers+torch": {"median": 1.0}}
    best = bench_step.fastest_torch(results)
    assert best["tiny"]["contender"] == "transformers+torch (tcmalloc)" and best["tiny"]["median"] == 6.0
    assert best["small"]["contender"] == "transformers+torch"


@pytest.mark.slow
def test_convert_bench_round_trips_a_toy_checkpoint(monkeypatch, tmp_path, capsys):
    """bench_convert end to end at toy width: both commands ran in their own processes, the round trip was checked and
    the table, the 7B estimate and the JSON came out; its files are gone."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_convert

    out = tmp_path / "convert.json"
    argv = ["--width", "tiny", "--layers", "4", "--vocab", "1000", "--shard-gb", "0.0002", "--dir", str(tmp_path),
            "--json", str(out)]
    assert bench_convert.main(argv) == 0
    text = capsys.readouterr().out
    assert "bit-identical" in text and "OLMo 3 7B" in text
    data = json.loads(out.read_text())
    assert data["sizes"]["shards"] > 1 and data["tensors_checked"] == 2 + 4 * 11 + 1
    for name in ("hf-to-orbax", "orbax-to-hf"):
        assert data["results"][name]["rc"] == 0 and data["results"][name]["peak_rss_bytes"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["convert.json"]


@pytest.mark.slow  # 6 fresh processes; -m slow
def test_speak_memory_bench_measures_each_run_at_toy_size(monkeypatch, tmp_path, capsys):
    """bench_speak_memory end to end at toy width: every reader/scheduler run loaded the same weights and generated in
    its own process, the peaks and temporaries came out, the checkpoint is gone."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_speak_memory

    out = tmp_path / "speak.json"
    assert bench_speak_memory.main(["--width", "tiny", "--layers", "4", "--dir", str(tmp_path), "--json", str(out)]) == 0
    assert "ours/memory" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert set(rows) == {"ours/memory", "ours/concurrency", "orbax/memory"}
    assert len({r["weights_bytes"] for r in rows.values()}) == 1
    for r in rows.values():
        assert r["tokens"] == 16 and r["peak_rss"] > 0 and r["after_load"]["live"] >= r["weights_bytes"]
        assert r["temps"]["prefill"] > 0 and r["temps"]["decode"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["speak.json"]


def test_order_benchmark_runs_at_toy_size(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_order

    out = tmp_path / "order.json"
    assert bench_order.main(["--instances", "200000", "--gib", "0.005", "--seconds", "0.2", "--verify",
                             "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["index"]["identical_to_olmo_core_line"] and results["index"]["index_bytes"] == 4 * 200000
    assert results["index"]["build"]["peak_rss_bytes"] > 0 and results["index"]["reload_cold"]["seconds"] > 0
    assert results["loader_ours_instances_per_s"] > 0 and results["loader_olmo-core_instances_per_s"] > 0
    assert "needed per host by a 7B stage-1 step on v5p-128" in capsys.readouterr().out


@pytest.mark.slow  # 29 s on this loaded 2-core host: four launches of a process; -m slow
def test_packing_benchmark_runs_at_toy_size(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_packing

    out = tmp_path / "packing.json"
    assert bench_packing.main(["--files", "4", "--tokens", "65536", "--seq-len", "1024", "--group-size", "2",
                               "--packer-documents", "2000", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["scenario"], r["when"]) for r in rows] == [(s, w) for s in ("csv", "scan")
                                                          for w in ("first launch", "relaunch")]
    read = {(r["scenario"], r["when"]): r["bytes"] / r["token_bytes"] for r in rows}
    assert read["scan", "first launch"] > 1 > read["csv", "first launch"]  # the scan reads every token once
    assert len({r["instances"] for r in rows}) == 1 and all(r["startup_s"] > 0 for r in rows)
    packer = json.loads(out.read_text())["packer"]
    assert len(packer) == 3 and all(r["ours_s"] > 0 and r["olmo_core_s"] > 0 for r in packer)
    assert "of the token bytes" in capsys.readouterr().out


@pytest.fixture
def profile_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import profile_step

    return profile_step


def test_step_profile_splits_overlapping_operations_evenly(profile_module):
    """Two operations running at once share the overlap; a gap between operations is its own row."""
    events = [{"name": "a", "ts": 0.0, "dur": 10.0}, {"name": "b", "ts": 4.0, "dur": 4.0},
              {"name": "a2", "ts": 13.0, "dur": 2.0}]
    wall, span = profile_module.attribute(events, {"a": "x", "a2": "x", "b": "y"})
    assert span == 15.0
    assert wall == {"x": 6.0 + 2.0 + 2.0, "y": 2.0, profile_module.NOT_TRACED: 3.0}


def test_step_profile_counts_the_matmuls_of_dots_fusions_and_loop_bodies(profile_module):
    """dot_flops reads every dot of the compiled program, a fusion's through its computation, with the FLOPs of one
    execution; stack_frames resolves an instruction to the Python line that made it."""

    def f(x, w, ws):
        y = jnp.tanh(x @ w)  # [8, 16] @ [16, 32]
        y, _ = jax.lax.scan(lambda h, wi: (h @ wi, None), y, ws)  # 3 x ([8, 32] @ [32, 32]) in a loop body
        return jnp.einsum("bij,bjk->bik", y.reshape(2, 4, 32), y.reshape(2, 4, 32).transpose(0, 2, 1))

    hlo = jax.jit(f).lower(jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones((3, 32, 32))).compile().as_text()
    flops = profile_module.dot_flops(hlo)
    assert sorted(set(flops.values())) == sorted({2 * 8 * 16 * 32, 2 * 8 * 32 * 32, 2 * 2 * 4 * 4 * 32})
    here = f.__code__.co_firstlineno
    lowered_at = here + 5  # the jax.jit(f).lower(...) line below f
    chains = profile_module.stack_frames(hlo)
    ours = [[frame.line for frame in chain if frame.file.endswith("test_bench.py")] for chain in chains.values()]
    assert {line for chain in ours for line in chain[:1]} >= {here + 1, here + 2, here + 3}
    # each of f's lines is called from the line that lowered f: the chain goes innermost to outermost
    assert [here + 1, lowered_at] in ours and [here + 3, lowered_at] in ours


@pytest.mark.slow  # 17 s: bench/profile_step.py; -m slow
def test_step_profile_attributes_a_scanned_step_to_its_source_lines(profile_module, monkeypatch, tmp_path, capsys):
    """End to end on a toy 8-layer model (a scan of 2 periods): every matmul execution counted (the loop body's twice),
    the rows name Linear's matmul forward and backward and the attention, and they add up to the traced span."""
    import bench_step

    from olmo3eqx.config import ModelConfig

    model = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=32, sliding_window=64,
                        max_position_embeddings=64, eos_token_id=1, pad_token_id=2)
    monkeypatch.setattr(bench_step, "bench_configs", lambda: {"toy": (model, 64, 2)})
    import olmo3eqx.flops

    monkeypatch.setattr(olmo3eqx.flops, "cpu_peak_flops", lambda refresh=False: 1e11)
    out = tmp_path / "profile.json"
    assert profile_module.main(["--config", "toy", "--steps", "2", "--warmup", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    tokens = 64 * 2
    projections = 6 * tokens * olmo3eqx.flops.matmul_params_per_token(model)
    # window 64 >= seq 64: every layer is causal, 4 query blocks of 16 against 16, 32, 48, 64 keys; 6 matmuls each
    attention = 8 * 6 * 2 * 2 * 2 * 16 * (16 + 32 + 48 + 64) * 32
    assert projections + attention <= result["matmul_flops_per_step"] <= 1.05 * (projections + attention)
    rows = result["per_step_ms"]
    import inspect

    from olmo3eqx.model import Linear

    source, first = inspect.getsourcelines(Linear.__call__)
    matmul = first + next(i for i, text in enumerate(source) if "@ self.weight" in text)  # the line, wherever it moves
    assert {f"forward model.py:{matmul} Linear.__call__", f"backward model.py:{matmul} Linear.__call__"} <= set(rows)
    assert any(" attention.py:" in row for row in rows)
    assert sum(rows.values()) == pytest.approx(result["span_ms"], rel=1e-6)
    table = capsys.readouterr().out
    assert "matmul FLOPs executed" in table and "Linear.__call__" in table


@pytest.mark.slow  # four compiles of the tiny step on 4 of the suite's devices; -m slow
def test_context_bench_compares_cp4_with_cp1_on_the_same_devices(monkeypatch, tmp_path, capsys):
    """CP-1 (fsdp 4) and CP-4 (context 4) on the same 4 devices, batch and tokens per device: both timed, the same
    first loss, and only CP-4 sends bytes over the context axis, which the table reports as added."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_context

    out = tmp_path / "context.json"
    argv = ["--seq", "256", "--batch", "4", "--documents", "3", "--steps", "1", "--json", str(out)]
    assert bench_context.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    one, four = results["CP-1"], results["CP-4"]
    assert one["mesh"]["fsdp"] == 4 and "context" not in one["mesh"]
    assert (four["mesh"]["fsdp"], four["mesh"]["context"]) == (1, 4)
    assert one["tokens_per_device"] == four["tokens_per_device"] == 256
    assert len(one["step_s"]) == len(four["step_s"]) == 1
    assert four["first_loss"] == pytest.approx(one["first_loss"], rel=1e-4)
    assert one["context_bytes"] == 0 and four["context_bytes"] > 0 and four["within_bytes"] > one["within_bytes"]
    table = capsys.readouterr().out
    added = (four["within_bytes"] - one["within_bytes"]) / 2**20
    assert f"+{added:,.2f}" in table and "CP-4" in table and "fsdp 1 x context 4" in table
