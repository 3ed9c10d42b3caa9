"""Each stage's work with 1 and 2 torch threads, on an idle machine and beside a busy process.

The CLI's `--threads` default comes from these figures. A representative piece of each
stage at the demo's size: LM training steps, SAE training steps, the circuits' weight stage
(interaction matrices, projection, eigh), and a model forward pass with gate statistics.
"Busy" runs one pure-Python loop in another process, as a second job on a shared 2-core
machine would. Each cell is the median of a few repeats, in seconds.

    python benchmarks/bench_threads.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_threads.txt"  # under benchmarks/results/

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def lm_steps():
    from pipelines.lm.model import PRESETS, build_model

    model = build_model(PRESETS["demo"].replace(d_vocab=600))
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 600, (32, 128))

    def run():
        for _ in range(3):
            loss = model(tokens, return_type="loss")
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()

    return run


def sae_steps():
    from sae.topk import TopKAutoencoder, TopKTrainer

    trainers = [TopKTrainer(TopKAutoencoder(128, 512, 16, seed=i), train_steps=100, lr=1e-3) for i in range(8)]
    batch = torch.randn(4096, 128)

    def run():
        for _ in range(3):
            for trainer in trainers:
                trainer.step(batch, stats=False)

    return run


def circuit_weights():
    from circuits.bilinear import interaction_matrices
    from circuits.interactions import interactions_and_gates
    from circuits.sae_basis import input_basis
    from circuits.spectra import eigh_by_magnitude

    g = torch.Generator().manual_seed(0)
    W_gate, W_in, W_out = torch.randn(128, 512, generator=g), torch.randn(128, 512, generator=g), torch.randn(512, 128, generator=g)
    basis = input_basis(torch.randn(512, 128, generator=g), torch.randn(128, generator=g), torch.ones(128))
    U = torch.randn(64, 128, generator=g)

    def run():
        for start in range(0, 64, 32):
            Q = interaction_matrices(W_gate, W_in, W_out, U[start : start + 32])
            interactions_and_gates(Q, basis, 50, 20, 256)
            eigh_by_magnitude(Q)

    return run


def token_pass():
    from circuits.gates.pairs import Candidates, GateStats
    from pipelines.lm.model import PRESETS, build_model
    from sae.activations import iter_activations
    from circuits.sites import MLP_OUT, RESID_MID

    model = build_model(PRESETS["demo"].replace(d_vocab=600)).eval()
    tokens = torch.randint(0, 600, (64, 128))
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 500, (512, 40), generator=g)
    stats = GateStats(Candidates(a, a + 1, torch.ones(512, 40, dtype=torch.bool)), torch.randn(512, 40).double(),
                      torch.ones(512), torch.zeros(512), 512)
    W = torch.randn(128, 512, generator=g)

    def run():
        for found in iter_activations(model, tokens, [(2, RESID_MID), (2, MLP_OUT)]):
            z = (found[(2, RESID_MID)] @ W).relu()
            acts = (found[(2, MLP_OUT)] @ W).relu()
            z = z * (z >= z.topk(16, dim=1).values[:, -1:])
            acts = acts * (acts >= acts.topk(16, dim=1).values[:, -1:])
            stats.update(z, torch.ones(len(z)), acts)

    return run


STAGES = {"train-lm (3 steps)": lm_steps, "train-saes (8 SAEs x 3 steps)": sae_steps,
          "circuits weights (64 outputs)": circuit_weights, "token pass + gate statistics": token_pass}


def timed(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    print(f"{'stage':<32}{'idle 1':>9}{'idle 2':>9}{'busy 1':>9}{'busy 2':>9}   seconds, median of {args.repeats}")
    for name, build in STAGES.items():
        run = build()
        row = {}
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    row[(busy, threads)] = timed(run, args.repeats)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
        print(f"{name:<32}" + "".join(f"{row[(b, t)]:>9.2f}" for b in (False, True) for t in (1, 2)))


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
