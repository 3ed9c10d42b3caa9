"""benchmarks/bench_superposition.py measures crowding by its definitions: no interference
between orthogonal latents, each latent's part along another's direction where they overlap,
and the norm's rise when one latent leaves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from circuits.weights import SAEWeights

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_superposition", ROOT / "benchmarks" / "bench_superposition.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

F64 = torch.float64


def _sae(W_dec: torch.Tensor) -> SAEWeights:
    n, d = W_dec.shape
    return SAEWeights(W_enc=torch.linalg.pinv(W_dec), b_enc=torch.zeros(n, dtype=F64), W_dec=W_dec,
                      b_dec=torch.zeros(d, dtype=F64))


def test_orthogonal_latents_do_not_interfere_and_the_norm_rises_by_what_is_removed_over_what_remains():
    r = torch.tensor([[3.0, 4.0, 0.0, 0.0]], dtype=F64)  # latents 3 and 4 along two axes
    found = bench.crowding(r, _sae(torch.eye(4, dtype=F64)), eps=0.0)
    assert found["L0"].tolist() == [2.0]
    assert found["interference"].tolist() == [0.0, 0.0]
    # mean(r^2) is 25/4; without the first latent 16/4, without the second 9/4
    assert found["norm rise"].tolist() == pytest.approx([25 / 16 - 1, 25 / 9 - 1])


def test_interference_is_the_other_latents_part_along_a_latents_direction():
    s = 2 ** -0.5
    W_dec = torch.tensor([[1.0, 0.0], [s, s]], dtype=F64)  # unit directions 45 degrees apart
    z = torch.tensor([[2.0, 1.0]], dtype=F64)
    found = bench.crowding(z @ W_dec, _sae(W_dec), eps=0.0)
    # along latent 0: 1 * s from latent 1, over its own 2; along latent 1: 2 * s, over 1
    assert found["interference"].tolist() == pytest.approx([s / 2, 2 * s])
