"""The bilinear tensor of a gated MLP with identity activation, kept in factored form.

With TransformerLens's weights `W_gate [d, h]`, `W_in [d, h]`, `W_out [h, d_out]`, the MLP
computes `((x @ W_gate) * (x @ W_in) + b_in) @ W_out + b_out`, so for any output direction u

    u . mlp(x) = x^T Q_u x + u . b_const,   Q_u = W_gate diag(W_out u) W_in^T,
    b_const = W_out^T b_in + b_out,

i.e. `Q_u = sum_o u_o B[o]` with `B[o, i, j] = sum_h W_out[h, o] W_gate[i, h] W_in[j, h]`.
Only the symmetric part of `Q_u` acts on x (`x^T A x = 0` for antisymmetric A) and `eigh`
needs symmetry, so every interaction matrix returned here is symmetrised. B itself is
`d_out * d^2` numbers and is only built by `bilinear_tensor`, for checks at small sizes.
"""

from __future__ import annotations

import torch


def symmetrise(Q: torch.Tensor) -> torch.Tensor:
    """`(Q + Q^T) / 2` over the last two dims. `[..., d, d] -> [..., d, d]`."""
    return (Q + Q.transpose(-1, -2)).mul_(0.5)


def output_constant(W_out: torch.Tensor, b_in: torch.Tensor, b_out: torch.Tensor) -> torch.Tensor:
    """`b_const = W_out^T b_in + b_out`, the part of mlp(x) that does not depend on x. `[d_out]`."""
    return b_in @ W_out + b_out


def interaction_matrices(
    W_gate: torch.Tensor, W_in: torch.Tensor, W_out: torch.Tensor, U: torch.Tensor
) -> torch.Tensor:
    """Symmetrised `Q_u = W_gate diag(W_out u) W_in^T` for each row u of `U [n, d_out]`.

    Returns `[n, d, d]`. Cost `n * d^2 * h`; memory `n * d * h`, so callers chunk over n.
    """
    n = U.shape[0]
    d, h = W_gate.shape
    weights = U @ W_out.T  # [n, h]
    scaled = W_gate.unsqueeze(0) * weights.unsqueeze(1)  # [n, d, h]
    Q = (scaled.reshape(n * d, h) @ W_in.T).reshape(n, d, d)
    return symmetrise(Q)


def bilinear_tensor(W_gate: torch.Tensor, W_in: torch.Tensor, W_out: torch.Tensor) -> torch.Tensor:
    """The full symmetrised tensor `B [d_out, d, d]`. Small sizes only (tests, toy models)."""
    return symmetrise(torch.einsum("ho,ih,jh->oij", W_out, W_gate, W_in))


def bilinear_gram(W_gate: torch.Tensor, W_in: torch.Tensor, W_out: torch.Tensor) -> torch.Tensor:
    """`B_mat B_mat^T [d_out, d_out]` for the symmetrised B reshaped to `(d_out, d*d)`.

    Entry (o, o') is the Frobenius product of B[o] and B[o']. Expanding the factored form,
    `<B_o, B_o'> = W_out^T (G_gg * G_ii) W_out` and `<B_o, B_o'^T> = W_out^T (G_gi * G_gi^T) W_out`
    with the `[h, h]` Gram matrices `G_gg = W_gate^T W_gate` etc.; symmetrising B averages the two.
    Cost `h^2 (d + d_out)`, independent of `d^2 * d_out`.
    """
    gg = W_gate.T @ W_gate
    ii = W_in.T @ W_in
    gi = W_gate.T @ W_in
    inner = 0.5 * (gg * ii + gi * gi.T)
    return W_out.T @ inner @ W_out


def hosvd(
    W_gate: torch.Tensor, W_in: torch.Tensor, W_out: torch.Tensor, k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k singular values and left singular vectors of B reshaped to `(d_out, d*d)`.

    Returns `S [k]` (descending) and `U [d_out, k]`. The matching right singular vector,
    reshaped to `d x d`, is the interaction matrix `Q_{u_k} / S_k`
    (`interaction_matrices(..., U.T) / S[:, None, None]`): an output direction with its
    own interaction matrix, for layers without output features. Computed from the eigen-
    decomposition of `bilinear_gram`, which squares the condition number: small singular
    values carry an absolute error of about `sqrt(eps_machine) * S_max`.
    """
    evals, evecs = torch.linalg.eigh(bilinear_gram(W_gate, W_in, W_out))
    evals, evecs = evals.flip(0), evecs.flip(1)
    if k is not None:
        evals, evecs = evals[:k], evecs[:, :k]
    return evals.clamp_min(0).sqrt(), evecs
