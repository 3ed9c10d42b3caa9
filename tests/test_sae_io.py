"""SAE folders on disk: the paper authors' format against an independent re-implementation of
their encoding, sae-lens folders, the checks that an SAE is used where it belongs, and the
training recipe's defaults and refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from sae.config import SAETrainConfig
from sae.io import check_sae_point, load_sae, sae_format
from sae.topk import TopKAutoencoder, save_sae_lens

D, N = 12, 40


def write_authors_sae(folder, point=("mlp-in", 1), k=5, normalize=None, encoder_bias=True, seed=0, **extra):
    """An SAE in the authors' layout from random weights: `config.json` (vars of their
    SAEConfig) and `model.safetensors`; returns the raw tensors."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"w_enc.weight": torch.randn(N, D, generator=g), "w_dec.weight": torch.randn(D, N, generator=g),
               "b_dec": torch.randn(D, generator=g)}
    if encoder_bias:
        tensors["w_enc.bias"] = torch.randn(N, generator=g)
    folder.mkdir(parents=True)
    config = {"point": list(point), "target": None, "lr": 1e-4, "d_model": D, "n_ctx": 256, "expansion": N // D,
              "k": k, "normalize": normalize, "encoder_bias": encoder_bias, "bilinear_encoder": False,
              "normalize_decoder": True, "tag": None, "kwargs": {}, **extra}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def their_encode(t, x, k, normalize):
    """Their encoding as described: top k raw values of w_enc(x / normalize - b_dec), no ReLU."""
    s = normalize or 1.0
    hid = (x / s - t["b_dec"]) @ t["w_enc.weight"].T + t.get("w_enc.bias", 0)
    top = hid.topk(k, dim=-1)
    return torch.zeros_like(hid).scatter(-1, top.indices, top.values)


def their_decode(t, z, normalize):
    return (z @ t["w_dec.weight"].T + t["b_dec"]) * (normalize or 1.0)


@pytest.mark.parametrize("normalize, encoder_bias", [(None, True), (2.5, False)])
def test_authors_format_encodes_and_decodes_as_theirs(tmp_path, normalize, encoder_bias):
    t = write_authors_sae(tmp_path / "1-mlp-in-x4-k5", normalize=normalize, encoder_bias=encoder_bias)
    sae = load_sae(tmp_path / "1-mlp-in-x4-k5")
    assert sae.format == "authors" and sae.point == (1, "mlp_in")
    x = 3 * torch.randn(200, D, generator=torch.Generator().manual_seed(1))
    z = sae.weights.encode(x)
    expected = their_encode(t, x, 5, normalize)
    torch.testing.assert_close(z, expected, rtol=1e-5, atol=1e-5)
    assert ((z != 0).sum(-1) == 5).all()
    torch.testing.assert_close(sae.weights.decode(z), their_decode(t, expected, normalize), rtol=1e-5, atol=1e-4)


def test_authors_topk_keeps_negative_values(tmp_path):
    t = write_authors_sae(tmp_path / "sae")
    t["w_enc.bias"] -= 100.0  # every pre-activation negative: a ReLU would silence them all
    save_file(t, str(tmp_path / "sae" / "model.safetensors"))
    x = torch.randn(50, D)
    z = load_sae(tmp_path / "sae").weights.encode(x)
    torch.testing.assert_close(z, their_encode(t, x, 5, None), rtol=1e-5, atol=1e-4)
    assert (z < 0).sum() == 50 * 5  # active means selected by the TopK, whatever the sign


@pytest.mark.parametrize("name, site", [("resid-mid", "resid_mid"), ("mlp-out", "mlp_out"), ("mlp_in", "mlp_in")])
def test_authors_point_names(tmp_path, name, site):
    write_authors_sae(tmp_path / "sae", point=(name, 3))
    assert load_sae(tmp_path / "sae").point == (3, site)


