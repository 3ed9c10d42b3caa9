"""Train the bilinear LM: AdamW with warm-up and cosine decay, held-out loss, resumable.

The checkpoint directory holds our model format (`config.json`, `model.safetensors`,
`tokenizer.json`), the training log (`train_log.parquet`), the training config
(`train_config.json`) and, while training is unfinished, `train_state.pt` with the weights,
optimiser and step so that an interrupted run continues where it stopped.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer

from pipelines.data import TokenRows
from pipelines.model import (
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    ModelConfig,
    build_model,
    save_model,
)

STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.parquet"
TRAIN_CONFIG_FILE = "train_config.json"


@dataclass
class LMTrainConfig:
    """Optimisation settings of `train-lm`."""

    train_tokens: int = 4_000_000  # tokens to train on (rounded to whole steps)
    batch_size: int = 32  # rows of n_ctx tokens per step
    lr: float = 3e-3  # peak learning rate
    warmup_frac: float = 0.05  # share of steps with linear warm-up
    min_lr_frac: float = 0.1  # cosine decays to this share of the peak
    weight_decay: float = 0.1  # AdamW weight decay
    grad_clip: float = 1.0  # gradient norm clip
    eval_every: int = 100  # steps between held-out evaluations
    eval_rows: int = 64  # held-out rows per evaluation
    checkpoint_every: int = 200  # steps between resumable checkpoints
    seed: int = 0  # data order seed

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


def unigram_entropy(tokens: torch.Tensor, d_vocab: int) -> float:
    """Entropy in nats of the corpus's token frequencies: the loss of a context-free model."""
    counts = torch.bincount(tokens.flatten(), minlength=d_vocab).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


@torch.no_grad()
def held_out_loss(model: HookedTransformer, rows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over `rows` [n, n_ctx]."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        loss = model(batch, return_type="loss", loss_per_token=True)
        total += float(loss.sum())
        count += loss.numel()
    model.train()
    return total / count


def _batch(rows: torch.Tensor, step: int, cfg: LMTrainConfig) -> torch.Tensor:
    """Rows for `step`: a fresh seeded permutation per epoch, so resuming replays the order."""
    n = len(rows)
    g = step * cfg.batch_size + torch.arange(cfg.batch_size)
    epochs = g // n
    idx = torch.empty(cfg.batch_size, dtype=torch.int64)
    for e in epochs.unique().tolist():
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + e))
        sel = epochs == e
        idx[sel] = perm[g[sel] % n]
    return rows[idx]


def _check_compatible(model_cfg: ModelConfig, tok: Tokenizer, rows: torch.Tensor) -> None:
    if tok.get_vocab_size() > model_cfg.d_vocab:
        raise ValueError(
            f"tokenizer has {tok.get_vocab_size()} tokens but the model only {model_cfg.d_vocab}"
        )
    if rows.shape[1] > model_cfg.n_ctx:
        raise ValueError(f"rows have {rows.shape[1]} tokens but the model's n_ctx is {model_cfg.n_ctx}")
    if int(rows.max()) >= model_cfg.d_vocab:
        raise ValueError(f"token id {int(rows.max())} is outside the model's vocabulary")


def is_trained(out_dir: str | Path) -> bool:
    out = Path(out_dir)
    return (out / WEIGHTS_FILE).is_file() and (out / LOG_FILE).is_file() and not (out / STATE_FILE).exists()


def train_lm(
    model_cfg: ModelConfig,
    tok: Tokenizer,
    train: TokenRows,
    held_out: TokenRows,
    cfg: LMTrainConfig,
    out_dir: str | Path,
) -> tuple[HookedTransformer, pd.DataFrame]:
    """Train (or resume training) a bilinear LM into `out_dir`; returns it and its log."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, eval_rows = train.tokens, held_out.tokens[: cfg.eval_rows]
    if len(rows) == 0:
        raise ValueError("the training corpus is empty")
    _check_compatible(model_cfg, tok, rows)
    if (out / STATE_FILE).exists() and json.loads((out / TRAIN_CONFIG_FILE).read_text()) != asdict(cfg):
        raise ValueError(f"{out} holds an unfinished run with other training settings; use a new --out")
    tok.save(str(out / TOKENIZER_FILE))
    (out / TRAIN_CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2))

    n_ctx = rows.shape[1]
    n_steps = cfg.n_steps(n_ctx)
    torch.manual_seed(model_cfg.seed)
    model = build_model(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    log: list[dict] = []
    step = 0
    if (out / STATE_FILE).exists():
        state = torch.load(out / STATE_FILE, weights_only=False)
        if state["model_config"] != model_cfg.to_json():
            raise ValueError(f"{out} holds an unfinished run of another model config; use a new --out")
        model.load_state_dict(state["model"])
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        opt.load_state_dict(state["optimizer"])
        step, log = state["step"], state["log"]
    model.train()

    bar = tqdm(total=n_steps, initial=step, desc="train-lm", unit="step")
    t0, tokens_since = time.perf_counter(), 0
    while step < n_steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, n_steps, cfg)
        loss = model(_batch(rows, step, cfg), return_type="loss")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens_since += cfg.batch_size * n_ctx
        bar.update(1)
        if step % cfg.eval_every == 0 or step == n_steps:
            tok_s = tokens_since / (time.perf_counter() - t0)
            entry = {"step": step, "tokens": step * cfg.batch_size * n_ctx, "train_loss": loss.item(),
                     "held_out_loss": held_out_loss(model, eval_rows, cfg.batch_size),
                     "lr": lr_at(step - 1, n_steps, cfg), "tokens_per_s": tok_s}
            log.append(entry)
            bar.set_postfix(loss=f"{entry['train_loss']:.3f}", held_out=f"{entry['held_out_loss']:.3f}",
                            tok_s=f"{tok_s:,.0f}")
            t0, tokens_since = time.perf_counter(), 0
        if step % cfg.checkpoint_every == 0 and step < n_steps:
            # weights, optimiser and step in one file, replaced in one rename, so they never disagree
            tmp = out / (STATE_FILE + ".tmp")
            torch.save({"model": model.state_dict(), "model_config": model_cfg.to_json(),
                        "optimizer": opt.state_dict(), "step": step, "log": log}, tmp)
            tmp.replace(out / STATE_FILE)
    bar.close()
    model.eval()
    save_model(model, model_cfg, out)
    df = pd.DataFrame(log)
    df.to_parquet(out / LOG_FILE, index=False)
    (out / STATE_FILE).unlink(missing_ok=True)
    return model, df
