"""Training an SAE from plain activation tensors (no model): resume and sae-lens's loader."""

from __future__ import annotations

import io

import pytest
import torch

from sae.config import SAETrainConfig
from sae.topk import save_sae_lens
from sae.train import TensorBatches, train_sae

D_IN, D_SAE, K = 16, 40, 3  # d_sae is no multiple of d_in: only `d_sae` can ask for it


def planted_chunks(n_features: int = 24, sizes=(300, 1000, 77, 513, 1200, 900, 64, 2000), seed: int = 0):
    """Activations that are sparse sums of planted unit directions, in uneven chunks; returns
    (chunks, directions `[n_features, D_IN]`)."""
    gen = torch.Generator().manual_seed(seed)
    directions = torch.randn(n_features, D_IN, generator=gen)
    directions /= directions.norm(dim=1, keepdim=True)
    chunks = []
    for n in sizes:
        fires = torch.rand(n, n_features, generator=gen) < 2 / n_features
        chunks.append((fires * (1 + torch.rand(n, n_features, generator=gen))) @ directions)
    return chunks, directions


def recipe(**kw) -> SAETrainConfig:
    return SAETrainConfig(**{"d_sae": D_SAE, "k": K, "train_tokens": 5_000, "batch_size": 250, "checkpoint_every": 4,
                             "lr": 1e-2, "dead_after_tokens": 1_000, **kw})


def test_batches_cut_uneven_chunks_in_order_and_resume_by_replay():
    chunks, _ = planted_chunks()
    rows = torch.cat(chunks)
    stream = TensorBatches(chunks, 250)
    batches = [b["sae"] for b in stream]
    assert len(batches) == rows.shape[0] // 250
    assert torch.equal(torch.cat(batches), rows[: len(batches) * 250])
    resumed = TensorBatches(chunks, 250)
    resumed.restore({"rows": 7 * 250})
    assert all(torch.equal(a["sae"], b) for a, b in zip(resumed, batches[7:], strict=True))


def test_sae_from_tensor_iterator_resumes_bitwise_and_loads_in_sae_lens(tmp_path):
    from sae_lens import SAE

    chunks, directions = planted_chunks()
    cfg = recipe()
    saved = {}

    def keep(state: dict) -> None:  # a copy, as a checkpoint file would hold it
        buffer = io.BytesIO()
        torch.save(state, buffer)
        saved[state["step"]] = buffer.getvalue()

    full = train_sae(chunks, D_IN, cfg, checkpoint=keep)
    assert sorted(saved) == [4, 8, 12, 16]
    assert full.steps == cfg.train_steps == 20 and full.sae.d_sae == D_SAE
    resume = torch.load(io.BytesIO(saved[8]), weights_only=False)
    again = train_sae(chunks, D_IN, cfg, resume=resume)
    for name, tensor in full.sae.state_dict().items():
        assert torch.equal(tensor, again.sae.state_dict()[name]), name
    assert torch.equal(full.fire_counts, again.fire_counts)

    # it learned the planted directions: most have a decoder row within 25 degrees
    cos = directions @ full.sae.W_dec.detach().T
    assert (cos.max(dim=1).values > 0.9).float().mean() > 0.6

    loaded = SAE.load_from_disk(save_sae_lens(full.sae, tmp_path / "sae"))
    assert loaded.cfg.d_sae == D_SAE and loaded.cfg.metadata.hook_name is None
    x = torch.cat(chunks)[:500]
    with torch.no_grad():
        assert torch.allclose(loaded.decode(loaded.encode(x)), full.sae(x), atol=1e-5)


def test_too_few_activations_and_bad_tensors_are_refused():
    chunks, _ = planted_chunks(sizes=(600,))
    with pytest.raises(ValueError, match="ran out after 2 of 20 steps"):
        train_sae(chunks, D_IN, recipe())
    with pytest.raises(ValueError, match="activation tensor 0 must be a 2-D tensor"):
        train_sae([torch.zeros(5)], D_IN, recipe())


def test_schedule_holds_then_decays_over_its_last_steps():
    from sae.topk import cosine_lr

    lr, end = 1e-2, 1e-3
    assert all(cosine_lr(step, 100, lr, end, decay_steps=20) == lr for step in range(80))
    assert cosine_lr(90, 100, lr, end, decay_steps=20) == pytest.approx((lr + end) / 2)  # halfway down the cosine
    assert cosine_lr(100, 100, lr, end, decay_steps=20) == pytest.approx(end)
    # a warm-up first, then the same decay window at the end
    assert cosine_lr(4, 100, lr, end, warmup_steps=10, decay_steps=20) == pytest.approx(lr * 5 / 10)
    assert cosine_lr(50, 100, lr, end, warmup_steps=10, decay_steps=20) == lr


def test_default_learning_rate_rule_and_d_sae():
    from sae.config import PAPER_STEPS, default_lr

    assert default_lr(512, 2048, PAPER_STEPS) == pytest.approx(1e-4)  # the paper's rate at its size
    assert default_lr(512, 2048, PAPER_STEPS // 4) == pytest.approx(2e-4, rel=1e-4)  # 4x fewer steps: 2x
    assert default_lr(128, 2048, PAPER_STEPS) == pytest.approx(2e-4)  # 4x smaller d_in * d_sae: 2x
    assert default_lr(512, 512, PAPER_STEPS) == pytest.approx(2e-4)
    assert default_lr(512, 2048, 10 * PAPER_STEPS) == pytest.approx(1e-4)  # never below the paper's for longer runs
    cfg = SAETrainConfig(train_tokens=4096 * 100).resolve(16)
    assert cfg.d_sae == 64 and cfg.decay_steps == 20
    assert SAETrainConfig(d_sae=40).resolve(16).d_sae == 40
