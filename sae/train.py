"""Train one TopK SAE with sae-lens's `TopKTrainingSAE` and `SAETrainer`.

sae-lens runs the loop (`SAETrainer.fit`: TopK forward, MSE plus aux-k loss, dead-latent
tracking, gradient clipping, lr schedule); a small subclass changes only what the paper
does differently:

- AdamW instead of sae-lens's Adam, over every parameter except `b_enc`;
- `b_enc` frozen at zero: sae-lens's TopK SAE always has an encoder bias, so it is zeroed,
  its gradient switched off and it is left out of the optimiser;
- a unit-norm decoder: rows of `W_dec` are renormalised after every step (sae-lens's
  `rescale_acts_by_decoder_norm` is off, so the encoder reads exactly `W_enc`);
- the encoder starts as the decoder's transpose (sae-lens does this; its decoder init norm
  is set to 1 so both start unit-norm);
- the decoder reads only the k active latents (`SparseDecodeTopKTrainingSAE`), which is
  faster and computes the same reconstruction.

The data provider is any iterator of `[batch_size, d_in]` activation batches, which is
the interface `SAETrainer` consumes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from sae_lens import LoggingConfig, TopKTrainingSAE, TopKTrainingSAEConfig
from sae_lens.config import SAETrainerConfig
from sae_lens.saes.sae import TrainStepOutput
from sae_lens.training.optim import get_lr_scheduler
from sae_lens.training.sae_trainer import SAETrainer
from tqdm.auto import tqdm

from sae.config import SAETrainConfig


class SparseDecodeTopKTrainingSAE(TopKTrainingSAE):
    """sae-lens's TopK training SAE with a decoder that touches only the active latents.

    sae-lens multiplies the dense `[batch, d_sae]` activations by `W_dec`, so with k of
    d_sae latents active almost all of that work (forward and both backward products)
    multiplies zeros. `embedding_bag` sums the k selected decoder rows weighted by their
    activations instead: the same reconstruction and gradients, about a third less time per
    step at the paper's size. Saved, it is a plain sae-lens "topk" SAE.
    """

    def decode(self, feature_acts: torch.Tensor) -> torch.Tensor:
        """feature_acts `[..., d_sae]` with at most k nonzeros per row -> `[..., d_in]`."""
        if self.cfg.rescale_acts_by_decoder_norm:
            raise ValueError("the sparse decoder assumes a unit-norm decoder, not decoder-norm rescaling")
        flat = feature_acts.reshape(-1, self.cfg.d_sae)
        values, indices = flat.topk(self.cfg.k, dim=-1, sorted=False)
        sae_out = F.embedding_bag(indices, self.W_dec, per_sample_weights=values, mode="sum") + self.b_dec
        sae_out = sae_out.reshape(*feature_acts.shape[:-1], self.cfg.d_in)
        sae_out = self.run_time_activation_norm_fn_out(self.hook_sae_recons(sae_out))
        return self.reshape_fn_out(sae_out, self.d_head)


class UnitNormTopKTrainer(SAETrainer):
    """`SAETrainer` with AdamW, a frozen zero `b_enc` and a unit-norm decoder."""

    def __init__(self, cfg: SAETrainerConfig, sae: TopKTrainingSAE, data_provider: Iterator[torch.Tensor],
                 weight_decay: float, desc: str = "SAE") -> None:
        super().__init__(cfg=cfg, sae=sae, data_provider=data_provider)
        with torch.no_grad():
            sae.b_enc.zero_()
        sae.b_enc.requires_grad_(False)
        trainable = [p for name, p in sae.named_parameters() if name != "b_enc"]
        # Replaces the Adam and schedule the parent built over all parameters.
        self.optimizer = torch.optim.AdamW(
            trainable, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=weight_decay
        )
        self.lr_scheduler = get_lr_scheduler(
            cfg.lr_scheduler_name,
            optimizer=self.optimizer,
            training_steps=cfg.total_training_steps,
            lr=cfg.lr,
            warm_up_steps=cfg.lr_warm_up_steps,
            decay_steps=cfg.lr_decay_steps,
            lr_end=cfg.lr_end,
            num_cycles=cfg.n_restart_cycles,
        )
        self.desc = desc

    def step(self, batch: torch.Tensor) -> TrainStepOutput:
        output = super().step(batch)
        normalize_decoder(self.sae)
        return output

    @torch.no_grad()
    def _update_pbar(self, step_output: TrainStepOutput, pbar: tqdm, update_interval: int = 50) -> None:
        # sae-lens moves its bar once per 100 steps; short runs would show nothing.
        pbar.set_description(self.desc, refresh=False)
        pbar.update(self.cfg.train_batch_size_samples)
        if self.n_training_steps % update_interval == 0:
            pbar.set_postfix(mse=f"{step_output.losses['mse_loss'].item():.4g}")


@torch.no_grad()
def normalize_decoder(sae: TopKTrainingSAE) -> None:
    """Scale every decoder row `W_dec[i]` `[d_in]` to unit norm, in place."""
    sae.W_dec.div_(sae.W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-12))


def build_sae(d_in: int, cfg: SAETrainConfig, metadata: dict | None = None) -> SparseDecodeTopKTrainingSAE:
    """A freshly initialised TopK training SAE with our settings (`cfg` must be resolved)."""
    cfg.validate(d_in)
    torch.manual_seed(cfg.seed)
    sae = SparseDecodeTopKTrainingSAE(
        TopKTrainingSAEConfig(
            d_in=d_in,
            d_sae=cfg.expansion * d_in,
            k=cfg.k,
            dtype="float32",
            device=cfg.device,
            apply_b_dec_to_input=True,
            normalize_activations="none",
            decoder_init_norm=1.0,
            rescale_acts_by_decoder_norm=False,
            aux_loss_coefficient=cfg.aux_k_coefficient,
        )
    )
    for key, value in (metadata or {}).items():
        sae.cfg.metadata[key] = value
    return sae


def train_sae(
    batches: Iterator[torch.Tensor],
    d_in: int,
    cfg: SAETrainConfig,
    desc: str = "SAE",
    metadata: dict | None = None,
) -> tuple[SparseDecodeTopKTrainingSAE, torch.Tensor]:
    """Train a TopK SAE on `cfg.train_steps` batches `[batch_size, d_in]` from `batches`.

    `cfg` must be resolved (`SAETrainConfig.resolve`). `b_dec` starts at the mean of the
    first batch, so the latents need not spend capacity on the activations' offset. Returns
    the trained SAE and its log10 firing frequencies `[d_sae]` over the last sparsity window.
    """
    if cfg.k is None or cfg.lr is None:
        raise ValueError("resolve the config first: SAETrainConfig.resolve(d_in)")
    sae = build_sae(d_in, cfg, metadata)
    first = next(batches)
    if first.shape[-1] != d_in:
        raise ValueError(f"activations have width {first.shape[-1]} but the SAE expects d_in={d_in}")
    with torch.no_grad():
        sae.b_dec.copy_(first.mean(0))
    dead_window = max(1, cfg.dead_after_tokens // cfg.batch_size)
    trainer_cfg = SAETrainerConfig(
        total_training_samples=cfg.used_tokens,
        train_batch_size_samples=cfg.batch_size,
        lr=cfg.lr,
        lr_end=cfg.lr * cfg.lr_end_fraction,
        lr_scheduler_name="cosineannealing",
        device=cfg.device,
        dead_feature_window=dead_window,
        feature_sampling_window=cfg.train_steps,  # one window: firing stats cover the whole run
        logger=LoggingConfig(log_to_wandb=False),
    )
    trainer = UnitNormTopKTrainer(
        trainer_cfg, sae, itertools.chain([first], batches), cfg.weight_decay, desc=desc
    )
    sae = trainer.fit()
    return sae, trainer.log_feature_sparsity
