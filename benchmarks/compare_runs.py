"""Compare the tables of two run directories: the same table files, each with the same
columns and rows, bit for bit (or, with --rtol/--atol, floats within that tolerance).

    python benchmarks/compare_runs.py RUN_A RUN_B [--rtol R] [--atol A]

Prints one line per table file (identical, close with the largest difference, or how it
differs) and a summary; exits 1 when any differs. Used to show that a restructuring
changes no result: two runs made with the same settings and `--threads 1` by the code
before and after it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd


def table_files(run: Path) -> dict[str, Path]:
    """Every Parquet file under `run/tables`, by its path relative to it."""
    tables = run / "tables"
    return {str(p.relative_to(tables)): p for p in sorted(tables.rglob("*.parquet"))}


def _as_lists(column: pd.Series) -> list:
    """A column of lists or arrays as plain, comparable Python lists."""
    return [None if v is None else (list(v) if hasattr(v, "__len__") and not isinstance(v, str) else v)
            for v in column]


def compare_frames(a: pd.DataFrame, b: pd.DataFrame, rtol: float, atol: float) -> tuple[str, float]:
    """('identical' | 'close' | why they differ, the largest float difference)."""
    if list(a.columns) != list(b.columns):
        return f"columns differ: {sorted(set(a.columns) ^ set(b.columns)) or 'order'}", float("nan")
    if len(a) != len(b):
        return f"{len(a)} rows against {len(b)}", float("nan")
    worst, exact = 0.0, True
    for name in a.columns:
        x, y = a[name], b[name]
        if pd.api.types.is_float_dtype(x.dtype) and pd.api.types.is_float_dtype(y.dtype):
            u, v = x.to_numpy(np.float64, na_value=np.nan), y.to_numpy(np.float64, na_value=np.nan)
            same_nan = np.isnan(u) == np.isnan(v)
            if not same_nan.all():
                return f"column {name}: NaN in different rows", float("nan")
            ok = ~np.isnan(u)
            if np.array_equal(u[ok].view(np.int64), v[ok].view(np.int64)):
                continue
            exact = False
            diff = np.abs(u[ok] - v[ok])
            worst = max(worst, float(diff.max()))
            if not np.all(diff <= atol + rtol * np.abs(v[ok])):
                return f"column {name}: differs by up to {diff.max():.3g}", worst
        elif _as_lists(x) != _as_lists(y) and not x.equals(y):
            return f"column {name}: values differ", float("nan")
    return ("identical" if exact else "close"), worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--rtol", type=float, default=0.0, help="relative float tolerance (default: bit for bit)")
    parser.add_argument("--atol", type=float, default=0.0, help="absolute float tolerance (default: bit for bit)")
    args = parser.parse_args(argv)
    a, b = table_files(args.run_a), table_files(args.run_b)
    if not a:
        print(f"no tables under {args.run_a / 'tables'}")
        return 1
    counts: dict[str, int] = {}
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            verdict, worst = f"only in {args.run_a if name in a else args.run_b}", float("nan")
        else:
            verdict, worst = compare_frames(pd.read_parquet(a[name]), pd.read_parquet(b[name]), args.rtol, args.atol)
        kind = verdict if verdict in ("identical", "close") else "different"
        counts[kind] = counts.get(kind, 0) + 1
        print(f"{name}: {verdict}" + (f" (largest float difference {worst:.3g})" if kind == "close" else ""))
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f" of {len(set(a) | set(b))} table files")
    return 0 if counts.get("different", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
