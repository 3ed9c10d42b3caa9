"""The converter from the paper authors' published checkpoints to our format.

A checkpoint is written in their layout with random weights, converted, loaded with
`load_model`, and its logits are compared with a reference forward pass written here in
plain torch straight from the published format's description (not from the converter):
RMS norms with optional gains, rotate-half rotary, attention output scaled by
1/sqrt(2 n_layer) when the checkpoint says so, and the bilinear MLP p((W x) * (V x)).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from pipelines.lm.convert import convert_checkpoint
from pipelines.engine.paths import TOKENIZER
from pipelines.lm.model import load_model

N_LAYER, D_MODEL, N_HEAD, D_HIDDEN, VOCAB, N_CTX = 2, 32, 4, 64, 100, 32
D_HEAD = D_MODEL // N_HEAD


def published_config(**overrides) -> dict:
    """An HF-style config as the authors' `Config.save_pretrained` writes it."""
    config = dict(n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL, d_hidden=D_HIDDEN,
                  n_ctx=N_CTX, bilinear=True, gate=None, bias=False, normalization=True,
                  scale_attn=True, tokenizer="ts-4096", architectures=["Transformer"])
    config.update(overrides)
    return config


def published_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights named and shaped like the published checkpoints."""
    gen = torch.Generator().manual_seed(seed)

    def linear(d_out: int, d_in: int) -> torch.Tensor:  # nn.Linear layout [out, in]
        return torch.randn(d_out, d_in, generator=gen) / math.sqrt(d_in)

    state = {
        "transformer.wte.weight": torch.randn(VOCAB, D_MODEL, generator=gen),
        "lm_head.weight": linear(VOCAB, D_MODEL),
    }
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D_HEAD, 2).float() / D_HEAD)
    for i in range(N_LAYER):
        h = f"transformer.h.{i}."
        state[h + "attn.qkv.weight"] = linear(3 * D_MODEL, D_MODEL)
        state[h + "attn.o.weight"] = linear(D_MODEL, D_MODEL)
        state[h + "attn.rotary.inv_freq"] = inv_freq.clone()  # a persistent buffer in theirs
        state[h + "mlp.w.weight"] = linear(2 * D_HIDDEN, D_MODEL)
        state[h + "mlp.p.weight"] = linear(D_MODEL, D_HIDDEN)
    return state


def write_tokenizer(path: Path) -> None:
    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def write_published(directory: Path, state: dict, config: dict, *, fmt: str = "safetensors",
                    tokenizer: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(state, str(directory / "model.safetensors"))
    else:
        torch.save(state, directory / "pytorch_model.bin")
    if tokenizer:
        write_tokenizer(directory / TOKENIZER)
    return directory


# --------------------------------------------------------------- reference forward pass


def rms_norm(x: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-8)
    return x if gain is None else x * gain


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary over the full head: x [batch, head, seq, d_head]."""
    seq, dh = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dh, 2, dtype=x.dtype) / dh)
    angles = torch.arange(seq, dtype=x.dtype)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)  # [seq, d_head]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def reference_attention(x: torch.Tensor, qkv_w: torch.Tensor, o_w: torch.Tensor) -> torch.Tensor:
    """Causal multi-head attention, x [batch, seq, d]; qkv rows are (3, n_head, d_head)."""
    b, s, d = x.shape
    qkv = (x @ qkv_w.T).reshape(b, s, 3, N_HEAD, D_HEAD).permute(2, 0, 3, 1, 4)
    q, k, v = rotary(qkv[0]), rotary(qkv[1]), qkv[2]  # [batch, head, seq, d_head]
    scores = q @ k.transpose(-1, -2) / math.sqrt(D_HEAD)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    z = (pattern @ v).transpose(1, 2).reshape(b, s, d)  # heads concatenated
    return z @ o_w.T


