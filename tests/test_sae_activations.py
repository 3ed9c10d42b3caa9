"""Collected activations (values, masking, the MLP input) and the shuffled activation stream."""

from __future__ import annotations

import pytest
import torch
import itertools

from circuits import forward
from pipelines.lm.model import PRESETS, build_model
from sae.activations import iter_activations
from circuits.sites import SITES, hook_name
from sae.stream import ActivationStream, StreamPosition

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
    keep = (tokens != BOS) & (tokens != PAD)
    assert keep.sum() == (tokens > PAD).sum()
    got = cat_batches(model, tokens, [(1, "resid_mid")], keep, batch_seqs=4)[(1, "resid_mid")]
    _, cache = model.run_with_cache(tokens)
    assert got.shape == (int(keep.sum()), 32)
    torch.testing.assert_close(got, cache["blocks.1.hook_resid_mid"][keep], rtol=1e-5, atol=1e-5)


def test_extra_mask_is_applied(model, tokens):
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 5:9] = True
    keep = mask & (tokens != BOS) & (tokens != PAD)
    got = cat_batches(model, tokens, [(0, "mlp_out")], keep, batch_seqs=3)[(0, "mlp_out")]
    _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(got, cache["blocks.0.hook_mlp_out"][keep], rtol=1e-5, atol=1e-5)
    assert got.shape[0] == int((mask & (tokens > PAD)).sum())


