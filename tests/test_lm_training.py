"""LM training: schedule, data order, loss going down, save and reload, exact resume, bf16
autocast, and the loss units (bits per byte, unigram entropy) by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

import pipelines.lm.training as training
from pipelines.data.corpus import CorpusConfig
from pipelines.data.story_corpus import write_story_corpus
from pipelines.data.stories import StoryConfig
from pipelines.data.tokenizer import TokenizerConfig, train_tokenizer
from pipelines.engine.paths import ModelPaths
from pipelines.data.tokens import bits_per_byte, build_token_store, unigram_entropy
from pipelines.lm.model import PRESETS, load_model
from pipelines.lm.training import LMTrainConfig, autocast, held_out_loss, lr_at, train_lm
from sae import activations
from sae.activations import resolve_precision

N_CTX = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    folder = write_story_corpus(StoryConfig(n_stories=300, seed=5), root / "corpus")
    tok = train_tokenizer(pd.read_parquet(folder / "part.parquet")["text"], TokenizerConfig(vocab_size=300))
    store = build_token_store(str(folder), tok, N_CTX, CorpusConfig(held_out=0.1), root / "tokens")
    cfg = PRESETS["tiny"].replace(n_ctx=N_CTX, d_vocab=tok.get_vocab_size())
    return store, cfg


@pytest.fixture(autouse=True)
def one_thread():
    """Bitwise reproducible CPU arithmetic (and, for models this small, faster): one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_cfg(**kw) -> LMTrainConfig:
    return LMTrainConfig(**{"train_tokens": 16 * N_CTX * 12, "batch_size": 16, "lr": 1e-2, "eval_every": 4,
                            "eval_rows": 16, "checkpoint_every": 4, **kw})


def test_schedule():
    cfg = LMTrainConfig(lr=1.0, warmup_frac=0.1, min_lr_frac=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(0.1)
    assert lr_at(9, 100, cfg) == pytest.approx(1.0)
    assert lr_at(10, 100, cfg) == pytest.approx(1.0)
    assert lr_at(55, 100, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert lr_at(100, 100, cfg) == pytest.approx(0.1)
    mids = [lr_at(s, 100, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(mids, mids[1:]))
    assert small_cfg().n_steps(N_CTX) == 12 and small_cfg(train_tokens=1).n_steps(N_CTX) == 1


def test_batches_visit_every_row_once_per_epoch():
    cfg = LMTrainConfig(batch_size=4, seed=2)
    n_rows = 12  # three steps per epoch
    draws = [training._batch(n_rows, step, cfg) for step in range(6)]
    for epoch in (0, 1):
        seen = torch.cat(draws[3 * epoch: 3 * epoch + 3]).sort().values
        assert seen.tolist() == list(range(n_rows))
    assert torch.cat(draws[:3]).tolist() != torch.cat(draws[3:]).tolist()  # each epoch its own order
    assert all(d.tolist() == sorted(d.tolist()) for d in draws)  # rows are read in file order
    assert training._batch(n_rows, 4, cfg).tolist() == draws[4].tolist()  # a pure function of the step
    assert torch.cat(draws[:3]).tolist() != torch.cat([training._batch(n_rows, s, cfg.replace(seed=3))
                                                       for s in range(3)]).tolist()
    odd = torch.cat([training._batch(10, step, cfg) for step in range(5)])  # 20 draws of 10 rows
    assert torch.bincount(odd, minlength=10).tolist() == [2] * 10


def test_trains_saves_and_reloads(data, tmp_path):
    store, cfg = data
    model, log = train_lm(cfg, store.train, store.held_out, small_cfg(), tmp_path)
    assert log["step"].tolist() == [4, 8, 12]
    assert log["held_out_loss"].iloc[-1] < log["held_out_loss"].iloc[0] < math.log(cfg.d_vocab) + 0.5
    assert log["tokens"].tolist() == [s * 16 * N_CTX for s in (4, 8, 12)]
    for name in ("config.json", "model.safetensors", "train_log.parquet"):
        assert (tmp_path / name).is_file()
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "train_log.parquet"), log)
    loaded, loaded_cfg = load_model(tmp_path)
    assert loaded_cfg == cfg.replace(seed=0)
    x = store.held_out.batch(slice(0, 2))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    # the logged held-out loss is the mean next-token cross-entropy of the first eval_rows rows
    rows = store.held_out.batch(slice(0, 16))
    with torch.no_grad():
        logits = model(rows)
    by_hand = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.d_vocab), rows[:, 1:].reshape(-1))
    assert log["held_out_loss"].iloc[-1] == pytest.approx(float(by_hand), rel=1e-5)
    assert held_out_loss(model, store.held_out, 16, 5) == pytest.approx(float(by_hand), rel=1e-5)


