"""The sparse TopK SAE step: gradients against dense autograd and sae-lens, dictionary recovery,
exact resume, and the sae-lens file format."""

from __future__ import annotations

import math

import pytest
import torch
from sae_lens import SAE, TopKTrainingSAE, TopKTrainingSAEConfig
from sae_lens.saes.sae import TrainStepInput
from sae_lens.training.optim import get_lr_scheduler

from circuits.weights import top_k_indices
from sae.topk import (TopKAutoencoder, TopKTrainer, _latent_by_token, _scatter_rows, cosine_lr, save_sae_lens,
                      training_losses)

PARAMS = ("W_enc", "W_dec", "b_dec")


@pytest.fixture
def one_thread():
    """A thousand tiny steps run faster on one thread than split over busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def perturbed_sae(d_in: int, d_sae: int, k: int, seed: int = 0) -> TopKAutoencoder:
    """A float64 SAE whose encoder is no longer the decoder's transpose and whose b_dec is not zero."""
    sae = TopKAutoencoder(d_in, d_sae, k, dtype=torch.float64, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        sae.W_enc.add_(0.3 * torch.randn(d_in, d_sae, generator=g, dtype=torch.float64))
        sae.b_dec.copy_(0.5 * torch.randn(d_in, generator=g, dtype=torch.float64))
    return sae


def dense_losses(sae: TopKAutoencoder, x: torch.Tensor, dead: torch.Tensor | None, k_aux: int, coefficient: float):
    """Plain autograd: dense pre-activations, top-k mask, ReLU, dense decode; returns
    (mse, aux, {name: leaf copy of each parameter})."""
    W_enc, W_dec, b_dec = (getattr(sae, name).detach().clone().requires_grad_() for name in PARAMS)
    pre = (x - b_dec) @ W_enc + sae.b_enc
    top = pre.topk(sae.k, dim=1)
    acts = torch.zeros_like(pre).scatter(1, top.indices, top.values.relu())
    recon = acts @ W_dec + b_dec
    mse = (recon - x).pow(2).sum(1).mean()
    aux = torch.zeros((), dtype=x.dtype)
    if dead is not None and (n_dead := int(dead.sum())) > 0:
        aux_top = torch.where(dead, pre, -math.inf).topk(min(k_aux, n_dead), dim=1)
        aux_acts = torch.zeros_like(pre).scatter(1, aux_top.indices, aux_top.values)
        residual = (x - recon).detach()
        aux = coefficient * min(n_dead / k_aux, 1.0) * (aux_acts @ W_dec - residual).pow(2).sum(1).mean()
    return mse, aux, dict(zip(PARAMS, (W_enc, W_dec, b_dec)))


def our_grads(sae: TopKAutoencoder, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    sae.zero_grad(set_to_none=True)
    loss.backward()
    return {name: getattr(sae, name).grad for name in PARAMS}


def assert_grads_match(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], rel: float = 1e-6) -> None:
    """Largest entry-wise difference within `rel` of the reference gradient's largest entry."""
    for name in PARAMS:
        scale = reference[name].abs().max()
        assert scale > 0, name
        assert (ours[name] - reference[name]).abs().max() <= rel * scale, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("k", [4, 30])  # 30 of 48 selects negative pre-activations, which ReLU zeroes
def test_sparse_gradients_equal_dense_autograd(k, dtype):
    sae = perturbed_sae(12, 48, k).to(dtype)
    x = torch.randn(40, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
    ours = training_losses(sae, x)
    mse, _, leaves = dense_losses(sae, x, None, 6, 1.0)
    if k == 30:
        assert (ours.values == 0).any()
    torch.testing.assert_close(ours.mse, mse, rtol=1e-6, atol=0)
    assert ours.aux.item() == 0
    grads = our_grads(sae, ours.mse)
    mse.backward()
    assert_grads_match(grads, {name: leaf.grad for name, leaf in leaves.items()})
    values, indices = sae.encode(x)
    pre = (x - sae.b_dec) @ sae.W_enc
    top = pre.topk(k, dim=1)
    dense = torch.zeros_like(pre).scatter(1, top.indices, top.values.relu())
    torch.testing.assert_close(sae.dense(values, indices), dense)
    assert torch.equal(indices, indices.sort(dim=1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scattered_rows_are_the_dense_product(dtype):
    """The compiled loop (CPUs) and the CSR product (accelerators, checked here in float64)
    both give the dense product of the latent-by-token matrix with the rows, a latent chosen by
    many tokens and one by none included."""
    g = torch.Generator().manual_seed(8)
    indices = torch.randn(30, 19, generator=g).topk(5, dim=1).indices  # latent 19: chosen by none
    indices[~(indices == 3).any(1), 0] = 3  # every token writes latent 3, still once per row
    weights, rows = torch.randn(30, 5, generator=g, dtype=dtype), torch.randn(30, 7, generator=g, dtype=dtype)
    expected = torch.zeros(20, 30, dtype=torch.float64).scatter(0, indices.T, weights.T.double()) @ rows.double()
    found = _scatter_rows(indices, weights, rows, 20)
    assert found.dtype == dtype
    torch.testing.assert_close(found, expected.to(dtype))
    csr = torch.sparse.mm(_latent_by_token(indices, weights.double(), 20), rows.double())
    torch.testing.assert_close(csr, expected)


@pytest.mark.parametrize("dead_share", [0.1, 0.6])  # fewer and more dead latents than k_aux
@pytest.mark.parametrize("sync_free", [False, True])
def test_aux_k_loss_equals_dense_reference(dead_share, sync_free):
    sae = perturbed_sae(16, 64, 4, seed=3)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(50, 16, generator=g, dtype=torch.float64)
    dead = torch.rand(64, generator=g) < dead_share
    k_aux, coefficient = 8, 0.25
    assert (int(dead.sum()) < k_aux) == (dead_share == 0.1)
    ours = training_losses(sae, x, dead, k_aux, coefficient, sync_free=sync_free)
    mse, aux, leaves = dense_losses(sae, x, dead, k_aux, coefficient)
    assert aux.item() > 0
    torch.testing.assert_close(ours.aux, aux, rtol=1e-6, atol=0)
    grads = our_grads(sae, ours.mse + ours.aux)
    (mse + aux).backward()
    assert_grads_match(grads, {name: leaf.grad for name, leaf in leaves.items()}, rel=1e-9)


def test_loss_and_gradients_equal_sae_lens_topk_training_sae():
    """Our conventions are sae-lens's: MSE summed over d_in and averaged over tokens, aux-k
    scaled by min(n_dead / k_aux, 1) with k_aux = d_in // 2, b_dec applied to the input."""
    d_in, d_sae, k, coefficient = 16, 64, 4, 1 / 32
    ours = perturbed_sae(d_in, d_sae, k, seed=11)
    theirs = TopKTrainingSAE(TopKTrainingSAEConfig(
        d_in=d_in, d_sae=d_sae, k=k, dtype="float64", rescale_acts_by_decoder_norm=False,
        apply_b_dec_to_input=True, aux_loss_coefficient=coefficient,
    ))
    theirs.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, d_in, generator=g, dtype=torch.float64)
    dead = torch.rand(d_sae, generator=g) < 0.3
    step = TrainStepInput(sae_in=x, coefficients={}, dead_neuron_mask=dead, n_training_steps=0, is_logging_step=False)
    out = theirs.training_forward_pass(step)
    out.loss.backward()
    losses = training_losses(ours, x, dead, aux_k_coefficient=coefficient)
    assert losses.aux.item() > 0
    torch.testing.assert_close(losses.mse, out.losses["mse_loss"], rtol=1e-9, atol=0)
    torch.testing.assert_close(losses.aux, out.losses["auxiliary_reconstruction_loss"], rtol=1e-9, atol=0)
    grads = our_grads(ours, losses.mse + losses.aux)
    assert_grads_match(grads, {name: getattr(theirs, name).grad for name in PARAMS}, rel=1e-9)
    torch.testing.assert_close(ours.dense(losses.values, losses.indices), out.feature_acts, rtol=1e-12, atol=0)


def test_schedule_is_sae_lens_cosine_annealing_with_warm_up():
    total, warm_up, lr, lr_end = 40, 5, 1e-3, 1e-4
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = get_lr_scheduler("cosineannealing", optimizer=optimizer, training_steps=total, lr=lr,
                                 warm_up_steps=warm_up, decay_steps=0, lr_end=lr_end, num_cycles=1)
    for step in range(total):
        assert cosine_lr(step, total, lr, lr_end, warm_up) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-9)
        optimizer.step()
        scheduler.step()
    assert cosine_lr(total, total, lr, lr_end, warm_up) == pytest.approx(lr_end)


def planted_batches(d: int, n_atoms: int, active: int, batch: int, seed: int):
    """Atoms `[n_atoms, d]` (random unit vectors) and an endless stream of batches `[batch, d]`:
    `active` atoms per token with positive codes, a common offset and a little noise."""
    g = torch.Generator().manual_seed(seed)
    atoms = torch.randn(n_atoms, d, generator=g)
    atoms /= atoms.norm(dim=1, keepdim=True)
    offset = torch.randn(d, generator=g)

    def stream():
        while True:
            chosen = torch.rand(batch, n_atoms, generator=g).argsort(1)[:, :active]
            codes = torch.zeros(batch, n_atoms).scatter_(1, chosen, torch.rand(batch, active, generator=g) + 0.5)
            yield codes @ atoms + offset + 0.01 * torch.randn(batch, d, generator=g)

    return atoms, stream()


def test_planted_dictionary_is_recovered(one_thread):
    atoms, batches = planted_batches(d=32, n_atoms=64, active=3, batch=256, seed=0)
    sae = TopKAutoencoder(32, 128, k=4, seed=0)
    steps = 1200
    trainer = TopKTrainer(sae, train_steps=steps, lr=2e-3, dead_steps=50)
    for _ in range(steps - 1):
        trainer.step(next(batches), stats=False)
    last = trainer.step(next(batches))
    decoder = sae.W_dec.detach()
    best_cos = (atoms @ decoder.T).max(dim=1).values
    print(f"planted dictionary: mean best cosine {best_cos.mean():.4f}, min {best_cos.min():.4f}, "
          f"fvu {last['fvu']:.4f}")
    assert best_cos.mean() >= 0.95
    assert last["fvu"] < 0.1 and last["lr"] == pytest.approx(cosine_lr(steps - 1, steps, 2e-3))
    torch.testing.assert_close(decoder.norm(dim=1), torch.ones(128))
    assert torch.equal(sae.b_enc, torch.zeros(128))
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-8)
    sparsity = trainer.log_feature_sparsity
    assert sparsity.shape == (128,) and sparsity.max() <= 0
    # 4 of 128 latents fire on at most every token: the frequencies add up to at most k
    assert (10 ** sparsity).sum() <= 4 + 1e-3


def test_trainer_settings_hold():
    sae = TopKAutoencoder(16, 64, 4)
    trainer = TopKTrainer(sae, train_steps=10, lr=1e-2, weight_decay=0.01)
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.01
    assert {id(p) for p in trainer.optimizer.param_groups[0]["params"]} == {id(getattr(sae, n)) for n in PARAMS}
    assert "b_enc" not in dict(sae.named_parameters()) and "b_enc" in sae.state_dict()
    torch.testing.assert_close(sae.W_enc, sae.W_dec.T)
    torch.testing.assert_close(sae.W_dec.norm(dim=1), torch.ones(64))
    x = torch.randn(32, 16) * 3 + 1
    trainer.step(x)
    assert trainer.steps == 1 and trainer.tokens == 32
    assert not torch.allclose(sae.b_dec, x.mean(0))  # set to the mean, then one step moved it
    torch.testing.assert_close(sae.b_dec, x.mean(0), atol=0.05, rtol=0)
    assert torch.equal(sae.b_enc, torch.zeros(64))
    assert (trainer.since_fired <= 1).all() and trainer.fire_counts.sum() <= 32 * 4


def train(trainer: TopKTrainer, batches: list[torch.Tensor]) -> list[dict[str, float]]:
    return [trainer.step(batch) for batch in batches]


def test_resume_is_bitwise_identical(tmp_path):
    def fresh() -> TopKTrainer:
        return TopKTrainer(TopKAutoencoder(16, 64, 4, seed=1), train_steps=40, lr=3e-3, warmup_steps=3,
                           weight_decay=0.01, dead_steps=3)

    _, stream = planted_batches(d=16, n_atoms=12, active=2, batch=64, seed=4)
    batches = [next(stream) for _ in range(40)]
    straight = fresh()
    logs = train(straight, batches)
    assert any(log["aux"] > 0 for log in logs[20:])  # the aux-k loss ran after the resume point

    first = fresh()
    train(first, batches[:20])
    torch.save(first.state_dict(), tmp_path / "trainer.pt")
    resumed = fresh()
    resumed.load_state_dict(torch.load(tmp_path / "trainer.pt", weights_only=True))
    assert train(resumed, batches[20:]) == logs[20:]

    for name, tensor in straight.sae.state_dict().items():
        assert torch.equal(tensor, resumed.sae.state_dict()[name]), name
    theirs = resumed.optimizer.state_dict()["state"]
    for index, state in straight.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, theirs[index][key]), (index, key)
    assert torch.equal(straight.since_fired, resumed.since_fired)
    assert torch.equal(straight.fire_counts, resumed.fire_counts)
    assert (straight.steps, straight.tokens) == (resumed.steps, resumed.tokens) == (40, 40 * 64)
    assert torch.equal(straight.log_feature_sparsity, resumed.log_feature_sparsity)


