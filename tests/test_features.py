"""Feature descriptions from planted activations: statistics, distinct-document contexts,
quantile samples, token features, label shares, and logit effects without special or
untrained tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.analysis.features import (FeatureConfig, _Best, _describe_feature, _lexicon_boosts, _Tracker,
                                         _Windows, describe, listable_tokens)
from pipelines.data.tokenizer import BOS, TokenizerConfig, train_tokenizer
from pipelines.data.tokens import TokenRows

TEXTS = ["the cat sat on the mat and was happy", "a dog ran far away and was sad", "the bird sang a song"] * 20


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, TokenizerConfig(vocab_size=64))


def test_best_keeps_the_top_entries_of_each_feature_across_batches():
    g = torch.Generator().manual_seed(0)
    best = _Best(n_features=3, m=4)
    every = {f: [] for f in range(3)}
    for _ in range(5):
        feature = torch.randint(0, 3, (40,), generator=g)
        score = torch.rand(40, generator=g)
        index = torch.randint(0, 1000, (40,), generator=g)
        best.add(feature, score, score * 2, index)
        for f, s, i in zip(feature.tolist(), score.tolist(), index.tolist()):
            every[f].append((s, i))
    for f in range(3):
        expected = sorted(every[f], reverse=True)[:4]
        assert best.score[f].tolist() == pytest.approx([s for s, _ in expected])
        assert best.index[f].tolist() == [i for _, i in expected]
        assert best.value[f].tolist() == pytest.approx([2 * s for s, _ in expected])


def test_tracker_statistics_token_mass_and_label_shares():
    cfg = FeatureConfig(n_contexts=2, n_samples=2)
    classes = {"negation": ["negation"], "context": ["positive", "negative"]}
    tracker = _Tracker(n_features=2, d_vocab=10, cfg=cfg, classes=classes)
    # 6 tokens; feature 0 fires on tokens 1 and 3 (ids 5 and 5), feature 1 everywhere
    acts = torch.tensor([[0, 1], [2, 1], [0, 1], [3, 1], [0, 1], [0, 1]], dtype=torch.float32)
    ids = torch.tensor([4, 5, 6, 5, 7, 8])
    labels = {"negation": torch.tensor([0, 1, 0, 1, 0, 0]), "context": torch.tensor([1, 1, 2, 2, 0, 0])}
    tracker.update(acts[:3], torch.arange(3), ids[:3], {k: v[:3] for k, v in labels.items()})
    tracker.update(acts[3:], torch.arange(3, 6), ids[3:], {k: v[3:] for k, v in labels.items()})
    assert tracker.n_tokens == 6 and tracker.count.tolist() == [2, 6]
    assert tracker.max.tolist() == [3, 1] and tracker.total.tolist() == [5, 6]
    assert tracker.top.index[0, :2].tolist() == [3, 1]
    mass = tracker.token_mass.view(2, 10)
    assert mass[0, 5] == 5 and mass[0].sum() == 5  # feature 0: all of it on token 5
    shares = {c: (m / tracker.abs_total[:, None]).tolist() for c, m in tracker.mass.items()}
    assert shares["negation"] == [pytest.approx([1.0]), pytest.approx([2 / 6])]
    assert shares["context"][0] == pytest.approx([2 / 5, 3 / 5])


def rows_for(tok, texts, n_ctx=16):
    """Packed rows as the token store makes them: BOS starts each document."""
    bos = tok.token_to_id(BOS)
    stream, docs = [], []
    for d, text in enumerate(texts):
        ids = [bos] + tok.encode(text).ids
        stream += ids
        docs += [d] * len(ids)
    n = len(stream) // n_ctx
    tokens = np.array(stream[: n * n_ctx]).reshape(n, n_ctx)
    row_doc = np.array(docs[: n * n_ctx]).reshape(n, n_ctx)[:, 0]
    return TokenRows(tokens, row_doc, {}, bos), np.array(docs[: n * n_ctx]).reshape(n, n_ctx)


def test_contexts_stay_in_their_document_and_bracket_the_token(tok):
    rows, docs = rows_for(tok, TEXTS[:6])
    windows = _Windows(rows, tok, FeatureConfig(left=30, right=30))
    flat = rows.n_ctx + 3
    assert windows.document(flat) == docs.reshape(-1)[flat]
    text = windows.context(flat)
    assert text.count("[") == 1 and text.count("]") == 1
    same_doc = TEXTS[int(docs.reshape(-1)[flat])]
    assert text.replace("[", "").replace("]", "") in same_doc  # nothing from a neighbouring document


def test_top_contexts_come_from_distinct_documents(tok):
    rows, docs = rows_for(tok, TEXTS[:9])
    cfg = FeatureConfig(n_contexts=3, n_samples=0)
    tracker = _Tracker(1, 64, cfg, {})
    flat = torch.arange(rows.tokens.size)
    acts = torch.linspace(0.1, 1.0, len(flat))[:, None]  # the highest activations all lie in the last document
    tracker.update(acts, flat, torch.from_numpy(rows.tokens.reshape(-1)), {},
                   torch.from_numpy(docs.reshape(-1)))
    row = _describe_feature(tracker, 0, _Windows(rows, tok, cfg), None, None, {}, cfg)
    assert len(row["top_documents"]) == 3 and len(set(row["top_documents"])) == 3
    assert row["top_documents"][0] == docs.reshape(-1)[-1]


def test_samples_spread_over_quantiles(tok):
    rows, _ = rows_for(tok, TEXTS[:6])
    cfg = FeatureConfig(n_contexts=1, n_samples=3)
    tracker = _Tracker(1, 64, cfg, {})
    flat = torch.arange(rows.tokens.size)
    tracker.update(torch.arange(1, len(flat) + 1, dtype=torch.float32)[:, None], flat,
                   torch.from_numpy(rows.tokens.reshape(-1)), {})
    row = _describe_feature(tracker, 0, _Windows(rows, tok, cfg), None, None, {}, cfg)
    quantiles = row["sample_quantiles"]
    assert len(quantiles) == 3 and quantiles == sorted(quantiles)
    assert quantiles[0] < 0.25 and 0.35 < quantiles[1] < 0.65 and quantiles[2] > 0.75


def test_the_config_seed_decides_the_sample_of_activations(tok):
    rows, _ = rows_for(tok, TEXTS[:6])
    flat = torch.arange(rows.tokens.size)

    def sampled(seed: int) -> list[int]:
        tracker = _Tracker(1, 64, FeatureConfig(n_contexts=1, n_samples=3, seed=seed), {})
        tracker.update(torch.ones(len(flat), 1), flat, torch.from_numpy(rows.tokens.reshape(-1)), {})
        return tracker.sample.index[0].tolist()

    assert sampled(0) == sampled(0)  # repeatable
    assert sampled(0) != sampled(1)  # and the seed is FeatureConfig's


def test_special_and_untrained_tokens_are_never_listable(tok):
    counts = np.zeros(70, dtype=np.int64)
    counts[4:40] = 50
    counts[40:50] = 3  # seen, but too rarely
    ok = listable_tokens(tok, 70, counts, min_count=10)
    for index in range(4):  # [PAD] [BOS] [EOS] [UNK]
        assert not ok[index]
    assert ok[4:40].all() and not ok[40:].any()  # rare, unseen and beyond the tokenizer


def test_lexicon_boost_is_the_class_mean_difference_in_sd():
    effects = torch.zeros(2, 20)
    effects[0, [2, 3, 4, 5, 6]] = 3.0  # feature 0 boosts the positive words
    effects[1, [10, 11, 12, 13, 14]] = 1.0  # feature 1 boosts the negative ones, less
    listable = torch.ones(20, dtype=torch.bool)
    lexicon = {"positive": [2, 3, 4, 5, 6], "negative": [10, 11, 12, 13, 14]}
    boosts = _lexicon_boosts(effects, listable, lexicon, FeatureConfig(min_lexicon_tokens=5))
    sd = effects.std(-1)
    assert boosts["positive"][0][0] == pytest.approx(3.0 / sd[0])
    assert boosts["negative"][0][1] == pytest.approx(1.0 / sd[1])
    assert boosts["positive"][1] == 5
    assert _lexicon_boosts(effects, listable, lexicon, FeatureConfig(min_lexicon_tokens=6)) == {}


def test_description_names_what_was_found():
    cfg = FeatureConfig()
    text = describe({"label": "negation", "label_share": 0.9, "top_tokens": ["not", "not", "never"],
                     "boost_label": "negative", "boost_sd": 2.0, "boosted_tokens": ["sad"]}, cfg)
    assert "negation 90%" in text and "on not, never" in text
    assert "predicts negative words (+2.0 sd)" in text and "boosts sad" in text
    token = describe({"is_token_feature": True, "top_token": "the", "top_token_share": 0.8}, cfg)
    assert "token feature: 'the' (80%)" in token
    assert "predicts" not in describe({"boost_label": "negative", "boost_sd": 0.5}, cfg)


def test_labels_need_a_share_well_above_the_base_rate_and_enough_tokens(tok):
    rows, _ = rows_for(tok, TEXTS[:9])
    cfg = FeatureConfig(n_contexts=1, n_samples=0)
    n = rows.tokens.size
    codes = torch.tensor([1, 2] * (n // 2) + [1] * (n % 2))  # two balanced classes of documents
    acts = torch.zeros(n, 3)
    acts[:, 0] = 1.0  # everywhere: 50% on either class, the base rate
    acts[codes == 1, 1] = 1.0  # only on class 1
    acts[torch.nonzero(codes == 1)[:5, 0], 2] = 1.0  # only on class 1, but on 5 tokens
    tracker = _Tracker(3, 64, cfg, {"polarity": ["pos", "neg"]})
    tracker.update(acts, torch.arange(n), torch.from_numpy(rows.tokens.reshape(-1)), {"polarity": codes})
    windows = _Windows(rows, tok, cfg)
    described = [_describe_feature(tracker, f, windows, None, None, {}, cfg) for f in range(3)]
    assert described[0]["label"] is None  # 50% of a class that holds 50% of the tokens
    assert described[1]["label"] == "polarity=pos" and described[1]["label_share"] == pytest.approx(1.0)
    assert described[2]["label"] is None  # too few tokens to say
    assert tracker.base_share("polarity", 0) == pytest.approx(0.5, abs=0.01)


def test_punctuation_in_token_lists_is_quoted():
    text = describe({"top_tokens": [",", "not", "##ing"], "boosted_tokens": [",", ".", "me", '"']}, FeatureConfig())
    assert "on ',', not, ##ing" in text and "boosts ',', '.', me, '\"'" in text
