"""Lexicon accuracy: constant stand-in models score exactly the share of the class they
prefer, counted from the stories' ground truth; negated positions come from the `negation`
channel."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.data.corpus import CorpusConfig
from pipelines.data.story_corpus import write_story_corpus
from pipelines.data.stories import NEGATIVE, POSITIVE, StoryConfig
from pipelines.data.tokenizer import WORD_START, TokenizerConfig, train_tokenizer
from pipelines.data.tokens import build_token_store
from pipelines.lm.behaviour import lexicon_accuracy


class Constant:
    """A stand-in LM whose every prediction puts its mass on the words of `favoured`."""

    def __init__(self, vocab: int, favoured: list[int]):
        self.cfg = SimpleNamespace(device="cpu")
        self.bias = torch.zeros(vocab)
        self.bias[favoured] = 5.0

    def __call__(self, tokens):
        return self.bias.expand(*tokens.shape, -1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("behaviour")
    folder = write_story_corpus(StoryConfig(n_stories=300, seed=9), root / "corpus")
    tok = train_tokenizer(pd.read_parquet(folder / "part.parquet")["text"], TokenizerConfig(vocab_size=500))
    cfg = CorpusConfig(held_out=0.2, lexicon=str(folder / "lexicon.tsv"))
    store = build_token_store(str(folder), tok, 64, cfg, root / "tokens")
    return folder, tok, cfg, store, root


def whole_word_ids(tok, words) -> list[int]:
    ids = [tok.token_to_id(WORD_START + w) for w in words]
    return [i for i in ids if i is not None]


def expected_scores(rows, tok, classes, favoured: str) -> dict:
    """From the ground truth: positions before a sentiment word that is one whole token; the
    reaction is negated when the word's valence is the opposite of its context's."""
    pos, neg = set(whole_word_ids(tok, POSITIVE)), set(whole_word_ids(tok, NEGATIVE))
    tokens = np.asarray(rows.tokens, dtype=np.int64)
    nxt = tokens[:, 1:]
    sentiment = np.array([""] + classes["sentiment"])[np.asarray(rows.labels["sentiment"], dtype=np.int64)[:, 1:]]
    context = np.array([""] + classes["context"])[np.asarray(rows.labels["context"], dtype=np.int64)[:, 1:]]
    target = np.isin(nxt, list(pos | neg))
    assert (sentiment[target] != "").all() and (context[target] != "").all()
    negated = target & (sentiment != context)
    plain = target & (sentiment == context)
    word_class = np.where(np.isin(nxt, list(pos)), "positive", "negative")
    return {"plain_count": int(plain.sum()), "negated_count": int(negated.sum()),
            "plain_accuracy": float((word_class[plain] == favoured).mean()),
            "negated_accuracy": float((word_class[negated] == favoured).mean())}


def test_constant_models_score_the_share_of_their_class(setup):
    folder, tok, cfg, store, _ = setup
    rows = store.held_out
    classes = store.classes
    assert len(whole_word_ids(tok, POSITIVE)) >= 5 and len(whole_word_ids(tok, NEGATIVE)) >= 5
    for favoured, words in (("positive", POSITIVE), ("negative", NEGATIVE)):
        model = Constant(tok.get_vocab_size(), whole_word_ids(tok, words))
        scores = lexicon_accuracy(model, rows, store.lexicon_tokens, classes["lexicon"], n_rows=len(rows), batch_size=7)
        expected = expected_scores(rows, tok, classes, favoured)
        assert expected["plain_count"] > 50 and expected["negated_count"] > 50
        assert scores["plain_count"] == expected["plain_count"]
        assert scores["negated_count"] == expected["negated_count"]
        assert scores["plain_accuracy"] == pytest.approx(expected["plain_accuracy"])
        assert scores["negated_accuracy"] == pytest.approx(expected["negated_accuracy"])
        assert 0.2 < scores["plain_accuracy"] < 0.8  # a constant model is not right by accident


def test_negated_positions_come_from_the_negation_channel(setup):
    """The same stories without their negation spans: every position counts as plain."""
    folder, tok, cfg, store, root = setup
    table = pq.read_table(folder / "part.parquet")
    spans = [[s for s in doc if s["label"] != "negation"] for doc in table.column("spans").to_pylist()]
    stripped = root / "stripped"
    stripped.mkdir()
    pq.write_table(table.set_column(1, "spans", pa.array(spans, type=table.schema.field("spans").type)),
                   stripped / "part.parquet")
    plain_store = build_token_store(str(stripped), tok, 64, cfg, root / "plain_tokens")
    assert "negation" not in plain_store.classes
    model = Constant(tok.get_vocab_size(), whole_word_ids(tok, POSITIVE))
    scores = lexicon_accuracy(model, plain_store.held_out, plain_store.lexicon_tokens,
                              plain_store.classes["lexicon"], n_rows=len(plain_store.held_out))
    both = lexicon_accuracy(model, store.held_out, store.lexicon_tokens, store.classes["lexicon"],
                            n_rows=len(store.held_out))
    assert scores["negated_count"] == 0 and "negated_accuracy" not in scores
    assert scores["plain_count"] == both["plain_count"] + both["negated_count"]
    # n_rows limits the rows scored
    few = lexicon_accuracy(model, store.held_out, store.lexicon_tokens, store.classes["lexicon"], n_rows=3)
    assert few["plain_count"] + few["negated_count"] < both["plain_count"] + both["negated_count"]


def test_a_lexicon_of_one_class_is_refused(setup):
    _, tok, _, store, _ = setup
    model = Constant(tok.get_vocab_size(), [])
    with pytest.raises(ValueError, match="at least two classes"):
        lexicon_accuracy(model, store.held_out, {"positive": store.lexicon_tokens["positive"]},
                         store.classes["lexicon"])
