"""Corpus readers, the built-in stories and the tokenizer.

Readers are checked against the documents that were written (planted texts and real text
from the King James Bible), never against another reader's output; the stories against
what their text says; the tokenizer against pieces spelled out by hand.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import re

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from pipelines.data.corpus import CorpusConfig, Documents, corpus_digest, iter_documents
from pipelines.data.labels import read_lexicon
from pipelines.data.stories import NEGATIVE, POSITIVE, StoryConfig, generate_stories
from pipelines.data.story_corpus import story_lexicon, story_spans, write_story_corpus
from pipelines.data.tokenizer import (BOS, EOS, PAD, SPECIAL_TOKENS, UNK, WORD_START, TokenizerConfig, display_token,
                                      join_pieces, special_ids, train_tokenizer)
from tests.real_text import kjv_chapters

COMPRESSORS = {
    "gz": gzip.compress,
    "bz2": bz2.compress,
    "xz": lzma.compress,
    "zst": lambda data: zstandard.ZstdCompressor().compress(data),
}

# planted documents: unicode, quotes, inner newlines, leading/trailing spaces kept as written
PLANTED = pd.DataFrame({
    "text": ["The café was “lovely”, wasn't it?", "Line one\nline two", "  spaced out  ",
             "Ünïcödé ß and 12 digits.", "Last one."],
    "label": ["a", "b", "a", "c", "b"],
})


def read_all(source, **cfg) -> Documents:
    """Every batch of `source` joined into one `Documents`."""
    batch_docs = cfg.pop("batch_docs", 10_000)
    texts, classes, spans, skipped, any_classes, any_spans = [], [], [], 0, False, False
    for batch in iter_documents(str(source), CorpusConfig(**cfg), batch_docs=batch_docs):
        assert 0 < len(batch.texts) + batch.skipped <= batch_docs
        texts += batch.texts
        skipped += batch.skipped
        if batch.classes is not None:
            any_classes = True
            assert len(batch.classes) == len(batch.texts)
            classes += batch.classes
        else:
            classes += [None] * len(batch.texts)
        if batch.spans is not None:
            any_spans = True
            assert len(batch.spans) == len(batch.texts)
            spans += batch.spans
        else:
            spans += [[]] * len(batch.texts)
    return Documents(texts, classes if any_classes else None, spans if any_spans else None, skipped)


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def write_every_format(df: pd.DataFrame, folder) -> dict[str, tuple[str, bool]]:
    """`df` (columns text, label) in every source format: name -> (path, carries labels)."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    write_jsonl(folder / "c.jsonl", df.to_dict("records"))
    out["jsonl"] = (folder / "c.jsonl", True)
    df.to_parquet(folder / "c.parquet", index=False)
    out["parquet"] = (folder / "c.parquet", True)
    parts = folder / "parts"
    parts.mkdir()
    half = len(df) // 2
    df.iloc[:half].to_parquet(parts / "part-0.parquet", index=False)  # read in name order
    df.iloc[half:].to_parquet(parts / "part-1.parquet", index=False)
    df.iloc[:1].to_parquet(parts / ".hidden.parquet", index=False)  # temporaries are not data
    out["parquet folder"] = (parts, True)
    (folder / "c.txt").write_text("\n\n".join(df["text"]) + "\n\n\n", encoding="utf-8")
    out["txt"] = (folder / "c.txt", False)
    datasets.Dataset.from_pandas(df, preserve_index=False).save_to_disk(str(folder / "ds"))
    out["save_to_disk"] = (folder / "ds", True)
    for kind, compress in COMPRESSORS.items():
        for name in ("c.jsonl", "c.txt"):
            path = folder / f"{name}.{kind}"
            path.write_bytes(compress((folder / name).read_bytes()))
            out[f"{name.split('.')[1]}.{kind}"] = (path, name.endswith("jsonl"))
    return out


def check_every_format(df: pd.DataFrame, folder) -> None:
    texts, labels = df["text"].tolist(), df["label"].tolist()
    formats = write_every_format(df, folder)
    assert len(formats) == 13
    for name, (path, has_labels) in formats.items():
        docs = read_all(path, label_column="label" if has_labels else None)
        assert docs.texts == texts, name  # paragraphs too: lines as written, inner newlines kept
        assert docs.skipped == 0 and docs.spans is None, name
        assert docs.classes == (labels if has_labels else None), name


# ------------------------------------------------------------------ readers