def reference_logits(state: dict[str, torch.Tensor], tokens: torch.Tensor, scale_attn: bool = True) -> torch.Tensor:
    """The published model's forward pass in float64: tokens [batch, seq] -> logits. Norm
    gains (`n1`, `n2`, `n_f` of older checkpoints) are applied when the state has them."""
    w = {k: v.double() for k, v in state.items()}
    x = w["transformer.wte.weight"][tokens]
    for i in range(N_LAYER):
        h = f"transformer.h.{i}."
        normed = rms_norm(x, w.get(h + "n1.weight"))
        attn = reference_attention(normed, w[h + "attn.qkv.weight"], w[h + "attn.o.weight"])
        x = x + (attn / math.sqrt(2 * N_LAYER) if scale_attn else attn)
        left, right = (rms_norm(x, w.get(h + "n2.weight")) @ w[h + "mlp.w.weight"].T).chunk(2, dim=-1)
        x = x + (left * right) @ w[h + "mlp.p.weight"].T
    return rms_norm(x, w.get("transformer.n_f.weight")) @ w["lm_head.weight"].T


TOKENS = torch.randint(0, VOCAB, (3, N_CTX), generator=torch.Generator().manual_seed(1))


def converted_logits(directory: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    model, _ = load_model(directory)
    with torch.no_grad():
        return model(tokens).double()


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_converted_logits_match_reference(tmp_path, fmt):
    state = published_weights()
    src = write_published(tmp_path / "published", state, published_config(), fmt=fmt)
    cfg = convert_checkpoint(src, tmp_path / "ours")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_mlp, cfg.d_vocab, cfg.n_ctx) == (
        N_LAYER, D_MODEL, N_HEAD, D_HIDDEN, VOCAB, N_CTX)
    assert cfg.eps == 1e-8
    assert (tmp_path / "ours" / TOKENIZER).is_file()

    model, loaded = load_model(tmp_path / "ours")
    assert loaded == cfg
    tokens = torch.randint(0, VOCAB, (3, N_CTX), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens).double()
    expected = reference_logits(state, tokens)
    assert expected.std() > 0.3  # logits carry signal, so the tolerance below is meaningful
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_mlp_factors_keep_their_names(tmp_path):
    """W (first half of mlp.w) is the gated factor: W_gate; V is W_in."""
    state = published_weights()
    convert_checkpoint(write_published(tmp_path / "p", state, published_config()), tmp_path / "o")
    model, _ = load_model(tmp_path / "o")
    w, v = state["transformer.h.1.mlp.w.weight"].chunk(2, dim=0)
    torch.testing.assert_close(model.blocks[1].mlp.W_gate.detach(), w.T)
    torch.testing.assert_close(model.blocks[1].mlp.W_in.detach(), v.T)


