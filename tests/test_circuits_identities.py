"""Exact identities of DESIGN section 4, on random small float64 weights.

References are computed independently: by a TransformerLens model, by sae-lens SAEs, or by
explicit formulas written out here, never by the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sae_lens.saes.standard_sae import StandardSAE, StandardSAEConfig
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
from circuits.sae_basis import (
    input_basis,
    output_directions,
    preactivation_offset,
    project,
    token_scale,
)
from circuits.spectra import eigh_by_magnitude
from circuits.weights import SAEWeights, from_hooked_transformer, from_sae_lens

SUPPORTED_ACTIVATIONS.setdefault("identity", lambda x: x)  # as pipelines' model registers it
TOL = dict(rtol=1e-10, atol=1e-10)
D, H, N_IN, N_OUT = 12, 20, 30, 25
F64 = torch.float64


def bilinear_model(seed: int = 0) -> HookedTransformer:
    cfg = HookedTransformerConfig(
        n_layers=2, d_model=D, n_heads=2, d_head=D // 2, d_mlp=H, n_ctx=16, d_vocab=50,
        act_fn="identity", gated_mlp=True, normalization_type="RMS",
        positional_embedding_type="rotary", rotary_dim=D // 2, eps=1e-5, seed=seed,
        dtype=F64, device="cpu",  # left unsaid, TransformerLens names CUDA wherever torch sees one
    )
    model = HookedTransformer(cfg, move_to_device=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # TransformerLens starts biases at 0 and gains at 1: make them count
        for block in model.blocks:
            block.mlp.b_in.normal_(generator=gen)
            block.mlp.b_out.normal_(generator=gen)
            block.ln2.w.uniform_(0.5, 1.5, generator=gen)
    return model


@pytest.fixture(scope="module")
def model() -> HookedTransformer:
    return bilinear_model(seed=6)


def random(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=F64)


def random_mlp(gen):
    Wg, Wi, Wo = random(D, H, gen=gen), random(H, D, gen=gen), random(H, D, gen=gen)
    return Wg, Wi.T.contiguous(), Wo, random(H, gen=gen), random(D, gen=gen)


def quadratic(x, Q):
    """`x_t^T Q_n x_t` for every token t and matrix n: `[t, d], [n, d, d] -> [t, n]`."""
    return torch.einsum("ti,nij,tj->tn", x, Q, x)


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
        # the per-token factor of the resid_mid basis is TransformerLens's own 1/scale^2
        tl_scale = cache[f"blocks.{layer}.ln2.hook_scale"].reshape(-1)
        torch.testing.assert_close(token_scale(r, mlp.eps, "resid_mid"), tl_scale.pow(-2), **TOL)

        Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, U)
        b_const = output_constant(mlp.W_out, mlp.b_in, mlp.b_out)
        mlp_out = cache[f"blocks.{layer}.hook_mlp_out"].reshape(-1, D)
        torch.testing.assert_close(quadratic(x, Q), mlp_out @ U.T - U @ b_const, **TOL)


def test_symmetrising_changes_no_output():
    gen = torch.Generator().manual_seed(3)
    Wg, Wi, Wo, _, _ = random_mlp(gen)
    U, x = random(5, D, gen=gen), random(40, D, gen=gen)
    raw = torch.stack([Wg @ torch.diag(Wo @ u) @ Wi.T for u in U])  # unsymmetrised Q_u
    assert not torch.allclose(raw, raw.mT)
    sym = interaction_matrices(Wg, Wi, Wo, U)
    torch.testing.assert_close(sym, sym.mT, rtol=0, atol=0)
    torch.testing.assert_close(sym, 0.5 * (raw + raw.mT), **TOL)
    torch.testing.assert_close(symmetrise(raw.clone()), 0.5 * (raw + raw.mT), **TOL)
    torch.testing.assert_close(quadratic(x, raw), quadratic(x, sym), **TOL)


def test_bilinear_tensor_matches_interaction_matrices_of_basis_vectors():
    gen = torch.Generator().manual_seed(4)
    Wg, Wi, Wo, _, _ = random_mlp(gen)
    B = bilinear_tensor(Wg, Wi, Wo)
    loops = torch.zeros(D, D, D, dtype=F64)
    for h in range(H):
        loops += Wo[h][:, None, None] * torch.outer(Wg[:, h], Wi[:, h])[None]
    torch.testing.assert_close(B, 0.5 * (loops + loops.transpose(1, 2)), **TOL)
    basis_vectors = torch.eye(D, dtype=F64)
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
    torch.testing.assert_close(gram, torch.eye(D, dtype=F64), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(torch.einsum("ok,k,kij->oij", U, S, right), B, rtol=1e-8, atol=1e-8)

    S3, U3 = hosvd(Wg, Wi, Wo, k=3)  # truncation error is the discarded singular values
    truncated = torch.einsum("ok,kij->oij", U3, interaction_matrices(Wg, Wi, Wo, U3.T))
    torch.testing.assert_close((B - truncated).norm(), S[3:].norm(), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(S3, S[:3], **TOL)


def fill(sae, gen):
    with torch.no_grad():
        for p in (sae.W_enc, sae.W_dec, sae.b_enc, sae.b_dec):
            p.copy_(random(*p.shape, gen=gen))
    return sae


def topk_sae(d_in, d_sae, k, apply_b_dec, gen, rescale=False) -> TopKSAE:
    cfg = TopKSAEConfig(
        d_in=d_in, d_sae=d_sae, k=k, dtype="float64", apply_b_dec_to_input=apply_b_dec,
        rescale_acts_by_decoder_norm=rescale,
    )
    return fill(TopKSAE(cfg), gen)


def sae_lens_pre(sae, a):
    """sae-lens's own pre-activation of `a`, read through its hook, and its activations."""
    captured = {}
    handle = sae.hook_sae_acts_pre.register_forward_hook(lambda _m, _i, out: captured.setdefault("pre", out))
    acts = sae.encode(a)
    handle.remove()
    return captured["pre"], acts