def test_every_format_gives_the_same_planted_documents(tmp_path):
    # a paragraph file cannot hold a document with a blank line or surrounding blank space
    check_every_format(PLANTED, tmp_path)


def test_every_format_gives_the_same_real_documents(tmp_path):
    df = kjv_chapters(books=["Ruth", "Jonah", "Philemon", "Jude"]).rename(columns={"book": "label"})
    assert len(df) == 4 + 4 + 1 + 1 and df["text"].str.len().min() > 500
    check_every_format(df[["text", "label"]], tmp_path)


def test_label_column_values(tmp_path):
    """Labels are the column's values as text (numbers too); a null label is None."""
    write_jsonl(tmp_path / "c.jsonl", [{"text": "one", "stars": 5}, {"text": "two", "stars": None},
                                       {"text": "three", "stars": 1.5}, {"text": "four"}])
    docs = read_all(tmp_path / "c.jsonl", label_column="stars")
    assert docs.texts == ["one", "two", "three", "four"]
    assert docs.classes == ["5", None, "1.5", None]
    pd.DataFrame({"body": ["x", "y"], "polarity": [0, 1]}).to_parquet(tmp_path / "c.parquet")
    docs = read_all(tmp_path / "c.parquet", text_column="body", label_column="polarity")
    assert docs.texts == ["x", "y"] and docs.classes == ["0", "1"]


def test_spans_as_structs_and_as_lists(tmp_path):
    texts = ["he was not sad", "plain text", "she was happy"]
    spans = [[(7, 10, "negation"), (11, 14, "sentiment=negative")], [], [(8, 13, "sentiment=positive")]]
    struct = pa.list_(pa.struct([("start", pa.int64()), ("end", pa.int64()), ("label", pa.string())]))
    table = pa.table({"text": texts, "spans": pa.array(
        [[{"start": a, "end": b, "label": c} for a, b, c in s] for s in spans], type=struct)})
    pq.write_table(table, tmp_path / "s.parquet")
    write_jsonl(tmp_path / "s.jsonl", [{"text": t, "spans": [list(x) for x in s]} for t, s in zip(texts, spans)])
    for name in ("s.parquet", "s.jsonl"):
        docs = read_all(tmp_path / name)
        assert docs.texts == texts and docs.spans == spans, name
        for text, doc_spans in zip(docs.texts, docs.spans):
            for a, b, label in doc_spans:  # the planted spans cover the words they name
                assert text[a:b] in {"not", "sad", "happy"}


def test_null_and_blank_texts_are_skipped_and_counted(tmp_path):
    records = [{"text": "a"}, {"text": None}, {"text": ""}, {"text": " \n\t "}, {"text": "b"}, {"other": 1},
               {"text": "c"}]
    write_jsonl(tmp_path / "c.jsonl", records)
    docs = read_all(tmp_path / "c.jsonl", batch_docs=3)
    assert docs.texts == ["a", "b", "c"] and docs.skipped == 4
    pd.DataFrame({"text": ["a", None, "  ", "b", float("nan")]}).to_parquet(tmp_path / "c.parquet")
    docs = read_all(tmp_path / "c.parquet")
    assert docs.texts == ["a", "b"] and docs.skipped == 3


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_text_column_of_numbers_is_refused_naming_the_file(tmp_path, fmt):
    path = tmp_path / f"numbers.{fmt}"
    if fmt == "parquet":
        pd.DataFrame({"text": [1, 2, 3]}).to_parquet(path)
    else:
        write_jsonl(path, [{"text": 1}, {"text": 2}])
    with pytest.raises(ValueError, match=re.escape(str(path)) + r".*'text'.*int"):
        read_all(path)


def test_text_column_of_numbers_in_a_parquet_folder_names_its_file(tmp_path):
    pd.DataFrame({"text": ["fine"]}).to_parquet(tmp_path / "a.parquet")
    pd.DataFrame({"text": [1.5, None]}).to_parquet(tmp_path / "b.parquet")
    pd.DataFrame({"text": pd.Series(["x", "y"], dtype="category")}).to_parquet(tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "b.parquet")) + r".*'text'.*double"):
        read_all(tmp_path)
    (tmp_path / "b.parquet").unlink()
    pd.DataFrame({"text": [None, None]}, dtype=object).to_parquet(tmp_path / "nulls.parquet")
    docs = read_all(tmp_path)  # categorical text is text; a column of nulls only is skipped
    assert docs.texts == ["fine", "x", "y"] and docs.skipped == 2