def test_resume_matches_an_uninterrupted_run(data, tmp_path, monkeypatch):
    store, cfg = data
    straight, straight_log = train_lm(cfg, store.train, store.held_out, small_cfg(), tmp_path / "a")

    monkeypatch.setattr(training, "clip_grad_norm_", _raise_after(5))  # a crash in step 6
    with pytest.raises(KeyboardInterrupt):
        train_lm(cfg, store.train, store.held_out, small_cfg(), tmp_path / "b")
    state = torch.load(ModelPaths(tmp_path / "b").train_state, weights_only=False)
    assert state["step"] == 4 and [e["step"] for e in state["log"]] == [4]
    assert not (tmp_path / "b" / "model.safetensors").exists()
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.startswith(".")]  # no temporaries

    monkeypatch.undo()
    resumed, log = train_lm(cfg, store.train, store.held_out, small_cfg(), tmp_path / "b")
    assert log["step"].tolist() == [4, 8, 12]
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    for column in ("train_loss", "held_out_loss", "lr", "tokens"):
        assert log[column].tolist() == straight_log[column].tolist(), column


def test_shards_give_the_whole_batch_gradient(data):
    """Seven rows over three copies (3, 2 and 2 rows): each shard's mean loss weighs by its
    rows, so the combined gradient is the whole batch's, to float32 rounding."""
    store, cfg = data
    model = training.build_model(cfg, "cpu", seed=1)
    whole = training.build_model(cfg, "cpu", seed=1)
    rows = store.train.batch(slice(0, 7))
    loss = training.forward.next_token_loss(training.forward.run(whole, rows)[0], rows).mean()
    loss.backward()
    with training.one_thread_workers(3) as pool:
        shards = training.Shards(model, 3, pool)
        loss_of_shards = float(shards.backward(rows, "none"))
    assert loss_of_shards == pytest.approx(loss.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6 * float(q.grad.abs().max())), name
    assert all(p.grad is None for c in shards.models[1:] for p in c.parameters())  # taken into the model's


def test_a_sharded_training_repeats_resumes_and_learns_as_one_does(data, tmp_path, monkeypatch):
    store, cfg = data
    one, one_log = train_lm(cfg, store.train, store.held_out, small_cfg(), tmp_path / "one")
    straight, straight_log = train_lm(cfg, store.train, store.held_out, small_cfg(), tmp_path / "a", n_shards=2)
    monkeypatch.setattr(training, "clip_grad_norm_", _raise_after(5))  # a crash in step 6
    with pytest.raises(KeyboardInterrupt):
        train_lm(cfg, store.train, store.held_out, small_cfg(), tmp_path / "b", n_shards=2)
    monkeypatch.undo()
    resumed, log = train_lm(cfg, store.train, store.held_out, small_cfg(), tmp_path / "b", n_shards=2)
    for name, value in straight.state_dict().items():  # the copies took the checkpoint's weights
        assert torch.equal(resumed.state_dict()[name], value), name
    assert log["held_out_loss"].tolist() == straight_log["held_out_loss"].tolist()
    # the same steps as one copy, up to the order of float sums
    assert straight_log["held_out_loss"].to_numpy() == pytest.approx(one_log["held_out_loss"].to_numpy(), abs=1e-3)
    assert not torch.equal(straight.W_E, one.W_E)  # a real difference in the sums: the shards did run


def test_more_shards_than_rows_train_a_copy_per_row(data, tmp_path):
    store, cfg = data
    _, log = train_lm(cfg, store.train, store.held_out, small_cfg(batch_size=2, train_tokens=2 * N_CTX * 2),
                      tmp_path, n_shards=3)
    assert log["step"].tolist() == [2] and np.isfinite(log["train_loss"]).all()


def test_state_of_another_model_is_refused(data, tmp_path, monkeypatch):
    store, cfg = data
    monkeypatch.setattr(training, "clip_grad_norm_", _raise_after(5))
    with pytest.raises(KeyboardInterrupt):
        train_lm(cfg, store.train, store.held_out, small_cfg(), tmp_path)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="another model config"):
        train_lm(cfg.replace(d_mlp=32), store.train, store.held_out, small_cfg(), tmp_path)


def _raise_after(n: int):
    calls = {"n": 0}
    real = torch.nn.utils.clip_grad_norm_

    def clip(*args, **kw):
        calls["n"] += 1
        if calls["n"] > n:
            raise KeyboardInterrupt
        return real(*args, **kw)

    return clip