def test_bias_checkpoint_is_refused(tmp_path):
    src = write_published(tmp_path / "p", published_weights(), published_config(bias=True))
    with pytest.raises(ValueError, match="bias=True"):
        convert_checkpoint(src, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_tokenizer_is_taken_from_argument_or_refused(tmp_path):
    src = write_published(tmp_path / "p", published_weights(), published_config(), tokenizer=False)
    with pytest.raises(FileNotFoundError, match="ts-4096.*cannot be downloaded"):
        convert_checkpoint(src, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_checkpoint(src, tmp_path / "o", tokenizer=tmp_path / "nope.json")

    write_tokenizer(tmp_path / "tok.json")
    convert_checkpoint(src, tmp_path / "o", tokenizer=tmp_path / "tok.json")
    assert (tmp_path / "o" / TOKENIZER).read_bytes() == (tmp_path / "tok.json").read_bytes()


def test_missing_parts_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        convert_checkpoint(tmp_path / "absent", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        convert_checkpoint(tmp_path / "empty", tmp_path / "o")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(published_config()))
    with pytest.raises(FileNotFoundError, match="model.safetensors or pytorch_model.bin"):
        convert_checkpoint(tmp_path / "empty", tmp_path / "o")


def test_unknown_key_names_list_the_keys_found(tmp_path):
    state = {k.replace(".attn.qkv.", ".attn.c_attn."): v for k, v in published_weights().items()}
    src = write_published(tmp_path / "p", state, published_config())
    with pytest.raises(ValueError, match=r"h\.0\.attn\.qkv\.weight.*transformer\.h\.0\.attn\.c_attn"):
        convert_checkpoint(src, tmp_path / "o")


def test_leftover_weights_are_refused(tmp_path):
    """A tensor the converter would silently drop (here an MLP bias) is an error."""
    state = published_weights()
    state["transformer.h.0.mlp.w.bias"] = torch.zeros(2 * D_HIDDEN)
    src = write_published(tmp_path / "p", state, published_config())
    with pytest.raises(ValueError, match="mlp.w.bias"):
        convert_checkpoint(src, tmp_path / "o")


# --------------------------------------------------------------- the attention scale


def test_config_without_scale_attn_is_refused_with_the_reason(tmp_path):
    config = published_config()
    del config["scale_attn"]
    src = write_published(tmp_path / "p", published_weights(), config)
    with pytest.raises(ValueError, match=r"no scale_attn field.*ambiguous.*1/sqrt\(2 n_layer\).*--attention-scale"):
        convert_checkpoint(src, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="scale_attn"):
        convert_checkpoint(src, tmp_path / "o", scale_attn="config")


@pytest.mark.parametrize("choice", ["on", "off"])
def test_the_callers_choice_decides_the_scale(tmp_path, choice):
    state = published_weights()
    config = published_config()
    del config["scale_attn"]
    convert_checkpoint(write_published(tmp_path / "p", state, config), tmp_path / "o", scale_attn=choice)
    ours = converted_logits(tmp_path / "o")
    torch.testing.assert_close(ours, reference_logits(state, TOKENS, scale_attn=choice == "on"), atol=1e-4, rtol=1e-4)
    # the choice beats what a config says
    contrary = published_config(scale_attn=choice != "on")
    convert_checkpoint(write_published(tmp_path / "q", state, contrary), tmp_path / "o2", scale_attn=choice)
    torch.testing.assert_close(converted_logits(tmp_path / "o2"), ours, atol=1e-6, rtol=1e-6)


def test_scale_attn_false_converts_exactly(tmp_path):
    state = published_weights(seed=3)
    src = write_published(tmp_path / "p", state, published_config(scale_attn=False))
    convert_checkpoint(src, tmp_path / "o")
    ours = converted_logits(tmp_path / "o")
    unscaled, scaled = reference_logits(state, TOKENS, scale_attn=False), reference_logits(state, TOKENS)
    torch.testing.assert_close(ours, unscaled, atol=1e-4, rtol=1e-4)
    assert (unscaled - scaled).abs().max() > 100 * 1e-4  # the scale matters at this tolerance


# --------------------------------------------------------------- dtypes, types, norm gains


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_convert(tmp_path, dtype):
    state = published_weights()
    half = {k: v.to(dtype) for k, v in state.items()}  # the rotary inv_freq buffers too
    assert half["transformer.h.0.attn.rotary.inv_freq"].dtype == dtype
    cfg = convert_checkpoint(write_published(tmp_path / "p", half, published_config()), tmp_path / "o")
    model, _ = load_model(tmp_path / "o")
    assert all(p.dtype == torch.float32 for p in model.parameters()) and cfg.eps == 1e-8
    ours = converted_logits(tmp_path / "o")
    # exact on the weights as stored (half -> float32 is exact) ...
    torch.testing.assert_close(ours, reference_logits(half, TOKENS), atol=1e-4, rtol=1e-4)
    # ... and within the dtype's rounding of the float32 original
    full = reference_logits(state, TOKENS)
    eps = torch.finfo(dtype).eps
    error = ((ours - full).abs().max() / full.std()).item()
    assert error < 8 * eps, error  # measured: about 2.5 eps


def test_rotary_buffer_of_another_base_is_refused(tmp_path):
    state = published_weights()
    state["transformer.h.1.attn.rotary.inv_freq"] = 1.0 / 500000 ** (torch.arange(0, D_HEAD, 2).float() / D_HEAD)
    src = write_published(tmp_path / "p", state, published_config())
    with pytest.raises(ValueError, match=r"h\.1\.attn\.rotary\.inv_freq is not rotary base 10000"):
        convert_checkpoint(src, tmp_path / "o")
    state["transformer.h.1.attn.rotary.inv_freq"] = torch.ones(D_HEAD)  # wrong length
    with pytest.raises(ValueError, match="rotary base"):
        convert_checkpoint(write_published(tmp_path / "q", state, published_config()), tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field, value, wanted", [
    ("scale_attn", "false", "a boolean"),
    ("bias", 0, "a boolean"),
    ("n_layer", "2", "an integer"),
    ("d_model", 32.0, "an integer"),
    ("n_head", True, "an integer"),
    ("normalization", 1, "a boolean or a string"),
])
def test_config_fields_of_the_wrong_type_are_refused(tmp_path, field, value, wanted):
    src = write_published(tmp_path / "p", published_weights(), published_config(**{field: value}))
    with pytest.raises(ValueError, match=rf"config field {field} must be {wanted}, got {value!r}"):
        convert_checkpoint(src, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_norm_gains_are_used(tmp_path):
    state = published_weights()
    gen = torch.Generator().manual_seed(5)
    for i in range(N_LAYER):
        state[f"transformer.h.{i}.n1.weight"] = torch.rand(D_MODEL, generator=gen) + 0.5
        state[f"transformer.h.{i}.n2.weight"] = torch.rand(D_MODEL, generator=gen) + 0.5
    state["transformer.n_f.weight"] = torch.rand(D_MODEL, generator=gen) + 0.5
    convert_checkpoint(write_published(tmp_path / "p", state, published_config()), tmp_path / "o")
    ours = converted_logits(tmp_path / "o")
    expected = reference_logits(state, TOKENS)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    without = reference_logits({k: v for k, v in state.items() if not k.endswith(("n1.weight", "n2.weight",
                                                                                   "n_f.weight"))}, TOKENS)
    assert (without - expected).abs().max() > 0.1
    model, _ = load_model(tmp_path / "o")
    torch.testing.assert_close(model.blocks[1].ln2.w.detach(), state["transformer.h.1.n2.weight"])
    torch.testing.assert_close(model.ln_final.w.detach(), state["transformer.n_f.weight"])


# --------------------------------------------------------------- outputs and other refusals


def test_a_folder_with_a_model_is_replaced_only_with_force(tmp_path):
    first, second = published_weights(seed=0), published_weights(seed=1)
    convert_checkpoint(write_published(tmp_path / "p0", first, published_config()), tmp_path / "o")
    before = {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()}
    src = write_published(tmp_path / "p1", second, published_config())
    with pytest.raises(ValueError, match="already holds a model; pass --force"):
        convert_checkpoint(src, tmp_path / "o")
    assert {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()} == before
    convert_checkpoint(src, tmp_path / "o", force=True)
    torch.testing.assert_close(converted_logits(tmp_path / "o"), reference_logits(second, TOKENS),
                               atol=1e-4, rtol=1e-4)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left
    with pytest.raises(ValueError, match="must differ"):
        convert_checkpoint(src, src, force=True)


def test_sharded_safetensors_convert(tmp_path):
    state = published_weights()
    src = tmp_path / "p"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(published_config()))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(src / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    write_tokenizer(src / TOKENIZER)
    convert_checkpoint(src, tmp_path / "o")
    torch.testing.assert_close(converted_logits(tmp_path / "o"), reference_logits(state, TOKENS), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("overrides, message", [
    ({"normalization": False}, "normalization=False"),
    ({"normalization": "layer"}, "only RMS norm"),
    ({"norm_bias": True}, "norm_bias=True"),
    ({"attention2": True}, "attention2=True"),
    ({"bilinear": False}, "non-bilinear"),
    ({"gate": "relu"}, "non-bilinear"),
    ({"vocab_size": VOCAB + 1}, f"vocab_size={VOCAB + 1}.*{VOCAB} rows"),
])
def test_variants_we_cannot_hold_are_refused(tmp_path, overrides, message):
    src = write_published(tmp_path / "p", published_weights(), published_config(**overrides))
    with pytest.raises(ValueError, match=message):
        convert_checkpoint(src, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    src = write_published(tmp_path / "p", published_weights(), published_config(), tokenizer=False)
    vocab = {f"w{i}": i for i in range(VOCAB + 4)} | {"[UNK]": VOCAB + 4}
    big = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.save(str(tmp_path / "big.json"))
    with pytest.raises(ValueError, match="not this model's tokenizer"):
        convert_checkpoint(src, tmp_path / "o", tokenizer=tmp_path / "big.json")
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="not a readable tokenizers file"):
        convert_checkpoint(src, tmp_path / "o", tokenizer=tmp_path / "junk.json")
    assert not (tmp_path / "o").exists()


def test_wrong_shapes_are_refused(tmp_path):
    state = published_weights()
    state["transformer.h.0.mlp.p.weight"] = torch.zeros(D_MODEL, D_HIDDEN + 1)
    src = write_published(tmp_path / "p", state, published_config())
    with pytest.raises(ValueError, match=r"mlp\.p\.weight has shape \(32, 65\), expected \(32, 64\)"):
        convert_checkpoint(src, tmp_path / "o")
