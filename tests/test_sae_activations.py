"""Hook-based activation caching: values, masking, the MLP input, and disk shards."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pipelines.model import PRESETS, build_model
from sae.activations import iter_activations, keep_mask
from sae.cache import ActivationCache, write_cache
from sae.sites import SITES, hook_name

BOS, PAD = 0, 1


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"]).eval()
    with torch.no_grad():  # a non-trivial norm gain, so forgetting it would show
        for block in model.blocks:
            block.ln2.w.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def tokens():
    """BOS-led rows, some right-padded to different lengths: `[12, 64]`."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, 512, (12, 64), generator=g)
    tokens[:, 0] = BOS
    for row, length in enumerate([64, 40, 10, 64, 33, 64, 2, 64, 50, 64, 64, 20]):
        tokens[row, length:] = PAD
    return tokens


def cat_batches(model, tokens, points, keep, batch_seqs):
    parts = list(iter_activations(model, tokens, points, keep, batch_seqs))
    return {p: torch.cat([part[p] for part in parts]) for p in points}


def test_collected_activations_equal_run_with_cache(model, tokens):
    points = [(layer, site) for layer in range(2) for site in SITES]
    got = cat_batches(model, tokens, points, None, batch_seqs=5)
    _, cache = model.run_with_cache(tokens)
    for layer, site in points:
        expected = cache[hook_name(layer, site)]
        if site == "mlp_in":
            expected = expected * model.blocks[layer].ln2.w
        torch.testing.assert_close(got[(layer, site)], expected.reshape(-1, 32), rtol=1e-5, atol=1e-5)


def test_bos_and_padding_are_skipped(model, tokens):
    keep = keep_mask(tokens, bos_id=BOS, pad_id=PAD)
    assert keep.sum() == (tokens > PAD).sum()
    got = cat_batches(model, tokens, [(1, "resid_mid")], keep, batch_seqs=4)[(1, "resid_mid")]
    _, cache = model.run_with_cache(tokens)
    assert got.shape == (int(keep.sum()), 32)
    torch.testing.assert_close(got, cache["blocks.1.hook_resid_mid"][keep], rtol=1e-5, atol=1e-5)


def test_extra_mask_is_applied(model, tokens):
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 5:9] = True
    keep = keep_mask(tokens, bos_id=BOS, pad_id=PAD, mask=mask)
    got = cat_batches(model, tokens, [(0, "mlp_out")], keep, batch_seqs=3)[(0, "mlp_out")]
    _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(got, cache["blocks.0.hook_mlp_out"][keep], rtol=1e-5, atol=1e-5)
    assert got.shape[0] == int((mask & (tokens > PAD)).sum())


def test_mlp_input_is_what_the_mlp_multiplies(model, tokens):
    """mlp_in @ W_in must be the MLP's linear pre-activation (the hook TransformerLens fires)."""
    got = cat_batches(model, tokens, [(1, "mlp_in")], None, batch_seqs=12)[(1, "mlp_in")]
    _, cache = model.run_with_cache(tokens)
    normalized = cache["blocks.1.ln2.hook_normalized"].reshape(-1, 32)
    torch.testing.assert_close(got, normalized * model.blocks[1].ln2.w, rtol=1e-6, atol=1e-6)
    pre_linear = cache["blocks.1.mlp.hook_pre_linear"].reshape(-1, 64)
    torch.testing.assert_close(got @ model.blocks[1].mlp.W_in, pre_linear, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(normalized @ model.blocks[1].mlp.W_in, pre_linear, atol=1e-3)


def test_the_model_stops_after_the_deepest_point(model, tokens):
    calls = []
    model.add_hook("blocks.1.hook_resid_pre", lambda act, hook: calls.append(1), is_permanent=True)
    try:
        list(iter_activations(model, tokens, [(0, "mlp_out")], None, batch_seqs=12))
        assert calls == []
        list(iter_activations(model, tokens, [(1, "resid_mid")], None, batch_seqs=12))
        assert calls == [1]
    finally:
        model.reset_hooks(including_permanent=True)


def test_unknown_site_or_layer_is_refused(model, tokens):
    with pytest.raises(ValueError, match="unknown site"):
        list(iter_activations(model, tokens, [(0, "attn_out")]))
    with pytest.raises(ValueError, match="layer 2 does not exist"):
        list(iter_activations(model, tokens, [(2, "mlp_out")]))


def test_disk_cache_holds_exactly_the_kept_rows_shuffled(model, tokens, tmp_path):
    keep = keep_mask(tokens, bos_id=BOS, pad_id=PAD)
    points = [(0, "resid_mid"), (1, "mlp_out")]
    n_tokens = int(keep.sum()) - 7  # the last kept rows are left out
    cache = write_cache(model, tokens, keep, points, tmp_path / "acts", n_tokens, shard_tokens=100, batch_seqs=3)
    assert sum(cache.shard_rows) == n_tokens and max(cache.shard_rows) <= 100
    assert ActivationCache.open(tmp_path / "acts") == cache
    direct = cat_batches(model, tokens, points, keep, batch_seqs=12)
    for point in points:
        batches = list(cache.batches(point, batch_size=50, buffer_tokens=120, seed=3))
        assert len(batches) == n_tokens // 50 and all(b.shape == (50, 32) for b in batches)
        # every cached row, read back straight from the shards, is one of the first n_tokens rows
        stored = torch.cat([load_file(cache.shard_path(point, i))["acts"] for i in range(len(cache.shard_rows))])
        expected = direct[point][:n_tokens]
        key = lambda rows: rows[rows[:, 0].argsort()]  # noqa: E731
        torch.testing.assert_close(key(stored), key(expected))
        assert not torch.equal(stored, expected)  # the shards are shuffled
        served = torch.cat(batches)
        assert torch.isin(served[:, 0], expected[:, 0]).all()
        assert served[:, 0].unique().numel() == served.shape[0]  # no row served twice
    cache.drop(points[0])
    assert ActivationCache.open(tmp_path / "acts").points == (points[1],)


def test_cache_refuses_a_corpus_too_small(model, tokens, tmp_path):
    keep = keep_mask(tokens, bos_id=BOS, pad_id=PAD)
    with pytest.raises(ValueError, match="corpus too small"):
        write_cache(model, tokens, keep, [(0, "mlp_out")], tmp_path / "acts", int(keep.sum()) + 1)
    assert not (tmp_path / "acts").exists()
