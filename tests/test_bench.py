"""The GPU benchmark script runs end to end at toy sizes on CPU (so it is ready when a GPU is lent). No timing is
asserted; the test checks that every variant ran and the table and JSON came out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def gpu_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu

    return gpu


def test_gpu_script_runs_every_variant_at_tiny_size(gpu_module, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_module.main(["--tiny", "--steps", "1", "--repeats", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    names = [name for name, *_ in gpu_module.variants(tiny=True)]
    assert len(names) == 6 and all(name in table for name in names)
    assert "failed" not in table and "skipped" not in table
    results = json.loads(out.read_text())["results"]
    assert set(results) == set(names)
    for r in results.values():
        assert r["tokens_per_s"] > 0 and r["flops_per_token"] > 0 and r["compile_s"] > 0
        assert 0 < r["loss"] < 20
    # The head variants keep parameters and FLOPs identical, as in the 7B recipe's 32x128 vs 16x256.
    by = {n: r for n, r in results.items()}
    narrow, wide = (by[n] for n in names[:2])
    assert narrow["model"]["num_attention_heads"] == 2 * wide["model"]["num_attention_heads"]
    assert narrow["flops_per_token"] == pytest.approx(wide["flops_per_token"])
    assert "MFU" in table and sys.modules["gpu"] is gpu_module