def test_resume_refuses_other_settings():
    trainer = TopKTrainer(TopKAutoencoder(16, 64, 4), train_steps=10, lr=1e-3)
    other = TopKTrainer(TopKAutoencoder(16, 64, 4), train_steps=20, lr=1e-3)
    with pytest.raises(ValueError, match="train_steps"):
        other.load_state_dict(trainer.state_dict())


def test_sae_lens_loads_ours_and_encodes_identically(tmp_path):
    _, stream = planted_batches(d=16, n_atoms=24, active=3, batch=128, seed=9)
    sae = TopKAutoencoder(16, 64, 4, seed=2)
    trainer = TopKTrainer(sae, train_steps=30, lr=1e-2)
    for _ in range(30):
        trainer.step(next(stream), stats=False)
    folder = save_sae_lens(sae, tmp_path / "layer0_mlp_out", {"hook_name": "blocks.0.hook_mlp_out"})
    assert sorted(p.name for p in folder.iterdir()) == ["cfg.json", "sae_weights.safetensors"]
    loaded = SAE.load_from_disk(folder)
    assert loaded.cfg.architecture() == "topk" and loaded.cfg.k == 4
    assert loaded.cfg.rescale_acts_by_decoder_norm is False
    assert loaded.cfg.apply_b_dec_to_input is True and loaded.cfg.normalize_activations == "none"
    assert loaded.cfg.metadata.hook_name == "blocks.0.hook_mlp_out"
    assert torch.equal(loaded.b_enc, torch.zeros(64))
    x = next(stream)
    with torch.no_grad():
        values, indices = sae.encode(x)
        assert torch.equal(loaded.encode(x), sae.dense(values, indices))
        # sae-lens decodes with a dense product, ours sums k rows: equal up to rounding
        torch.testing.assert_close(loaded.decode(loaded.encode(x)), sae.decode(values, indices))


