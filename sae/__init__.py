"""Activations and TopK SAEs: caching, training with sae-lens, evaluation, loading.

- `sae.sites`: (layer, site) points and their hooks (`resid_mid`, `mlp_out`, `mlp_in`);
- `sae.activations`: one hooked model pass collects every point, BOS/padding skipped;
- `sae.cache`: those activations as shuffled disk shards, read back batch by batch;
- `sae.config`: `SAETrainConfig`, the training recipe (paper defaults, scaled down);
- `sae.train`: `train_sae`, driving sae-lens's `TopKTrainingSAE` and `SAETrainer`;
- `sae.metrics`: NMSE, L0, dead fraction, loss added by splicing the SAE in;
- `sae.io`: saving in sae-lens's format, `load_sae`, compatibility checks.

This package never imports `pipelines`.
"""

from sae.config import SAETrainConfig
from sae.io import check_sae_fits, load_sae
from sae.metrics import SAEMetrics, evaluate_sae
from sae.train import train_sae

__all__ = ["SAETrainConfig", "SAEMetrics", "check_sae_fits", "evaluate_sae", "load_sae", "train_sae"]