@pytest.mark.parametrize("site", ["resid_mid", "mlp_in"])
@pytest.mark.parametrize("apply_b_dec", [True, False])
def test_sae_basis_form_equals_output_sae_preactivation(model, site, apply_b_dec):
    mlp = from_hooked_transformer(model, 1)
    gen = torch.Generator().manual_seed(7)
    sae_in = from_sae_lens(topk_sae(D, N_IN, 4, True, gen))
    out_sae = topk_sae(D, N_OUT, 5, apply_b_dec, gen)
    sae_out = from_sae_lens(out_sae)

    # the input SAE's site built from its latents: sparse, nonnegative, with b_dec
    z = torch.rand(64, N_IN, generator=gen, dtype=F64)
    z *= torch.rand(64, N_IN, generator=gen) < 0.2
    a = z @ sae_in.W_dec + sae_in.b_dec
    block = model.blocks[1]
    if site == "resid_mid":  # TransformerLens's own norm (with gain) and MLP
        mlp_out = block.mlp(block.ln2(a))
        factor = 1 / (a.pow(2).mean(-1) + mlp.eps)
        basis = input_basis(sae_in.W_dec, sae_in.b_dec, mlp.g)
        torch.testing.assert_close(basis, torch.cat([sae_in.W_dec, sae_in.b_dec[None]]).T * mlp.g[:, None], **TOL)
    else:  # the SAE writes the MLP input itself: no norm, no gain, no factor
        mlp_out = block.mlp(a)
        factor = torch.ones(64, dtype=F64)
        basis = input_basis(sae_in.W_dec, sae_in.b_dec, None)
        torch.testing.assert_close(basis, torch.cat([sae_in.W_dec, sae_in.b_dec[None]]).T, rtol=0, atol=0)
    scale = token_scale(a, mlp.eps, site)
    torch.testing.assert_close(scale, factor, **TOL)
    pre, acts = sae_lens_pre(out_sae, mlp_out)

    Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, output_directions(sae_out.W_enc))
    Qt = project(Q, basis)
    assert Qt.shape == (N_OUT, N_IN + 1, N_IN + 1)
    z1 = torch.cat([z, torch.ones(64, 1, dtype=F64)], 1)  # b_dec is the constant coordinate
    offset = preactivation_offset(
        sae_out.W_enc, sae_out.b_enc, sae_out.b_dec, apply_b_dec,
        output_constant(mlp.W_out, mlp.b_in, mlp.b_out),
    )
    ours = torch.einsum("ta,fab,tb->tf", z1, Qt, z1) * scale[:, None] + offset
    torch.testing.assert_close(ours, pre, **TOL)
    # and the TopK activation is top-k of it, then ReLU
    top = ours.topk(5, dim=1)
    expected = torch.zeros_like(ours).scatter_(1, top.indices, top.values.relu())
    torch.testing.assert_close(acts, expected, **TOL)
    torch.testing.assert_close(sae_out.encode(mlp_out), acts, **TOL)


