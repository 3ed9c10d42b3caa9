"""Activations and TopK SAEs: streaming, training, evaluation, loading.

- `sae.activations`: one hooked model pass collects every point, BOS left out;
- `sae.stream`: those activations in bounded shuffle buffers, batch by batch, resumable;
- `sae.topk`: a TopK SAE whose training step touches only the active latents;
- `sae.train`: one loop with checkpoints, fed by any iterable of activation tensors (`train_sae`)
  or by one model stream for every point's SAE (`train_saes`);
- `sae.config`: `SAETrainConfig`, the training recipe (paper defaults, scaled down by a rule
  chosen on ground truth);
- `sae.metrics`: NMSE, L0, dead fraction, loss added by splicing the SAE in;
- `sae.io`: sae-lens's format (ours) and the paper authors' format, and fit checks.

Sites, their points and hooks are `circuits.sites`. This package never imports `pipelines`.
"""