def test_mlp_input_is_what_the_mlp_multiplies(model, tokens):
    """mlp_in @ W_in must be the MLP's linear pre-activation (the hook TransformerLens fires)."""
    got = cat_batches(model, tokens, [(1, "mlp_in")], None, batch_seqs=12)[(1, "mlp_in")]
    _, cache = model.run_with_cache(tokens)
    normalized = cache["blocks.1.ln2.hook_normalized"].reshape(-1, 32)
    torch.testing.assert_close(got, normalized * model.blocks[1].ln2.w, rtol=1e-5, atol=1e-5)
    pre_linear = cache["blocks.1.mlp.hook_pre_linear"].reshape(-1, 64)
    torch.testing.assert_close(got @ model.blocks[1].mlp.W_in, pre_linear, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(normalized @ model.blocks[1].mlp.W_in, pre_linear, atol=1e-3)


def test_the_model_stops_after_the_deepest_point(model, tokens, monkeypatch):
    layers = []
    attention = forward.attention
    monkeypatch.setattr(forward, "attention",
                        lambda m, layer, h, kept=None: layers.append(layer) or attention(m, layer, h, kept))
    list(iter_activations(model, tokens, [(0, "mlp_out")], None, batch_seqs=12))
    assert layers == [0]
    list(iter_activations(model, tokens, [(1, "resid_mid"), (0, "mlp_in")], None, batch_seqs=12))
    assert layers == [0, 0, 1]


def test_unknown_site_or_layer_is_refused(model, tokens):
    with pytest.raises(ValueError, match="unknown site"):
        list(iter_activations(model, tokens, [(0, "attn_out")]))
    with pytest.raises(ValueError, match="layer 2 does not exist"):
        list(iter_activations(model, tokens, [(2, "mlp_out")]))


class _Rows:
    """A minimal row source for the stream (what `TokenRows` offers)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return len(self.tokens)

    def batch(self, rows):
        return self.tokens[torch.as_tensor(rows) if not isinstance(rows, slice) else rows]

    def keep(self, tokens):
        return (tokens != BOS) & (tokens != PAD)


def test_stream_serves_every_kept_token_once_per_fill_shuffled_alike(model, tokens):
    rows = _Rows(tokens)
    points = [(0, "resid_mid"), (1, "mlp_out")]
    stream = ActivationStream(model, rows, points, buffer_tokens=64 * 12, batch_size=50, seed=3, model_batch_rows=5)
    n_kept = int(rows.keep(tokens).sum())
    batches = list(itertools.islice(iter(stream), n_kept // 50))
    assert all(b[p].shape == (50, 32) for b in batches for p in points)
    direct = cat_batches(model, tokens, points, rows.keep(tokens), batch_seqs=12)
    for point in points:
        served = torch.cat([b[point] for b in batches])
        # one fill holds every row: each served row is a distinct kept token's activation
        match = torch.cdist(served, direct[point]).argmin(1)
        torch.testing.assert_close(served, direct[point][match], rtol=1e-5, atol=1e-5)
        assert match.unique().numel() == served.shape[0]
        assert not torch.equal(match, match.sort().values)  # shuffled
    # the same permutation at every point: token i of a batch is the same token everywhere
    m0 = torch.cdist(torch.cat([b[points[0]] for b in batches]), direct[points[0]]).argmin(1)
    m1 = torch.cdist(torch.cat([b[points[1]] for b in batches]), direct[points[1]]).argmin(1)
    assert torch.equal(m0, m1)


def test_stream_resumed_from_its_position_continues_identically(model, tokens):
    rows = _Rows(tokens)
    points = [(1, "resid_mid")]
    whole = ActivationStream(model, rows, points, buffer_tokens=64 * 3, batch_size=40, seed=5, model_batch_rows=4)
    batches = list(itertools.islice(iter(whole), 12))
    first = ActivationStream(model, rows, points, buffer_tokens=64 * 3, batch_size=40, seed=5, model_batch_rows=4)
    head = list(itertools.islice(iter(first), 7))
    resumed = ActivationStream(model, rows, points, buffer_tokens=64 * 3, batch_size=40, seed=5, model_batch_rows=4)
    resumed.position = StreamPosition(**first.position.to_json())
    tail = list(itertools.islice(iter(resumed), 5))
    for got, expected in zip(head + tail, batches):
        assert torch.equal(got[points[0]], expected[points[0]])


@pytest.mark.parametrize("precision, batch_rows", [("none", 3), ("bf16", 3), ("none", 5)])
def test_a_stream_whose_model_batches_run_on_threads_serves_the_same_batches(model, tokens, precision, batch_rows):
    """The same batches, bit for bit, with a fill's model batches on two threads as one after
    another: rows keep different numbers of tokens, so each batch's tokens start where the
    earlier batches' end (where that is, the tests above check); a fill of 5 rows is split 3 +
    2, or taken whole; in bfloat16 each thread must enter the autocast itself."""
    from pipelines.runtime import intra_op_threads, one_thread_workers

    rows = _Rows(tokens)
    points = [(0, "resid_mid"), (1, "mlp_out")]
    make = lambda pool=None: ActivationStream(model, rows, points, buffer_tokens=64 * 5, batch_size=40,  # noqa: E731
                                              seed=2, model_batch_rows=batch_rows, precision=precision, pool=pool)
    assert len(set(rows.keep(tokens).sum(1).tolist())) > 1
    with intra_op_threads(1):
        alone = list(itertools.islice(iter(make()), 10))
        with one_thread_workers(2) as pool:
            threaded = list(itertools.islice(iter(make(pool)), 10))
    for got, expected in zip(threaded, alone):
        for point in points:
            assert torch.equal(got[point], expected[point]), point
            assert not got[point].requires_grad  # grad mode is per thread too: no graph kept from a worker


class _CountingRows(_Rows):
    def __init__(self, tokens):
        super().__init__(tokens)
        self.reads = []

    def batch(self, rows):
        out = super().batch(rows)
        self.reads.append(len(out))
        return out


def test_the_last_fill_reads_only_the_rows_its_batches_need(model):
    """A fill holds 6 batches; for 8 the second fill runs the model on 4 rows, not 10."""
    tokens = torch.randint(2, 512, (40, 64), generator=torch.Generator().manual_seed(2))
    tokens[:, 0] = BOS  # 63 kept tokens a row
    rows = _CountingRows(tokens)
    stream = ActivationStream(model, rows, [(0, "mlp_out")], buffer_tokens=64 * 10, batch_size=100, seed=0,
                              total_batches=8)
    rows.reads.clear()
    batches = list(itertools.islice(iter(stream), 8))
    assert len(batches) == 8 and rows.reads == [10, 4]  # 200 tokens need ceil(200 / 63) rows


def test_a_resumed_stream_trims_its_last_fill_alike(model, tokens):
    rows = _Rows(tokens)
    points = [(1, "resid_mid")]
    make = lambda: ActivationStream(model, rows, points, buffer_tokens=64 * 3, batch_size=40, seed=5,  # noqa: E731
                                    model_batch_rows=4, total_batches=12)
    batches = list(itertools.islice(iter(make()), 12))
    first = make()
    head = list(itertools.islice(iter(first), 7))
    resumed = make()
    resumed.position = StreamPosition(**first.position.to_json())
    tail = list(itertools.islice(iter(resumed), 5))
    for got, expected in zip(head + tail, batches, strict=True):
        assert torch.equal(got[points[0]], expected[points[0]])


def test_stream_refuses_a_buffer_smaller_than_a_batch(model, tokens):
    with pytest.raises(ValueError, match="less than one batch"):
        ActivationStream(model, _Rows(tokens), [(0, "mlp_out")], buffer_tokens=64, batch_size=500, seed=0)


def test_stream_with_bf16_autocast_runs_on_cpu_and_stays_close(model, tokens):
    """The GPU option's twin on the CPU: bf16 forward passes give the float32 batches, rounded."""
    rows = _Rows(tokens)
    points = [(1, "mlp_out")]
    exact = next(iter(ActivationStream(model, rows, points, buffer_tokens=64 * 12, batch_size=50, seed=1)))
    rounded = next(iter(ActivationStream(model, rows, points, buffer_tokens=64 * 12, batch_size=50, seed=1,
                                         precision="bf16")))
    assert rounded[points[0]].dtype == torch.float32
    assert not torch.equal(rounded[points[0]], exact[points[0]])
    torch.testing.assert_close(rounded[points[0]], exact[points[0]], rtol=0.05, atol=0.05)