def test_decoder_basis_form_is_the_mlp_output_along_the_decoder_rows(model):
    mlp = from_hooked_transformer(model, 0)
    gen = torch.Generator().manual_seed(17)
    out_sae = from_sae_lens(topk_sae(D, N_OUT, 5, True, gen))
    U = output_directions(out_sae.W_enc, out_sae.W_dec, "decoder")
    torch.testing.assert_close(U, out_sae.W_dec, rtol=0, atol=0)
    torch.testing.assert_close(output_directions(out_sae.W_enc), out_sae.W_enc.T, rtol=0, atol=0)
    with pytest.raises(ValueError):
        output_directions(out_sae.W_enc, None, "decoder")
    with pytest.raises(ValueError):
        output_directions(out_sae.W_enc, out_sae.W_dec, "rows")

    r = random(50, D, gen=gen)
    block = model.blocks[0]
    x = block.ln2(r)
    mlp_out = block.mlp(x)
    b_const = block.mlp.b_in @ block.mlp.W_out + block.mlp.b_out  # written out, not output_constant
    Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, U)
    torch.testing.assert_close(quadratic(x, Q), (mlp_out - b_const) @ out_sae.W_dec.T, **TOL)


def test_sae_lens_topk_encode_matches_sae_weights_with_decoder_norm_rescaling():
    gen = torch.Generator().manual_seed(8)
    for rescale, apply_b_dec in [(True, True), (False, True), (True, False)]:
        sae = topk_sae(D, N_OUT, 6, apply_b_dec, gen, rescale=rescale)
        with torch.no_grad():  # decoder rows far from unit norm, so rescaling changes the top k
            sae.W_dec.mul_(torch.linspace(0.2, 5.0, N_OUT, dtype=F64)[:, None])
        weights = from_sae_lens(sae)
        assert weights.k == 6 and weights.relu and weights.apply_b_dec_to_input == apply_b_dec
        a = random(40, D, gen=gen)
        acts = sae.encode(a)
        assert ((acts != 0).sum(1) <= 6).all() and (acts != 0).any()
        torch.testing.assert_close(weights.encode(a), acts, **TOL)
        torch.testing.assert_close(weights.decode(acts), sae.decode(acts), **TOL)
        # the plain formulas hold with the folded tensors
        pre = (a - weights.b_dec * apply_b_dec) @ weights.W_enc + weights.b_enc
        torch.testing.assert_close(weights.pre(a), pre, **TOL)
        if rescale:
            torch.testing.assert_close(weights.W_dec.norm(dim=1), torch.ones(N_OUT, dtype=F64), **TOL)
    # without folding, the top k of the rescaled SAE would differ: the test has teeth
    raw = (a - sae.b_dec * apply_b_dec) @ sae.W_enc + sae.b_enc
    top = raw.topk(6, dim=1)
    unfolded = torch.zeros_like(raw).scatter_(1, top.indices, top.values.relu())
    assert not torch.equal(unfolded != 0, sae.encode(a) != 0)


