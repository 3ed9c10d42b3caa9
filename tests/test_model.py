"""The bilinear LM: its MLP is exactly bilinear, it saves and loads, it can be hooked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipelines.lm.model import PRESETS, ModelConfig, build_model, load_model, model_digest, save_model
from tests.children import child_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = build_model(PRESETS["tiny"])
    with torch.no_grad():  # nonzero biases so the constant term is exercised
        for block in m.blocks:
            block.mlp.b_in.normal_()
            block.mlp.b_out.normal_()
            block.ln2.w.uniform_(0.5, 1.5)
    return m


def test_loading_a_model_leaves_the_global_generators_alone(model, tmp_path):
    # TransformerLens reseeds torch, numpy and random from its config's seed: only a model
    # being initialised for training should do that, not every load of a trained one
    save_model(model, PRESETS["tiny"], tmp_path)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_model(tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_mlp_is_exactly_bilinear(model):
    tokens = torch.randint(0, PRESETS["tiny"].d_vocab, (3, 16))
    _, cache = model.run_with_cache(tokens)
    for layer, block in enumerate(model.blocks):
        r = cache[f"blocks.{layer}.hook_resid_mid"]
        x = r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + block.ln2.eps) * block.ln2.w
        mlp = block.mlp
        expected = ((x @ mlp.W_gate) * (x @ mlp.W_in)) @ mlp.W_out + (mlp.b_in @ mlp.W_out + mlp.b_out)
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_mlp_out"], expected, atol=1e-5, rtol=1e-5)
        # the hook the pipeline reads for the MLP input, times the gain, is the same x
        normalized = cache[f"blocks.{layer}.ln2.hook_normalized"]
        torch.testing.assert_close(normalized * block.ln2.w, x, atol=1e-6, rtol=1e-6)


def test_hook_points_exist(model):
    hooks = set(model.hook_dict)
    for layer in range(model.cfg.n_layers):
        for name in ("hook_resid_mid", "hook_mlp_out", "ln2.hook_normalized", "hook_resid_pre"):
            assert f"blocks.{layer}.{name}" in hooks


def test_save_load_identical_logits(model, tmp_path):
    tokens = torch.randint(0, PRESETS["tiny"].d_vocab, (2, 20))
    save_model(model, PRESETS["tiny"], tmp_path)
    loaded, cfg = load_model(tmp_path)
    assert cfg == PRESETS["tiny"]
    assert torch.equal(loaded(tokens), model.eval()(tokens))


def test_missing_and_corrupt_checkpoints(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    save_model(model, PRESETS["tiny"], tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt model weights"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt model config"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"n_layers": 2, "bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        load_model(tmp_path)


def test_checkpoint_of_other_shape_is_refused(model, tmp_path):
    save_model(model, PRESETS["tiny"], tmp_path)
    other = ModelConfig(**{**PRESETS["tiny"].to_json(), "d_mlp": 96})
    (tmp_path / "config.json").write_text(json.dumps(other.to_json()))
    with pytest.raises(ValueError, match="does not match"):
        load_model(tmp_path)


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match="divisible"):
        build_model(ModelConfig(d_model=30, n_heads=4))


def test_model_digest_is_content_based(model, tmp_path):
    save_model(model, PRESETS["tiny"], tmp_path / "a")
    save_model(model, PRESETS["tiny"], tmp_path / "b")
    assert model_digest(tmp_path / "a") == model_digest(tmp_path / "b")
    with torch.no_grad():
        model.blocks[0].mlp.W_in[0, 0] += 1.0
    save_model(model, PRESETS["tiny"], tmp_path / "b")
    assert model_digest(tmp_path / "a") != model_digest(tmp_path / "b")
    save_model(model, PRESETS["tiny"].replace(seed=1), tmp_path / "a")
    assert model_digest(tmp_path / "a") != model_digest(tmp_path / "b")  # the config counts too


def test_non_finite_weights_are_refused(model, tmp_path):
    with torch.no_grad():
        model.blocks[1].attn.W_O[0, 0, 0] = float("nan")
    save_model(model, PRESETS["tiny"], tmp_path)
    with pytest.raises(ValueError, match="W_O"):
        load_model(tmp_path)


def test_importing_the_model_module_leaves_transformer_lens_alone():
    # the identity activation is registered where a model is built (or loaded), once, not as a
    # side effect of an import: a fresh interpreter shows what importing alone does
    code = """import transformer_lens.utilities.activation_functions as tl
import pipelines.lm.model as lm
assert "identity" not in tl.SUPPORTED_ACTIVATIONS, "registered on import"
lm.build_model(lm.PRESETS["tiny"])
assert tl.SUPPORTED_ACTIVATIONS["identity"] is lm.identity
"""
    env = child_env(HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_model_built_for_the_cpu_says_so_where_a_gpu_is_present(monkeypatch, tmp_path):
    # TransformerLens fills a config's device with CUDA when torch sees one; the passes that move
    # their batches to the model's device read it there (a GPU check of `--device cpu` sent the
    # held-out batches to CUDA while the model stayed on the CPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = build_model(PRESETS["tiny"].replace(d_vocab=50), "cpu", seed=0)
    assert model.cfg.device == "cpu"
    save_model(model, PRESETS["tiny"].replace(d_vocab=50), tmp_path / "lm")
    assert load_model(tmp_path / "lm", "cpu")[0].cfg.device == "cpu"