def test_bf16_autocast_runs_on_cpu(data, tmp_path):
    store, cfg = data
    x = store.held_out.batch(slice(0, 2))
    model, log = train_lm(cfg, store.train, store.held_out, small_cfg(autocast="bf16"), tmp_path / "bf16")
    with torch.no_grad(), autocast("bf16", "cpu"):
        assert model(x).dtype == torch.bfloat16
    with torch.no_grad(), autocast("none", "cpu"):
        assert model(x).dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights stay float32
    assert np.isfinite(log["train_loss"]).all() and np.isfinite(log["held_out_loss"]).all()
    assert log["held_out_loss"].iloc[-1] < log["held_out_loss"].iloc[0]
    full, full_log = train_lm(cfg, store.train, store.held_out, small_cfg(autocast="none"), tmp_path / "fp32")
    # the same run in float32 ends close by, but not identically: bf16 was really used
    assert log["held_out_loss"].iloc[-1] == pytest.approx(full_log["held_out_loss"].iloc[-1], abs=0.15)
    assert log["train_loss"].tolist() != full_log["train_loss"].tolist()
    assert set(log["precision"]) == {"bf16"} and set(full_log["precision"]) == {"none"}
    # the log's held-out losses are the float32 model's, as every later stage reads it
    assert log["held_out_loss"].iloc[-1] == held_out_loss(model, store.held_out, 16, 16)


def test_a_resumed_run_logs_the_precision_of_each_stretch(data, tmp_path, monkeypatch, capsys):
    store, cfg = data
    monkeypatch.setattr(training, "clip_grad_norm_", _raise_after(5))  # a crash in step 6
    with pytest.raises(KeyboardInterrupt):
        train_lm(cfg, store.train, store.held_out, small_cfg(autocast="bf16"), tmp_path)
    monkeypatch.undo()
    _, log = train_lm(cfg, store.train, store.held_out, small_cfg(autocast="none"), tmp_path)
    assert log["precision"].tolist() == ["bf16", "none", "none"]
    assert "begun in bf16 precision in none" in capsys.readouterr().out


def test_native_bf16_asks_the_hardware_and_counts_no_emulation(monkeypatch):
    for avx512_bf16, amx, native in ((True, False, True), (False, True, True), (False, False, False)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert activations.native_bf16("cpu") == native
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert not activations.native_bf16("cpu")  # a torch without the checks: no
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, native in (((7, 5), False), ((8, 0), True), ((9, 0), True)):  # a T4 emulates bf16; A100, H100
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert activations.native_bf16("cuda:0") == native
    assert not activations.native_bf16("meta")


def test_auto_precision_is_bf16_only_where_the_hardware_multiplies_it(monkeypatch):
    assert resolve_precision("none", "cpu") == "none" and resolve_precision("bf16", "cpu") == "bf16"
    for native in (True, False):
        monkeypatch.setattr(activations, "native_bf16", lambda device, native=native: native)
        assert resolve_precision("auto", "cpu") == ("bf16" if native else "none")
        with autocast("auto", "cpu"):
            assert torch.is_autocast_enabled("cpu") == native
    with pytest.raises(ValueError, match="fp8"):
        resolve_precision("fp8", "cpu")


def test_clear_errors(data, tmp_path):
    store, cfg = data
    with pytest.raises(ValueError, match="n_ctx"):
        train_lm(cfg.replace(n_ctx=16), store.train, store.held_out, small_cfg(), tmp_path)
    with pytest.raises(ValueError, match="empty"):
        train_lm(cfg, store.train.head(0), store.held_out, small_cfg(), tmp_path)
    with pytest.raises(ValueError, match="autocast"):
        small_cfg(autocast="fp8")


def test_bits_per_byte_and_unigram_entropy_by_hand():
    # four tokens with counts 1, 1, 2 (and one never seen): H = 2 * 1/4 ln 4 + 1/2 ln 2
    assert unigram_entropy(np.array([1, 1, 2, 0])) == pytest.approx(1.5 * math.log(2))
    assert unigram_entropy(np.array([0, 7, 0])) == 0.0
    assert unigram_entropy(np.full(8, 3)) == pytest.approx(math.log(8))
    # 2 nats per token of 4 bytes: 2 / ln 2 bits per 4 bytes
    assert bits_per_byte(2.0, 4.0) == pytest.approx(0.7213475204444817)
    assert bits_per_byte(math.log(2), 1.0) == pytest.approx(1.0)
