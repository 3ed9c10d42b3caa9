"""Time one layer of circuit analysis on random weights at the paper's size.

    python benchmarks/bench_circuits.py            # d_model 512, d_hidden 2048, 2048 in/out
    python benchmarks/bench_circuits.py --n-out 256 --tokens 20000   # a quick look

Prints seconds per stage of `circuits.analyse_layer`, the total wall and CPU time, the
load average (other processes on the machine slow the wall time down), and the process's
peak resident memory. Output activations are random (top-k active per token), so the
correlations themselves mean nothing here; only their cost does.
"""

from __future__ import annotations

from pathlib import Path

import sys

import argparse
import json
import os
import resource
import time

import torch

from circuits import CircuitConfig, LayerBatch, MLPWeights, Outputs, SAEWeights
from pipelines.analysis.circuit_tables import analyse_layer
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_circuits.txt"  # under benchmarks/results/


def random_mlp(d: int, h: int, gen: torch.Generator) -> MLPWeights:
    def w(*shape):
        return torch.randn(*shape, generator=gen) / shape[0] ** 0.5

    return MLPWeights(
        W_gate=w(d, h), W_in=w(d, h), W_out=w(h, d), b_in=w(h) * 0.1, b_out=w(d) * 0.1,
        g=1 + 0.1 * torch.randn(d, generator=gen), eps=1e-5,
    )


def random_sae(d: int, n: int, gen: torch.Generator) -> SAEWeights:
    W_dec = torch.randn(n, d, generator=gen)
    W_dec /= W_dec.norm(dim=1, keepdim=True)
    return SAEWeights(
        W_enc=W_dec.T.clone(), b_enc=torch.zeros(n), W_dec=W_dec,
        b_dec=0.1 * torch.randn(d, generator=gen), apply_b_dec_to_input=True,
    )


def topk_like(b: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """`[b, n]` with k random positive entries per row, as a TopK SAE's activations."""
    acts = torch.zeros(b, n)
    active = torch.rand(b, n, generator=gen).topk(k, dim=1).indices
    return acts.scatter_(1, active, torch.rand(b, k, generator=gen) + 0.01)


def random_batches(n_tokens: int, batch: int, d: int, n_in: int, n_out: int, k: int, seed: int):
    """A callable giving a fresh pass of random LayerBatches: MLP inputs, input latents and
    output activations with k random features active per token."""

    def batches():
        gen = torch.Generator().manual_seed(seed)
        for start in range(0, n_tokens, batch):
            b = min(batch, n_tokens - start)
            yield LayerBatch(x=torch.randn(b, d, generator=gen), z=topk_like(b, n_in, k, gen),
                             scale=torch.ones(b), acts=topk_like(b, n_out, k, gen))

    return batches


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-hidden", type=int, default=2048)
    p.add_argument("--n-in", type=int, default=2048, help="input SAE features")
    p.add_argument("--n-out", type=int, default=2048, help="output SAE features")
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--k", type=int, default=30, help="active input and output features per token")
    p.add_argument("--batch", type=int, default=4096, help="tokens per input batch")
    p.add_argument("--config", type=str, default=None, help="CircuitConfig as JSON")
    add_output(p, OUTPUT)
    args = p.parse_args()

    cfg = CircuitConfig.from_json(json.loads(args.config)) if args.config else CircuitConfig()
    gen = torch.Generator().manual_seed(0)
    mlp = random_mlp(args.d_model, args.d_hidden, gen)
    sae_in = random_sae(args.d_model, args.n_in, gen)
    sae_out = random_sae(args.d_model, args.n_out, gen)
    batches = random_batches(args.tokens, args.batch, args.d_model, args.n_in, args.n_out, args.k, 1)

    print(f"threads {torch.get_num_threads()}, config {cfg.to_json()}")
    print(
        f"d_model {args.d_model}, d_hidden {args.d_hidden}, n_in {args.n_in}, n_out {args.n_out}, "
        f"tokens {args.tokens}, k {args.k}"
    )
    timings: dict[str, float] = {}
    load_before = os.getloadavg()[0]
    cpu_start, start = cpu_seconds(), time.perf_counter()
    outputs = Outputs("sae", sae_out.W_enc.T, sae=sae_out)
    tables = analyse_layer(mlp, sae_in, outputs, batches, cfg, layer=0, timings=timings)
    total, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    # the token passes include making the random batches (twice); time that apart
    gen_start = time.perf_counter()
    for _ in batches():
        pass
    making = 2 * (time.perf_counter() - gen_start)

    print("seconds per stage (the first three are summed over worker threads):")
    for stage, seconds in timings.items():
        print(f"{stage:>22s} {seconds:8.1f} s")
    print(f"{'(making random batches':>22s} {making:8.1f} s, inside the token passes)")
    print(f"{'total wall':>22s} {total:8.1f} s")
    print(f"{'total CPU (user+sys)':>22s} {cpu:8.1f} s")
    print(f"{'load average':>22s} {load_before:8.2f} before, {os.getloadavg()[0]:.2f} after")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"{'peak memory':>22s} {peak:8.2f} GiB")
    print("rows:", {name: len(df) for name, df in tables.items()})


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
