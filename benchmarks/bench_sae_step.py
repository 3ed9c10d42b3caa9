"""One SAE optimiser step at the paper's proportions: ours, sae-lens's and sparsify's.

d_in 512, 2048 latents, k 30, batches of 4096 tokens, lr 1e-4, activations already in
memory (random), so the figures are the training steps' own speed:

- ours: `sae.topk.TopKTrainer.step` (AdamW, sparse encoder and decoder backward);
- sae-lens: `SAETrainer.step` with a default `TopKTrainingSAE`, as `bench_sae.py` runs it
  (Adam, dense activations);
- sparsify: EleutherAI's `SparseCoder` and the per-step work of its `Trainer` (decoder
  renormalised, forward with the dead mask, FVU backward, gradient projected off the decoder
  rows, Adam, linear schedule, dead-latent counters), if the package (`eai-sparsify`) is
  installed and runs on the device.

The trainers take turns in rounds of a few steps, so load from other processes slows all of
them alike and the ratios stay meaningful on a busy machine.

    python benchmarks/bench_sae_step.py [--steps 30] [--warmup 3] [--threads 1 2] [--device cpu]
"""

from __future__ import annotations

from pathlib import Path

import sys

import argparse
import os
import time
from collections.abc import Callable

import torch

os.environ.setdefault("WANDB_MODE", "disabled")

from sae.topk import TopKAutoencoder, TopKTrainer  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file and sae_lens_topk, beside this script
from results_file import add_output, run_recorded  # noqa: E402
from sae_lens_topk import sae_lens_topk  # noqa: E402

OUTPUT = "bench_sae_step.txt"  # under benchmarks/results/

D_IN, D_SAE, K, BATCH, LR = 512, 2048, 30, 4096, 1e-4
ROUND_STEPS = 5  # steps a trainer runs before the next one takes its turn
Step = Callable[[torch.Tensor], None]


def _ours(total_steps: int, device: str) -> Step:
    trainer = TopKTrainer(TopKAutoencoder(D_IN, D_SAE, K, device=device), train_steps=total_steps, lr=LR)

    def step(batch: torch.Tensor) -> None:
        trainer.step(batch, stats=False)

    return step


def _sae_lens(total_steps: int, device: str) -> Step:
    return sae_lens_topk(D_IN, D_SAE, K, total_steps, BATCH, LR, 0.0, "cosineannealing", device)[2]


def _sparsify(total_steps: int, device: str) -> Step:
    """Raises ImportError without the package."""
    from sparsify import SparseCoder, SparseCoderConfig
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(0)
    sae = SparseCoder(D_IN, SparseCoderConfig(num_latents=D_SAE, k=K), device=device)
    optimizer = torch.optim.Adam(sae.parameters(), lr=LR)  # what sparsify uses without bitsandbytes
    schedule = get_linear_schedule_with_warmup(optimizer, 0, total_steps)
    tokens_since_fired = torch.zeros(D_SAE, dtype=torch.long, device=device)
    dead_after_tokens = 10_000_000  # sparsify's default dead_feature_threshold
    first = [True]

    def step(batch: torch.Tensor) -> None:
        x = batch.to(device)
        if first[0]:
            sae.b_dec.data = x.mean(0)
            first[0] = False
        sae.set_decoder_norm_to_unit_norm()
        out = sae(x, dead_mask=tokens_since_fired > dead_after_tokens)
        (out.fvu + out.auxk_loss / 32 + out.multi_topk_fvu / 8).backward()
        fired = torch.zeros(D_SAE, dtype=torch.bool, device=device)
        fired[out.latent_indices.flatten()] = True
        sae.remove_gradient_parallel_to_decoder_directions()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        with torch.no_grad():
            tokens_since_fired.add_(x.shape[0])
            tokens_since_fired[fired] = 0

    return step


def _synchronize(device: str) -> None:
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize(device)


def per_sae_step_rates(steps: int = 30, device: str = "cpu", threads: int | None = None, warmup: int = 3) -> dict:
    """Time `steps` optimiser steps (after `warmup` untimed ones) of each trainer.

    `threads` sets torch's CPU threads for the measurement (None: leave as is). Returns
    `{"threads", "device", "steps", "ours", "sae_lens", "sparsify", "ours_over_sae_lens",
    "ours_over_sparsify"}`; each trainer's entry is `{"tokens_per_s", "ms_per_step"}`, or
    `{"error": why}` for a trainer that could not run (its ratio is then None).
    """
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        pool = [(torch.randn(BATCH, D_IN, generator=generator) + 0.5).to(device) for _ in range(4)]
        total = warmup + steps
        trainers: dict[str, Step] = {}
        results: dict[str, dict] = {}
        for name, build in (("ours", _ours), ("sae_lens", _sae_lens), ("sparsify", _sparsify)):
            try:
                trainers[name] = build(total, device)
                for i in range(warmup):
                    trainers[name](pool[i % len(pool)])
            except Exception as error:  # noqa: BLE001 - sparsify is optional: report why it did not run
                if name != "sparsify":
                    raise
                results[name] = {"error": f"{type(error).__name__}: {error}"}
                trainers.pop(name, None)
        elapsed = dict.fromkeys(trainers, 0.0)
        done = 0
        while done < steps:
            n = min(ROUND_STEPS, steps - done)
            for name, step in trainers.items():
                _synchronize(device)
                start = time.perf_counter()
                for i in range(done, done + n):
                    step(pool[i % len(pool)])
                _synchronize(device)
                elapsed[name] += time.perf_counter() - start
            done += n
        for name, seconds in elapsed.items():
            results[name] = {"tokens_per_s": steps * BATCH / seconds, "ms_per_step": 1000 * seconds / steps}

        def ratio(other: str) -> float | None:
            if "tokens_per_s" not in results["ours"] or "tokens_per_s" not in results[other]:
                return None
            return results["ours"]["tokens_per_s"] / results[other]["tokens_per_s"]

        return {
            "threads": torch.get_num_threads(), "device": device, "steps": steps, **results,
            "ours_over_sae_lens": ratio("sae_lens"), "ours_over_sparsify": ratio("sparsify"),
        }
    finally:
        torch.set_num_threads(previous_threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="timed optimiser steps per trainer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per trainer first")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch CPU thread counts to try")
    parser.add_argument("--device", default="cpu")
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    print(f"d_in {D_IN}, d_sae {D_SAE}, k {K}, batch {BATCH}, {args.steps} steps after {args.warmup} warm-up, "
          f"{args.device}; torch.get_num_threads() = {torch.get_num_threads()} by default")
    for threads in args.threads:
        rates = per_sae_step_rates(args.steps, args.device, threads, args.warmup)
        print(f"\n{rates['threads']} torch thread(s):")
        for name in ("ours", "sae_lens", "sparsify"):
            entry = rates[name]
            if "error" in entry:
                print(f"  {name:>9}: did not run ({entry['error']})")
            else:
                print(f"  {name:>9}: {entry['tokens_per_s']:9.0f} tokens/s  {entry['ms_per_step']:8.1f} ms/step")
        for key in ("ours_over_sae_lens", "ours_over_sparsify"):
            if rates[key] is not None:
                print(f"  {key}: {rates[key]:.2f}x")


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
