"""The built-in story corpus, other corpus sources, the tokenizer and row packing."""

import json
import re

import pandas as pd
import pytest

from pipelines.corpus import frame_stories, load_corpus, stories_frame, write_story_corpus
from pipelines.data import pack_corpus, split_rows
from pipelines.stories import NEGATIVE, POSITIVE, StoryConfig, generate_stories
from pipelines.tokenizer import BOS, EOS, TokenizerConfig, train_tokenizer

NEGATION_SCOPES = {"not", "never", "wasn't", "didn't feel", "did not feel"}


@pytest.fixture(scope="module")
def stories():
    return generate_stories(StoryConfig(n_stories=1500, seed=3))


@pytest.fixture(scope="module")
def tokenizer(stories):
    return train_tokenizer([s.text for s in stories], TokenizerConfig(vocab_size=600))


def test_seeded_and_varied():
    a = generate_stories(StoryConfig(n_stories=200, seed=1))
    b = generate_stories(StoryConfig(n_stories=200, seed=1))
    c = generate_stories(StoryConfig(n_stories=200, seed=2))
    assert [s.text for s in a] == [s.text for s in b]
    assert [s.text for s in a] != [s.text for s in c]
    assert len({s.text for s in a}) == len(a)  # no repeated story


def test_negation_flips_valence_and_plain_agrees(stories):
    """Checked from the text: a sentiment word is negated when its sentence has a cue before it."""
    counts = {"negated": 0, "plain": 0}
    for s in stories:
        for a, b, valence in s.sentiment_spans:
            word = s.text[a:b]
            assert (word in POSITIVE and valence == 1) or (word in NEGATIVE and valence == -1)
            context = [v for ca, cb, v in s.context_spans if ca <= a < cb]
            assert len(context) == 1
            sentence = s.text[s.text.rfind(".", 0, a) + 1 : a]
            negated = re.search(r"\b(not|never|wasn't|didn't)\b", sentence) is not None
            counts["negated" if negated else "plain"] += 1
            assert valence == (-context[0] if negated else context[0]), (s.text, word)
    total = sum(counts.values())
    assert 0.35 < counts["negated"] / total < 0.65  # both kinds are common


def test_negation_spans_run_from_cue_to_flipped_word(stories):
    for s in stories[:300]:
        words = {a: b for a, b, _ in s.sentiment_spans}
        for a, b in s.negation_spans:
            assert s.text[a:b] in NEGATION_SCOPES
            assert b + 1 in words  # the flipped word follows after one space


def test_contexts_of_both_valences(stories):
    valences = [v for s in stories for _, _, v in s.context_spans]
    assert 0.4 < sum(v > 0 for v in valences) / len(valences) < 0.6


def test_corpus_roundtrip_and_sources(stories, tmp_path):
    folder = write_story_corpus(StoryConfig(n_stories=50, seed=4), tmp_path)
    df = load_corpus(folder)
    regenerated = generate_stories(StoryConfig(n_stories=50, seed=4))
    assert [s.text for s in frame_stories(df)] == [s.text for s in regenerated]
    assert frame_stories(df)[7].negation_spans == regenerated[7].negation_spans

    texts = ["First story here.", "Second one."]
    (tmp_path / "c.txt").write_text("\n\n".join(texts) + "\n\n\n")
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    pd.DataFrame({"text": texts}).to_parquet(tmp_path / "c.parquet")
    import datasets

    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    for name in ("c.txt", "c.jsonl", "c.parquet", "ds"):
        assert load_corpus(tmp_path / name)["text"].tolist() == texts, name


def test_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_corpus(tmp_path / "missing.parquet")
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "empty.txt")
    pd.DataFrame({"body": ["x"]}).to_parquet(tmp_path / "wrong.parquet")
    with pytest.raises(ValueError, match="no 'text' column"):
        load_corpus(tmp_path / "wrong.parquet")


def test_tokenizer_specials_and_lowercase(tokenizer):
    for special in (BOS, EOS, "[PAD]", "[UNK]"):
        assert tokenizer.token_to_id(special) is not None
    enc = tokenizer.encode("Mia wasn't SAD.")
    assert enc.tokens == ["mia", "wasn", "'", "t", "sad", "."]


def test_packing_and_token_labels(stories, tokenizer):
    df = stories_frame(stories[:300])
    rows = pack_corpus(df, tokenizer, n_ctx=64)
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    assert rows.tokens.shape[1] == 64
    assert (rows.tokens[:, 0] == bos).all() and (rows.tokens[:, 1:] != bos).all()
    assert (rows.tokens == eos).any()
    words = [[tokenizer.id_to_token(int(t)) for t in row] for row in rows.tokens]
    neg, sent, ctx = rows.labels["negation"], rows.labels["sentiment"], rows.labels["context"]
    assert neg.sum() > 0 and (sent != 0).sum() > 0
    for i, row in enumerate(words):
        for j, w in enumerate(row):
            if neg[i, j]:
                assert w in {"not", "never", "wasn", "'", "t", "didn", "did", "feel"}
            if sent[i, j] == 1:
                assert w in POSITIVE
            if sent[i, j] == -1:
                assert w in NEGATIVE
            if w in ("[BOS]", "[EOS]"):
                assert ctx[i, j] == 0
    # every sentiment token lies in a context, and plain ones agree with it
    assert ((sent != 0) <= (ctx != 0)).all()


def test_split_rows(stories, tokenizer):
    rows = pack_corpus(stories_frame(stories[:200]), tokenizer, n_ctx=32)
    train, held = split_rows(rows, 0.1)
    assert len(train) + len(held) == len(rows)
    joined = {tuple(r.tolist()) for r in train.tokens} & {tuple(r.tolist()) for r in held.tokens}
    assert len(held) >= 1 and not joined
    with pytest.raises(ValueError, match="n_ctx"):
        pack_corpus(stories_frame(stories[:2]), tokenizer, n_ctx=1)
    with pytest.raises(ValueError, match="fewer than one row"):
        pack_corpus(pd.DataFrame({"text": ["hi"]}), tokenizer, n_ctx=64)


def test_packing_without_bos_or_eos(stories):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {w for s in stories[:50] for w in s.text.lower().replace(".", " ").split()}
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(sorted(words) + ["[UNK]"])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    rows = pack_corpus(stories_frame(stories[:50]), tok, n_ctx=16)
    stream = [i for s in stories[:50] for i in tok.encode(s.text).ids]
    assert rows.tokens.flatten().tolist() == stream[: rows.tokens.numel()]
    assert rows.labels["negation"].shape == rows.tokens.shape
