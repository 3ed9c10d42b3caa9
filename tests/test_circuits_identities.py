"""Exact identities of DESIGN section 4, on random small float64 weights.

References are computed independently: by a TransformerLens model, by sae-lens SAEs, or by
explicit formulas written out here, never by the code under test.
"""

from __future__ import annotations

import pytest
import torch
from sae_lens.saes.topk_sae import TopKSAE, TopKSAEConfig
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.utilities.activation_functions import SUPPORTED_ACTIVATIONS

from circuits.bilinear import (
    bilinear_gram,
    bilinear_tensor,
    hosvd,
    interaction_matrices,
    output_constant,
    symmetrise,
)
from circuits.sae_basis import input_basis, output_directions, preactivation_offset, project
from circuits.spectra import eigh_by_magnitude
from circuits.weights import from_hooked_transformer, from_sae_lens

SUPPORTED_ACTIVATIONS.setdefault("identity", lambda x: x)  # as pipelines.model registers it
TOL = dict(rtol=1e-10, atol=1e-10)
D, H, N_IN, N_OUT = 12, 20, 30, 25


def bilinear_model(seed: int = 0) -> HookedTransformer:
    cfg = HookedTransformerConfig(
        n_layers=2, d_model=D, n_heads=2, d_head=D // 2, d_mlp=H, n_ctx=16, d_vocab=50,
        act_fn="identity", gated_mlp=True, normalization_type="RMS",
        positional_embedding_type="rotary", rotary_dim=D // 2, eps=1e-5, seed=seed,
        dtype=torch.float64,
    )
    model = HookedTransformer(cfg, move_to_device=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # TransformerLens starts biases at 0 and gains at 1: make them count
        for block in model.blocks:
            block.mlp.b_in.normal_(generator=gen)
            block.mlp.b_out.normal_(generator=gen)
            block.ln2.w.uniform_(0.5, 1.5, generator=gen)
    return model


def random(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def random_mlp(gen):
    Wg, Wi, Wo = random(D, H, gen=gen), random(H, D, gen=gen), random(H, D, gen=gen)
    return Wg, Wi.T.contiguous(), Wo, random(H, gen=gen), random(D, gen=gen)


def mlp_formula(x, Wg, Wi, Wo, b_in, b_out):
    """TransformerLens's GatedMLP with identity activation, written out."""
    return ((x @ Wg) * (x @ Wi) + b_in) @ Wo + b_out


def test_quadratic_form_matches_transformer_lens_mlp():
    model = bilinear_model()
    tokens = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(1))
    _, cache = model.run_with_cache(tokens)
    gen = torch.Generator().manual_seed(2)
    for layer in range(2):
        mlp = from_hooked_transformer(model, layer)
        U = random(7, D, gen=gen)
        normalized = cache[f"blocks.{layer}.ln2.hook_normalized"]
        x = (normalized * model.blocks[layer].ln2.w).reshape(-1, D)
        r = cache[f"blocks.{layer}.hook_resid_mid"].reshape(-1, D)
        rms = (r.pow(2).mean(-1, keepdim=True) + mlp.eps).sqrt()
        torch.testing.assert_close(x, mlp.g * r / rms, **TOL)

        Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, U)
        quadratic = torch.einsum("ti,nij,tj->tn", x, Q, x)
        b_const = output_constant(mlp.W_out, mlp.b_in, mlp.b_out)
        mlp_out = cache[f"blocks.{layer}.hook_mlp_out"].reshape(-1, D)
        torch.testing.assert_close(quadratic, mlp_out @ U.T - U @ b_const, **TOL)


def test_symmetrising_changes_no_output():
    gen = torch.Generator().manual_seed(3)
    Wg, Wi, Wo, _, _ = random_mlp(gen)
    U, x = random(5, D, gen=gen), random(40, D, gen=gen)
    raw = torch.stack([Wg @ torch.diag(Wo @ u) @ Wi.T for u in U])  # unsymmetrised Q_u
    assert not torch.allclose(raw, raw.mT)
    sym = interaction_matrices(Wg, Wi, Wo, U)
    torch.testing.assert_close(sym, sym.mT, rtol=0, atol=0)
    torch.testing.assert_close(sym, symmetrise(raw), **TOL)
    torch.testing.assert_close(
        torch.einsum("ti,nij,tj->tn", x, raw, x), torch.einsum("ti,nij,tj->tn", x, sym, x), **TOL
    )


def test_bilinear_tensor_matches_interaction_matrices_of_basis_vectors():
    gen = torch.Generator().manual_seed(4)
    Wg, Wi, Wo, _, _ = random_mlp(gen)
    B = bilinear_tensor(Wg, Wi, Wo)
    loops = torch.zeros(D, D, D, dtype=torch.float64)
    for h in range(H):
        loops += Wo[h][:, None, None] * torch.outer(Wg[:, h], Wi[:, h])[None]
    torch.testing.assert_close(B, 0.5 * (loops + loops.transpose(1, 2)), **TOL)
    basis_vectors = torch.eye(D, dtype=torch.float64)
    torch.testing.assert_close(interaction_matrices(Wg, Wi, Wo, basis_vectors), B, **TOL)


