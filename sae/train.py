"""Train TopK SAEs from activations: any iterable of tensors, or one model stream for many points.

One loop (`run_training`) steps a set of `sae.topk.TopKTrainer`s on batches drawn from a
resumable stream, and every `checkpoint_every` steps hands a `checkpoint(state)` callback
everything needed to continue exactly: each trainer's state and the stream's position. Given
that state back, the loop continues where it stopped and ends with the same SAEs an
uninterrupted run gives (bitwise on the same device and thread count). Two streams feed it:

- `train_sae`: one SAE from an iterable of activation tensors `[n, d_in]` (any n, no model):
  `TensorBatches` cuts them into batches and resumes by replaying the iterable, so it must
  give the same tensors each time it is iterated (a list, a seeded generator, files read in
  order); shuffling is the caller's;
- `train_saes`: every (layer, site) point's SAE from `sae.stream.ActivationStream` (one model
  pass feeds every point).

Our own loop rather than sae-lens's `SAETrainer`: its dense encoder backward and dense
decoder cost several times our sparse step (benchmarks/bench_sae_step.py measures it), and
it cannot share one activation stream between SAEs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from tqdm.auto import tqdm

from circuits.sites import SITES, Point, point_name
from circuits.weights import SAEWeights
from sae.config import SAETrainConfig
from sae.stream import ActivationStream, Rows
from sae.topk import TopKAutoencoder, TopKTrainer

if TYPE_CHECKING:  # annotations only: importing TransformerLens takes seconds
    from transformer_lens import HookedTransformer


class Stream(Protocol):
    """Endless or finite batches `{key: [batch_size, d_in]}` with a position to resume from."""

    def __iter__(self) -> Iterator[dict]: ...

    def state(self) -> dict: ...  # JSON-able position of the next batch

    def restore(self, state: dict) -> None: ...


@dataclass
class TensorBatches:
    """Batches of `batch_size` rows, `{key: [batch_size, d_in]}`, from an iterable of
    activation tensors `[n, d_in]` of any n; rows left over at the end are not used.

    Its position is the number of rows handed out; `restore` then iterating again replays
    `source` from its start and skips those rows, so `source` must give the same tensors
    every time it is iterated.
    """

    source: Iterable[torch.Tensor]
    batch_size: int
    key: Hashable = "sae"
    rows: int = 0  # rows handed out so far

    def state(self) -> dict:
        return {"rows": self.rows}

    def restore(self, state: dict) -> None:
        self.rows = int(state["rows"])

    def __iter__(self) -> Iterator[dict]:
        skip, pending, have = self.rows, [], 0
        for index, chunk in enumerate(self.source):
            if not isinstance(chunk, torch.Tensor) or chunk.ndim != 2:
                raise ValueError(f"activation tensor {index} must be a 2-D tensor [n, d_in], got "
                                 f"{tuple(chunk.shape) if isinstance(chunk, torch.Tensor) else type(chunk).__name__}")
            if skip >= chunk.shape[0]:
                skip -= chunk.shape[0]
                continue
            chunk, skip = chunk[skip:], 0
            pending.append(chunk)
            have += chunk.shape[0]
            while have >= self.batch_size:
                joined = torch.cat(pending) if len(pending) > 1 else pending[0]
                rest = joined[self.batch_size :]
                pending, have = ([rest] if rest.shape[0] else []), rest.shape[0]
                self.rows += self.batch_size
                yield {self.key: joined[: self.batch_size]}


def new_trainer(d_in: int, cfg: SAETrainConfig, device: str = "cpu", seed: int | None = None) -> TopKTrainer:
    """A fresh SAE of `cfg`'s recipe (resolved) for inputs of width `d_in` and its trainer;
    `seed` draws the SAE (default: `cfg.seed`)."""
    if cfg.k is None or cfg.lr is None or cfg.d_sae is None or cfg.dead_after_tokens is None:
        raise ValueError("resolve the config first: SAETrainConfig.resolve(d_in)")
    sae = TopKAutoencoder(d_in, cfg.d_sae, cfg.k, device=device, seed=cfg.seed if seed is None else seed)
    return TopKTrainer(
        sae, train_steps=cfg.train_steps, lr=cfg.lr, lr_end_fraction=cfg.lr_end_fraction,
        warmup_steps=cfg.warmup_steps, decay_steps=cfg.decay_steps, weight_decay=cfg.weight_decay,
        aux_k_coefficient=cfg.aux_k_coefficient, dead_steps=max(1, cfg.dead_after_tokens // cfg.batch_size),
    )


def build_trainers(points: list[Point], d_in: int, cfg: SAETrainConfig, device: str) -> dict[Point, TopKTrainer]:
    """A fresh SAE and trainer per point (`cfg` resolved). Each point's seed comes from the
    point itself, so SAEs of different points do not start alike, and a point starts alike
    whichever other points train beside it (a group of SAEs on a Ray worker, or all here)."""
    return {point: new_trainer(d_in, cfg, device, seed=cfg.seed * 1000 + point[0] * len(SITES) + SITES.index(point[1]))
            for point in points}


def run_training(
    trainers: dict,
    stream: Stream,
    cfg: SAETrainConfig,
    checkpoint: Callable[[dict], None] | None = None,
    resume: dict | None = None,
    on_step: Callable[[], None] | None = None,
    name: Callable[[Hashable], str] = str,
) -> dict:
    """Step every trainer of `trainers` (keyed as the stream's batches) `cfg.train_steps`
    times; returns `trainers`. Each trainer moves its batch to its SAE's device itself.

    Every `cfg.checkpoint_every` steps (but not after the last) `checkpoint` receives
    `{"step", "stream": stream.state(), "trainers": {name(key): trainer.state_dict()}}`;
    `resume` is such a state, from a run with the same trainers, stream and recipe.
    `on_step()` is called after every step (progress reports). ValueError if the stream ends
    before the last step.
    """
    step = 0
    if resume is not None:
        for key, trainer in trainers.items():
            trainer.load_state_dict(resume["trainers"][name(key)])
        stream.restore(resume["stream"])
        step = resume["step"]
    bar = tqdm(total=cfg.train_steps, initial=step, desc=f"train {len(trainers)} SAE{'' if len(trainers) == 1 else 's'}", unit="step")
    batches = iter(stream)
    started, done_since = time.perf_counter(), 0
    while step < cfg.train_steps:
        batch = next(batches, None)
        if batch is None:
            raise ValueError(f"the activations ran out after {step} of {cfg.train_steps} steps of {cfg.batch_size} "
                             f"tokens: give at least train_tokens={cfg.train_tokens} rows or lower train_tokens")
        last = {}
        for key, trainer in trainers.items():
            last[key] = trainer.step(batch[key], stats=(step + 1) % 50 == 0)
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
            checkpoint({"step": step, "stream": stream.state(),
                        "trainers": {name(key): t.state_dict() for key, t in trainers.items()}})
    bar.close()
    return trainers


def train_sae(
    activations: Iterable[torch.Tensor],
    d_in: int,
    cfg: SAETrainConfig = SAETrainConfig(),
    device: str = "cpu",
    checkpoint: Callable[[dict], None] | None = None,
    resume: dict | None = None,
) -> TopKTrainer:
    """Train one TopK SAE on `activations`, an iterable of tensors `[n, d_in]` (see
    `TensorBatches`), with `cfg`'s recipe (resolved here for `d_in`); returns its trainer
    (`.sae` is the SAE; `sae.topk.save_sae_lens` writes it for sae-lens).

    `checkpoint` and `resume` as in `run_training`; the resumed run must get the same
    activations, `d_in` and `cfg`.
    """
    cfg = cfg.resolve(d_in, device)
    trainers = {"sae": new_trainer(d_in, cfg, device)}
    run_training(trainers, TensorBatches(activations, cfg.batch_size), cfg, checkpoint, resume)
    return trainers["sae"]


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
    """Train one SAE per point on `cfg.train_steps` batches of one model stream; returns the
    finished trainers.

    `cfg` must be resolved (`SAETrainConfig.resolve`). `checkpoint`, `resume` and `on_step`
    as in `run_training` (for the same points, rows and recipe). `pool`: the stream's model
    batches run on its threads.
    """
    if cfg.k is None or cfg.lr is None:
        raise ValueError("resolve the config first: SAETrainConfig.resolve(d_model)")
    trainers = build_trainers(points, model.cfg.d_model, cfg, device)
    stream = ActivationStream(model, rows, points, cfg.buffer_tokens, cfg.batch_size, cfg.seed,
                              cfg.model_batch_rows, precision=cfg.autocast, total_batches=cfg.train_steps, pool=pool)
    return run_training(trainers, stream, cfg, checkpoint, resume, on_step, name=point_name)


def inference_weights(sae: TopKAutoencoder) -> SAEWeights:
    """A trained SAE as the plain tensors every analysis reads."""
    return SAEWeights(W_enc=sae.W_enc.detach(), b_enc=sae.b_enc.detach(), W_dec=sae.W_dec.detach(),
                      b_dec=sae.b_dec.detach(), apply_b_dec_to_input=True, k=sae.k)
