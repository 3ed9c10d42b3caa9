"""Stage: train a TopK SAE on every chosen (layer, site) of the LM and tabulate their metrics.

Activations of all unfinished points are cached in one model pass under
`run_dir/activations` (disk shards, bounded memory; `points_per_pass` splits the points
into several passes to bound disk use), then each SAE trains on its point's shards, is
evaluated on held-out rows and saved to `run_dir/saes/layer{l}_{site}/`. A finished SAE
folder is never touched again, so an interrupted stage resumes where it stopped. Metrics
go to the table `run_dir/tables/sae_metrics` (partitioned by layer).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import torch
from transformer_lens import HookedTransformer

from circuits.tables import write_table
from pipelines.paths import RunPaths
from sae.activations import check_tokens, keep_mask
from sae.cache import ActivationCache, fingerprint, write_cache
from sae.config import SAETrainConfig
from sae.io import is_finished, read_metrics, save_sae
from sae.metrics import evaluate_sae
from sae.sites import SAE_SITES, Point, check_points, hook_name, point_name
from sae.train import train_sae

METRICS_TABLE = "sae_metrics"
ACTIVATIONS_DIR = "activations"


def train_saes(
    model: HookedTransformer,
    tokens: torch.Tensor,
    run_dir: str | Path,
    layers: list[int] | None = None,
    sites: tuple[str, ...] | list[str] = SAE_SITES,
    cfg: SAETrainConfig = SAETrainConfig(),
    bos_id: int | None = None,
    pad_id: int | None = None,
    mask: torch.Tensor | None = None,
) -> pd.DataFrame:
    """Train (or keep) an SAE for every layer x site; returns their metrics, one row each.

    tokens: `[n_seq, n_ctx]`; the last `cfg.eval_seqs` rows are held out for evaluation.
    BOS (`bos_id`), padding (`pad_id`) and positions outside `mask` are neither trained on
    nor spliced. Raises ValueError for unknown sites or layers, a config that cannot train
    (e.g. k above the dictionary size), a corpus with fewer usable tokens than
    `cfg.train_tokens`, or a finished SAE trained with another recipe.
    """
    run = RunPaths(Path(run_dir))
    layers = list(range(model.cfg.n_layers)) if layers is None else list(layers)
    points = [(layer, site) for layer in layers for site in sites]
    check_points(model, points, SAE_SITES)
    check_tokens(tokens, model)
    d_in = model.cfg.d_model
    cfg = cfg.resolve(d_in)
    keep = keep_mask(tokens, bos_id, pad_id, mask)
    (train_tokens, train_keep), eval_rows = _split(tokens, keep, cfg)

    todo = [point for point in points if not _finished(run.sae(*point), cfg)]
    per_pass = cfg.points_per_pass or len(points)
    for start in range(0, len(todo), per_pass):
        group = todo[start : start + per_pass]
        cache = _ensure_cache(model, train_tokens, train_keep, group, run.root / ACTIVATIONS_DIR, cfg)
        for point in group:
            _train_one(model, cache, point, eval_rows, run, cfg, bos_id is not None)
            if not cfg.keep_activations:
                cache.drop(point)
            _write_layer_table(run, point[0])
        if not cfg.keep_activations and not ActivationCache.open(cache.directory).points:
            shutil.rmtree(cache.directory)
    return pd.DataFrame([read_metrics(run.sae(*point)) for point in points])


def _split(tokens: torch.Tensor, keep: torch.Tensor, cfg: SAETrainConfig):
    """((train tokens, train keep), (eval tokens, eval keep)), after checking there is enough."""
    n_seq = tokens.shape[0]
    if n_seq <= cfg.eval_seqs:
        raise ValueError(
            f"corpus too small: {n_seq} rows, but {cfg.eval_seqs} are held out for evaluation "
            "(eval_seqs) and training needs the rest"
        )
    cut = n_seq - cfg.eval_seqs
    usable = int(keep[:cut].sum())
    if usable < cfg.used_tokens:
        raise ValueError(
            f"corpus too small: {usable} usable training tokens (after BOS/padding and the "
            f"{cfg.eval_seqs} held-out rows) but {cfg.used_tokens} are requested "
            f"(train_tokens={cfg.train_tokens}); give more text or lower train_tokens"
        )
    if not keep[cut:].any():
        raise ValueError("the held-out evaluation rows have no usable tokens")
    return (tokens[:cut], keep[:cut]), (tokens[cut:], keep[cut:])


def _finished(folder: Path, cfg: SAETrainConfig) -> bool:
    """Whether `folder` holds a finished SAE; raises ValueError if it was trained differently."""
    if not is_finished(folder):
        return False
    saved = SAETrainConfig.load(folder)
    if not saved.same_recipe(cfg):
        changed = sorted(k for k, v in cfg.to_json().items() if saved.to_json()[k] != v)
        raise ValueError(
            f"{folder} holds an SAE trained with other settings ({', '.join(changed)}); "
            "delete it or choose another run directory"
        )
    return True


def _ensure_cache(
    model: HookedTransformer,
    tokens: torch.Tensor,
    keep: torch.Tensor,
    points: list[Point],
    directory: Path,
    cfg: SAETrainConfig,
) -> ActivationCache:
    """The activation cache for `points`, reused if an earlier run left a matching one."""
    stamp = fingerprint(
        model, tokens, keep, n_tokens=cfg.used_tokens, shard_tokens=cfg.shard_tokens,
        dtype=cfg.cache_dtype, seed=cfg.seed,
    )
    cache = ActivationCache.open(directory)
    if cache is not None and cache.fingerprint == stamp and set(points) <= set(cache.points):
        return cache
    return write_cache(
        model, tokens, keep, points, directory, n_tokens=cfg.used_tokens,
        shard_tokens=cfg.shard_tokens, batch_seqs=cfg.model_batch_seqs,
        dtype=cfg.cache_dtype, seed=cfg.seed, fingerprint=stamp,
    )


def _train_one(
    model: HookedTransformer,
    cache: ActivationCache,
    point: Point,
    eval_rows: tuple[torch.Tensor, torch.Tensor],
    run: RunPaths,
    cfg: SAETrainConfig,
    prepend_bos: bool,
) -> None:
    """Train, evaluate and save the SAE of one point."""
    layer, site = point
    d_in = model.cfg.d_model
    metadata = {
        "model_name": model.cfg.model_name,
        "hook_name": hook_name(layer, site),
        "context_size": model.cfg.n_ctx,
        "prepend_bos": prepend_bos,
        "layer": layer,
        "site": site,
    }
    batches = cache.batches(point, cfg.batch_size, cfg.buffer_tokens, seed=cfg.seed)
    sae, log_sparsity = train_sae(batches, d_in, cfg, desc=point_name(point), metadata=metadata)
    sae.eval()
    eval_tokens, eval_keep = eval_rows
    metrics = evaluate_sae(model, sae, eval_tokens, layer, site, eval_keep, cfg.model_batch_seqs)
    row = {
        "layer": layer,
        "site": site,
        "hook": hook_name(layer, site),
        "d_in": d_in,
        "d_sae": sae.cfg.d_sae,
        "k": cfg.k,
        "train_tokens": cfg.used_tokens,
        **metrics.to_json(),
    }
    save_sae(sae, run.sae(layer, site), cfg, row, log_sparsity)


def _write_layer_table(run: RunPaths, layer: int) -> None:
    """Rewrite the layer's partition of the metrics table from every finished SAE of the layer."""
    rows = [
        read_metrics(run.sae(layer, site)) for site in SAE_SITES if is_finished(run.sae(layer, site))
    ]
    write_table(pd.DataFrame(rows), run.tables, METRICS_TABLE, layer=layer)
