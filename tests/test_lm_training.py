"""LM training: schedule, loss going down, checkpoints, resume, clear errors."""

import math

import pytest
import torch

import pipelines.lm_training as lm_training
from pipelines.corpus import stories_frame
from pipelines.data import pack_corpus, split_rows
from pipelines.lm_training import LMTrainConfig, lr_at, train_lm, unigram_entropy
from pipelines.model import PRESETS, ModelConfig, load_model
from pipelines.stories import StoryConfig, generate_stories
from pipelines.tokenizer import TokenizerConfig, train_tokenizer


@pytest.fixture(scope="module")
def data():
    stories = generate_stories(StoryConfig(n_stories=400, seed=5))
    tok = train_tokenizer([s.text for s in stories], TokenizerConfig(vocab_size=400))
    train, held = split_rows(pack_corpus(stories_frame(stories), tok, n_ctx=32), 0.1)
    cfg = ModelConfig(**{**PRESETS["tiny"].to_json(), "n_ctx": 32, "d_vocab": tok.get_vocab_size()})
    return tok, train, held, cfg


def small_cfg(**kw):
    return LMTrainConfig(**{"train_tokens": 16 * 32 * 12, "batch_size": 16, "lr": 1e-2,
                            "eval_every": 4, "eval_rows": 16, "checkpoint_every": 4, **kw})


def test_schedule():
    cfg = LMTrainConfig(lr=1.0, warmup_frac=0.1, min_lr_frac=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(0.1)
    assert lr_at(9, 100, cfg) == pytest.approx(1.0)
    assert lr_at(10, 100, cfg) == pytest.approx(1.0)
    assert lr_at(100, 100, cfg) == pytest.approx(0.1)
    mids = [lr_at(s, 100, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(mids, mids[1:]))


def test_unigram_entropy():
    assert unigram_entropy(torch.arange(8).repeat(5), 16) == pytest.approx(math.log(8))
    assert unigram_entropy(torch.zeros(10, dtype=torch.int64), 4) == pytest.approx(0.0)


def test_trains_saves_and_reloads(data, tmp_path):
    tok, train, held, cfg = data
    model, log = train_lm(cfg, tok, train, held, small_cfg(), tmp_path)
    assert log["held_out_loss"].iloc[-1] < log["held_out_loss"].iloc[0] < math.log(cfg.d_vocab) + 0.5
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_log.parquet"):
        assert (tmp_path / name).is_file()
    assert not (tmp_path / "train_state.pt").exists()
    loaded, _ = load_model(tmp_path)
    x = held.tokens[:2]
    assert torch.equal(loaded(x), model(x))


def test_resume_matches_uninterrupted_run(data, tmp_path, monkeypatch):
    tok, train, held, cfg = data
    straight, _ = train_lm(cfg, tok, train, held, small_cfg(), tmp_path / "a")

    real_clip = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def crash_at_step_6(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real_clip(*args, **kw)

    monkeypatch.setattr(lm_training.torch.nn.utils, "clip_grad_norm_", crash_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        train_lm(cfg, tok, train, held, small_cfg(), tmp_path / "b")
    assert torch.load(tmp_path / "b" / "train_state.pt", weights_only=False)["step"] == 4
    monkeypatch.setattr(lm_training.torch.nn.utils, "clip_grad_norm_", real_clip)
    with pytest.raises(ValueError, match="other training settings"):
        train_lm(cfg, tok, train, held, small_cfg(lr=5e-3), tmp_path / "b")
    resumed, log = train_lm(cfg, tok, train, held, small_cfg(), tmp_path / "b")
    assert log["step"].tolist() == [4, 8, 12]
    x = held.tokens[:2]
    torch.testing.assert_close(resumed(x), straight(x), atol=1e-5, rtol=1e-5)


def test_clear_errors(data, tmp_path):
    tok, train, held, cfg = data
    small_vocab = ModelConfig(**{**cfg.to_json(), "d_vocab": 10})
    with pytest.raises(ValueError, match="tokenizer has"):
        train_lm(small_vocab, tok, train, held, small_cfg(), tmp_path)
    short = ModelConfig(**{**cfg.to_json(), "n_ctx": 16})
    with pytest.raises(ValueError, match="n_ctx"):
        train_lm(short, tok, train, held, small_cfg(), tmp_path)
    with pytest.raises(ValueError, match="empty"):
        train_lm(cfg, tok, train.take(slice(0, 0)), held, small_cfg(), tmp_path)
