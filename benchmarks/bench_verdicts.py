"""The verdicts stage, before and after a change, on copies of one run directory.

    python benchmarks/bench_verdicts.py --run RUN --before /work/wt/base [--after .] [--threads 1]
                                        [--work DIR] [--layers 0,1,2,3]

Copies RUN (a finished demo run: circuits and features done) once per code tree, without its
verdicts tables and stamps, and runs `verdicts` there with each tree first on the path, in its
own process, one after the other. Prints per tree the stage's wall time and CPU time (user
and system, of its process: on a shared machine the fair measure, since wall time depends on
what else runs), the candidates it judged causally (the old code: those it ablated in the
model; the new: every pair and group gate tested by intervention with enough tokens, and
those ablated), candidates judged per CPU second, and the ratio of the two CPU times.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
from bench_stages import code_env

from pipelines.schemas import TABLES
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_verdicts.txt"  # under benchmarks/results/

VERDICT_TABLES = [name for name, table in TABLES.items() if table.stage == "verdicts"]


def fresh_copy(run: Path, target: Path) -> Path:
    """RUN copied to `target`, with every verdicts-stage table and stamp removed."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(run, target, symlinks=True)
    for name in VERDICT_TABLES + ["gate_verdicts"]:
        shutil.rmtree(target / "tables" / name, ignore_errors=True)
    for stamp in target.rglob("*"):
        if "verdicts" in stamp.name and stamp.is_file():
            stamp.unlink()
    return target


def run_verdicts(code: Path, run: Path, threads: int, layers: str | None) -> tuple[float, float]:
    """Wall and CPU seconds of the verdicts stage of `code` on `run`."""
    env = code_env(code)
    cmd = [sys.executable, "-m", "pipelines", "verdicts", "--out", str(run), "--threads", str(threads)]
    if layers:
        cmd += ["--layers", layers]
    cpu = lambda: (lambda u: u.ru_utime + u.ru_stime)(resource.getrusage(resource.RUSAGE_CHILDREN))  # noqa: E731
    start, start_cpu = time.perf_counter(), cpu()
    done = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True)
    seconds, cpu_seconds = time.perf_counter() - start, cpu() - start_cpu
    if done.returncode:
        raise SystemExit(f"verdicts with {code} failed:\n{done.stderr[-3000:]}")
    return seconds, cpu_seconds


def judged(run: Path) -> dict[str, int]:
    """Candidates the stage tested causally: by intervention (tables of the new code) and by
    model-run ablation (both)."""
    read = lambda name: pd.read_parquet(run / "tables" / name) if (run / "tables" / name).exists() else None  # noqa: E731
    found = {}
    for name, keys in (("gate_ablation", ["layer", "out_feature", "in_a", "in_b"]),
                       ("group_ablation", ["layer", "out_feature", "group_a", "group_b"])):
        frame = read(name)
        found[f"ablated ({name})"] = 0 if frame is None else len(frame.drop_duplicates(keys))
    for name in ("pair_gates", "group_gates"):
        frame = read(name)
        if frame is not None and "gate_type" in frame:
            found[f"tested by intervention ({name})"] = int((frame["gate_type"] != "untested").sum())
            found[f"rows ({name})"] = len(frame)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished demo run (it is only read)")
    parser.add_argument("--before", type=Path, required=True, help="the code tree before the change")
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the code tree after it (default: this one)")
    parser.add_argument("--work", type=Path, default=None, help="where the copies go (default: next to RUN)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each stage (default: %(default)s)")
    parser.add_argument("--layers", default=None, help="comma list of layers (default: all)")
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    work = args.work or args.run.parent
    rows = []
    for label, code in (("before", args.before), ("after", args.after)):
        copy = fresh_copy(args.run, work / f"{args.run.name}-bench-{label}")
        seconds, cpu_seconds = run_verdicts(code.resolve(), copy, args.threads, args.layers)
        counts = judged(copy)
        causal = sum(v for k, v in counts.items() if k.startswith(("ablated", "tested")))
        rows.append({"code": f"{label} ({code})", "wall seconds": seconds, "CPU seconds": cpu_seconds, **counts,
                     "judged": causal, "judged per CPU second": causal / cpu_seconds})
        print(f"{label}: {seconds:.1f} s wall, {cpu_seconds:.1f} s CPU, {causal} candidates judged "
              f"({causal / cpu_seconds:.1f} per CPU second)", flush=True)
    table = pd.DataFrame(rows).set_index("code").T
    print(table.to_string())
    print(f"speed-up of the verdicts stage: {rows[0]['CPU seconds'] / rows[1]['CPU seconds']:.1f}x in CPU time "
          f"({rows[0]['wall seconds'] / rows[1]['wall seconds']:.1f}x in wall time); candidates judged per CPU second: "
          f"{rows[1]['judged per CPU second'] / rows[0]['judged per CPU second']:.0f}x")


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