@pytest.mark.parametrize("change, message", [
    ({"point": ["attn-out", 1]}, "not one this toolkit analyses"),
    ({"point": "mlp-in"}, "must be \\[name, layer\\]"),
    ({"k": "5"}, "k must be int"),
    ({"normalize": "yes"}, "normalize must be a positive number"),
    ({"bilinear_encoder": True}, "bilinear encoder"),
])
def test_authors_format_refusals(tmp_path, change, message):
    folder = tmp_path / "sae"
    write_authors_sae(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_sae(folder)


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    t = write_authors_sae(tmp_path / "sae")
    t["w_dec.weight"][2, 3] = float("inf")
    save_file(t, str(tmp_path / "sae" / "model.safetensors"))
    with pytest.raises(ValueError, match="w_dec.weight holds Inf"):
        load_sae(tmp_path / "sae")


def test_a_folder_of_neither_format_is_named(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match="notes.txt"):
        sae_format(tmp_path / "x")


def test_our_sae_lens_folder_loads_with_its_hook(tmp_path):
    sae = TopKAutoencoder(D, N, 4, seed=3)
    with torch.no_grad():
        sae.b_dec.normal_()
    save_sae_lens(sae, tmp_path / "sae", {"hook_name": "blocks.2.hook_resid_mid"})
    loaded = load_sae(tmp_path / "sae")
    assert loaded.format == "sae-lens" and loaded.point == (2, "resid_mid")
    x = torch.randn(100, D)
    values, indices = sae.encode(x)
    torch.testing.assert_close(loaded.weights.encode(x), sae.dense(values, indices).detach())


def test_check_sae_point_refuses_what_does_not_fit(tmp_path):
    write_authors_sae(tmp_path / "sae", point=("mlp-in", 1))
    sae = load_sae(tmp_path / "sae")
    assert check_sae_point(sae, D, 1, ("resid_mid", "mlp_in"), "input") == "mlp_in"
    with pytest.raises(ValueError, match="layer 0's input SAE must read"):
        check_sae_point(sae, D, 0, ("resid_mid", "mlp_in"), "input")
    with pytest.raises(ValueError, match="blocks.1.hook_mlp_out"):
        check_sae_point(sae, D, 1, ("mlp_out",), "output")
    with pytest.raises(ValueError, match="width 12"):
        check_sae_point(sae, 16, 1, ("mlp_in",), "input")
    config = json.loads((tmp_path / "sae" / "config.json").read_text())
    config["point"] = None
    (tmp_path / "sae" / "config.json").write_text(json.dumps(config))
    hookless = load_sae(tmp_path / "sae")
    with pytest.raises(ValueError, match="--allow-hookless-saes"):
        check_sae_point(hookless, D, 0, ("resid_mid",), "input")
    assert check_sae_point(hookless, D, 0, ("resid_mid",), "input", allow_hookless=True) == "resid_mid"


def test_recipe_scales_defaults_and_round_trips_through_json():
    paper = SAETrainConfig(train_tokens=150_000_000).resolve(512)
    assert (paper.k, paper.lr) == (30, pytest.approx(1e-4))
    small = SAETrainConfig(train_tokens=150_000_000).resolve(128)
    assert small.k == 8 and small.lr == pytest.approx(4e-4)  # d_in and d_sae 4x smaller: sqrt(16) times the rate
    short = SAETrainConfig(train_tokens=150_000_000 // 100).resolve(512)
    assert short.lr == pytest.approx(1e-3, rel=0.01)
    assert SAETrainConfig.from_json(json.loads(json.dumps(small.to_json()))) == small
    # the dead-latent window: the paper-length run keeps 1M tokens, the demo's 1M-token run a sixteenth
    assert paper.dead_after_tokens == 1_000_000
    assert SAETrainConfig(train_tokens=1_000_000).resolve(128).dead_after_tokens == 62_500
    assert SAETrainConfig(train_tokens=1_000_000, dead_after_tokens=5_000).resolve(128).dead_after_tokens == 5_000


def test_the_resolved_recipe_says_which_precision_the_stream_runs_in(monkeypatch):
    """`auto` is bf16 where the device multiplies bfloat16 in hardware: the recipe (and so the
    SAEs' stamps) holds what it resolved to, not `auto`, so that a run on other hardware is
    another recipe; an explicit precision stays as asked."""
    import sae.activations

    for native, expected in ((True, "bf16"), (False, "none")):
        monkeypatch.setattr(sae.activations, "native_bf16", lambda device, native=native: native)
        assert SAETrainConfig().resolve(128, "cpu").autocast == expected
        assert SAETrainConfig(autocast="none").resolve(128, "cpu").autocast == "none"
        assert SAETrainConfig(autocast="bf16").resolve(128, "cpu").autocast == "bf16"


@pytest.mark.parametrize("fields, message", [
    ({"k": 129}, "k=129 must not exceed the dictionary size d_sae=128"),
    ({"train_tokens": 100, "batch_size": 128}, "at least one batch"),
    ({"buffer_tokens": 64, "batch_size": 128, "train_tokens": 1024}, "buffer_tokens"),
    ({"train_tokens": -5}, "train_tokens must be at least 1"),
    ({"lr": "fast"}, "lr must be"),
])
def test_impossible_recipes_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SAETrainConfig(**fields).resolve(32)
