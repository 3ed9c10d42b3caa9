"""The negation scan's pieces that need no run (the scan on a run: tests/test_cli.py)."""

import torch

from circuits.cross_terms import bilinear_vectors
from circuits.sites import MLP_IN, RESID_MID
from circuits.weights import MLPWeights
from pipelines.analysis.negation import _renormed_cross

F = torch.float64


def _mlp(g: torch.Generator, d: int = 6, h: int = 9) -> MLPWeights:
    return MLPWeights(*(torch.randn(*s, generator=g, dtype=F) for s in ((d, h), (d, h), (h, d), (h,), (d,))),
                      g=1 + 0.1 * torch.randn(d, generator=g, dtype=F), eps=1e-5)


def test_without_a_norm_between_the_four_point_interaction_is_the_cross_term():
    g = torch.Generator().manual_seed(0)
    mlp = _mlp(g)
    r, r_a, r_b = (torch.randn(5, 6, generator=g, dtype=F) for _ in range(3))
    cross = 2 * bilinear_vectors(mlp.W_gate, mlp.W_in, mlp.W_out, r_a, r_b)
    assert torch.allclose(_renormed_cross(mlp, r, r_a, r_b, None, MLP_IN), cross, atol=1e-10)


def test_the_recomputed_norm_rescales_what_a_removal_leaves():
    """Two sides that the layer only adds, x_A^T Q x_A and x_B^T Q x_B with no cross block: with
    the norm recomputed, removing one side shrinks the input's RMS and so scales the other side
    up, an interaction the frozen cross term (zero) does not have."""
    d, h = 4, 2
    W_gate, W_in = torch.zeros(d, h, dtype=F), torch.zeros(d, h, dtype=F)
    W_gate[0, 0] = W_in[0, 0] = W_gate[1, 1] = W_in[1, 1] = 1.0
    mlp = MLPWeights(W_gate, W_in, torch.ones(h, 1, dtype=F), torch.zeros(h, dtype=F), torch.zeros(1, dtype=F),
                     torch.ones(d, dtype=F), eps=0.0)
    r_a, r_b, rest = (torch.zeros(1, d, dtype=F) for _ in range(3))
    r_a[0, 0], r_b[0, 1], rest[0, 2] = 1.0, 1.0, 1.0
    r = r_a + r_b + rest
    assert bilinear_vectors(mlp.W_gate, mlp.W_in, mlp.W_out, r_a, r_b).abs().max() == 0
    # x = r / rms(r): with all three on rms^2 = 3/4, without a or b 2/4, without both 1/4
    expected = (1 + 1) / 0.75 - 1 / 0.5 - 1 / 0.5 + 0
    found = _renormed_cross(mlp, r, r_a, r_b, mlp.g, RESID_MID)
    assert torch.allclose(found, torch.tensor([[expected]], dtype=F), atol=1e-12)
