"""sae-lens's own TopK trainer, one batch at a time, for the benchmarks that set ours beside it
(bench_sae_step, bench_synthetic): `SAETrainer.fit` reads batches from an activation store,
so the benchmarks step the trainer themselves on batches they already hold."""

from __future__ import annotations

from collections.abc import Callable

import torch


def sae_lens_topk(d_in: int, d_sae: int, k: int, steps: int, batch: int, lr: float, lr_end: float, schedule: str,
                  device: str = "cpu", seed: int = 0) -> tuple[torch.nn.Module, object, Callable[[torch.Tensor], None]]:
    """A fresh `TopKTrainingSAE` (drawn after seeding torch with `seed`) and its `SAETrainer`,
    everything at sae-lens's defaults but the size, `steps` batches of `batch` rows, and the
    rate going from `lr` to `lr_end` by sae-lens's scheduler `schedule` ("constant",
    "cosineannealing", ...). Returns `(sae, trainer, step)`: `step(x)` is one optimiser step
    on `x` `[batch, d_in]`, counted as `fit` counts it."""
    from sae_lens import LoggingConfig, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(seed)
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=d_in, d_sae=d_sae, k=k, device=device))
    cfg = SAETrainerConfig(total_training_samples=steps * batch, train_batch_size_samples=batch, lr=lr, lr_end=lr_end,
                           lr_scheduler_name=schedule, device=device, logger=LoggingConfig(log_to_wandb=False))
    trainer = SAETrainer(cfg=cfg, sae=sae, data_provider=iter(()))

    def step(x: torch.Tensor) -> None:
        trainer.step(x)
        trainer.n_training_steps += 1  # `fit` counts steps outside `step`

    return sae, trainer, step
