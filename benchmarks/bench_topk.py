"""Top-k selection: torch's `topk` against `circuits.weights.top_k_indices` (one compiled
pass per row), at the shapes the toolkit selects from: the demo's SAEs (512 latents, k 16)
in training batches and token caches, the paper preset's (2048 latents, k 30), the smallest
synthetic benchmark's (256, k 9), and k 32 and 64 of 512, either side of
the bound beyond which torch's `topk` does the work. Both in
one run, alternating, on the same rows, with freed memory kept as the command line keeps it
(`pipelines.runtime.reuse_freed_memory`); prints milliseconds per call and their ratio.

    python benchmarks/bench_topk.py [--threads 1 2] [--repeats 30]
"""

from __future__ import annotations

from pathlib import Path

import sys

import argparse
import time

import torch

from circuits.weights import top_k_indices
from pipelines.runtime import reuse_freed_memory
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_topk.txt"  # under benchmarks/results/

SHAPES = {"demo SAE step": (4096, 512, 16), "demo token cache": (8192, 512, 16), "paper SAE step": (4096, 2048, 30),
          "zipf-64 SAE step": (4096, 256, 9), "k 32 of 512": (4096, 512, 32),
          "k 64 of 512": (4096, 512, 64)}


def per_call(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts to try")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per method and shape")
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    reuse_freed_memory()
    generator = torch.Generator().manual_seed(0)
    print(f"{'shape':18s} {'threads':>7s} {'topk ms':>8s} {'ours ms':>8s} {'speed-up':>8s}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, (rows, n, k) in SHAPES.items():
            x = torch.randn(rows, n, generator=generator)
            theirs = ours = 0.0
            for _ in range(3):  # alternating, so a busy spell slows both
                theirs += per_call(lambda: x.topk(k, dim=-1, sorted=False), args.repeats)
                ours += per_call(lambda: top_k_indices(x, k), args.repeats)
            print(f"{name:18s} {threads:7d} {theirs / 3:8.2f} {ours / 3:8.2f} {theirs / ours:7.2f}x")


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
