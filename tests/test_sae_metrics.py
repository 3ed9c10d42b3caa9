"""SAE metrics against hand-written references: a manual splice, plain-torch NMSE, L0, dead."""

from __future__ import annotations

import pytest
import torch

from circuits.weights import SAEWeights
from sae.metrics import clean_losses, evaluate_sae

BOS, PAD = 0, 1


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(2, 512, (10, 64), generator=g)
    tokens[:, 0] = BOS
    tokens[3, 30:] = PAD
    tokens[7, 50:] = PAD
    return tokens


def keep_mask(tokens, bos_id=None, pad_id=None):
    keep = torch.ones_like(tokens, dtype=torch.bool)
    for special in (bos_id, pad_id):
        if special is not None:
            keep &= tokens != special
    return keep


def make_sae(d_in: int = 32, k: int = 4, seed: int = 0) -> SAEWeights:
    """A random TopK SAE whose bias and first 10 latents make the metrics non-trivial."""
    g = torch.Generator().manual_seed(seed)
    W_dec = torch.randn(4 * d_in, d_in, generator=g)
    W_dec /= W_dec.norm(dim=1, keepdim=True)
    W_enc = W_dec.T.clone()
    W_enc[:, :10] = 0  # pre-activation 0: these latents can never fire
    return SAEWeights(W_enc=W_enc, b_enc=torch.zeros(4 * d_in), W_dec=W_dec,
                      b_dec=0.1 * torch.randn(d_in, generator=g), apply_b_dec_to_input=True, k=k)


def manual_reconstruction(sae, x: torch.Tensor):
    """TopK SAE written out from its weights: (latents `[n, d_sae]`, reconstruction `[n, d]`)."""
    pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc
    top = pre.topk(sae.k, dim=-1)
    latents = torch.zeros_like(pre).scatter(-1, top.indices, top.values.clamp_min(0))
    return latents, latents @ sae.W_dec + sae.b_dec


def cross_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-position next-token loss `[batch, pos - 1]` from log-softmax, by hand."""
    logp = logits[:, :-1].log_softmax(-1)
    return -logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("site", ["resid_mid", "mlp_out", "mlp_in"])
def test_metrics_match_a_manual_splice(model, tokens, site):
    sae = make_sae()
    keep = keep_mask(tokens, bos_id=BOS, pad_id=PAD)
    hook = "blocks.1.ln2.hook_normalized" if site == "mlp_in" else f"blocks.1.hook_{site}"
    gain = model.blocks[1].ln2.w if site == "mlp_in" else torch.ones(32)
    with torch.no_grad():
        got = evaluate_sae(model, sae, tokens, 1, site, keep, batch_seqs=3)

        _, cache = model.run_with_cache(tokens)
        x = cache[hook][keep] * gain  # mlp_in: what the MLP multiplies, after the gain
        latents, x_hat = manual_reconstruction(sae, x)

        def replace(act, hook):
            act = act.clone()
            act[keep] = x_hat / gain
            return act

        clean = model(tokens)
        patched = model.run_with_hooks(tokens, fwd_hooks=[(hook, replace)])
    scored = keep[:, :-1] & keep[:, 1:]
    loss_clean = cross_entropy(clean, tokens)[scored].mean().item()
    loss_patched = cross_entropy(patched, tokens)[scored].mean().item()
    assert got.loss_clean == pytest.approx(loss_clean, rel=1e-5)
    assert got.loss_patched == pytest.approx(loss_patched, rel=1e-5)
    assert got.loss_added == pytest.approx((loss_patched - loss_clean) / loss_clean, rel=1e-3, abs=1e-6)
    assert abs(got.loss_added) > 1e-5  # the splice really changed the model

    nmse = ((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    assert got.nmse == pytest.approx(nmse.item(), rel=1e-4)
    assert got.l0 == pytest.approx((latents > 0).sum(1).float().mean().item())
    dead = 1 - (latents > 0).any(0).float().mean().item()
    assert got.dead_fraction == pytest.approx(dead)
    assert got.dead_fraction >= 10 / 128
    assert got.eval_tokens == int(keep.sum())


def test_clean_losses_computed_once_give_each_saes_metrics(model, tokens):
    """The SAE stage computes the model's own losses once for all its SAEs: each SAE's metrics
    are then the same, bit for bit, as when evaluate_sae computes them itself."""
    keep = keep_mask(tokens, bos_id=BOS, pad_id=PAD)
    clean = clean_losses(model, tokens, batch_seqs=3)
    assert clean.shape == (tokens.shape[0], tokens.shape[1] - 1)
    for seed, site in ((0, "resid_mid"), (1, "mlp_out")):
        alone = evaluate_sae(model, make_sae(seed=seed), tokens, 1, site, keep, batch_seqs=3)
        assert evaluate_sae(model, make_sae(seed=seed), tokens, 1, site, keep, batch_seqs=3, clean=clean) == alone
    with pytest.raises(ValueError, match="clean losses of shape"):
        evaluate_sae(model, make_sae(), tokens, 1, "resid_mid", keep, batch_seqs=3, clean=clean[:4])


def test_a_perfect_reconstruction_adds_no_loss(model, tokens):
    """An SAE that reconstructs exactly (identity dictionary, k = d) gives NMSE 0, loss added 0."""
    sae = SAEWeights(W_enc=torch.eye(32) * 1e3,  # every latent positive once x - b_dec is shifted
                     b_enc=torch.zeros(32), W_dec=torch.eye(32) * 1e-3, b_dec=torch.full((32,), -100.0), k=32)
    got = evaluate_sae(model, sae, tokens, 0, "resid_mid", keep_mask(tokens, bos_id=BOS))
    assert got.nmse == pytest.approx(0, abs=1e-8)
    assert got.loss_added == pytest.approx(0, abs=1e-6)
    assert got.l0 == 32 and got.dead_fraction == 0


def test_dimension_mismatch_is_refused(model, tokens):
    sae = make_sae(d_in=16)
    with pytest.raises(ValueError, match="dimension mismatch.*d_in=16.*d_model=32"):
        evaluate_sae(model, sae, tokens, 0, "mlp_out")


def test_unknown_site_is_refused(model, tokens):
    with pytest.raises(ValueError, match="unknown SAE site 'attn_out'"):
        evaluate_sae(model, make_sae(), tokens, 0, "attn_out")
