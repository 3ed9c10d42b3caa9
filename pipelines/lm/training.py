"""Train the bilinear LM: AdamW with warm-up and cosine decay, held-out loss, resumable.

`train_lm` writes into a work folder: our model format (`config.json`, `model.safetensors`),
the training log (`train_log.parquet`) and, every `checkpoint_every` steps,
`train_state.pt` (weights, optimiser, step and log in one file, replaced in one rename), so
that an interrupted run continues where its last checkpoint stopped. Batches are a pure
function of the step (a seeded permutation of the rows per epoch), so a resumed run sees
the same data as an uninterrupted one.
"""

from __future__ import annotations

import copy
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
from torch.nn.utils import clip_grad_norm_
from tqdm.auto import tqdm

from circuits import forward
from circuits.config import Config, option, seed_option
from pipelines.data.tokens import TokenRows
from pipelines.engine.files import atomic_file
from pipelines.engine.paths import ModelPaths
from pipelines.lm.model import ModelConfig, build_model, save_model
from pipelines.runtime import one_thread_workers
from sae.activations import PRECISIONS, autocast, resolve_precision

if TYPE_CHECKING:  # annotations only: importing TransformerLens takes seconds
    from transformer_lens import HookedTransformer


SHARD_ROWS = 16  # least rows of a step per `Shards` copy: the demo's half batch, where it was measured


