"""The settings of TopK SAE training, written as JSON next to every SAE.

The paper trains on a 6-layer d_model 512 model with k 30, 4x expansion, batches of 4096
tokens, lr 1e-4, AdamW with a cosine schedule and about 150M tokens per SAE. Smaller models
get scaled values when a field is left at None (see `resolve`):

- k keeps the paper's share of active latents, 30 of 2048 (1.5% of d_sae), at least 4,
  so that tiny dictionaries still combine a few features per token;
- lr is the paper's 1e-4 times sqrt(512 / d_in) times sqrt(PAPER_STEPS / steps) (the
  last factor only for runs shorter than the paper's). Adam moves each weight by about lr
  per step and the weights of a unit-norm decoder row are about 1/sqrt(d_in) large, so the
  first factor keeps a row's relative step as in the paper; noisy Adam steps add up like a
  random walk, so the second keeps the distance a short run can travel.

Tokens are not scaled automatically: pass what the corpus and the machine allow (the paper's
150M is about 73k tokens per latent; 2M train a d_model 128 SAE in one to three minutes on
two busy CPU cores). The activation cache takes points x tokens x d_model x dtype bytes of
disk at once (8 points of 2M tokens at d_model 128 in float32: 8 GB); `points_per_pass` and
`cache_dtype` bound it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

CONFIG_FILE = "train_config.json"
PAPER_STEPS = 150_000_000 // 4096  # optimiser steps of one paper SAE
CACHE_DTYPES = ("float32", "float16", "bfloat16")
# Fields that change how a run executes but not the SAE it trains.
RUNTIME_FIELDS = frozenset({"model_batch_seqs", "keep_activations", "points_per_pass", "device"})


@dataclass(frozen=True)
class SAETrainConfig:
    """One TopK SAE's training recipe; the same recipe serves every (layer, site)."""

    expansion: int = 4  # latents per input dimension: d_sae = expansion * d_in (paper: 4)
    k: int | None = None  # active latents per token; None: round(30 * d_sae / 2048), at least 4
    train_tokens: int = 2_000_000  # tokens each SAE sees, once each (paper: ~150M)
    batch_size: int = 4096  # tokens per optimiser step (paper: 4096)
    lr: float | None = None  # peak learning rate; None: scaled from the paper's 1e-4 (module doc)
    lr_end_fraction: float = 0.0  # the cosine schedule ends at lr * this
    weight_decay: float = 0.0  # AdamW's decoupled weight decay (the paper names no value)
    aux_k_coefficient: float = 1 / 32  # weight of the aux-k loss that revives dead latents (OpenAI's TopK value)
    dead_after_tokens: int = 1_000_000  # a latent silent this long counts as dead for the aux-k loss
    eval_seqs: int = 64  # rows held out of training for the metrics (NMSE, L0, dead, loss added)
    model_batch_seqs: int = 32  # rows per model forward pass while caching and evaluating
    shard_tokens: int = 65536  # rows per activation shard on disk; caching holds about this many per point
    buffer_tokens: int = 262144  # shuffle buffer while training, in rows (sae-lens mixing buffer)
    cache_dtype: str = "float32"  # dtype of cached activations: float32, float16 or bfloat16
    keep_activations: bool = False  # keep a point's cached activations after its SAE is finished
    points_per_pass: int | None = None  # points cached per model pass (None: all); bounds disk use
    seed: int = 0  # seeds the SAE initialisation, the shard shuffle and the batch order
    device: str = "cpu"  # where the SAE trains

    def resolve(self, d_in: int) -> "SAETrainConfig":
        """This config with k and lr filled in for input width `d_in`, validated.

        Raises ValueError for settings that cannot train (k above the dictionary size,
        a shuffle buffer smaller than a batch, too few tokens for one step, ...).
        """
        k = self.k if self.k is not None else max(4, round(30 * self.expansion * d_in / 2048))
        steps = max(1, self.train_steps)
        lr = self.lr if self.lr is not None else 1e-4 * math.sqrt(512 / d_in * max(1.0, PAPER_STEPS / steps))
        resolved = replace(self, k=k, lr=lr)
        resolved.validate(d_in)
        return resolved

    def validate(self, d_in: int) -> None:
        d_sae = self.expansion * d_in
        if self.expansion < 1:
            raise ValueError(f"expansion must be at least 1, got {self.expansion}")
        if self.k is not None and not 1 <= self.k <= d_sae:
            raise ValueError(
                f"k={self.k} must lie between 1 and the dictionary size d_sae={d_sae} "
                f"(expansion {self.expansion} x d_in {d_in})"
            )
        if self.batch_size < 1 or self.train_tokens < self.batch_size:
            raise ValueError(
                f"train_tokens={self.train_tokens} must hold at least one batch of {self.batch_size}"
            )
        if self.buffer_tokens < self.batch_size:
            raise ValueError(f"buffer_tokens={self.buffer_tokens} must be at least batch_size={self.batch_size}")
        if self.points_per_pass is not None and self.points_per_pass < 1:
            raise ValueError(f"points_per_pass must be at least 1 (or None for all), got {self.points_per_pass}")
        if self.eval_seqs < 1:
            raise ValueError(f"eval_seqs must be at least 1, got {self.eval_seqs}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"unknown cache_dtype {self.cache_dtype!r}; choose from {', '.join(CACHE_DTYPES)}")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")

    def same_recipe(self, other: "SAETrainConfig") -> bool:
        """Whether both configs train the same SAE (they may differ in runtime fields)."""
        mine, theirs = self.to_json(), other.to_json()
        return all(mine[f] == theirs[f] for f in mine if f not in RUNTIME_FIELDS)

    @property
    def train_steps(self) -> int:
        return self.train_tokens // self.batch_size

    @property
    def used_tokens(self) -> int:
        """Tokens actually trained on: whole batches only."""
        return self.train_steps * self.batch_size

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "SAETrainConfig":
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown SAE training config fields: {sorted(unknown)}")
        return cls(**data)

    def save(self, directory: str | Path) -> None:
        (Path(directory) / CONFIG_FILE).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> "SAETrainConfig":
        return cls.from_json(json.loads((Path(directory) / CONFIG_FILE).read_text()))
