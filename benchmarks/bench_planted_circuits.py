"""How well the toolkit finds circuits whose answer is known: a planted bilinear layer
(`pipelines.planted`) with group ANDs, pair ANDs, an OR, an XOR, split concepts, confounders
(an additive output of two inputs that nearly always co-occur, a one-sided output with a
co-occurring bystander, an inhibition, a threshold AND that only the output SAE's cut-off
makes, a square of one direction written as two latents) and distractors in superposition,
run through the circuits, features and verdicts code paths.

Prints, per seed and per way of forming groups (eigenvectors only; eigenvectors and label
classes): what was found for each planted output (its circuit candidate pair and best group
gate, their circuit ranks, the gate_type of its planted candidate, the ablation verdict and
what removing each side keeps), then the recovery figures: precision and recall of the
planted ANDs among the k and 2k best candidates by circuit_rank (pairs: k = 2 planted pair
ANDs; group gates: k = 4 planted ANDs), whether a split concept is ranked as a gate, the
share of planted outputs typed right, and whether the ablations confirm every planted AND
and reject every other planted output.

    python benchmarks/bench_planted_circuits.py [--seeds 0,1,2] [--rows 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

# this checkout's packages, not an installed copy of another one; results_file, beside this script
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from circuits.layer import CircuitConfig  # noqa: E402
from pipelines.analysis.features import FeatureConfig  # noqa: E402
from pipelines.analysis.verdicts import VerdictConfig  # noqa: E402
from pipelines.planted import PlantedConfig, analyse, build_world, score  # noqa: E402
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_planted_circuits.txt"  # under benchmarks/results/


def run(seed: int, rows: int, groups: tuple[str, ...]) -> tuple[pd.DataFrame, dict, float]:
    start = time.perf_counter()
    world = build_world(PlantedConfig(seed=seed, rows=rows))
    n_out = len(world.gates)
    tables = analyse(world, CircuitConfig(seed=seed), FeatureConfig(n_rows=rows, seed=seed),
                     VerdictConfig(rows=rows, groups=groups, n_ablate=n_out, seed=seed))
    frame, summary = score(world, tables)
    return frame, summary, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="planted worlds to build (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=512, help="rows of 32 tokens per world (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 20)
    pd.set_option("display.max_colwidth", 60)
    summaries = []
    for groups in (("eigen",), ("eigen", "labels")):
        for seed in (int(s) for s in args.seeds.split(",")):
            frame, summary, seconds = run(seed, args.rows, groups)
            print(f"\nseed {seed}, groups from {' and '.join(groups)} ({seconds:.0f} s):")
            print(frame.to_string(index=False))
            summaries.append({"groups": "+".join(groups), "seed": seed, **summary})
    table = pd.DataFrame(summaries).set_index(["groups", "seed"]).T
    print("\nrecovery (k = planted ANDs):")
    print(table.to_string())


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