@dataclass(frozen=True)
class LMTrainConfig(Config):
    """Optimisation settings of `train-lm`."""

    train_tokens: int = option(4_000_000, "tokens to train on (rounded to whole steps)", low=1)
    batch_size: int = option(32, "rows of n_ctx tokens per optimiser step", low=1)
    lr: float = option(3e-3, "peak learning rate", low=0.0)
    warmup_frac: float = option(0.05, "share of steps with linear warm-up", low=0.0, high=1.0)
    min_lr_frac: float = option(0.1, "the cosine schedule decays to this share of the peak", low=0.0, high=1.0)
    weight_decay: float = option(0.1, "AdamW weight decay", low=0.0)
    grad_clip: float = option(1.0, "gradient norm clip", low=0.0)
    eval_every: int = option(100, "steps between held-out evaluations", low=1, runtime=True)
    eval_rows: int = option(64, "held-out rows per evaluation", low=1)
    checkpoint_every: int = option(50, "steps between resumable checkpoints (a kill loses at most this many)", low=1, runtime=True)
    seed: int = seed_option("seed of the weight initialisation and the data order")
    autocast: str = option("auto", "precision of the training passes' products: none (float32), bf16 (bfloat16 "
                           "autocast; weights, optimiser and held-out losses stay float32) or auto (bf16 where the "
                           "device multiplies bfloat16 in hardware)", choices=PRECISIONS, runtime=True)

    def n_steps(self, n_ctx: int) -> int:
        return max(1, self.train_tokens // (self.batch_size * n_ctx))


def lr_at(step: int, n_steps: int, cfg: LMTrainConfig) -> float:
    """Learning rate at `step`: linear warm-up, then cosine decay to `min_lr_frac * lr`."""
    warmup = max(1, int(cfg.warmup_frac * n_steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, n_steps - warmup)
    floor = cfg.min_lr_frac
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def held_out_loss(model: HookedTransformer, rows: TokenRows, n_rows: int, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over the first `n_rows` held-out rows, in float32
    whatever the training's precision: the model every later stage reads."""
    was_training = model.training
    model.eval()
    device = model.cfg.device
    total, count = 0.0, 0
    for _, batch in rows.iter_batches(batch_size, n_rows):
        batch = batch.to(device)
        loss = forward.next_token_loss(forward.run(model, batch)[0], batch)
        total += float(loss.float().sum())
        count += loss.numel()
    model.train(was_training)
    return total / count


def _batch(n_rows: int, step: int, cfg: LMTrainConfig) -> torch.Tensor:
    """Row indices of `step`: a fresh seeded permutation per epoch, so resuming replays the order."""
    g = step * cfg.batch_size + torch.arange(cfg.batch_size)
    epochs = g // n_rows
    idx = torch.empty(cfg.batch_size, dtype=torch.int64)
    for e in epochs.unique().tolist():
        perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + e))
        sel = epochs == e
        idx[sel] = perm[g[sel] % n_rows]
    return idx.sort().values  # sorted: memory-mapped rows are read in file order


def train_lm(
    model_cfg: ModelConfig,
    train: TokenRows,
    held_out: TokenRows,
    cfg: LMTrainConfig,
    work_dir: str | Path,
    device: str = "cpu",
    n_shards: int = 1,
) -> tuple[HookedTransformer, pd.DataFrame]:
    """Train (or resume training) a bilinear LM in `work_dir`; returns it and its log.
    `n_shards`: each step's rows split over that many copies of the model, a thread and one
    intra-op thread each (`Shards`).

    The caller decides whether `work_dir` holds a resumable state of this very run (same
    model config, data and training config); a state of another model config is refused.
    """
    out = Path(work_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = ModelPaths(out)
    if len(train) == 0:
        raise ValueError("the training corpus is empty")
    if train.n_ctx > model_cfg.n_ctx:
        raise ValueError(f"rows have {train.n_ctx} tokens but the model's n_ctx is {model_cfg.n_ctx}")
    n_steps = cfg.n_steps(train.n_ctx)
    model_cfg = model_cfg.replace(seed=cfg.seed)
    model = build_model(model_cfg, device, seed=cfg.seed)
    optimiser = _optimiser(model, cfg)
    log: list[dict] = []
    step = 0
    if (files.train_state).exists():
        state = torch.load(files.train_state, weights_only=False, map_location=device)
        if state["model_config"] != model_cfg.to_json():
            raise ValueError(f"{out} holds an unfinished run of another model config; use a new --out")
        model.load_state_dict(state["model"])
        optimiser.load_state_dict(state["optimizer"])
        step, log = state["step"], state["log"]
    precision = resolve_precision(cfg.autocast, device)
    before = {entry.get("precision", "none") for entry in log}
    if before - {precision}:
        print(f"resuming a training begun in {', '.join(sorted(before))} precision in {precision}: the log's "
              "precision column says which steps ran in which")
    model.train()

    n_shards = min(n_shards, cfg.batch_size)  # a copy without rows would have no loss
    with one_thread_workers(n_shards) as pool:
        shards = Shards(model, n_shards if pool else 1, pool)
        bar = tqdm(total=n_steps, initial=step, desc="train-lm", unit="step")
        t0, tokens_since = time.perf_counter(), 0
        while step < n_steps:
            for group in optimiser.param_groups:
                group["lr"] = lr_at(step, n_steps, cfg)
            rows = train.batch(_batch(len(train), step, cfg).numpy()).to(device)
            optimiser.zero_grad(set_to_none=True)
            loss = shards.backward(rows, precision)
            clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimiser.step()
            shards.sync()
            step += 1
            tokens_since += rows.numel()
            bar.update(1)
            if step % cfg.eval_every == 0 or step == n_steps:
                tok_s = tokens_since / (time.perf_counter() - t0)
                entry = {"step": step, "tokens": step * cfg.batch_size * train.n_ctx, "precision": precision,
                         "train_loss": loss.item(),
                         "held_out_loss": held_out_loss(model, held_out, cfg.eval_rows, cfg.batch_size),
                         "lr": lr_at(step - 1, n_steps, cfg), "tokens_per_s": tok_s}
                log.append(entry)
                bar.set_postfix(loss=f"{entry['train_loss']:.3f}", held_out=f"{entry['held_out_loss']:.3f}",
                                tok_s=f"{tok_s:,.0f}")
                t0, tokens_since = time.perf_counter(), 0
            if step % cfg.checkpoint_every == 0 and step < n_steps:
                with atomic_file(files.train_state) as tmp:
                    torch.save({"model": model.state_dict(), "model_config": model_cfg.to_json(),
                                "optimizer": optimiser.state_dict(), "step": step, "log": log}, tmp)
    bar.close()
    model.eval()
    save_model(model, model_cfg, out)
    df = pd.DataFrame(log)
    with atomic_file(files.train_log) as tmp:
        df.to_parquet(tmp, index=False)
    return model, df


class Shards:
    """A step's rows split over copies of the model, each on a thread of `pool` with one
    intra-op thread, and their gradients combined into the model's: the gradient of the whole
    batch's mean loss, up to the order of float sums (a fixed order: repeatable run to run).

    Why: the demo's model is small (4096 x 128 x 512 products, attention over 128 tokens), and
    two intra-op threads on each of its operations wait on each other at every one; two halves
    of the batch on a thread each do not (`pipelines.runtime.one_thread_workers`;
    `benchmarks/bench_stages.py` measures the stage). Each shard has a copy of the weights
    that `sync` refreshes after each optimiser step. Without a pool the
    model takes every row."""

    def __init__(self, model: HookedTransformer, n: int, pool: ThreadPoolExecutor | None):
        self.models, self.pool = [model] + [copy.deepcopy(model) for _ in range(n - 1)], pool

    def backward(self, rows: torch.Tensor, precision: str) -> torch.Tensor:
        """The mean next-token loss of `rows [batch, n_ctx]`, its gradient in the model's `.grad`."""
        if self.pool is None:
            return _backward(self.models[0], rows, precision)
        parts = rows.tensor_split(len(self.models))
        losses = list(self.pool.map(_backward, self.models, parts, [precision] * len(parts)))
        weights = [len(part) / len(rows) for part in parts]
        for own, *others in zip(*(m.parameters() for m in self.models)):  # every parameter has a gradient
            own.grad.mul_(weights[0])
            for other, weight in zip(others, weights[1:]):
                own.grad.add_(other.grad, alpha=weight)
                other.grad = None
        return sum(w * loss for w, loss in zip(weights, losses))

    @torch.no_grad()
    def sync(self) -> None:
        """The copies take the model's weights (after each optimiser step)."""
        for own, *others in zip(*(m.parameters() for m in self.models)):
            for other in others:
                other.copy_(own)


def _backward(model: HookedTransformer, rows: torch.Tensor, precision: str) -> torch.Tensor:
    """The mean next-token loss of `rows`, back-propagated into `model`'s `.grad`."""
    with autocast(precision, str(rows.device)):
        loss = forward.next_token_loss(forward.run(model, rows)[0], rows).mean()
    loss.backward()
    return loss.detach()


def _optimiser(model: HookedTransformer, cfg: LMTrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