def test_sae_lens_relu_sae_encode_matches_sae_weights():
    gen = torch.Generator().manual_seed(18)
    sae = fill(StandardSAE(StandardSAEConfig(d_in=D, d_sae=N_OUT, dtype="float64")), gen)
    weights = from_sae_lens(sae)
    assert weights.k is None and weights.relu
    a = random(30, D, gen=gen)
    acts = sae.encode(a)
    assert (acts == 0).any() and (acts > 0).any()
    torch.testing.assert_close(weights.encode(a), acts, **TOL)


def test_raw_topk_keeps_negative_values():
    """`relu=False`: the k largest pre-activations stay as they are, negative ones included."""
    gen = torch.Generator().manual_seed(19)
    k, n = 4, 9
    sae = SAEWeights(W_enc=random(D, n, gen=gen), b_enc=random(n, gen=gen) - 3.0,
                     W_dec=random(n, D, gen=gen), b_dec=random(D, gen=gen), k=k, relu=False)
    a = random(50, D, gen=gen)
    pre = ((a - sae.b_dec) @ sae.W_enc + sae.b_enc).numpy()
    expected = np.zeros_like(pre)
    for t in range(len(pre)):  # an independent top k: sort, keep the first k
        keep = np.argsort(-pre[t], kind="stable")[:k]
        expected[t, keep] = pre[t, keep]
    got = sae.encode(a).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert (got < 0).any()  # the planted negative bias makes some kept values negative
    assert ((got != 0).sum(1) == k).all()
    # with relu the same selection is clipped at zero
    relu = SAEWeights(**{**sae.tensors(), "k": k, "relu": True})
    np.testing.assert_allclose(relu.encode(a).numpy(), np.maximum(expected, 0), rtol=1e-12, atol=1e-12)


def test_full_rank_eigen_expansion_reproduces_quadratic_form():
    gen = torch.Generator().manual_seed(9)
    Wg, Wi, Wo, _, _ = random_mlp(gen)
    U, x = random(6, D, gen=gen), random(50, D, gen=gen)
    Q = interaction_matrices(Wg, Wi, Wo, U)
    lam, V = eigh_by_magnitude(Q)
    assert (lam.abs()[:, :-1] >= lam.abs()[:, 1:]).all()
    torch.testing.assert_close(V.mT @ V, torch.eye(D, dtype=F64).expand(6, D, D), **TOL)
    torch.testing.assert_close(V @ torch.diag_embed(lam) @ V.mT, Q, **TOL)
    expansion = (lam[None] * torch.einsum("td,ndi->tni", x, V).square()).sum(-1)
    torch.testing.assert_close(expansion, quadratic(x, Q), **TOL)


def test_from_hooked_transformer_refuses_non_bilinear_models():
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=8, n_heads=2, d_head=4, d_mlp=16, n_ctx=8, d_vocab=20,
        act_fn="gelu", gated_mlp=True, normalization_type="RMS",
    )
    with pytest.raises(ValueError, match="not a bilinear MLP"):
        from_hooked_transformer(HookedTransformer(cfg, move_to_device=False), 0)


def test_the_sparse_product_of_outputs_and_inputs_warns_nothing():
    """Issue 51 item 17: `circuits` printed torch's two warnings about sparse CSR tensors (beta
    support, invariant checks off) on every run; the product itself is the dense one."""
    import warnings

    from circuits.layer import csr

    g = torch.Generator().manual_seed(0)
    dense = torch.randn(6, 5, generator=g) * (torch.rand(6, 5, generator=g) < 0.4)
    other = torch.randn(6, 3, generator=g)
    row, col = dense.nonzero(as_tuple=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        product = csr(dense, row, col).t() @ other
    assert [str(w.message) for w in caught] == []
    torch.testing.assert_close(product, dense.T @ other)