def test_each_point_is_seeded_by_itself_not_by_its_place_among_the_points():
    from sae.config import SAETrainConfig
    from sae.train import build_trainers

    cfg = SAETrainConfig(k=4, train_tokens=4096, batch_size=256).resolve(16)
    every = build_trainers([(0, "resid_mid"), (0, "mlp_out"), (1, "mlp_in"), (1, "mlp_out")], 16, cfg, "cpu")
    alone = build_trainers([(1, "mlp_out")], 16, cfg, "cpu")
    reordered = build_trainers([(1, "mlp_out"), (0, "resid_mid")], 16, cfg, "cpu")
    start = lambda trainers, point: trainers[point].sae.W_dec.detach()  # noqa: E731
    assert torch.equal(start(every, (1, "mlp_out")), start(alone, (1, "mlp_out")))
    assert torch.equal(start(every, (0, "resid_mid")), start(reordered, (0, "resid_mid")))
    starts = [start(every, p) for p in every]  # and no two points start alike
    assert all(not torch.equal(starts[i], starts[j]) for i in range(4) for j in range(i + 1, 4))
    other_seed = build_trainers([(1, "mlp_out")], 16, cfg.replace(seed=1), "cpu")
    assert not torch.equal(start(other_seed, (1, "mlp_out")), start(alone, (1, "mlp_out")))


