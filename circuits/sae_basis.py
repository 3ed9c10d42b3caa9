"""Interaction matrices expressed in SAE feature bases.

Output side: an output feature f is read by the output SAE's *encoder* column `e_f`, so its
interaction matrix is `Q_{e_f}`. Input side: resid_mid is written by the input SAE's
*decoder*, `r ~ D z + b_dec = D' z'` with `D' = [D, b_dec]` and `z' = [z, 1]`. The MLP input
is `x = g * r / rms(r)` with TransformerLens's `rms(r) = sqrt(mean(r^2) + eps)`, hence

    x^T Q x = (1 / rms(r)^2) z'^T Qt z',   Qt = D'^T diag(g) Q diag(g) D' = M^T Q M,

with the input basis `M = diag(g) D'` `[d, n_in + 1]`. The last row and column of `Qt` hold
each input feature's linear term and the constant: they belong to the exact decomposition.
The form is exact for `r = D' z'`; on real activations it is exact up to the input SAE's
reconstruction error, and the positive per-token factor `1/rms(r)^2` rescales every term
of a token alike, changing magnitudes but not which interactions dominate.
"""

from __future__ import annotations

import torch


def input_basis(W_dec: torch.Tensor, b_dec: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`M = diag(g) [D, b_dec]` with `D = W_dec^T`: `[n_in, d], [d], [d] -> [d, n_in + 1]`.

    Column `n_in` is the constant coordinate (z'_{n_in} = 1).
    """
    return g.unsqueeze(1) * torch.cat([W_dec, b_dec.unsqueeze(0)]).T


def project(Q: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """`Qt = M^T Q M`: `[..., d, d], [d, m] -> [..., m, m]`.

    Costs `m^2 d` per matrix; `circuits.interactions` streams over blocks of it instead.
    """
    return basis.T @ Q @ basis


def output_directions(W_enc: torch.Tensor) -> torch.Tensor:
    """The output SAE's encoder columns as rows: `[d_out, n_out] -> [n_out, d_out]`."""
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
