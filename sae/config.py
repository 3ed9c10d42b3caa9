"""The recipe of TopK SAE training, written as JSON next to every SAE.

The paper trains on a 6-layer d_model 512 model with k 30, 4x expansion, batches of 4096
tokens, lr 1e-4, AdamW with a cosine schedule and about 150M tokens per SAE. Smaller models
get scaled values when a field is left at None (see `resolve`):

- k keeps the paper's share of active latents, 30 of 2048 (1.5% of d_sae), at least 4,
  so that tiny dictionaries still combine a few features per token (the demo overrides it,
  see `pipelines.demo`);
- lr is the paper's 1e-4 times sqrt(512 * 2048 / (d_in * d_sae)) times
  sqrt(PAPER_STEPS / steps) (the last factor only for runs shorter than the paper's). It
  gives the paper's rate at the paper's size, and was chosen on ground truth: on sae-lens's
  synthetic benchmark (benchmarks/bench_synthetic.py, docs/results/sae-defaults.md) the best
  rate of our trainer fell by about sqrt(4) when a run took 4 times the steps, and rose as
  the input and the dictionary shrank, faster than sqrt(512 / d_in) alone (the earlier rule);
- the schedule holds lr and then decays it by a cosine over the last fifth of the steps
  (`decay_fraction` 0.2) to 0: on the same benchmark this beat a cosine over the whole run
  at every rate, size and budget tried; a warm-up, an end above 0 and sae-lens's aux-k
  coefficient (1 instead of 1/32) did not help there;
- a latent counts as dead for the aux-k loss after a sixteenth of the run's tokens without
  firing, at most 1M (OpenAI's TopK paper uses 10M in far longer runs): with a fixed 1M the
  loss never acted in runs as short as the demo's, where the higher rate leaves a few
  latents silent at the end; the shorter window revived them at the same NMSE.

Tokens are not scaled automatically: pass what the corpus and the machine allow (the paper's
150M is about 73k tokens per latent). Memory is bounded by the shuffle buffer,
`buffer_tokens * d_model * 4` bytes per (layer, site), whatever the number of tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from circuits.config import Config, option, seed_option
from sae.activations import resolve_precision

PAPER_STEPS = 150_000_000 // 4096  # optimiser steps of one paper SAE


def default_lr(d_in: int, d_sae: int, steps: int) -> float:
    """The learning rate rule (module docstring): the paper's 1e-4 at d_in 512, d_sae 2048
    and `PAPER_STEPS` steps, scaled by sqrt(512 * 2048 / (d_in * d_sae)) and, for shorter
    runs, by sqrt(PAPER_STEPS / steps)."""
    return 1e-4 * math.sqrt(512 * 2048 / (d_in * d_sae) * max(1.0, PAPER_STEPS / max(1, steps)))


def default_dead_after(train_tokens: int) -> int:
    """The dead-latent window (module docstring): a sixteenth of the run, at most 1M tokens."""
    return max(1, min(1_000_000, train_tokens // 16))


@dataclass(frozen=True)
class SAETrainConfig(Config):
    """One TopK SAE's training recipe; the same recipe serves every (layer, site)."""

    expansion: int = option(4, "latents per model dimension, d_sae = expansion * d_model (paper: 4)", low=1)
    d_sae: int | None = option(None, "latents of the dictionary; overrides expansion when given", low=1)
    k: int | None = option(None, "active latents per token (default: the paper's 30 of 2048, scaled to d_sae, at least 4)", low=1)
    train_tokens: int = option(2_000_000, "tokens each SAE trains on (paper: about 150M)", low=1)
    batch_size: int = option(4096, "tokens per optimiser step (paper: 4096)", low=1)
    lr: float | None = option(None, "peak learning rate (default: the paper's 1e-4 times sqrt(512 * 2048 / (d_in * "
                              "d_sae)) times sqrt(paper's steps / steps) for shorter runs)", low=0.0)
    warmup_fraction: float = option(0.0, "share of the steps over which lr rises linearly from lr / warm-up steps",
                                    low=0.0, high=1.0)
    decay_fraction: float = option(0.2, "share of the steps, at the end, over which a cosine takes lr to lr * "
                                   "lr_end_fraction (1: the whole run after the warm-up)", low=0.0, high=1.0)
    lr_end_fraction: float = option(0.0, "the schedule ends at lr times this", low=0.0, high=1.0)
    weight_decay: float = option(0.0, "AdamW's decoupled weight decay (the paper names none)", low=0.0)
    aux_k_coefficient: float = option(1 / 32, "weight of the aux-k loss that revives dead latents", low=0.0)
    dead_after_tokens: int | None = option(None, "a latent silent for this many tokens counts as dead for the aux-k loss "
                                           "(default: a sixteenth of train_tokens, at most 1M)", low=1)
    buffer_tokens: int = option(262_144, "shuffle buffer per (layer, site), in tokens: bounds memory", low=2)
    eval_rows: int = option(64, "held-out rows the metrics (NMSE, L0, dead, loss added) are measured on", low=1)
    seed: int = seed_option("seeds the SAE initialisation and the order of the data")
    checkpoint_every: int = option(100, "optimiser steps between resumable checkpoints (a kill loses at most this many)",
                                   low=1, runtime=True)
    model_batch_rows: int = option(32, "rows per model forward pass", low=1, runtime=True)
    autocast: str = option("auto", "precision of the stream's model passes: none (float32), bf16 (bfloat16 autocast; "
                           "changes the activations in their last bits) or auto (bf16 where the device multiplies "
                           "bfloat16 in hardware); the SAEs themselves train in float32", choices=("none", "bf16", "auto"))

    def check(self) -> None:
        if self.train_tokens < self.batch_size:
            raise ValueError(f"SAETrainConfig: train_tokens={self.train_tokens} must hold at least one batch "
                             f"of batch_size={self.batch_size}")
        if self.buffer_tokens < self.batch_size:
            raise ValueError(f"SAETrainConfig: buffer_tokens={self.buffer_tokens} must be at least "
                             f"batch_size={self.batch_size}")

    def resolve(self, d_in: int, device: str = "cpu") -> "SAETrainConfig":
        """This config with k and lr filled in for input width `d_in`, and the precision that
        `autocast` means on `device` (so that a run's recipe says which ran); ValueError if k
        does not fit."""
        d_sae = self.d_sae if self.d_sae is not None else self.expansion * d_in
        k = self.k if self.k is not None else max(4, round(30 * d_sae / 2048))
        if k > d_sae:
            raise ValueError(f"k={k} must not exceed the dictionary size d_sae={d_sae} "
                             f"(d_sae or expansion {self.expansion} x d_model {d_in})")
        steps = max(1, self.train_steps)
        lr = self.lr if self.lr is not None else default_lr(d_in, d_sae, steps)
        dead = self.dead_after_tokens if self.dead_after_tokens is not None else default_dead_after(self.train_tokens)
        return self.replace(d_sae=d_sae, k=k, lr=lr, dead_after_tokens=dead,
                            autocast=resolve_precision(self.autocast, device))

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_fraction * self.train_steps)

    @property
    def decay_steps(self) -> int:
        return max(1, round(self.decay_fraction * self.train_steps))

    @property
    def train_steps(self) -> int:
        return self.train_tokens // self.batch_size

    @property
    def used_tokens(self) -> int:
        """Tokens actually trained on: whole batches only."""
        return self.train_steps * self.batch_size
