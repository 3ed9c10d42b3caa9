"""The `train-saes` stage: one TopK SAE per (layer, site), and each layer's `sae_metrics`.

The points still to train are split into groups (one per Ray worker; one here), each
trained from one stream of the model with a checkpoint of its own; a finished SAE's folder
carries its stamp.
"""

from __future__ import annotations

import pandas as pd
import torch
from tqdm.auto import tqdm

from circuits.sites import SITES, Point, hook_name, point_name
from pipelines import schemas
from pipelines.engine import stamps
from pipelines.engine.files import atomic_dir, atomic_file, clean_temporaries, text_digest
from pipelines.engine.paths import RunPaths, stamp_of
from pipelines.engine.stamps import Stamp
from pipelines.engine.tasks import Task, run_tasks
from pipelines.inputs import StageInputs
from pipelines.jobs import SAEJob
from pipelines.runtime import Runtime, one_thread_workers
from pipelines.stages.base import TABLE_FORMAT, gpus, tokens_digest
from sae.config import SAETrainConfig
from sae.io import read_metrics, write_sae_extras
from sae.metrics import clean_losses, evaluate_sae


def ensure_saes(work: StageInputs, *, job: SAEJob, layers: list[int], runtime: Runtime) -> pd.DataFrame:
    """Train every (layer, site) SAE whose folder is not current; returns all their metrics.

    The points still to train are split into groups (one per Ray worker; one here), each
    trained from one stream of the model with a checkpoint of its own.
    """
    run = work.run
    cfg = job.sae.resolve(work.lm.config.d_model, runtime.device)
    clean_temporaries(run.root)
    points = [(layer, site) for layer in layers for site in job.sites]
    todo = []
    for point in points:
        stamp = _sae_stamp(work, cfg, point)
        folder = run.sae(*point)
        if stamps.is_current(stamp_of(folder), stamp):
            continue
        changed = stamps.changes(stamp_of(folder), stamp)
        if changed:
            print(f"retraining {point_name(point)}: its {', '.join(changed)} changed")
        todo.append(point)
    n_groups = min(len(todo), runtime.workers if runtime.ray else 1)
    groups = [todo[i::n_groups] for i in range(n_groups)] if todo else []
    current = {_checkpoint_name(work, cfg, group) for group in groups}
    for name, stale in run.sae_checkpoints().items():  # of another grouping or recipe
        if name not in current:
            print(f"discarding {stale.name}: it resumes SAEs grouped or trained otherwise than now")
            stale.unlink()
            run.sae_checkpoint_stamp(name).unlink(missing_ok=True)
    # a group's stream runs its model batches side by side on the CPU's threads, one intra-op thread each
    workers = runtime.tasks_at_once(runtime.threads)
    tasks = [Task("SAEs " + ", ".join(point_name(p) for p in group), (cfg, group, workers), gpus(runtime))
             for group in groups]
    run_tasks(runtime, _train_points, work, tasks, "train-saes")
    for layer in sorted({p[0] for p in points}):
        _write_metrics_table(run, layer)
    return pd.DataFrame([read_metrics(run.sae(*p)) for p in points])


def _sae_stamp(work: StageInputs, cfg: SAETrainConfig, point: Point) -> Stamp:
    return Stamp("train-saes", {"model": work.lm.digest, "tokens": tokens_digest(work.store.train)},
                 {"format": TABLE_FORMAT, "recipe": cfg.recipe(), "point": list(point)})


def _group_stamp(work: StageInputs, cfg: SAETrainConfig, points: list[Point]) -> Stamp:
    """What one group's checkpoint resumes: these points, each with its own stamp."""
    return Stamp("train-saes", {point_name(p): text_digest(_sae_stamp(work, cfg, p).to_json()) for p in points}, {})


def _checkpoint_name(work: StageInputs, cfg: SAETrainConfig, points: list[Point]) -> str:
    return text_digest(_group_stamp(work, cfg, points).to_json())[:12]


def _train_points(work: StageInputs, unit: tuple[SAETrainConfig, list[Point], int]) -> None:
    """Train one group of SAEs from one stream, resuming its own checkpoint if it has one; the
    stream's model batches run on `workers` threads, one intra-op thread each."""
    # here, not at the top: sae-lens (with TransformerLens) takes seconds to import, and the
    # command line's parser imports this module
    from sae.topk import save_sae_lens
    from sae.train import inference_weights, train_saes

    cfg, todo, workers = unit
    run, device = work.run, work.lm.device
    job = _group_stamp(work, cfg, todo)
    name = _checkpoint_name(work, cfg, todo)
    checkpoint, marker = run.sae_checkpoint(name), run.sae_checkpoint_stamp(name)
    resume = None
    if stamps.is_current(marker, job) and checkpoint.is_file():
        resume = torch.load(checkpoint, weights_only=False, map_location=device)
        print(f"resuming SAE training at step {resume['step']} of {cfg.train_steps}")
    else:
        checkpoint.unlink(missing_ok=True)
        stamps.finish(marker, job)

    def save_checkpoint(state: dict) -> None:
        with atomic_file(checkpoint) as tmp:
            torch.save(state, tmp)

    model = work.lm.model
    with one_thread_workers(workers) as pool:
        trainers = train_saes(model, work.store.train, todo, cfg, device, save_checkpoint, resume,
                              on_step=lambda: work.report(cfg.batch_size * len(todo)), pool=pool)
    eval_rows = work.store.held_out.head(cfg.eval_rows)
    tokens = eval_rows.batch(slice(None))
    keep = eval_rows.keep(tokens)
    clean = clean_losses(model, tokens, cfg.model_batch_rows)
    for point, trainer in tqdm(trainers.items(), desc="evaluate SAEs", unit="SAE"):
        layer, site = point
        weights = inference_weights(trainer.sae)
        metrics = evaluate_sae(model, weights, tokens, layer, site, keep, cfg.model_batch_rows, clean)
        row = {"layer": layer, "site": site, "hook": hook_name(layer, site), "d_in": weights.d_in,
               "d_sae": weights.d_sae, "k": cfg.k, "train_tokens": cfg.used_tokens, **metrics.to_json()}
        with atomic_dir(run.sae(*point)) as tmp:
            save_sae_lens(trainer.sae, tmp, {"hook_name": hook_name(layer, site), "model_name": "bilinear-lm",
                                             "context_size": work.lm.config.n_ctx, "prepend_bos": True})
            write_sae_extras(tmp, cfg.to_json(), row, trainer.log_feature_sparsity)
            stamps.finish(stamp_of(tmp), _sae_stamp(work, cfg, point))
    checkpoint.unlink(missing_ok=True)
    stamps.begin(marker)


def _write_metrics_table(run: RunPaths, layer: int) -> None:
    """The layer's metrics table from every finished SAE of the layer."""
    rows = [read_metrics(run.sae(layer, s)) for s in SITES if stamp_of(run.sae(layer, s)).is_file()]
    if rows:
        schemas.write(pd.DataFrame(rows), run.tables, "sae_metrics", layer=layer)
