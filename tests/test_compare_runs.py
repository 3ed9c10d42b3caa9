"""benchmarks/compare_runs.py tells identical runs from close and from different ones."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "benchmarks" / "compare_runs.py")
compare_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_runs)


def _run(root: Path, frame: pd.DataFrame) -> Path:
    folder = root / "tables" / "gates" / "layer0"
    folder.mkdir(parents=True)
    frame.to_parquet(folder / "resid_mid-sae.parquet")
    return root


def _frame(**changes) -> pd.DataFrame:
    frame = pd.DataFrame({"in_a": [1, 2, 3], "score": [0.5, np.nan, 1.25], "members": [[1, 2], [3], []]})
    for column, values in changes.items():
        frame[column] = values
    return frame


def test_identical_close_and_different_runs(tmp_path, capsys):
    base = _run(tmp_path / "a", _frame())
    assert compare_runs.main([str(base), str(_run(tmp_path / "b", _frame()))]) == 0
    assert "1 identical of 1" in capsys.readouterr().out
    nudged = _run(tmp_path / "c", _frame(score=[0.5 + 1e-12, np.nan, 1.25]))
    assert compare_runs.main([str(base), str(nudged)]) == 1  # bit for bit by default
    assert compare_runs.main([str(base), str(nudged), "--atol", "1e-9"]) == 0
    assert "close (largest float difference 1e-12)" in capsys.readouterr().out
    for name, frame in {"nan": _frame(score=[0.5, 0.0, 1.25]), "ints": _frame(in_a=[1, 2, 4]),
                        "lists": _frame(members=[[1, 2], [3], [4]]), "rows": _frame().head(2)}.items():
        assert compare_runs.main([str(base), str(_run(tmp_path / name, frame)), "--atol", "1"]) == 1, name
    (tmp_path / "e" / "tables").mkdir(parents=True)
    assert compare_runs.main([str(base), str(tmp_path / "e")]) == 1  # a table only one run has