@pytest.mark.parametrize("name", ["bad.txt", "bad.jsonl", "bad.txt.gz", "bad.jsonl.zst"])
def test_bytes_that_are_not_utf8_are_refused_naming_the_file(tmp_path, name):
    raw = b"good text\n\n" + b"caf\xe9 au lait\n" if "txt" in name else b'{"text": "caf\xe9"}\n'
    path = tmp_path / name
    if name.endswith(".gz"):
        raw = gzip.compress(raw)
    elif name.endswith(".zst"):
        raw = zstandard.ZstdCompressor().compress(raw)
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*not UTF-8"):
        read_all(path)


def test_missing_column_names_the_file_and_lists_the_columns(tmp_path):
    import datasets

    pd.DataFrame({"body": ["x"], "stars": [1]}).to_parquet(tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "c.parquet")) + r".*'text'.*body.*stars"):
        read_all(tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"'label'.*body"):
        read_all(tmp_path / "c.parquet", text_column="body", label_column="label")
    parts = tmp_path / "parts"
    parts.mkdir()
    pd.DataFrame({"text": ["x"]}).to_parquet(parts / "a.parquet")
    pd.DataFrame({"body": ["y"]}).to_parquet(parts / "b.parquet")
    with pytest.raises(ValueError, match=re.escape(str(parts / "b.parquet")) + r".*'text'.*body"):
        read_all(parts)
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "ds")) + r".*'text'.*body"):
        read_all(tmp_path / "ds")
    write_jsonl(tmp_path / "c.jsonl", [{"body": "x", "stars": 1}, {"body": "y"}])
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "c.jsonl")) + r".*'text'.*body.*stars"):
        read_all(tmp_path / "c.jsonl")


