"""A TopK SAE and its training step, with a backward pass that touches only the active latents.

sae-lens's `TopKTrainingSAE` scatters the k active latents of every token into a dense
`[batch, d_sae]` tensor, so decoding and every gradient product are dense matrix products
in which all but k of d_sae entries are zeros. Here only the encoder's forward product
`(x - b_dec) @ W_enc` is dense (every pre-activation is needed to choose the top k); the rest
reads or writes only the selected latents (the idea of EleutherAI's sparsify):

- decoding sums the k selected decoder rows (`F.embedding_bag`);
- the gradient of an activation is the dot product of the output gradient with its decoder
  row, computed only at the selected entries (`torch.sparse.sampled_addmm`);
- the gradients of `W_dec` and of `W_enc` add `weight * row` into the selected latents'
  rows: on a CPU one compiled loop, elsewhere a sparse `[d_sae, batch]` matrix times a dense
  `[batch, d_in]` one;
- `b_dec`'s gradient through the encoder is `-W_enc @ (summed gradient per latent)`.

At the paper's size (d_in 512, d_sae 2048, k 30, 4096 tokens) that is one dense product
per step instead of six; on a CPU that product and the top-k selection take about two
thirds of a step. Latent indices are kept ascending within each row, the order a CSR
pattern needs. The sparse kernels exist on CPUs and CUDA GPUs.

The math matches sae-lens 6.54.12's `TopKTrainingSAE` with `rescale_acts_by_decoder_norm`
off and `apply_b_dec_to_input` on, trained by `SAETrainer`:

- pre-activations `(x - b_dec) @ W_enc + b_enc`; the top k are kept and ReLU'd (a selected
  latent below zero is 0 and does not count as firing). `b_dec` therefore gets a gradient
  both from the reconstruction and through the encoder's input.
- reconstruction loss: squared error summed over d_in, averaged over tokens (sae-lens's
  `mse_loss`; sparsify instead divides by the batch's total variance, an FVU).
- aux-k loss (OpenAI's TopK paper, as sae-lens computes it): a latent is dead when it has
  not fired for more than `dead_steps` steps; the top `k_aux` (default d_in // 2)
  pre-activations among the dead latents, raw (no ReLU), decode without `b_dec` into an
  estimate of the detached residual `x - x_hat`; the loss is the squared error (summed
  over d_in, averaged over tokens) times `aux_k_coefficient * min(n_dead / k_aux, 1)`. Like
  sae-lens and unlike OpenAI and sparsify, it is not divided by the variance.
- the gradient's total norm is clipped to 1.0 (sae-lens hard-codes that value);
  the decoder's rows are rescaled to unit norm after every step (the gradient is not
  projected first, as in our sae-lens recipe; sparsify projects it).

What differs from sae-lens's own trainer is the paper's recipe: AdamW instead of Adam, and
`b_enc` a buffer frozen at zero (sae-lens trains it). The cosine schedule is evaluated in
closed form, where torch's `CosineAnnealingLR` (sae-lens) updates recursively; the two agree
up to rounding.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from sae_lens import TopKSAE as SaeLensTopKSAE
from sae_lens import TopKSAEConfig
from sae_lens.saes.sae import SAEMetadata
from torch import Tensor, nn

from circuits.weights import top_k_indices

# Fused AdamW is one kernel instead of a dozen passes over the weights; elsewhere torch picks
# its default implementation.
FUSED_ADAM_DEVICES = ("cpu", "cuda")


def _scatter_rows(indices: Tensor, weights: Tensor, rows: Tensor, n_out: int) -> Tensor:
    """`out[i] = sum of weights[b, j] * rows[b] over the (b, j) with indices[b, j] == i`.

    indices, weights `[batch, m]` (indices distinct within each row), rows `[batch, d]` ->
    `[n_out, d]`. On a CPU one compiled loop adds each weighted row in place
    (`circuits.cpu_kernels.scatter_rows`, in float32 for dtypes other than float64): several
    times faster there than torch's sparse product, which sorts the nonzeros first. Elsewhere it
    is a sparse CSR `[n_out, batch]` matrix times `rows`, which sums each output row's terms in
    one place instead of materialising the `[batch * m, d]` products an `index_add_` would need.
    """
    if rows.device.type == "cpu":
        from circuits.cpu_kernels import scatter_rows

        dtype = rows.dtype if rows.dtype == torch.float64 else torch.float32
        out = torch.zeros(n_out, rows.shape[1], dtype=dtype)
        scatter_rows(indices.contiguous().numpy(), weights.detach().to(dtype).contiguous().numpy(),
                     rows.detach().to(dtype).contiguous().numpy(), out.numpy())
        return out.to(rows.dtype)
    return torch.sparse.mm(_latent_by_token(indices, weights, n_out), rows)


def _latent_by_token(indices: Tensor, weights: Tensor, n_out: int) -> Tensor:
    """The sparse CSR `[n_out, batch]` matrix with `weights[b, j]` at `(indices[b, j], b)`;
    indices, weights `[batch, m]`, indices distinct within each row."""
    batch, m = indices.shape
    flat = indices.reshape(-1)
    # A stable sort by latent keeps each latent's tokens ascending, as CSR wants them.
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_out + 1, dtype=flat.dtype, device=flat.device).index_add_(0, flat + 1, torch.ones_like(flat))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(
            counts.cumsum(0), order.div(m, rounding_mode="floor"), weights.reshape(-1)[order], (n_out, batch),
            check_invariants=False,
        )


def _sampled_dots(indices: Tensor, rows: Tensor, table: Tensor) -> Tensor:
    """`out[b, j] = rows[b] . table[indices[b, j]]`.

    indices `[batch, m]` ascending and distinct within each row (a valid CSR pattern on
    every backend), rows `[batch, d]`, table `[n, d]` -> `[batch, m]`. `sampled_addmm`
    computes only the requested entries of `rows @ table.T`, without gathering the
    `[batch, m, d]` rows of `table`.
    """
    batch, m = indices.shape
    crow = torch.arange(0, batch * m + 1, m, device=indices.device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        pattern = torch.sparse_csr_tensor(
            crow, indices.reshape(-1), rows.new_zeros(batch * m), (batch, table.shape[0]), check_invariants=False
        )
    return torch.sparse.sampled_addmm(pattern, rows, table.T, beta=0.0).values().view(batch, m)


class _PreActsAt(torch.autograd.Function):
    """The pre-activations at chosen latents, with a backward that touches only those."""

    @staticmethod
    def forward(ctx, pre: Tensor, indices: Tensor, x: Tensor, W_enc: Tensor, b_dec: Tensor) -> Tensor:
        """pre `[batch, d_sae]` = `(x - b_dec) @ W_enc + b_enc`, computed without autograd;
        indices `[batch, m]`; x `[batch, d_in]` -> `pre` at `indices`, `[batch, m]`."""
        ctx.save_for_backward(indices, x, W_enc, b_dec)
        return pre.gather(1, indices)

    @staticmethod
    def backward(ctx, grad: Tensor):
        indices, x, W_enc, b_dec = ctx.saved_tensors
        grad = grad.contiguous()
        grad_W_enc = grad_b_dec = None
        if ctx.needs_input_grad[3]:
            grad_W_enc = _scatter_rows(indices, grad, x - b_dec, W_enc.shape[1]).T.contiguous()
        if ctx.needs_input_grad[4]:
            per_latent = grad.new_zeros(W_enc.shape[1]).index_add_(0, indices.reshape(-1), grad.reshape(-1))
            grad_b_dec = -(W_enc @ per_latent)
        return None, None, None, grad_W_enc, grad_b_dec


class _DecodeRows(torch.autograd.Function):
    """Weighted sums of chosen decoder rows, with a backward that touches only those."""

    @staticmethod
    def forward(ctx, values: Tensor, indices: Tensor, W_dec: Tensor) -> Tensor:
        """values, indices `[batch, m]` (indices ascending within a row), W_dec `[d_sae, d_in]`
        -> `sum_j values[b, j] * W_dec[indices[b, j]]`, `[batch, d_in]`."""
        ctx.save_for_backward(values, indices, W_dec)
        return F.embedding_bag(indices, W_dec, per_sample_weights=values, mode="sum")

    @staticmethod
    def backward(ctx, grad: Tensor):
        values, indices, W_dec = ctx.saved_tensors
        grad = grad.contiguous()
        grad_values = grad_W_dec = None
        if ctx.needs_input_grad[0]:
            grad_values = _sampled_dots(indices, grad, W_dec)
        if ctx.needs_input_grad[2]:
            grad_W_dec = _scatter_rows(indices, values, grad, W_dec.shape[0])
        return grad_values, None, grad_W_dec


def decode_rows(values: Tensor, indices: Tensor, W_dec: Tensor) -> Tensor:
    """`sum_j values[b, j] * W_dec[indices[b, j]]`: values, indices `[batch, m]` (indices
    ascending and distinct within each row), W_dec `[d_sae, d_in]` -> `[batch, d_in]`."""
    return _DecodeRows.apply(values, indices, W_dec)


class TopKAutoencoder(nn.Module):
    """A TopK sparse autoencoder in sae-lens's layout, without an encoder bias.

    Parameters `W_enc [d_in, d_sae]`, `W_dec [d_sae, d_in]` (unit-norm rows), `b_dec [d_in]`;
    `b_enc [d_sae]` is a buffer of zeros (the paper has no encoder bias; sae-lens's format
    has one). Starts with seeded random unit-norm decoder rows and the encoder as their
    transpose; `TopKTrainer` sets `b_dec` to the mean of its first batch. Inputs must be
    in the SAE's dtype and on its device.
    """

    def __init__(self, d_in: int, d_sae: int, k: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> None:
        super().__init__()
        if not 1 <= k <= d_sae:
            raise ValueError(f"k={k} must lie between 1 and d_sae={d_sae}")
        self.d_in, self.d_sae, self.k = d_in, d_sae, k
        # Drawn on the CPU so a seed gives the same SAE on every device.
        decoder = torch.randn(d_sae, d_in, generator=torch.Generator().manual_seed(seed))
        decoder = (decoder / decoder.norm(dim=1, keepdim=True)).to(device=device, dtype=dtype)
        self.W_dec = nn.Parameter(decoder)
        self.W_enc = nn.Parameter(decoder.T.contiguous())
        self.b_dec = nn.Parameter(torch.zeros(d_in, device=device, dtype=dtype))
        self.register_buffer("b_enc", torch.zeros(d_sae, device=device, dtype=dtype))

    @torch.no_grad()
    def pre_acts(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """`(x - b_dec) @ W_enc + b_enc`: x `[batch, d_in]` -> `[batch, d_sae]`, outside autograd
        (`select` attaches the gradient of the entries that are used), into `out` if given."""
        return torch.addmm(self.b_enc, x - self.b_dec, self.W_enc, out=out)

    def select(self, x: Tensor, pre: Tensor, indices: Tensor) -> Tensor:
        """`pre` `[batch, d_sae]` (from `pre_acts(x)`) at `indices` `[batch, m]` -> `[batch, m]`,
        differentiable in `W_enc` and `b_dec` with a backward over the selected latents only."""
        return _PreActsAt.apply(pre, indices, x, self.W_enc, self.b_dec)

    def top_indices(self, pre: Tensor) -> Tensor:
        """The k largest pre-activations' latents `[batch, k]`, ascending within each row."""
        return top_k_indices(pre, self.k).sort(dim=1).values

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x `[batch, d_in]` -> (values `[batch, k]` ReLU'd, indices `[batch, k]` ascending)."""
        pre = self.pre_acts(x)
        indices = self.top_indices(pre)
        return self.select(x, pre, indices).relu(), indices

    def decode(self, values: Tensor, indices: Tensor) -> Tensor:
        """values, indices `[batch, k]` (as `encode` returns them) -> reconstruction `[batch, d_in]`."""
        return decode_rows(values, indices, self.W_dec) + self.b_dec

    def dense(self, values: Tensor, indices: Tensor) -> Tensor:
        """values, indices `[batch, k]` -> activations `[batch, d_sae]`, zero where not selected."""
        return values.new_zeros(values.shape[0], self.d_sae).scatter(1, indices, values)

    def forward(self, x: Tensor) -> Tensor:
        """x `[batch, d_in]` -> reconstruction `[batch, d_in]`."""
        return self.decode(*self.encode(x))

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Rescale every row of `W_dec` to unit norm, in place."""
        self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12))


def reconstruction_loss(target: Tensor, estimate: Tensor) -> Tensor:
    """Squared error summed over d_in, averaged over tokens: `[batch, d_in]` twice -> scalar."""
    # One fused kernel each way; squaring by hand or `pow(2)` takes two to three times longer.
    return F.mse_loss(estimate, target, reduction="sum") / target.shape[0]


class Losses(NamedTuple):
    mse: Tensor  # scalar, reconstruction loss
    aux: Tensor  # scalar, aux-k loss including its coefficient (zero without dead latents)
    values: Tensor  # [batch, k] ReLU'd activations
    indices: Tensor  # [batch, k] their latents, ascending within each row


def _dead_latents(
    pre: Tensor, dead: Tensor, k_aux: int, sync_free: bool
) -> tuple[Tensor, Tensor | None, Tensor | float] | None:
    """The dead latents the aux-k loss reads, for pre `[batch, d_sae]` and dead `[d_sae]` bool.

    Returns (indices `[batch, m]` ascending, live `[batch, m]` bool or None when every slot
    is a dead latent, scale `min(n_dead / k_aux, 1)`), or None when nothing is dead. With
    `sync_free`, the count of dead latents never goes to the host: `min(k_aux, d_sae)` slots
    are always taken from the pre-activations with live latents masked to -inf, and `live`
    zeroes the slots that fell on live latents. Otherwise (free on a CPU, where nothing
    needs syncing) only the dead latents' pre-activations are ranked, and only when more
    than `k_aux` are dead.
    """
    if sync_free:
        slots = top_k_indices(pre.masked_fill(~dead, -math.inf), min(k_aux, pre.shape[1]))
        slots = slots.sort(dim=1).values
        return slots, dead[slots], (dead.sum() / k_aux).clamp(max=1.0)
    dead_ids = dead.nonzero().squeeze(1)
    n_dead = dead_ids.numel()
    if n_dead == 0:
        return None
    if n_dead <= k_aux:
        return dead_ids.expand(pre.shape[0], n_dead).contiguous(), None, n_dead / k_aux
    best = top_k_indices(pre.index_select(1, dead_ids), k_aux)
    return dead_ids[best].sort(dim=1).values, None, 1.0


def training_losses(
    sae: TopKAutoencoder, x: Tensor, dead: Tensor | None = None, k_aux: int | None = None, aux_k_coefficient: float = 1 / 32,
    sync_free: bool = False, pre_out: Tensor | None = None,
) -> Losses:
    """The TopK reconstruction loss and the aux-k loss of `sae` on x `[batch, d_in]`.

    `dead` `[d_sae]` bool marks the dead latents (None: no aux-k loss); `k_aux` defaults to
    d_in // 2; `sync_free` as in `_dead_latents` (same loss, different work). `pre_out`
    `[batch, d_sae]`, if given, receives the pre-activations (the losses do not keep them).
    """
    k_aux = k_aux if k_aux is not None else sae.d_in // 2
    pre = sae.pre_acts(x, out=pre_out)
    top = sae.top_indices(pre)
    values = sae.select(x, pre, top).relu()
    recon = sae.decode(values, top)
    mse = reconstruction_loss(x, recon)
    aux = _dead_latents(pre, dead, k_aux, sync_free) if dead is not None else None
    if aux is None:
        return Losses(mse, mse.new_zeros(()), values, top)
    aux_indices, live, scale = aux
    # Selected apart from the top k: a latent may be in both, and a sparse pattern must not repeat an entry.
    aux_values = sae.select(x, pre, aux_indices)
    if live is not None:
        aux_values = aux_values * live
    residual = (x - recon).detach()
    aux_loss = aux_k_coefficient * scale * reconstruction_loss(residual, decode_rows(aux_values, aux_indices, sae.W_dec))
    return Losses(mse, aux_loss, values, top)


def cosine_lr(step: int, train_steps: int, lr: float, lr_end: float = 0.0, warmup_steps: int = 0,
              decay_steps: int | None = None) -> float:
    """The learning rate of step `step` (0-based): `lr * (step + 1) / warmup_steps` during
    warm-up, then `lr` until the last `decay_steps` steps, over which a cosine takes it to
    `lr_end` (`lr_end` after them). `decay_steps` None: every step after the warm-up decays,
    sae-lens's "cosineannealing" schedule."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, train_steps - warmup_steps)
    if decay_steps is not None:
        span = max(1, min(span, decay_steps))
    if step < train_steps - span:
        return lr
    t = min(step - (train_steps - span), span)
    return lr_end + (lr - lr_end) * (1 + math.cos(math.pi * t / span)) / 2


class TopKTrainer:
    """Trains a `TopKAutoencoder` one batch at a time: AdamW over `W_enc`, `W_dec` and `b_dec`, a
    cosine schedule, gradient clipping, a unit-norm decoder, dead-latent tracking for the
    aux-k loss and firing counts for the log10 frequency of every latent.

    Works on the SAE's device; batches are moved there. `state_dict`/`load_state_dict` hold
    everything a resumed run needs to continue bitwise identically on the same device.
    """

    def __init__(self, sae: TopKAutoencoder, train_steps: int, lr: float, lr_end_fraction: float = 0.0, warmup_steps: int = 0,
                 decay_steps: int | None = None, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), max_grad_norm: float = 1.0,
                 aux_k_coefficient: float = 1 / 32, k_aux: int | None = None, dead_steps: int = 1000) -> None:
        if train_steps < 1:
            raise ValueError(f"train_steps must be at least 1, got {train_steps}")
        self.sae = sae
        self.settings = dict(
            d_in=sae.d_in, d_sae=sae.d_sae, k=sae.k, train_steps=train_steps, lr=lr, lr_end_fraction=lr_end_fraction,
            warmup_steps=warmup_steps, decay_steps=decay_steps, weight_decay=weight_decay, betas=tuple(betas), max_grad_norm=max_grad_norm,
            aux_k_coefficient=aux_k_coefficient, k_aux=k_aux if k_aux is not None else sae.d_in // 2,
            dead_steps=dead_steps,
        )
        device = sae.W_enc.device
        self.params = [sae.W_enc, sae.W_dec, sae.b_dec]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, betas=betas, weight_decay=weight_decay,
            fused=True if device.type in FUSED_ADAM_DEVICES else None,
        )
        # Reading the number of dead latents back costs nothing on a CPU but stalls an
        # accelerator's queue; see `_dead_latents`.
        self.sync_free = device.type != "cpu"
        self.steps = 0
        self.tokens = 0
        self.since_fired = torch.zeros(sae.d_sae, dtype=torch.long, device=device)  # steps since each latent fired
        self.fire_counts = torch.zeros(sae.d_sae, dtype=torch.long, device=device)  # tokens each latent fired on
        # Reused every step: the CPU allocator hands blocks this large back to the system, and
        # faulting a fresh [batch, d_sae] tensor in again costs a tenth of a step at the paper's size.
        self._pre = torch.empty(0, sae.d_sae, dtype=sae.W_enc.dtype, device=device)

    def next_lr(self) -> float:
        """The learning rate of the next step."""
        s = self.settings
        return cosine_lr(self.steps, s["train_steps"], s["lr"], s["lr"] * s["lr_end_fraction"], s["warmup_steps"],
                         s["decay_steps"])

    def step(self, batch: Tensor, stats: bool = True) -> dict[str, float]:
        """One optimiser step on batch `[batch_size, d_in]`.

        Returns the step's lr and, with `stats`, its losses (before the update) and FVU (MSE
        over the batch's variance about its mean): `{"mse", "aux", "fvu", "lr"}`. Reading the
        losses is the step's only device-to-host sync; `stats=False` skips it and returns
        only the lr.
        """
        s, sae = self.settings, self.sae
        x = batch.to(device=sae.W_enc.device, dtype=sae.W_enc.dtype)
        if self.steps == 0:
            with torch.no_grad():
                sae.b_dec.copy_(x.mean(0))
        lr = self.next_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # `since_fired` is at most `steps`, so nothing can be dead before then: a host-side check.
        dead = self.dead if self.steps > s["dead_steps"] else None
        if self._pre.shape[0] != x.shape[0]:
            self._pre = self._pre.new_empty(x.shape[0], sae.d_sae)
        losses = training_losses(sae, x, dead, s["k_aux"], s["aux_k_coefficient"], self.sync_free, self._pre)
        self.optimizer.zero_grad(set_to_none=True)
        (losses.mse + losses.aux).backward()
        torch.nn.utils.clip_grad_norm_(self.params, s["max_grad_norm"])
        self.optimizer.step()
        sae.normalize_decoder()
        self._count_firing(losses.values.detach(), losses.indices)
        self.steps += 1
        self.tokens += x.shape[0]
        if not stats:
            return {"lr": lr}
        with torch.no_grad():
            variance = reconstruction_loss(x, x.mean(0).expand_as(x))
            mse, aux, fvu = torch.stack([losses.mse, losses.aux, losses.mse / variance]).tolist()
        return {"mse": mse, "aux": aux, "fvu": fvu, "lr": lr}

    @torch.no_grad()
    def _count_firing(self, values: Tensor, indices: Tensor) -> None:
        """Update firing counts and steps since firing from values, indices `[batch, k]`."""
        active = (values > 0).reshape(-1).long()
        fired = torch.zeros_like(self.fire_counts).scatter_add_(0, indices.reshape(-1), active)
        self.fire_counts += fired
        self.since_fired.add_(1).masked_fill_(fired > 0, 0)

    @property
    def log_feature_sparsity(self) -> Tensor:
        """log10 of each latent's firing frequency over all steps so far, `[d_sae]` on the CPU
        (sae-lens's `log_feature_sparsity`, with 1e-10 added so silent latents give -10)."""
        frequency = self.fire_counts.double() / max(self.tokens, 1)
        return (frequency + 1e-10).log10().float().cpu()

    @property
    def dead(self) -> Tensor:
        """`[d_sae]` bool: latents silent for more than `dead_steps` steps."""
        return self.since_fired > self.settings["dead_steps"]

    def state_dict(self) -> dict:
        """Everything `load_state_dict` needs for an exact resume (a step draws no random
        numbers, so there is no generator state). Like torch's state dicts, its tensors are
        the trainer's own: save or copy it before training on."""
        return {
            "settings": dict(self.settings),
            "sae": self.sae.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "tokens": self.tokens,
            "since_fired": self.since_fired,
            "fire_counts": self.fire_counts,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()` of a trainer with the same settings (else ValueError)."""
        saved = {key: tuple(v) if isinstance(v, list) else v for key, v in state["settings"].items()}
        if saved != self.settings:
            keys = set(saved) | set(self.settings)
            differing = sorted(key for key in keys if saved.get(key) != self.settings.get(key))
            raise ValueError(f"the checkpoint was made with different settings: {', '.join(differing)}")
        self.sae.load_state_dict(state["sae"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps, self.tokens = state["steps"], state["tokens"]
        self.since_fired.copy_(state["since_fired"])
        self.fire_counts.copy_(state["fire_counts"])


def save_sae_lens(sae: TopKAutoencoder, directory: str | Path, metadata: dict | None = None) -> Path:
    """Write `sae` to `directory` in sae-lens's format for a TopK SAE (`cfg.json`,
    `sae_weights.safetensors`), loadable with `sae_lens.SAE.load_from_disk`.

    `metadata` (hook_name, model_name, ...) goes into the config's metadata; without it the
    SAE records no hook (sae-lens's defaults). Written in place; the caller makes it atomic
    if needed.
    """
    cfg = TopKSAEConfig(
        d_in=sae.d_in, d_sae=sae.d_sae, k=sae.k, dtype=str(sae.W_enc.dtype).removeprefix("torch."), device="cpu",
        apply_b_dec_to_input=True, normalize_activations="none", rescale_acts_by_decoder_norm=False,
        metadata=SAEMetadata(**(metadata or {})),
    )
    out = SaeLensTopKSAE(cfg)
    out.load_state_dict({name: tensor.detach().cpu() for name, tensor in sae.state_dict().items()})
    out.save_model(directory)
    return Path(directory)
