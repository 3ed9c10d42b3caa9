"""Wall time of the demo's SAE, circuits, features and verdicts stages here and on a local
Ray runtime, from a run that already has its corpus and LM (a demo run's, say).

Each stage runs twice from the same inputs, in two copies of the run: as a plain command
(`--threads` for the whole machine) and with `--ray --workers N` (the cores shared among the
workers), with the demo's settings. Prints the seconds of each and their ratio. (With other
thread counts the two runs' numbers differ in the last bits; `tests/test_ray.py` checks that
with one thread per worker they are the same.)

    python benchmarks/bench_ray.py RUN [--workers 2] [--threads 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_ray.txt"  # under benchmarks/results/

# the demo's settings of each stage (`pipelines.demo.DemoConfig`)
STAGES = [
    ("train-saes", ["--sites", "resid_mid,mlp_out", "--k", "16", "--train-tokens", "1000000"]),
    ("circuits", []),
    ("features", ["--sites", "resid_mid,mlp_out"]),
    ("verdicts", []),
]


def copy_inputs(run: Path, to: Path) -> None:
    """The run's corpus, tokens and LM: what the stages below start from."""
    for part in ("corpus", "tokens", "lm"):
        if (run / part).exists():
            shutil.copytree(run / part, to / part)


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run with corpus/, tokens/ and lm/ (e.g. a demo's)")
    parser.add_argument("--workers", type=int, default=2, help="Ray workers (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the plain run; each Ray worker gets "
                                                               "threads / workers (default: %(default)s)")
    parser.add_argument("--keep", type=Path, default=None, help="keep both runs here instead of a temporary folder")
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_ray_"))
    here, there = root / "here", root / "ray"
    for run in (here, there):
        copy_inputs(args.run, run)
    per_worker = max(1, args.threads // args.workers)
    rows = []
    for stage, options in STAGES:
        base = [sys.executable, "-m", "pipelines", stage, *options, "--device", "cpu"]
        local = timed([*base, "--out", str(here), "--threads", str(args.threads)])
        ray = timed([*base, "--out", str(there), "--threads", str(per_worker), "--ray", "--workers", str(args.workers)])
        rows.append({"stage": stage, "here (s)": round(local, 1), f"ray, {args.workers} workers (s)": round(ray, 1),
                     "ray / here": round(ray / local, 2)})
        print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    total = table.iloc[:, 1:3].sum()
    table.loc[len(table)] = ["all", round(total.iloc[0], 1), round(total.iloc[1], 1), round(total.iloc[1] / total.iloc[0], 2)]
    print(f"\n{args.run}: each stage here with {args.threads} threads, and on a local Ray runtime with {args.workers} "
          f"workers of {per_worker} thread(s) (Ray's start and each worker's imports included)")
    print(table.to_string(index=False))
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
