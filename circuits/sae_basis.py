"""Interaction matrices expressed in SAE feature bases.

Output side: an output feature f is read by the output SAE's *encoder* column `e_f`
(`basis="encoder"`, the default), so its interaction matrix is `Q_{e_f}` and
`x^T Q_{e_f} x + c_f` is exactly the feature's pre-activation (`preactivation_offset`).
With `basis="decoder"` it is the decoder row `d_f` that the feature writes (the paper
authors' `use_encoder=False`): then `x^T Q_{d_f} x = d_f . (mlp(x) - b_const)`, the part of
the MLP's output along the feature's direction, exactly.

Input side, for an input SAE on `resid_mid` (before the norm): resid_mid is written by the
input SAE's *decoder*, `r ~ D z + b_dec = D' z'` with `D' = [D, b_dec]` and `z' = [z, 1]`.
The MLP input is `x = g * r / rms(r)` with TransformerLens's `rms(r) = sqrt(mean(r^2) + eps)`,
hence

    x^T Q x = (1 / rms(r)^2) z'^T Qt z',   Qt = D'^T diag(g) Q diag(g) D' = M^T Q M,

with the input basis `M = diag(g) D'` `[d, n_in + 1]`. The last row and column of `Qt` hold
each input feature's linear term and the constant: they belong to the exact decomposition.
The form is exact for `r = D' z'`; on real activations it is exact up to the input SAE's
reconstruction error, and the positive per-token factor `1/rms(r)^2` rescales every term
of a token alike, changing magnitudes but not which interactions dominate.

For an input SAE on `mlp_in` (the MLP's input after the norm and its gain, where the paper
authors put theirs) the SAE writes x itself, `x ~ D' z'`, so `M = D'` (no gain) and
`x^T Q x = z'^T Qt z'` with no per-token factor.
"""

from __future__ import annotations

import torch

from circuits.sites import RESID_MID, check_input_site

OUTPUT_BASES = ("encoder", "decoder")


def input_basis(W_dec: torch.Tensor, b_dec: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """`M = diag(g) [D, b_dec]` with `D = W_dec^T`: `[n_in, d], [d], [d] -> [d, n_in + 1]`.

    Column `n_in` is the constant coordinate (z'_{n_in} = 1). `g` is the gain the input
    site implies (`circuits.sites.input_gain`): the norm's on resid_mid, None on mlp_in.
    """
    D = torch.cat([W_dec, b_dec.unsqueeze(0)]).T
    return D if g is None else g.unsqueeze(1) * D


def token_scale(r: torch.Tensor, eps: float, site: str) -> torch.Tensor:
    """The per-token factor s with `x^T Q x = s * z'^T Qt z'`: `1 / rms(r)^2` for resid_mid
    inputs `r [..., d]` (mean(r^2) + eps), 1 for mlp_in. Returns `[...]`."""
    if check_input_site(site) == RESID_MID:
        return 1.0 / (r.square().mean(-1) + eps)
    return torch.ones(r.shape[:-1], dtype=r.dtype, device=r.device)


def project(Q: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """`Qt = M^T Q M`: `[..., d, d], [d, m] -> [..., m, m]`.

    Costs `m^2 d` per matrix; `circuits.interactions` streams over blocks of it instead.
    """
    return basis.T @ Q @ basis


def output_directions(W_enc: torch.Tensor, W_dec: torch.Tensor | None = None, basis: str = "encoder") -> torch.Tensor:
    """Output directions `[n_out, d_out]`: the encoder columns `W_enc [d_out, n_out]` as rows,
    or with `basis="decoder"` the decoder rows `W_dec [n_out, d_out]`."""
    if basis == "decoder":
        if W_dec is None:
            raise ValueError("the decoder basis needs the output SAE's decoder")
        return W_dec
    if basis != "encoder":
        raise ValueError(f"unknown output basis {basis!r}; choose from {', '.join(OUTPUT_BASES)}")
    return W_enc.T


def preactivation_offset(
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    b_dec: torch.Tensor,
    apply_b_dec_to_input: bool,
    b_const: torch.Tensor,
) -> torch.Tensor:
    """Per-output-feature constant `c_f` with `pre_f = x^T Q_{e_f} x + c_f` exactly. `[n_out]`.

    The output SAE's pre-activation is `e_f . (mlp_out - b_dec * apply) + b_enc_f` and
    `mlp_out = (x^T Q_o x)_o + b_const`, so `c_f = e_f . (b_const - b_dec * apply) + b_enc_f`.
    """
    shift = b_const - b_dec if apply_b_dec_to_input else b_const
    return shift @ W_enc + b_enc
