"""The train_saes stage: outputs, metrics table, resume after interruption, clear errors."""

from __future__ import annotations

import pytest
import torch
from sae_lens import SAE

import pipelines.train_saes as stage
from circuits.tables import read_table
from sae.config import SAETrainConfig
from sae.io import load_sae

BOS = 0
CFG = SAETrainConfig(train_tokens=4096, batch_size=512, eval_seqs=8, shard_tokens=1500, buffer_tokens=2048)
COLUMNS = ["layer", "site", "d_in", "d_sae", "k", "train_tokens", "nmse", "l0", "dead_fraction",
           "loss_clean", "loss_patched", "loss_added"]


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 512, (80, 64), generator=g)
    tokens[:, 0] = BOS
    return tokens


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of the trainer and the cache writer; `fail_at` makes a trainer call raise."""
    calls = {"train": 0, "cache": 0, "fail_at": None}
    train, cache = stage.train_sae, stage.write_cache

    def train_sae(*args, **kwargs):
        calls["train"] += 1
        if calls["train"] == calls["fail_at"]:
            raise KeyboardInterrupt
        return train(*args, **kwargs)

    def write_cache(*args, **kwargs):
        calls["cache"] += 1
        return cache(*args, **kwargs)

    monkeypatch.setattr(stage, "train_sae", train_sae)
    monkeypatch.setattr(stage, "write_cache", write_cache)
    return calls


def snapshot(folder):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}


def test_stage_trains_every_point_and_resumes(model, tokens, tmp_path, counted):
    counted["fail_at"] = 3  # interrupted while training the third SAE
    with pytest.raises(KeyboardInterrupt):
        stage.train_saes(model, tokens, tmp_path, [0, 1], cfg=CFG, bos_id=BOS)
    saes = tmp_path / "saes"
    assert sorted(p.name for p in saes.iterdir()) == ["layer0_mlp_out", "layer0_resid_mid"]
    before = {name: snapshot(saes / name) for name in ["layer0_mlp_out", "layer0_resid_mid"]}

    counted["fail_at"] = None
    df = stage.train_saes(model, tokens, tmp_path, [0, 1], cfg=CFG, bos_id=BOS)
    assert counted["train"] == 3 + 2  # the two unfinished SAEs only
    assert counted["cache"] == 1  # the interrupted run's cache was reused
    assert {name: snapshot(saes / name) for name in before} == before
    assert not (tmp_path / "activations").exists()  # freed once every SAE is done

    assert list(df[["layer", "site"]].itertuples(index=False, name=None)) == [
        (0, "resid_mid"), (0, "mlp_out"), (1, "resid_mid"), (1, "mlp_out")]
    table = read_table(tmp_path / "tables", "sae_metrics")
    assert set(COLUMNS) <= set(table.columns) and len(table) == 4
    assert (df["train_tokens"] == 4096).all() and (df["d_sae"] == 128).all() and (df["k"] == 4).all()
    assert (df["l0"] <= 4).all() and (df["nmse"] > 0).all() and (df["nmse"] < 1).all()
    assert (df["eval_tokens"] == 8 * 63).all()  # held-out rows without their BOS
    for _, row in df.iterrows():
        sae = load_sae(tmp_path / "saes" / f"layer{row.layer}_{row.site}", model=model)
        assert isinstance(sae, SAE) and sae.cfg.metadata.hook_name == f"blocks.{row.layer}.hook_{row.site}"

    again = stage.train_saes(model, tokens, tmp_path, [0, 1], cfg=CFG, bos_id=BOS)
    assert counted["train"] == 5 and counted["cache"] == 1  # nothing retrained, nothing cached
    assert again.equals(df)


def test_one_point_per_pass_trains_the_same_saes(model, tokens, tmp_path, counted):
    stage.train_saes(model, tokens, tmp_path / "together", [0], cfg=CFG, bos_id=BOS)
    assert counted["cache"] == 1
    apart = SAETrainConfig(**{**CFG.to_json(), "points_per_pass": 1})
    stage.train_saes(model, tokens, tmp_path / "apart", [0], cfg=apart, bos_id=BOS)
    assert counted["cache"] == 3  # one model pass per point
    for name in ["layer0_resid_mid", "layer0_mlp_out"]:
        weights = [(tmp_path / run / "saes" / name / "sae_weights.safetensors").read_bytes()
                   for run in ("together", "apart")]
        assert weights[0] == weights[1]


def test_a_finished_sae_with_another_recipe_is_not_silently_reused(model, tokens, tmp_path):
    stage.train_saes(model, tokens, tmp_path, [1], ["mlp_out"], cfg=CFG, bos_id=BOS)
    other = SAETrainConfig(**{**CFG.to_json(), "k": 6})
    with pytest.raises(ValueError, match="other settings.*k"):
        stage.train_saes(model, tokens, tmp_path, [1], ["mlp_out"], cfg=other, bos_id=BOS)
    runtime_only = SAETrainConfig(**{**CFG.to_json(), "model_batch_seqs": 5})
    stage.train_saes(model, tokens, tmp_path, [1], ["mlp_out"], cfg=runtime_only, bos_id=BOS)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sites": ["attn_out"]}, "unknown site 'attn_out'"),
        ({"layers": [2]}, "layer 2 does not exist"),
        ({"cfg": SAETrainConfig(**{**CFG.to_json(), "k": 200})}, "k=200 must lie between"),
        ({"cfg": SAETrainConfig(**{**CFG.to_json(), "train_tokens": 5000})}, "corpus too small"),
        ({"cfg": SAETrainConfig(**{**CFG.to_json(), "eval_seqs": 80})}, "corpus too small"),
    ],
)
def test_bad_requests_fail_clearly_before_any_work(model, tokens, tmp_path, kwargs, message):
    # 72 training rows of 63 usable tokens hold 4536 tokens: 5000 is too many
    args = {"layers": [0], "sites": ["resid_mid"], "cfg": CFG, **kwargs}
    with pytest.raises(ValueError, match=message):
        stage.train_saes(model, tokens, tmp_path, bos_id=BOS, **args)
    assert not any(tmp_path.iterdir())
