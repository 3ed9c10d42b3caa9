"""SAEs on disk: sae-lens's format plus our training config and metrics.

A finished SAE folder holds

    cfg.json, sae_weights.safetensors   sae-lens's inference format (`SAE.load_from_disk`)
    sparsity.safetensors                log10 firing frequency per latent during training
    train_config.json                   our `SAETrainConfig`
    metrics.json                        the evaluation (`SAEMetrics`)

It is written under a temporary name and renamed, so a folder that exists is finished; an
interrupted save leaves nothing under the real name.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file
from sae_lens import SAE, TrainingSAE
from sae_lens.constants import SAE_CFG_FILENAME, SAE_WEIGHTS_FILENAME, SPARSITY_FILENAME
from transformer_lens import HookedTransformer

from sae.config import CONFIG_FILE, SAETrainConfig
from sae.sites import check_hook

METRICS_FILE = "metrics.json"
FINISHED_FILES = (SAE_CFG_FILENAME, SAE_WEIGHTS_FILENAME, CONFIG_FILE, METRICS_FILE)


def save_sae(
    sae: TrainingSAE,
    directory: str | Path,
    cfg: SAETrainConfig,
    metrics: dict,
    log_sparsity: torch.Tensor,
) -> Path:
    """Atomically write a trained SAE, its config and metrics to `directory` (replacing it)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.{uuid.uuid4().hex}.tmp")
    try:
        sae.save_inference_model(tmp)
        save_file({"sparsity": log_sparsity.contiguous()}, tmp / SPARSITY_FILENAME)
        cfg.save(tmp)
        (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def is_finished(directory: str | Path) -> bool:
    """Whether `directory` holds an SAE saved by `save_sae`."""
    return all((Path(directory) / name).is_file() for name in FINISHED_FILES)


def read_metrics(directory: str | Path) -> dict:
    return json.loads((Path(directory) / METRICS_FILE).read_text())


def load_sae(path: str | Path, device: str = "cpu", model: HookedTransformer | None = None) -> SAE:
    """Load an SAE in sae-lens's format (ours or anyone's) for inference.

    With `model`, also check that the SAE fits it (see `check_sae_fits`).
    """
    path = Path(path)
    missing = [name for name in (SAE_CFG_FILENAME, SAE_WEIGHTS_FILENAME) if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"no SAE at {path}: {', '.join(missing)} missing")
    sae = SAE.load_from_disk(path, device=device)
    if model is not None:
        check_sae_fits(model, sae)
    return sae.eval()


def check_sae_fits(model: HookedTransformer, sae: SAE, hook: str | None = None) -> None:
    """Raise ValueError when the SAE's width is not the model's, or its hook is not the model's.

    `hook` is where the SAE will be used; its recorded hook (`cfg.metadata.hook_name`), if
    any, is checked against the model as well.
    """
    if sae.cfg.d_in != model.cfg.d_model:
        raise ValueError(
            f"SAE/model dimension mismatch: the SAE reads d_in={sae.cfg.d_in} but the model's "
            f"activations have d_model={model.cfg.d_model}"
        )
    recorded = sae.cfg.metadata.hook_name
    for name in (hook, recorded):
        if name is not None:
            check_hook(model, name)
