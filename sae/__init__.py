"""Activations and TopK SAEs: streaming, training, evaluation, loading.

- `sae.activations`: one hooked model pass collects every point, BOS left out;
- `sae.stream`: those activations in bounded shuffle buffers, batch by batch, resumable;
- `sae.topk`: a TopK SAE whose training step touches only the active latents;
- `sae.train`: every point's SAE trained from one stream, with checkpoints;
- `sae.config`: `SAETrainConfig`, the training recipe (paper defaults, scaled down);
- `sae.metrics`: NMSE, L0, dead fraction, loss added by splicing the SAE in;
- `sae.io`: sae-lens's format (ours) and the paper authors' format, and fit checks.

Sites, their points and hooks are `circuits.sites`. This package never imports `pipelines`.
"""