def test_hosvd_matches_svd_of_reshaped_tensor():
    gen = torch.Generator().manual_seed(5)
    Wg, Wi, Wo, _, _ = random_mlp(gen)
    B = torch.einsum("ho,ih,jh->oij", Wo, Wg, Wi)
    B = 0.5 * (B + B.transpose(1, 2))
    flat = B.reshape(D, D * D)
    torch.testing.assert_close(bilinear_gram(Wg, Wi, Wo), flat @ flat.T, **TOL)

    S, U = hosvd(Wg, Wi, Wo)
    torch.testing.assert_close(S, torch.linalg.svdvals(flat), rtol=1e-8, atol=1e-8)
    right = interaction_matrices(Wg, Wi, Wo, U.T) / S[:, None, None]  # [k, d, d]
    gram = torch.einsum("kij,lij->kl", right, right)
    torch.testing.assert_close(gram, torch.eye(D, dtype=torch.float64), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(torch.einsum("ok,k,kij->oij", U, S, right), B, rtol=1e-8, atol=1e-8)

    S3, U3 = hosvd(Wg, Wi, Wo, k=3)  # truncation error is the discarded singular values
    truncated = torch.einsum("ok,kij->oij", U3, interaction_matrices(Wg, Wi, Wo, U3.T))
    torch.testing.assert_close((B - truncated).norm(), S[3:].norm(), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(S3, S[:3], **TOL)


def topk_sae(d_in, d_sae, k, apply_b_dec, gen, rescale=False) -> TopKSAE:
    cfg = TopKSAEConfig(
        d_in=d_in, d_sae=d_sae, k=k, dtype="float64", apply_b_dec_to_input=apply_b_dec,
        rescale_acts_by_decoder_norm=rescale,
    )
    sae = TopKSAE(cfg)
    with torch.no_grad():
        for p in (sae.W_enc, sae.W_dec, sae.b_enc, sae.b_dec):
            p.copy_(random(*p.shape, gen=gen))
    return sae


@pytest.mark.parametrize("apply_b_dec", [True, False])
def test_sae_basis_form_equals_output_sae_preactivation(apply_b_dec):
    model = bilinear_model(seed=6)
    mlp = from_hooked_transformer(model, 1)
    gen = torch.Generator().manual_seed(7)
    sae_in = from_sae_lens(topk_sae(D, N_IN, 4, True, gen))
    out_sae = topk_sae(D, N_OUT, 5, apply_b_dec, gen)
    sae_out = from_sae_lens(out_sae)

    # resid_mid built from input-SAE latents: sparse, nonnegative, with b_dec
    z = torch.rand(64, N_IN, generator=gen, dtype=torch.float64)
    z *= torch.rand(64, N_IN, generator=gen) < 0.2
    r = z @ sae_in.W_dec + sae_in.b_dec
    rms = (r.pow(2).mean(-1, keepdim=True) + mlp.eps).sqrt()
    mlp_out = model.blocks[1].mlp(model.blocks[1].ln2(r))  # TransformerLens's own norm and MLP
    pre = out_sae.hook_sae_acts_pre  # read sae-lens's pre-activation through its hook
    captured = {}
    handle = pre.register_forward_hook(lambda _m, _i, out: captured.setdefault("pre", out))
    acts = out_sae.encode(mlp_out)
    handle.remove()

    Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, output_directions(sae_out.W_enc))
    Qt = project(Q, input_basis(sae_in.W_dec, sae_in.b_dec, mlp.g))
    z1 = torch.cat([z, torch.ones(64, 1, dtype=torch.float64)], 1)
    offset = preactivation_offset(
        sae_out.W_enc, sae_out.b_enc, sae_out.b_dec, apply_b_dec,
        output_constant(mlp.W_out, mlp.b_in, mlp.b_out),
    )
    ours = torch.einsum("ta,fab,tb->tf", z1, Qt, z1) / rms.square() + offset
    torch.testing.assert_close(ours, captured["pre"], **TOL)
    # and the TopK activation is top-k of it, then ReLU
    top = ours.topk(5, dim=1)
    expected = torch.zeros_like(ours).scatter_(1, top.indices, top.values.relu())
    torch.testing.assert_close(acts, expected, **TOL)


def test_sae_lens_decoder_norm_rescaling_is_folded():
    gen = torch.Generator().manual_seed(8)
    sae = topk_sae(D, N_OUT, 6, True, gen, rescale=True)
    weights = from_sae_lens(sae)
    a = random(10, D, gen=gen)
    pre = (a - weights.b_dec) @ weights.W_enc + weights.b_enc
    top = pre.topk(6, dim=1)
    acts = torch.zeros_like(pre).scatter_(1, top.indices, top.values.relu())
    torch.testing.assert_close(sae.encode(a), acts, **TOL)
    reconstruction = acts @ weights.W_dec + weights.b_dec
    torch.testing.assert_close(sae.decode(sae.encode(a)), reconstruction, **TOL)


def test_full_rank_eigen_expansion_reproduces_quadratic_form():
    gen = torch.Generator().manual_seed(9)
    Wg, Wi, Wo, _, _ = random_mlp(gen)
    U, x = random(6, D, gen=gen), random(50, D, gen=gen)
    Q = interaction_matrices(Wg, Wi, Wo, U)
    lam, V = eigh_by_magnitude(Q)
    assert (lam.abs()[:, :-1] >= lam.abs()[:, 1:]).all()
    torch.testing.assert_close(V.mT @ V, torch.eye(D, dtype=torch.float64).expand(6, D, D), **TOL)
    expansion = (lam[None] * torch.einsum("td,ndi->tni", x, V).square()).sum(-1)
    torch.testing.assert_close(expansion, torch.einsum("ti,nij,tj->tn", x, Q, x), **TOL)


def test_from_hooked_transformer_refuses_non_bilinear_models():
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=8, n_heads=2, d_head=4, d_mlp=16, n_ctx=8, d_vocab=20,
        act_fn="gelu", gated_mlp=True, normalization_type="RMS",
    )
    with pytest.raises(ValueError, match="not a bilinear MLP"):
        from_hooked_transformer(HookedTransformer(cfg, move_to_device=False), 0)
