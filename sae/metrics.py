"""How good an SAE is: reconstruction (NMSE), sparsity (L0, dead latents), and loss added
when its reconstruction replaces the activation inside the model."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from circuits.weights import SAEWeights
from sae.activations import check_tokens
from circuits.sites import MLP_IN, SITES, hook_name

if TYPE_CHECKING:  # annotations only: importing TransformerLens takes seconds
    from transformer_lens import HookedTransformer


@dataclass(frozen=True)
class SAEMetrics:
    """Evaluation of one SAE on held-out tokens."""

    nmse: float  # sum ||x - x_hat||^2 / sum ||x - mean(x)||^2 over eval tokens (1 - explained variance)
    l0: float  # mean number of active latents per token
    dead_fraction: float  # share of latents that never fired on the eval tokens
    loss_clean: float  # next-token cross-entropy of the model as is (nats)
    loss_patched: float  # the same with the SAE's reconstruction spliced in at its hook
    loss_added: float  # (loss_patched - loss_clean) / loss_clean
    eval_tokens: int  # kept positions the reconstruction metrics average over

    def to_json(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate_sae(
    model: HookedTransformer,
    sae: SAEWeights,
    tokens: torch.Tensor,
    layer: int,
    site: str,
    keep: torch.Tensor | None = None,
    batch_seqs: int = 32,
    clean: torch.Tensor | None = None,
) -> SAEMetrics:
    """Metrics of `sae` at (`layer`, `site`) on `tokens` `[n_seq, n_ctx]`.

    Only kept positions (`keep` `[n_seq, n_ctx]`, default all) are reconstructed and spliced;
    the others keep their real activation (BOS, for one, is never spliced: the SAE did not
    train on it). NMSE is normalised by the total variance of the activations around their
    mean over the kept eval tokens, `sum_t ||x_t - mean||^2`, not by their raw squared norm,
    so a constant offset earns no credit. The losses average over positions `t` that are kept
    and whose target `t + 1` is kept, the predictions the splice can change. `clean`: the
    model's own losses on `tokens` (`clean_losses`, with the same `batch_seqs`), when several
    SAEs are evaluated on the same tokens; computed here otherwise.
    """
    if site not in SITES:
        raise ValueError(f"unknown SAE site {site!r}; SAEs are evaluated at {', '.join(SITES)}")
    if sae.d_in != model.cfg.d_model:
        raise ValueError(f"SAE/model dimension mismatch: the SAE reads d_in={sae.d_in} but the model has "
                         f"d_model={model.cfg.d_model}")
    hook = hook_name(layer, site)
    # TransformerLens fires ln2.hook_normalized before the gain: the SAE reads (and the splice
    # writes) what the MLP multiplies, so the gain is applied and divided out around it
    gain = getattr(model.blocks[layer].ln2, "w", None) if site == MLP_IN else None
    check_tokens(tokens, model)
    clean = clean_losses(model, tokens, batch_seqs) if clean is None else clean
    if clean.shape != (tokens.shape[0], tokens.shape[1] - 1):
        raise ValueError(f"clean losses of shape {tuple(clean.shape)} for tokens {tuple(tokens.shape)}: "
                         "give clean_losses of the same tokens")
    keep = torch.ones_like(tokens, dtype=torch.bool) if keep is None else keep.bool()
    stats = _ReconstructionStats(sae.d_in, sae.d_sae)
    loss_sums = torch.zeros(2, dtype=torch.float64)  # clean, patched
    n_loss = 0
    device = model.cfg.device
    for start in range(0, tokens.shape[0], batch_seqs):
        batch = tokens[start : start + batch_seqs].to(device)
        rows = keep[start : start + batch_seqs].to(device)
        if not rows.any():
            continue

        def splice(act: torch.Tensor, hook) -> torch.Tensor:  # act: [batch, pos, d_in]
            x = act[rows] if gain is None else act[rows] * gain
            feats = sae.encode(x.to(sae.W_enc.dtype))
            x_hat = sae.decode(feats)
            stats.add(x, x_hat, feats)
            act = act.clone()
            act[rows] = (x_hat if gain is None else x_hat / gain).to(act.device, act.dtype)
            return act

        scored = rows[:, :-1] & rows[:, 1:]  # [batch, pos - 1]
        patched = model.run_with_hooks(batch, fwd_hooks=[(hook, splice)])
        loss_sums[0] += clean[start : start + batch_seqs].to(device)[scored].double().sum().cpu()
        loss_sums[1] += token_losses(patched, batch)[scored].double().sum().cpu()
        n_loss += int(scored.sum())
    if stats.n == 0 or n_loss == 0:
        raise ValueError("no evaluation tokens: every position was masked out")
    loss_clean, loss_patched = (loss_sums / n_loss).tolist()
    return SAEMetrics(
        nmse=stats.nmse(),
        l0=stats.l0(),
        dead_fraction=stats.dead_fraction(),
        loss_clean=loss_clean,
        loss_patched=loss_patched,
        loss_added=(loss_patched - loss_clean) / loss_clean,
        eval_tokens=stats.n,
    )


@torch.no_grad()
def clean_losses(model: HookedTransformer, tokens: torch.Tensor, batch_seqs: int = 32) -> torch.Tensor:
    """The model's next-token losses `[n_seq, n_ctx - 1]` on `tokens`, `batch_seqs` rows a pass
    (on the CPU): what `evaluate_sae` compares each SAE's splice with, computed once for all
    the SAEs of a stage rather than once per SAE."""
    device = model.cfg.device
    return torch.cat([token_losses(model(batch), batch).cpu()
                      for batch in (tokens[s : s + batch_seqs].to(device) for s in range(0, len(tokens), batch_seqs))])


def token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy `[batch, pos - 1]` of logits `[batch, pos, vocab]`."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")


class _ReconstructionStats:
    """Running sums for NMSE, L0 and dead latents over batches of tokens (float64)."""

    def __init__(self, d_in: int, d_sae: int) -> None:
        self.n = 0
        self.sse = 0.0
        self.sum_x = torch.zeros(d_in, dtype=torch.float64)
        self.sum_sq = 0.0
        self.active = 0
        self.fired = torch.zeros(d_sae, dtype=torch.bool)

    def add(self, x: torch.Tensor, x_hat: torch.Tensor, feats: torch.Tensor) -> None:
        """x, x_hat: `[n, d_in]`; feats: `[n, d_sae]`."""
        x, x_hat = x.double().cpu(), x_hat.double().cpu()
        self.n += x.shape[0]
        self.sse += float((x - x_hat).pow(2).sum())
        self.sum_x += x.sum(0)
        self.sum_sq += float(x.pow(2).sum())
        on = (feats != 0).cpu()
        self.active += int(on.sum())
        self.fired |= on.any(0)

    def nmse(self) -> float:
        # sum ||x - mean||^2 = sum ||x||^2 - n ||mean||^2
        variance = self.sum_sq - float(self.sum_x.pow(2).sum()) / self.n
        return self.sse / variance

    def l0(self) -> float:
        return self.active / self.n

    def dead_fraction(self) -> float:
        return 1.0 - float(self.fired.float().mean())
