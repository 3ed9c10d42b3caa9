"""The plain forward pass (`circuits.forward`) against TransformerLens's on the same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from circuits import forward
from circuits.sites import SITES, hook_name
from pipelines.lm.model import PRESETS, build_model, hooked_config


@pytest.fixture(scope="module")
def model():
    """The tiny LM with every weight drawn at random: biases, norm gains and all, so that a
    term the plain pass forgot (or TransformerLens's zero-initialised biases hid) shows."""
    model = build_model(PRESETS["tiny"].replace(d_vocab=97), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if name.endswith((".w", "b_Q", "b_K", "b_V", "b_O", "b_in", "b_out", "b_U")) else 0.0
            p.mul_(1.5).add_(scale * torch.randn(p.shape, generator=g) + (1.0 if name.endswith(".w") else 0.0))
    return model.eval()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(2))


def test_logits_equal_transformer_lens(model, tokens):
    logits, found = forward.run(model, tokens)
    expected = model(tokens)
    assert found == {}
    scale = float(expected.detach().abs().max())
    assert scale > 1.0  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=2e-6 * scale)


def test_every_site_equals_the_hooks(model, tokens):
    points = [(layer, site) for layer in range(2) for site in SITES]
    _, found = forward.run(model, tokens, points)
    _, cache = model.run_with_cache(tokens)
    for layer, site in points:
        expected = cache[hook_name(layer, site)]
        if site == "mlp_in":  # the hook fires before the norm's gain
            expected = expected * model.blocks[layer].ln2.w
        torch.testing.assert_close(found[layer, site], expected, rtol=1e-5, atol=2e-6 * float(expected.detach().abs().max()))


def test_loss_and_gradients_equal_transformer_lens(model, tokens):
    per_token = forward.next_token_loss(forward.run(model, tokens)[0], tokens)
    expected = model(tokens, return_type="loss", loss_per_token=True)
    torch.testing.assert_close(per_token, expected, rtol=1e-5, atol=1e-5)
    names = [name for name, _ in model.named_parameters()]
    ours = torch.autograd.grad(per_token.mean(), list(model.parameters()))
    theirs = torch.autograd.grad(model(tokens, return_type="loss"), list(model.parameters()))
    for name, a, b in zip(names, ours, theirs, strict=True):
        scale = float(b.abs().max())
        assert scale > 0, name  # every weight takes part
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * scale, msg=name)


def test_blocks_stop_where_asked(model, tokens, monkeypatch):
    seen = []
    mlp = forward.mlp
    monkeypatch.setattr(forward, "mlp", lambda m, layer, x: seen.append(layer) or mlp(m, layer, x))
    stream, found = forward.blocks(model, forward.embed(model, tokens), 0, 1, [(0, "mlp_out")])
    assert seen == [0] and set(found) == {(0, "mlp_out")}
    expected = model.run_with_cache(tokens)[1]["blocks.1.hook_resid_pre"]
    torch.testing.assert_close(stream, expected, rtol=1e-5, atol=2e-6 * float(expected.detach().abs().max()))


def test_bf16_autocast_runs_as_transformer_lens_does(tokens):
    model = build_model(PRESETS["tiny"].replace(d_vocab=97), seed=3).eval()  # as initialised: less sharp
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = forward.run(model, tokens)
        expected = model(tokens)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), expected.float(), rtol=0.02, atol=0.02 * float(expected.detach().abs().max()))


def test_attention_runs_in_float32_under_cpu_autocast(model, tokens, monkeypatch):
    seen = []
    sdpa = forward.F.scaled_dot_product_attention
    monkeypatch.setattr(forward.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
                        or sdpa(q, k, v, **kw))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = forward.run(model, tokens)
    assert logits.dtype == torch.bfloat16  # the products around it are bf16
    assert seen and all(s == (torch.float32,) * 3 + (False,) for s in seen)


@pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated")  # TransformerLens 3.9's, for any model
@pytest.mark.parametrize("change", [{"rotary_adjacent_pairs": True}, {"normalization_type": "LN"},
                                    {"act_fn": "gelu"}, {"parallel_attn_mlp": True}])
def test_another_architecture_is_refused(model, change):
    from transformer_lens import HookedTransformer

    other = HookedTransformer(dataclasses.replace(hooked_config(PRESETS["tiny"].replace(d_vocab=97), 0), **change))
    with pytest.raises(ValueError, match=f"not a bilinear LM .*{next(iter(change))}"):
        forward.run(other, torch.zeros(1, 4, dtype=torch.long))


