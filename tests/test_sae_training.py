"""TopK SAE training with sae-lens: planted dictionary recovery, our settings, save/load."""

from __future__ import annotations

import json

import pytest
import torch
from sae_lens import SAE, TopKTrainingSAE
from sae_lens.saes.sae import TrainStepInput

from sae.config import SAETrainConfig
from sae.io import is_finished, load_sae, save_sae
from sae.train import UnitNormTopKTrainer, build_sae, train_sae


def planted_activations(n: int, d: int, n_features: int, active: int, seed: int):
    """Tokens `[n, d]` = sparse sums of `active` of `n_features` unit directions + noise."""
    g = torch.Generator().manual_seed(seed)
    directions = torch.randn(n_features, d, generator=g)
    directions /= directions.norm(dim=1, keepdim=True)
    chosen = torch.rand(n, n_features, generator=g).argsort(1)[:, :active]
    codes = torch.zeros(n, n_features).scatter_(1, chosen, torch.rand(n, active, generator=g) + 0.5)
    offset = torch.randn(d, generator=g)  # a mean the SAE's b_dec has to absorb
    return codes @ directions + offset + 0.01 * torch.randn(n, d, generator=g), directions


@pytest.fixture
def one_thread():
    """Hundreds of tiny steps run faster on one thread than split over busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_planted_dictionary_is_recovered(one_thread):
    d, batch = 32, 256
    acts, directions = planted_activations(100_000, d, n_features=64, active=3, seed=0)
    cfg = SAETrainConfig(k=4, train_tokens=acts.shape[0], batch_size=batch).resolve(d)
    sae, _ = train_sae(iter(acts.split(batch)), d, cfg)
    decoder = sae.W_dec.detach()
    best_cos = (directions @ (decoder / decoder.norm(dim=1, keepdim=True)).T).max(dim=1).values
    print(f"planted dictionary: mean best cosine {best_cos.mean():.4f}, min {best_cos.min():.4f}")
    assert best_cos.mean() >= 0.9


def test_our_settings_hold_through_training():
    d = 16
    cfg = SAETrainConfig(k=3, train_tokens=2048, batch_size=128, lr=1e-2, weight_decay=0.01).resolve(d)
    fresh = build_sae(d, cfg)
    torch.testing.assert_close(fresh.W_enc, fresh.W_dec.T)  # encoder starts as the decoder's transpose
    torch.testing.assert_close(fresh.W_dec.norm(dim=1), torch.ones(4 * d))
    acts = torch.randn(2048, d) * 3 + 1
    seen: dict = {}
    original_init = UnitNormTopKTrainer.__init__

    def spy(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        seen["trainer"] = self

    UnitNormTopKTrainer.__init__ = spy
    try:
        sae, log_sparsity = train_sae(iter(acts.split(128)), d, cfg)
    finally:
        UnitNormTopKTrainer.__init__ = original_init
    trainer = seen["trainer"]
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.01
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert id(sae.b_enc) not in optimised and {id(sae.W_enc), id(sae.W_dec), id(sae.b_dec)} <= optimised
    assert trainer.n_training_steps == 16
    assert torch.equal(sae.b_enc, torch.zeros(4 * d))
    torch.testing.assert_close(sae.W_dec.norm(dim=1), torch.ones(4 * d))
    assert not torch.allclose(sae.W_enc, sae.W_dec.T, atol=1e-3)  # it did train
    assert log_sparsity.shape == (4 * d,)
    # the cosine schedule ran to its end
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-6)


def test_sparse_decoder_matches_sae_lens_dense_decoder():
    """Same loss and the same gradients as sae-lens's own TopK SAE with the same weights."""
    cfg = SAETrainConfig(k=5, train_tokens=512, batch_size=512).resolve(24)
    ours = build_sae(24, cfg)
    theirs = TopKTrainingSAE(ours.cfg)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(300, 24)
    dead = torch.rand(4 * 24) < 0.3  # exercises the aux-k loss as well
    losses = []
    for sae in (ours, theirs):
        step = TrainStepInput(sae_in=x, coefficients={}, dead_neuron_mask=dead, n_training_steps=0,
                              is_logging_step=False)
        out = sae.training_forward_pass(step)
        out.loss.backward()
        losses.append(out.loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for name in ("W_enc", "W_dec", "b_dec"):
        torch.testing.assert_close(getattr(ours, name).grad, getattr(theirs, name).grad, rtol=1e-4, atol=1e-6)
    assert type(ours).decode is not TopKTrainingSAE.decode


def test_saved_sae_loads_with_sae_lens_and_encodes_identically(tmp_path):
    d = 16
    cfg = SAETrainConfig(k=3, train_tokens=1024, batch_size=128).resolve(d)
    acts = torch.randn(1024, d)
    sae, log_sparsity = train_sae(iter(acts.split(128)), d, cfg, metadata={"hook_name": "blocks.0.hook_mlp_out"})
    folder = save_sae(sae, tmp_path / "layer0_mlp_out", cfg, {"nmse": 0.5}, log_sparsity)
    assert is_finished(folder)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
    loaded = SAE.load_from_disk(folder)
    x = torch.randn(200, d) * 2
    with torch.no_grad():
        assert torch.equal(loaded.encode(x), sae.encode(x))
        # sae-lens decodes with a dense product, ours sums k rows: equal up to rounding
        torch.testing.assert_close(loaded.decode(loaded.encode(x)), sae.decode(sae.encode(x)))
        assert torch.equal(load_sae(folder).encode(x), sae.encode(x))
    assert loaded.cfg.metadata.hook_name == "blocks.0.hook_mlp_out"
    assert SAETrainConfig.load(folder) == cfg
    assert json.loads((folder / "metrics.json").read_text()) == {"nmse": 0.5}


def test_config_scales_defaults_and_round_trips_through_json():
    paper = SAETrainConfig(train_tokens=150_000_000).resolve(512)
    assert (paper.k, paper.lr) == (30, pytest.approx(1e-4))
    small = SAETrainConfig(train_tokens=150_000_000).resolve(128)
    assert small.k == 8 and small.lr == pytest.approx(2e-4)
    short = SAETrainConfig(train_tokens=150_000_000 // 100).resolve(512)
    assert short.lr == pytest.approx(1e-3, rel=0.01)
    assert SAETrainConfig.from_json(json.loads(json.dumps(small.to_json()))) == small


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"k": 129}, "k=129 must lie between 1 and the dictionary size d_sae=128"),
        ({"train_tokens": 100, "batch_size": 128}, "at least one batch"),
        ({"buffer_tokens": 64, "batch_size": 128, "train_tokens": 1024}, "buffer_tokens"),
    ],
)
def test_impossible_configs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SAETrainConfig(**fields).resolve(32)


def test_activation_width_must_match_the_sae():
    cfg = SAETrainConfig(k=3, train_tokens=256, batch_size=128).resolve(16)
    with pytest.raises(ValueError, match="width 8"):
        train_sae(iter(torch.randn(256, 8).split(128)), 16, cfg)
