"""SAE training throughput at the paper's proportions: our trainer next to plain sae-lens.

d_in 512, 2048 latents, k 30, batches of 4096 tokens, lr 1e-4 with a cosine schedule, fed
from activations already in memory (random, cycled from a small pool), so the figures
are the trainers' own speed. "ours" is `sae.train.train_sae` (AdamW, frozen zero b_enc,
decoder renormalised every step); "sae-lens" is `SAETrainer` with a default
`TopKTrainingSAE` (Adam, trainable b_enc, decoder-norm rescaling).

    python benchmarks/bench_sae.py [--steps 100] [--device cpu]
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch

os.environ.setdefault("WANDB_MODE", "disabled")

from sae_lens import LoggingConfig, TopKTrainingSAE, TopKTrainingSAEConfig  # noqa: E402
from sae_lens.config import SAETrainerConfig  # noqa: E402
from sae_lens.training.sae_trainer import SAETrainer  # noqa: E402

from sae.config import SAETrainConfig  # noqa: E402
from sae.train import train_sae  # noqa: E402

D_IN, D_SAE, K, BATCH, LR = 512, 2048, 30, 4096, 1e-4


def activations(n_batches: int, device: str):
    """An endless stream of `[BATCH, D_IN]` batches cycled from `n_batches` random ones."""
    g = torch.Generator().manual_seed(0)
    pool = [(torch.randn(BATCH, D_IN, generator=g) + 0.5).to(device) for _ in range(n_batches)]
    return itertools.cycle(pool)


def run_ours(steps: int, device: str) -> float:
    cfg = SAETrainConfig(k=K, expansion=D_SAE // D_IN, train_tokens=steps * BATCH, batch_size=BATCH,
                         lr=LR, device=device).resolve(D_IN)
    start = time.perf_counter()
    train_sae(activations(8, device), D_IN, cfg, desc="ours")
    return steps * BATCH / (time.perf_counter() - start)


def run_sae_lens(steps: int, device: str) -> float:
    torch.manual_seed(0)
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=D_IN, d_sae=D_SAE, k=K, device=device))
    cfg = SAETrainerConfig(
        total_training_samples=steps * BATCH, train_batch_size_samples=BATCH, lr=LR, lr_end=0.0,
        lr_scheduler_name="cosineannealing", device=device, logger=LoggingConfig(log_to_wandb=False),
    )
    start = time.perf_counter()
    SAETrainer(cfg=cfg, sae=sae, data_provider=activations(8, device)).fit()
    return steps * BATCH / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="optimiser steps per trainer")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(f"d_in {D_IN}, d_sae {D_SAE}, k {K}, batch {BATCH}, {args.steps} steps, {args.device}, "
          f"{torch.get_num_threads()} threads")
    results = {"ours": run_ours(args.steps, args.device), "sae-lens": run_sae_lens(args.steps, args.device)}
    for name, tokens_per_s in results.items():
        print(f"{name:>9}: {tokens_per_s:10.0f} tokens/s")


if __name__ == "__main__":
    main()