def test_streams_resume_where_the_last_pass_of_a_batch_stopped(model, tokens, monkeypatch):
    seen = []
    mlp = forward.mlp
    monkeypatch.setattr(forward, "mlp", lambda m, layer, x: seen.append(layer) or mlp(m, layer, x))
    points = lambda layer: [(layer, "resid_mid"), (layer, "mlp_out")]  # noqa: E731
    streams = forward.Streams(model)
    entering0, found0 = streams.layer("rows 0-2", tokens, 0, points(0))
    entering1, found1 = streams.layer("rows 0-2", tokens, 1, points(1))
    assert seen == [0, 1]  # layer 1 resumed from the stream block 0 left: each block ran once
    seen.clear()
    _, expected = forward.blocks(model, forward.embed(model, tokens), 0, 2, points(0) + points(1))
    assert torch.equal(entering0, forward.embed(model, tokens))
    assert torch.equal(entering1, forward.blocks(model, forward.embed(model, tokens), 0, 1)[0])
    for point, value in {**found0, **found1}.items():
        assert torch.equal(value, expected[point]), point  # the same operations on the same values
    seen.clear()
    other = tokens.flip(0)  # other tokens under the same key: not resumed
    _, found = streams.layer("rows 0-2", other, 1, points(1))
    assert seen == [0, 1]
    torch.testing.assert_close(found[1, "mlp_out"], expected[1, "mlp_out"].flip(0))
    seen.clear()
    streams.layer("rows 0-2", other, 0, points(0))  # the kept stream has passed layer 0: from the embedding
    assert seen == [0]
    with pytest.raises(ValueError, match="not all in layer 0"):
        streams.layer("rows 0-2", tokens, 0, [(1, "mlp_out")])


def test_streams_keep_nothing_when_asked_and_after_clear(model, tokens, monkeypatch):
    seen = []
    mlp = forward.mlp
    monkeypatch.setattr(forward, "mlp", lambda m, layer, x: seen.append(layer) or mlp(m, layer, x))
    points = lambda layer: [(layer, "mlp_out")]  # noqa: E731
    once = forward.Streams(model, keep=False)
    once.layer("rows", tokens, 0, points(0))
    once.layer("rows", tokens, 1, points(1))
    assert seen == [0, 0, 1]  # nothing kept: layer 1 ran from the embedding
    seen.clear()
    streams = forward.Streams(model)
    streams.layer("rows", tokens, 0, points(0))
    streams.clear()
    streams.layer("rows", tokens, 1, points(1))
    assert seen == [0, 0, 1]


@torch.no_grad()
def test_a_resumed_pass_equals_the_whole_pass_after_its_first_changed_position(model, tokens):
    """Changing block 0's MLP input at some positions of each row changes nothing before the
    first of them: resuming there, with the clean pass's keys and values of the later
    blocks, gives what a whole pass with the change gives, at every resumed position."""
    g = torch.Generator().manual_seed(5)
    x0 = forward.embed(model, tokens)
    kept = {}
    _, clean = forward.blocks(model, x0, 0, 2, [(0, "resid_mid")], kept=kept)
    # each row resumed from another position, a run of positions with padding (-1) after it
    positions = torch.tensor([[3, 4, 5, 6, 7], [20, 21, 22, -1, -1], [39, -1, -1, -1, -1]])
    valid = positions >= 0
    change = torch.zeros(tokens.shape + (32,))
    rows = torch.arange(3)[:, None].expand_as(positions)
    change[rows[valid], positions[valid]] = torch.randn(int(valid.sum()), 32, generator=g)
    changed_input = lambda resid_mid, mlp_in: mlp_in - change  # noqa: E731
    final, found = forward.blocks(model, x0, 0, 2, [(0, "mlp_out")], edits={0: changed_input})
    at = positions.clamp_min(0)
    here = lambda t: t[rows, at]  # noqa: E731  [3, 5, d] at the resumed positions
    resumed, mlp_out = forward.resume(model, here(clean[0, "resid_mid"]), 0, 2, positions,
                                      {1: kept[1]}, edit=lambda resid_mid, mlp_in: mlp_in - here(change))
    scale = float(final.abs().max())
    assert float((final - forward.blocks(model, x0, 0, 2)[0]).abs()[rows[valid], at[valid]].min()) > 1e-3 * scale
    torch.testing.assert_close(resumed[valid], here(final)[valid], rtol=1e-5, atol=2e-6 * scale)
    torch.testing.assert_close(mlp_out[valid], here(found[0, "mlp_out"])[valid], rtol=1e-5, atol=2e-6 * scale)