def test_other_read_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        read_all(tmp_path / "missing.parquet")
    with pytest.raises(FileNotFoundError, match="missing"):
        corpus_digest(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no Parquet files"):
        read_all(tmp_path / "empty")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is no parquet")
    with pytest.raises(ValueError, match="broken.parquet.*not a readable Parquet"):
        read_all(tmp_path / "broken.parquet")
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl, line 2: not JSON"):
        read_all(tmp_path / "c.jsonl")
    (tmp_path / "list.jsonl").write_text('{"text": "fine"}\n["text", "a list"]\n')
    with pytest.raises(ValueError, match=r"list\.jsonl, line 2"):
        read_all(tmp_path / "list.jsonl")
    (tmp_path / "truncated.txt.gz").write_bytes(gzip.compress(b"some text\n" * 100)[:-12])
    with pytest.raises(ValueError, match="truncated.txt.gz"):
        read_all(tmp_path / "truncated.txt.gz")


def test_offline_hub_name_is_a_value_error_naming_it(monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(ValueError, match=re.escape("hf:nobody-here/no-such-corpus:test") + ".*local"):
        read_all("hf:nobody-here/no-such-corpus:test")
    assert corpus_digest("hf:a/b") != corpus_digest("hf:a/c")  # a hub corpus is known by its name


def test_batches_stream_the_same_documents_as_one_batch(tmp_path):
    n = 23
    records = [{"text": f"document {i}" if i % 5 else None, "label": str(i % 3),
                "spans": [[0, 8, "word"]] if i % 4 == 0 else []} for i in range(n)]
    write_jsonl(tmp_path / "c.jsonl", records)
    pd.DataFrame([{**r, "spans": [dict(zip(("start", "end", "label"), s)) for s in r["spans"]]}
                  for r in records]).to_parquet(tmp_path / "c.parquet")
    for name in ("c.jsonl", "c.parquet"):
        whole = read_all(tmp_path / name, label_column="label", batch_docs=1000)
        batches = list(iter_documents(str(tmp_path / name), CorpusConfig(label_column="label"), batch_docs=4))
        assert len(batches) == -(-n // 4)  # the stream is cut every 4 records, skipped ones included
        assert [t for b in batches for t in b.texts] == whole.texts
        assert [c for b in batches for c in b.classes] == whole.classes
        assert [s for b in batches for s in (b.spans or [[]] * len(b.texts))] == whole.spans
        assert sum(b.skipped for b in batches) == whole.skipped == 5
        expected = [r for r in records if r["text"] is not None]
        assert whole.texts == [r["text"] for r in expected]
        assert whole.spans == [[tuple(s) for s in r["spans"]] for r in expected]


def test_corpus_digest_is_content_based(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        pd.DataFrame({"text": ["x", "y"]}).to_parquet(tmp_path / folder / "part.parquet")
    assert corpus_digest(str(tmp_path / "a")) == corpus_digest(str(tmp_path / "b"))
    pd.DataFrame({"text": ["x", "z"]}).to_parquet(tmp_path / "b" / "part.parquet")
    assert corpus_digest(str(tmp_path / "a")) != corpus_digest(str(tmp_path / "b"))


# ------------------------------------------------------------------ the built-in stories


@pytest.fixture(scope="module")
def stories():
    return generate_stories(StoryConfig(n_stories=1000, seed=3))


def test_stories_are_seeded_and_varied():
    a = generate_stories(StoryConfig(n_stories=200, seed=1))
    b = generate_stories(StoryConfig(n_stories=200, seed=1))
    c = generate_stories(StoryConfig(n_stories=200, seed=2))
    assert [s.text for s in a] == [s.text for s in b]
    assert [s.negation_spans for s in a] == [s.negation_spans for s in b]
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
            sentence = s.text[s.text.rfind(".", 0, a) + 1: a]
            negated = re.search(r"\b(not|never|wasn't|didn't)\b", sentence) is not None
            counts["negated" if negated else "plain"] += 1
            assert valence == (-context[0] if negated else context[0]), (s.text, word)
            # the negation span, when there is one, ends just before this word
            assert negated == any(nb == a - 1 for _, nb in s.negation_spans)
    total = sum(counts.values())
    assert 0.35 < counts["negated"] / total < 0.65  # both kinds are common
    valences = [v for s in stories for _, _, v in s.context_spans]
    assert 0.4 < sum(v > 0 for v in valences) / len(valences) < 0.6


def test_negation_spans_run_from_cue_to_the_flipped_word(stories):
    scopes = {"not", "never", "wasn't", "didn't feel", "did not feel"}
    for s in stories[:300]:
        words = {a for a, _, _ in s.sentiment_spans}
        for a, b in s.negation_spans:
            assert s.text[a:b] in scopes
            assert b + 1 in words  # the flipped word follows after one space


def test_story_corpus_round_trips(tmp_path):
    cfg = StoryConfig(n_stories=40, seed=4)
    folder = write_story_corpus(cfg, tmp_path / "corpus")
    assert sorted(p.name for p in folder.iterdir()) == ["lexicon.tsv", "part.parquet", "story_config.json"]
    regenerated = generate_stories(cfg)
    docs = read_all(folder)
    assert docs.texts == [s.text for s in regenerated]
    for story, spans in zip(regenerated, docs.spans):
        name = {1: "positive", -1: "negative"}
        expected = sorted([(a, b, "negation") for a, b in story.negation_spans]
                          + [(a, b, "context=" + name[v]) for a, b, v in story.context_spans]
                          + [(a, b, "sentiment=" + name[v]) for a, b, v in story.sentiment_spans])
        assert spans == expected == story_spans(story)
        for a, b, label in spans:
            if label.startswith("sentiment="):
                word = story.text[a:b]
                assert word in (POSITIVE if label.endswith("positive") else NEGATIVE)
    assert pq.read_schema(folder / "part.parquet").field("spans").type.value_type.names == ["start", "end", "label"]
    lexicon = read_lexicon(folder / "lexicon.tsv")
    assert lexicon == {**{w: "positive" for w in POSITIVE}, **{w: "negative" for w in NEGATIVE}}
    assert StoryConfig.from_json(json.loads((folder / "story_config.json").read_text())) == cfg


def test_the_built_in_corpus_lexicon_is_read_unless_another_is_named(tmp_path):
    folder = write_story_corpus(StoryConfig(n_stories=5), tmp_path / "corpus")
    assert story_lexicon(folder, CorpusConfig(held_out=0.1)) == CorpusConfig(held_out=0.1,
                                                                             lexicon=str(folder / "lexicon.tsv"))
    assert story_lexicon(folder, CorpusConfig(lexicon="mine.tsv")).lexicon == "mine.tsv"
    (tmp_path / "user").mkdir()  # a user's corpus folder ships no lexicon
    assert story_lexicon(tmp_path / "user", CorpusConfig()) == CorpusConfig()


# ------------------------------------------------------------------ the tokenizer


@pytest.fixture(scope="module")
def story_tok(stories):
    return train_tokenizer([s.text for s in stories], TokenizerConfig(vocab_size=600))


def test_word_start_marks_words(story_tok, kjv_tokenizer):
    tok = kjv_tokenizer
    assert tok.encode("but").tokens == [WORD_START + "but"]
    inside = tok.encode("contribution").tokens
    assert inside[0].startswith(WORD_START) and WORD_START + "but" not in inside
    assert "".join(inside) == WORD_START + "contribution"
    assert tok.token_to_id(WORD_START + "but") not in tok.encode("contribution").ids
    # the pre-tokenizer marks every word and splits punctuation and digits off it
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("but contribution, 42")]
    assert pieces == [WORD_START + "but", WORD_START + "contribution", ",", WORD_START, "4", "2"]
    # merges never cross a word boundary: no piece holds letters of two words
    for text in kjv_chapters(books=["Jude"])["text"]:
        for piece in tok.encode(text).tokens:
            assert WORD_START not in piece[1:], piece


def test_contractions_stay_whole(story_tok):
    assert [p for p, _ in story_tok.pre_tokenizer.pre_tokenize_str("didn't")] == [WORD_START + "didn't"]
    for word in ("didn't", "wasn't"):
        pieces = story_tok.encode(word).tokens
        assert "'" not in pieces and "t" not in pieces, pieces  # not n ' t
        assert "".join(pieces) == WORD_START + word
    # a quote that is not inside a word still splits off
    assert [p for p, _ in story_tok.pre_tokenizer.pre_tokenize_str("it' s")] == [
        WORD_START + "it", "'", WORD_START + "s"]


def test_word_after_an_opening_quote_keeps_its_word_start(story_tok):
    assert story_tok.encode('"I am happy," said Mia.').tokens[:3] == [WORD_START + '"', WORD_START + "i", WORD_START + "am"]


def test_sentiment_words_are_single_tokens_in_real_text(kjv_tokenizer):
    tok = kjv_tokenizer
    assert tok.get_vocab_size() == 4096
    for word in ("good", "bad", "great", "love", "happy", "sad", "evil", "joy"):
        assert tok.encode(word).tokens == [WORD_START + word], word
        assert tok.encode(word.capitalize()).tokens == [WORD_START + word], word  # lower-cased


def test_lowercase_is_optional():
    texts = ["Mia met Tom. Tom met Mia."] * 50
    lower = train_tokenizer(texts, TokenizerConfig(vocab_size=60, lowercase=True))
    cased = train_tokenizer(texts, TokenizerConfig(vocab_size=60, lowercase=False))
    assert lower.encode("Mia").tokens == [WORD_START + "mia"]
    assert cased.encode("Mia").tokens == [WORD_START + "Mia"]
    assert cased.encode("mia").tokens != [WORD_START + "Mia"]
    # whitespace runs are one space either way
    assert [p for p, _ in cased.pre_tokenizer.pre_tokenize_str(cased.normalizer.normalize_str("a \n\t b"))] == [
        WORD_START + "a", WORD_START + "b"]


def test_special_tokens_have_ids(story_tok):
    ids = [story_tok.token_to_id(t) for t in (PAD, BOS, EOS, UNK)]
    assert ids == [0, 1, 2, 3] and SPECIAL_TOKENS == [PAD, BOS, EOS, UNK]
    assert special_ids(story_tok) == [0, 1, 2, 3]
    from tokenizers import Tokenizer, models

    plain = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<s>": 2}, unk_token="a"))
    assert special_ids(plain) == []
    plain.add_special_tokens(["<s>"])
    assert special_ids(plain) == [2]


def test_display_and_join(story_tok):
    assert display_token(WORD_START + "good") == "good"
    assert display_token("ing") == "##ing"
    assert display_token("9") == "##9"
    assert display_token(",") == "," and display_token(",\"") == ",\""
    assert display_token(WORD_START) == " "
    assert join_pieces([WORD_START + "the", WORD_START + "contri", "bution", ",", WORD_START + "ok", "."]) == \
        "the contribution, ok."
    text = "Mia was not sad. She didn't feel angry at all, and she hugged her mom."
    assert join_pieces(story_tok.encode(text).tokens) == text.lower()
    rendered = [display_token(p) for p in story_tok.encode("hugged").tokens]
    assert rendered[0] == rendered[0].lstrip("#") and all(r.startswith("##") for r in rendered[1:])
