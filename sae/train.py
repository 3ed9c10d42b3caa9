"""Train the TopK SAEs of several (layer, site) points at once from one activation stream.

Each step draws one batch per point from `sae.stream.ActivationStream` (one model pass
feeds every point) and steps every point's `sae.topk.TopKTrainer`. Every
`checkpoint_every` steps a `checkpoint(state)` callback receives everything needed to
continue exactly: each trainer's state and the stream's position. Given that state back,
`train_saes` continues where it stopped and ends with the same SAEs an uninterrupted run
gives (bitwise on the same device and thread count).

Our own loop rather than sae-lens's `SAETrainer`: its dense encoder backward and dense
decoder cost several times our sparse step (benchmarks/bench_sae_step.py measures it), and
it cannot share one activation stream between SAEs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from circuits.weights import SAEWeights
from sae.config import SAETrainConfig
from circuits.sites import SITES, Point, point_name
from sae.stream import ActivationStream, Rows, StreamPosition
from sae.topk import TopKSAE, TopKTrainer

if TYPE_CHECKING:  # annotations only: importing TransformerLens takes seconds
    from transformer_lens import HookedTransformer


def build_trainers(points: list[Point], d_in: int, cfg: SAETrainConfig, device: str) -> dict[Point, TopKTrainer]:
    """A fresh SAE and trainer per point (`cfg` resolved). Each point's seed comes from the
    point itself, so SAEs of different points do not start alike, and a point starts alike
    whichever other points train beside it (a group of SAEs on a Ray worker, or all here)."""
    trainers = {}
    for point in points:
        layer, site = point
        sae = TopKSAE(d_in, cfg.expansion * d_in, cfg.k, device=device,
                      seed=cfg.seed * 1000 + layer * len(SITES) + SITES.index(site))
        trainers[point] = TopKTrainer(
            sae, train_steps=cfg.train_steps, lr=cfg.lr, lr_end_fraction=cfg.lr_end_fraction,
            weight_decay=cfg.weight_decay, aux_k_coefficient=cfg.aux_k_coefficient,
            dead_steps=max(1, cfg.dead_after_tokens // cfg.batch_size),
        )
    return trainers


def train_saes(
    model: HookedTransformer,
    rows: Rows,
    points: list[Point],
    cfg: SAETrainConfig,
    device: str = "cpu",
    checkpoint: Callable[[dict], None] | None = None,
    resume: dict | None = None,
    on_step: Callable[[], None] | None = None,
    pool: Executor | None = None,
) -> dict[Point, TopKTrainer]:
    """Train one SAE per point on `cfg.train_steps` batches; returns the finished trainers.

    `cfg` must be resolved (`SAETrainConfig.resolve`). `resume` is a state an earlier
    `checkpoint` call received, for the same points, rows and recipe. `on_step()` is called
    after every step (progress reports). `pool`: the stream's model batches run on its threads.
    """
    if cfg.k is None or cfg.lr is None:
        raise ValueError("resolve the config first: SAETrainConfig.resolve(d_model)")
    trainers = build_trainers(points, model.cfg.d_model, cfg, device)
    stream = ActivationStream(model, rows, points, cfg.buffer_tokens, cfg.batch_size, cfg.seed,
                              cfg.model_batch_rows, precision=cfg.autocast, total_batches=cfg.train_steps, pool=pool)
    step = 0
    if resume is not None:
        for point, trainer in trainers.items():
            trainer.load_state_dict(resume["trainers"][point_name(point)])
        stream.position = StreamPosition(**resume["stream"])
        step = resume["step"]
    bar = tqdm(total=cfg.train_steps, initial=step, desc=f"train {len(points)} SAEs", unit="step")
    batches = iter(stream)
    started, done_since = time.perf_counter(), 0
    while step < cfg.train_steps:
        batch = next(batches)
        last = {}
        for point, trainer in trainers.items():
            last[point] = trainer.step(batch[point].to(device), stats=(step + 1) % 50 == 0)
        step += 1
        done_since += 1
        bar.update(1)
        if on_step is not None:
            on_step()
        if step % 50 == 0:
            rate = done_since * cfg.batch_size / (time.perf_counter() - started)
            worst = max(last.values(), key=lambda losses: losses.get("fvu", 0.0))
            bar.set_postfix(tok_s=f"{rate:,.0f}", worst_fvu=f"{worst.get('fvu', float('nan')):.3f}")
            started, done_since = time.perf_counter(), 0
        if checkpoint is not None and step % cfg.checkpoint_every == 0 and step < cfg.train_steps:
            checkpoint({"step": step, "stream": stream.position.to_json(),
                        "trainers": {point_name(p): t.state_dict() for p, t in trainers.items()}})
    bar.close()
    return trainers


def inference_weights(sae: TopKSAE) -> SAEWeights:
    """A trained SAE as the plain tensors every analysis reads."""
    return SAEWeights(W_enc=sae.W_enc.detach(), b_enc=sae.b_enc.detach(), W_dec=sae.W_dec.detach(),
                      b_dec=sae.b_dec.detach(), apply_b_dec_to_input=True, k=sae.k)
