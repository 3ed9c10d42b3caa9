"""The tensors circuit analysis reads: one bilinear MLP and the two SAEs around it.

Conventions are TransformerLens's and sae-lens's, so weights can be lifted straight from a
`HookedTransformer` and an sae-lens `SAE` (duck-typed: nothing here imports either package).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class MLPWeights:
    """One bilinear MLP and the RMS norm in front of it.

    The MLP computes `((x @ W_gate) * (x @ W_in) + b_in) @ W_out + b_out` on its input
    `x = g * r / sqrt(mean(r^2) + eps)`, where `r` is resid_mid.
    """

    W_gate: torch.Tensor  # [d_model, d_mlp]
    W_in: torch.Tensor  # [d_model, d_mlp]
    W_out: torch.Tensor  # [d_mlp, d_model]
    b_in: torch.Tensor  # [d_mlp]
    b_out: torch.Tensor  # [d_model]
    g: torch.Tensor  # [d_model], gain of the RMS norm ln2 (ones when folded or absent)
    eps: float  # added to mean(r^2) inside the RMS norm

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> "MLPWeights":
        return _cast(self, dtype, device)


@dataclass
class SAEWeights:
    """An SAE's tensors and its exact encoding rule.

    Pre-activation: `(a - b_dec * apply_b_dec_to_input) @ W_enc + b_enc`;
    reconstruction: `z @ W_dec + b_dec`. Encoding keeps the `k` largest pre-activations per
    token (all of them when `k` is None) and then, with `relu`, zeroes negative ones (sae-lens
    TopK and ReLU SAEs). With `relu=False` the kept values stay as they are, negative ones
    included: the paper authors' TopK. A latent is *active* on a token when the encoding
    selected it with a nonzero value.
    """

    W_enc: torch.Tensor  # [d_in, d_sae]
    b_enc: torch.Tensor  # [d_sae]
    W_dec: torch.Tensor  # [d_sae, d_in]
    b_dec: torch.Tensor  # [d_in]
    apply_b_dec_to_input: bool = True
    k: int | None = None  # latents kept per token; None keeps every one
    relu: bool = True  # zero negative kept values (False: the authors' raw TopK)

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> "SAEWeights":
        return _cast(self, dtype, device)

    def pre(self, a: torch.Tensor) -> torch.Tensor:
        """Pre-activations `[..., d_sae]` of inputs `a [..., d_in]`."""
        if self.apply_b_dec_to_input:
            a = a - self.b_dec
        return a @ self.W_enc + self.b_enc

    def encode(self, a: torch.Tensor) -> torch.Tensor:
        """Activations `[..., d_sae]` of inputs `a [..., d_in]` (zeros where inactive)."""
        pre = self.pre(a)
        if self.k is None or self.k >= self.d_sae:
            return pre.relu() if self.relu else pre
        indices, values = self._kept(pre)
        return torch.zeros_like(pre).scatter_(-1, indices, values)

    def encode_sparse(self, a: torch.Tensor) -> torch.Tensor:
        """`encode` of inputs `a [t, d_in]` as a coalesced sparse COO tensor `[t, d_sae]`, made
        from the k kept latents: no dense table's zeros written, then scanned for nonzeros
        (the verdicts' token cache builds faster so)."""
        if self.k is None or self.k >= self.d_sae:
            return self.encode(a).to_sparse()
        pre = self.pre(a)
        indices, values = self._kept(pre)
        indices, order = indices.sort(-1)  # a row's latents in order: the COO tensor is coalesced as made
        values = values.gather(-1, order)
        on = values != 0
        rows = torch.arange(len(pre), device=pre.device)[:, None].expand_as(indices)
        return torch.sparse_coo_tensor(torch.stack([rows[on], indices[on]]), values[on], pre.shape, is_coalesced=True,
                                       check_invariants=False)

    def _kept(self, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each row of `pre [..., d_sae]` keeps its k largest, and their activations
        (ReLU applied when `relu`), `[..., k]` each."""
        indices = top_k_indices(pre, self.k)
        values = pre.gather(-1, indices)
        return indices, (values.relu() if self.relu else values)

    def encode_at(self, pre: torch.Tensor, latent: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`encode`'s value of latent `latent[i]` in row i `[N]`, from pre-activations `pre [N, d_sae]`
        (or in row `rows[i]` of `pre [R, d_sae]`, rows that several entries share): with TopK,
        the latent is kept when fewer than k latents exceed it, that is when it is at least
        the row's k-th largest (a rank test, not a selection of every latent; the two differ
        only on exact ties)."""
        value = pre.gather(-1, latent[:, None])[:, 0] if rows is None else pre[rows, latent]
        if self.k is not None and self.k < self.d_sae:
            if rows is not None and 8 * len(pre) <= len(rows):  # few rows, many readers: each row's k-th largest once
                keep = value >= pre.topk(self.k, dim=-1).values[:, -1][rows]
            else:  # a count per entry is cheaper than a top-k per row
                keep = torch.empty_like(value, dtype=torch.bool)
                # on a CPU a block of entries' rows at a time: at 2 MB they stay in the cache between their
                # copy and the count, where all rows at once would be read from memory twice
                block = max(1, (2 << 20) // (pre.shape[-1] * pre.element_size())) if pre.device.type == "cpu" \
                    else max(1, len(value))
                for start in range(0, len(value), block):
                    at = slice(start, start + block)
                    full = pre[at] if rows is None else pre.index_select(0, rows[at])
                    keep[at] = (full > value[at, None]).sum(-1, dtype=torch.int32) < self.k
            value = torch.where(keep, value, torch.zeros_like(value))
        return value.relu() if self.relu else value

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Reconstruction `[..., d_in]` of activations `z [..., d_sae]`."""
        return z @ self.W_dec + self.b_dec

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}


# The kernel's sorted buffer costs about k moves per value let in, and about k ln(n / k) values
# of a row get in: beyond k 64, or k above a sixteenth of the row, torch's partition is faster
# (benchmarks/bench_topk.py times both sides of the bound).
KERNEL_MAX_K = 64
KERNEL_MIN_ROW_PER_K = 16


def top_k_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """`[..., k]`: where each row of `x [..., n]` holds its k largest values, in no order;
    the places `x.topk(k, sorted=False).indices` names, ties included.

    On a CPU, float32 and float64 rows with k up to `KERNEL_MAX_K` and at least
    `KERNEL_MIN_ROW_PER_K` entries per selected one go through one compiled
    pass per row (`circuits.cpu_kernels.row_top_k`); the rows it cannot answer as torch would (a tie at
    the k-th value, about one row in a million in the demo's SAE training, or a NaN) are
    ranked by torch. Elsewhere torch ranks every row.
    """
    n = x.shape[-1]
    kernel = x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
    if not kernel or not 1 <= k <= min(KERNEL_MAX_K, n // KERNEL_MIN_ROW_PER_K):
        return x.topk(k, dim=-1, sorted=False).indices
    from circuits.cpu_kernels import row_top_k

    rows = x.detach().reshape(-1, n).contiguous()
    found = torch.empty(len(rows), k, dtype=torch.long)
    unsure = torch.empty(len(rows), dtype=torch.bool)
    row_top_k(rows.numpy(), k, found.numpy(), unsure.numpy())
    redo = unsure.nonzero()[:, 0]
    if len(redo):
        found[redo] = rows[redo].topk(k, dim=-1, sorted=False).indices
    return found.view(*x.shape[:-1], k)


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise ValueError naming the first tensor that holds NaN or Inf.

    Non-finite weights would not fail loudly later: they empty gate tables and turn
    coefficients into NaN, which reads like a result.
    """
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = ~torch.isfinite(tensor)
            kind = "NaN" if torch.isnan(tensor).any() else "Inf"
            raise ValueError(f"{where}: tensor {name} holds {kind} ({int(bad.sum())} of {tensor.numel()} "
                             "entries); refusing to analyse non-finite weights")


def _cast(weights, dtype, device):
    changes = {
        f.name: getattr(weights, f.name).detach().to(device=device, dtype=dtype)
        for f in fields(weights)
        if isinstance(getattr(weights, f.name), torch.Tensor)
    }
    return replace(weights, **changes)


def from_hooked_transformer(model, layer: int) -> MLPWeights:
    """The MLP of block `layer` of a TransformerLens `HookedTransformer`.

    Refuses models whose MLP is not bilinear (no gate, or a nonlinear activation) and
    models with LayerNorm, whose mean subtraction the quadratic form does not include.
    """
    cfg = model.cfg
    if not cfg.gated_mlp or cfg.act_fn != "identity":
        raise ValueError(
            f"layer {layer} is not a bilinear MLP: gated_mlp={cfg.gated_mlp}, act_fn={cfg.act_fn!r}"
            " (need gated_mlp=True and act_fn='identity')"
        )
    if cfg.normalization_type not in ("RMS", "RMSPre"):
        raise ValueError(f"unsupported normalization {cfg.normalization_type!r}: need RMS norm")
    block = model.blocks[layer]
    mlp = block.mlp
    gain = getattr(block.ln2, "w", None)
    if gain is None:
        gain = torch.ones_like(mlp.b_out)
    return MLPWeights(
        W_gate=mlp.W_gate.detach(),
        W_in=mlp.W_in.detach(),
        W_out=mlp.W_out.detach(),
        b_in=mlp.b_in.detach(),
        b_out=mlp.b_out.detach(),
        g=gain.detach(),
        eps=float(cfg.eps),
    )


def from_sae_lens(sae) -> SAEWeights:
    """The weights of an sae-lens SAE (TopK or plain ReLU).

    A TopK SAE trained with `rescale_acts_by_decoder_norm` scales its pre-activations by the
    decoder row norms and divides them out again before decoding; that is folded into the
    encoder and decoder here so that the plain formulas of `SAEWeights` hold (the TopK
    selection then compares the same scaled values).
    """
    cfg = sae.cfg
    norm = getattr(cfg, "normalize_activations", "none")
    if norm not in ("none", None):
        raise ValueError(f"SAE normalises its inputs ({norm!r}); fold the normalisation first")
    architecture = cfg.architecture() if callable(getattr(cfg, "architecture", None)) else "standard"
    if architecture not in ("topk", "standard"):
        raise ValueError(f"unsupported sae-lens architecture {architecture!r}: only TopK and ReLU SAEs")
    W_enc, b_enc, W_dec = sae.W_enc.detach(), sae.b_enc.detach(), sae.W_dec.detach()
    if getattr(cfg, "rescale_acts_by_decoder_norm", False):
        scale = W_dec.norm(dim=-1)
        W_enc, b_enc, W_dec = W_enc * scale, b_enc * scale, W_dec / scale[:, None]
    return SAEWeights(
        W_enc=W_enc,
        b_enc=b_enc,
        W_dec=W_dec,
        b_dec=sae.b_dec.detach(),
        apply_b_dec_to_input=bool(cfg.apply_b_dec_to_input),
        k=int(cfg.k) if architecture == "topk" else None,
    )
