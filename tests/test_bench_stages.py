"""benchmarks/bench_stages.py refuses to time a stage whose output `--from` copies in: such a
stage does no work, and its zero floor once ended the script in a ZeroDivisionError after
the other stages had run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_stages", ROOT / "benchmarks" / "bench_stages.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_from_a_run_refuses_to_time_the_stages_it_copies(tmp_path, monkeypatch):
    source = tmp_path / "source"
    for name in ("corpus", "lm"):
        (source / name).mkdir(parents=True)
    monkeypatch.setattr(sys, "argv", ["bench_stages.py", "--from", str(source), "--stages", "corpus,train-lm",
                                      "--out", str(tmp_path / "out")])
    monkeypatch.setattr(bench, "run_child", lambda *a, **k: pytest.fail("a stage ran"))
    with pytest.raises(SystemExit) as stop:
        bench.main()
    assert "--from" in str(stop.value) and "corpus, train-lm" in str(stop.value)
    assert not (tmp_path / "out").exists()