@pytest.mark.parametrize("rows, n, k", [(300, 512, 16), (64, 2048, 30), (50, 100, 7), (40, 64, 16), (20, 32, 32)])
def test_top_k_indices_finds_each_rows_k_largest(rows, n, k):
    """The places torch.topk names for each row's k largest values: without ties, with the
    largest crowded into one block, and with many ties (values from a few integers), where
    which of the tied places win is torch's choice."""
    generator = torch.Generator().manual_seed(n + k)
    x = torch.randn(rows, n, generator=generator, dtype=torch.float64)
    found = top_k_indices(x, k)
    assert found.shape == (rows, k)
    assert torch.equal(found.sort(1).values, x.topk(k, dim=1).indices.sort(1).values)
    # the largest values of a row in one block, the rest small: the blocks' maxima alone would miss them
    crowded = x.clone()
    crowded[:, :k] = 100 + torch.arange(k, dtype=x.dtype)
    assert torch.equal(top_k_indices(crowded, k).sort(1).values, torch.arange(k).expand(rows, k))
    tied = torch.randint(0, 3, (rows, n), generator=generator).double()
    tied[: rows // 2] += torch.randn(rows // 2, n, generator=generator, dtype=x.dtype)  # half the rows untied
    found = top_k_indices(tied, k).sort(1).values
    assert torch.equal(found, tied.topk(k, dim=1, sorted=False).indices.sort(1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_k_indices_rows_torch_would_rank_otherwise(dtype):
    """Rows with a NaN (torch ranks it above everything), with -inf, with a tie at the k-th
    value inside or across the cut-off, and k of 1: the places torch names."""
    generator = torch.Generator().manual_seed(7)
    for trial in range(40):
        x = torch.randint(0, 40, (30, 512), generator=generator).to(dtype)
        x[:15] += torch.randn(15, 512, generator=generator, dtype=dtype)
        x[trial % 30, trial % 512] = float("nan")
        x[(trial + 1) % 30, : 500 + trial % 12] = -float("inf")
        x[(trial + 2) % 30] = float("-inf")
        for k in (1, 3, 8, 32):
            found = top_k_indices(x, k).sort(1).values
            assert torch.equal(found, x.topk(k, dim=1, sorted=False).indices.sort(1).values), (trial, k)


def test_top_k_indices_other_inputs_go_to_torch():
    """A non-contiguous view, bfloat16, k above the kernel's bound and an input that needs a
    gradient give torch's places; k beyond the row is refused as torch refuses it."""
    x = torch.randn(200, 256, generator=torch.Generator().manual_seed(3))
    expect = lambda t, k: t.float().topk(k, dim=1).indices.sort(1).values  # noqa: E731
    assert torch.equal(top_k_indices(x.T.contiguous().T, 10).sort(1).values, expect(x, 10))
    assert torch.equal(top_k_indices(x.T, 10).sort(1).values, expect(x.T, 10))
    assert torch.equal(top_k_indices(x.requires_grad_(), 10).sort(1).values, expect(x.detach(), 10))
    assert torch.equal(top_k_indices(x.detach(), 70).sort(1).values, expect(x.detach(), 70))
    rounded = x.detach().to(torch.bfloat16)
    assert torch.equal(top_k_indices(rounded, 5).sort(1).values, rounded.topk(5, dim=1).indices.sort(1).values)
    with pytest.raises(RuntimeError):
        top_k_indices(x.detach(), 257)


def test_top_k_indices_keeps_leading_dimensions():
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(1))
    found = top_k_indices(x, 8)
    assert found.shape == (3, 5, 8)
    assert torch.equal(found.sort(-1).values, x.topk(8, dim=-1).indices.sort(-1).values)
