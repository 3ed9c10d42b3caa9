"""The token store: rows packed from documents, split by document, labels aligned, memory-mapped.

Every expectation is rebuilt here from the corpus file (read with pandas or json, not with
the store's readers) and the tokenizer: each split is the stream `[BOS] + ids` of its
documents in corpus order, cut into rows of n_ctx with the last partial row left out.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import pipelines.data.tokens as tokens_module
from pipelines.data.corpus import CorpusConfig, iter_documents
from pipelines.data.story_corpus import write_story_corpus
from pipelines.data.labels import LEXICON_CHANNEL, read_lexicon
from pipelines.data.stories import StoryConfig
from pipelines.data.tokenizer import BOS, WORD_START, TokenizerConfig, train_tokenizer
from pipelines.data.tokens import SPLITS, build_token_store, held_out_mask, open_token_store
from tests.real_text import kjv_chapters, vader_lexicon_file, write_corpus_files

N_CTX = 30
HELD_OUT = 0.2
SEED = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The built-in stories (text, spans, lexicon), and their texts and spans read with pandas."""
    folder = write_story_corpus(StoryConfig(n_stories=240, seed=7), tmp_path_factory.mktemp("stories") / "corpus")
    df = pd.read_parquet(folder / "part.parquet")
    spans = [[(int(s["start"]), int(s["end"]), s["label"]) for s in doc] for doc in df["spans"]]
    return folder, df["text"].tolist(), spans


@pytest.fixture(scope="module")
def tok(corpus):
    return train_tokenizer(corpus[1], TokenizerConfig(vocab_size=400))


def store_config(corpus, **kw) -> CorpusConfig:
    return CorpusConfig(**{"held_out": HELD_OUT, "split_seed": SEED, "lexicon": str(corpus[0] / "lexicon.tsv"), **kw})


@pytest.fixture(scope="module")
def store(corpus, tok, tmp_path_factory):
    return build_token_store(str(corpus[0]), tok, N_CTX, store_config(corpus), tmp_path_factory.mktemp("t") / "store")


def streams(texts, tok, share=HELD_OUT, seed=SEED, bos=True):
    """Per split: the token stream, the document of each token and the documents, in order."""
    bos_id = tok.token_to_id(BOS) if bos else None
    held = held_out_mask(np.arange(len(texts)), share, seed)
    out = {split: ([], [], []) for split in SPLITS}
    for i, text in enumerate(texts):
        ids = ([bos_id] if bos else []) + tok.encode(text).ids
        ts, ds, docs = out["held_out" if held[i] else "train"]
        ts += ids
        ds += [i] * len(ids)
        docs.append(i)
    return {k: (np.array(t, dtype=np.int64), np.array(d, dtype=np.int64), d2) for k, (t, d, d2) in out.items()}


def as_rows(stream: np.ndarray, n_ctx: int = N_CTX) -> np.ndarray:
    n = len(stream) // n_ctx
    return stream[: n * n_ctx].reshape(n, n_ctx)


# ------------------------------------------------------------------ packing and splitting


def test_rows_are_each_splits_document_stream(store, corpus, tok):
    expected = streams(corpus[1], tok)
    bos = tok.token_to_id(BOS)
    assert store.info["bos_id"] == bos and store.info["n_ctx"] == N_CTX and store.info["documents"] == len(corpus[1])
    for split in SPLITS:
        rows = getattr(store, split)
        ids, docs, _ = expected[split]
        assert len(rows) == len(ids) // N_CTX > 0, split
        np.testing.assert_array_equal(rows.tokens, as_rows(ids))
        np.testing.assert_array_equal(rows.row_doc, as_rows(docs)[:, 0])
        # BOS exactly where a document starts, never inside one
        starts = np.r_[True, docs[1:] != docs[:-1]][: rows.tokens.size]
        np.testing.assert_array_equal(rows.tokens.ravel() == bos, starts)
        assert int((rows.tokens == bos).sum()) == len(np.unique(docs[: rows.tokens.size])) - (not starts[0])
    # long documents continue in the next row, without a BOS
    lengths = [len(tok.encode(t).ids) + 1 for t in corpus[1]]
    assert max(lengths) > N_CTX
    assert (store.train.tokens[:, 0] != bos).sum() > len(store.train) // 4


def test_documents_recovers_the_document_of_every_token(store, corpus, tok):
    expected = streams(corpus[1], tok)
    for split in SPLITS:
        rows = getattr(store, split)
        want = as_rows(expected[split][1])
        np.testing.assert_array_equal(rows.documents(slice(None)), want, err_msg=split)
        np.testing.assert_array_equal(rows.documents(slice(2, 5)), want[2:5])
        picked = np.array([len(rows) - 1, 0, 3])
        np.testing.assert_array_equal(rows.documents(picked), want[picked])
        np.testing.assert_array_equal(rows.head(4).documents(slice(None)), want[:4])


def test_split_is_by_document(store, corpus, tok):
    expected = streams(corpus[1], tok)
    train_docs = set(np.unique(store.train.documents(slice(None))).tolist())
    held_docs = set(np.unique(store.held_out.documents(slice(None))).tolist())
    assert train_docs and held_docs and not train_docs & held_docs
    assert train_docs == set(expected["train"][2][: len(train_docs)])
    info = store.info["splits"]
    n = len(corpus[1])
    assert info["train"]["documents"] + info["held_out"]["documents"] == n
    assert abs(info["held_out"]["documents"] / n - HELD_OUT) < 4 * math.sqrt(HELD_OUT * (1 - HELD_OUT) / n)
    # the whole text of every document lies in one split: its tokens are contiguous there
    for split in SPLITS:
        docs = getattr(store, split).documents(slice(None)).ravel()
        changes = np.flatnonzero(docs[1:] != docs[:-1])
        assert len(set(docs[changes + 1].tolist())) == len(changes)  # no document comes back later


def test_store_is_reproducible_and_independent_of_batch_size(store, corpus, tok, tmp_path, monkeypatch):
    def small_batches(source, cfg, batch_docs=0):
        return iter_documents(source, cfg, batch_docs=7)

    monkeypatch.setattr(tokens_module, "iter_documents", small_batches)
    again = build_token_store(str(corpus[0]), tok, N_CTX, store_config(corpus), tmp_path / "again")
    names = sorted(p.name for p in store.folder.iterdir())
    assert names == sorted(p.name for p in again.folder.iterdir())
    for name in names:
        assert (store.folder / name).read_bytes() == (again.folder / name).read_bytes(), name
    other = build_token_store(str(corpus[0]), tok, N_CTX, store_config(corpus, split_seed=SEED + 1), tmp_path / "o")
    assert other.info["splits"]["held_out"] != store.info["splits"]["held_out"]


def test_held_out_mask_is_a_deterministic_function_of_the_index():
    index = np.arange(200_000)
    mask = held_out_mask(index, 0.05, 0)
    assert mask.dtype == bool and mask.shape == index.shape
    np.testing.assert_array_equal(mask, held_out_mask(index, 0.05, 0))
    assert abs(mask.mean() - 0.05) < 0.003
    assert abs(held_out_mask(index, 0.3, 9).mean() - 0.3) < 0.006
    perm = np.random.default_rng(0).permutation(len(index))
    np.testing.assert_array_equal(held_out_mask(index[perm], 0.05, 0), mask[perm])  # order does not matter
    chunks = np.concatenate([held_out_mask(c, 0.05, 0) for c in np.array_split(index, 13)])
    np.testing.assert_array_equal(chunks, mask)
    other = held_out_mask(index, 0.05, 1)
    assert abs(other.mean() - 0.05) < 0.003
    assert abs((mask & other).mean() - 0.05 ** 2) < 0.001  # another seed is an independent draw
    assert (held_out_mask(index, 0.1, 0) >= mask).all()  # a larger share holds out a superset


# ------------------------------------------------------------------ labels


def span_labels(text: str, enc, spans, classes) -> dict[str, np.ndarray]:
    """Per channel, the code of each token from the planted spans: a token is labelled when
    its characters (without the space in front of a word) lie inside a span."""
    out = {channel: np.zeros(len(enc.ids), dtype=np.int8) for channel in classes}
    for t, (a, b) in enumerate(enc.offsets):
        while a < b and text[a].isspace():
            a += 1
        for sa, sb, name in spans:
            channel, _, label = name.partition("=")
            if channel in out and sa <= a < b <= sb:
                out[channel][t] = classes[channel].index(label or channel) + 1
    return out


def test_labels_are_aligned_with_tokens(store, corpus, tok):
    folder, texts, spans = corpus
    classes = store.classes
    assert set(classes) == {"negation", "context", "sentiment", LEXICON_CHANNEL}
    assert sorted(classes["sentiment"]) == sorted(classes[LEXICON_CHANNEL]) == ["negative", "positive"]
    held = held_out_mask(np.arange(len(texts)), HELD_OUT, SEED)
    for split in SPLITS:
        rows = getattr(store, split)
        expected = {c: [] for c in ("negation", "context", "sentiment")}
        for i, text in enumerate(texts):
            if held[i] != (split == "held_out"):
                continue
            enc = tok.encode(text)
            for channel, codes in span_labels(text, enc, spans[i], {c: classes[c] for c in expected}).items():
                expected[channel] += [0] + codes.tolist()  # BOS has no label
        for channel, codes in expected.items():
            np.testing.assert_array_equal(rows.labels[channel], as_rows(np.array(codes)), err_msg=channel)
            assert rows.labels[channel].dtype == np.int8
        # the lexicon (sentiment words by name) and the sentiment spans (by position) agree
        lex = np.array([""] + classes[LEXICON_CHANNEL])[np.asarray(rows.labels[LEXICON_CHANNEL], dtype=np.int64)]
        sent = np.array([""] + classes["sentiment"])[np.asarray(rows.labels["sentiment"], dtype=np.int64)]
        np.testing.assert_array_equal(lex, sent)
        assert (sent != "").sum() > 50
    # negation tokens are the cue up to the flipped word and nothing else
    pieces = np.array([tok.id_to_token(i) for i in range(tok.get_vocab_size())])
    negated = set(pieces[np.asarray(store.train.tokens)[np.asarray(store.train.labels["negation"]) != 0]])
    assert {WORD_START + "not", WORD_START + "never"} <= negated
    assert negated <= {WORD_START + w for w in ("not", "never", "did", "feel", "didn't", "wasn't", "didn", "wasn")} | {
        "'t", "'", "t"}


def test_planted_span_and_classes_in_real_text(tmp_path, kjv_tokenizer):
    """KJV chapters with a made-up word planted in each, labelled by a span; the testament
    as document class; VADER as lexicon."""
    tok = kjv_tokenizer
    df = kjv_chapters(books=["Ruth", "Jonah", "Matthew", "Jude"])
    nonce = "Zorblaxian"
    texts, spans = [], []
    for i, text in enumerate(df["text"]):
        words = text.split(" ")
        at = (7 * i + 3) % len(words)
        start = len(" ".join(words[:at])) + (1 if at else 0)
        texts.append(" ".join(words[:at] + [nonce] + words[at:]))
        spans.append([{"start": start, "end": start + len(nonce), "label": "planted"}])
        assert texts[-1][start:start + len(nonce)] == nonce
    df = df.assign(text=texts, spans=spans)
    paths = write_corpus_files(df[["text", "testament", "spans"]], tmp_path / "kjv", compress=("zst",))
    cfg = CorpusConfig(label_column="testament", lexicon=str(vader_lexicon_file()), held_out=0.25, split_seed=1)
    store = build_token_store(str(paths["jsonl.zst"]), tok, 128, cfg, tmp_path / "store")
    lexicon = read_lexicon(vader_lexicon_file())
    assert store.classes["planted"] == ["planted"]
    assert sorted(store.classes["testament"]) == ["new", "old"]
    pieces = np.array([tok.id_to_token(i) for i in range(tok.get_vocab_size())])
    bos = tok.token_to_id(BOS)
    held = held_out_mask(np.arange(len(df)), 0.25, 1)
    for split in SPLITS:
        rows = getattr(store, split)
        ids = np.asarray(rows.tokens).ravel()
        docs = rows.documents(slice(None)).ravel()
        planted = np.asarray(rows.labels["planted"]).ravel()
        # the planted word's pieces, and nothing else, carry the span's label
        whole_docs = np.unique(docs)[:-1]  # the last one may be cut off by the end of the rows
        assert len(whole_docs) >= 2
        for doc in whole_docs:
            assert "".join(pieces[ids[(docs == doc) & (planted == 1)]]) == WORD_START + nonce.lower()
        assert set(np.unique(planted)) <= {0, 1}
        # every token but BOS has its document's testament
        testament = np.array([""] + store.classes["testament"])[np.asarray(rows.labels["testament"]).ravel()]
        want = np.where(ids == bos, "", df["testament"].to_numpy()[docs])
        np.testing.assert_array_equal(testament, want)
        assert (held[np.unique(docs)] == (split == "held_out")).all()
        # whole-word lexicon pieces followed by a new word are labelled with the word's class
        lex = np.array([""] + store.classes[LEXICON_CHANNEL])[np.asarray(rows.labels[LEXICON_CHANNEL]).ravel()]
        word_end = np.r_[[not (p[:1].isalnum() or p[:1] == "'") for p in pieces[ids[1:]]], False]
        whole = np.array([p.startswith(WORD_START) and p[1:] in lexicon for p in pieces[ids]])
        for t in np.flatnonzero(whole & word_end):
            assert lex[t] == lexicon[pieces[ids[t]][1:]], pieces[ids[t]]
        assert len(np.flatnonzero(whole & word_end)) > 20
    for label, token_ids in store.lexicon_tokens.items():
        assert all(lexicon[pieces[i][1:]] == label for i in token_ids)
    assert tok.token_to_id(WORD_START + "good") in store.lexicon_tokens["positive"]


def test_literal_special_tokens_in_text_are_text(tmp_path, tok):
    texts = ["She wrote [BOS] and [PAD] on the board.", "[BOS] [EOS] [UNK]"] * 20 + ["Mia was happy."] * 40
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    store = build_token_store(str(tmp_path / "c.jsonl"), tok, 8, CorpusConfig(held_out=0.3), tmp_path / "s")
    bos = tok.token_to_id(BOS)
    for split in SPLITS:
        rows = getattr(store, split)
        docs = rows.documents(slice(None)).ravel()
        starts = np.r_[rows.tokens[0, 0] == bos, docs[1:] != docs[:-1]]
        np.testing.assert_array_equal(np.asarray(rows.tokens).ravel() == bos, starts)


# ------------------------------------------------------------------ statistics and files


def test_statistics_count_bytes_tokens_and_documents(store, corpus, tok):
    texts = corpus[1]
    held = held_out_mask(np.arange(len(texts)), HELD_OUT, SEED)
    for split in SPLITS:
        mine = [t for t, h in zip(texts, held) if h == (split == "held_out")]
        stats = store.info["splits"][split]
        assert stats["documents"] == len(mine)
        assert stats["bytes"] == sum(len(t.encode("utf-8")) for t in mine)
        assert stats["tokens"] == sum(len(tok.encode(t).ids) for t in mine)
        assert stats["rows"] == len(getattr(store, split))
        assert store.bytes_per_token(split) == pytest.approx(stats["bytes"] / stats["tokens"])
    assert 2 < store.bytes_per_token() < 8


def test_statistics_without_bos(corpus, tmp_path):
    """A tokenizer without [BOS] (a converted one, say): rows start mid-text, counts stay exact."""
    texts = corpus[1][:120]
    words = sorted({w for t in texts for w in t.lower().replace(".", " ").replace(",", " ").split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words + ["[UNK]"])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    pd.DataFrame({"text": texts}).to_parquet(tmp_path / "c.parquet")
    store = build_token_store(str(tmp_path / "c.parquet"), tok, 16, CorpusConfig(held_out=0.25), tmp_path / "s")
    assert store.info["bos_id"] is None
    expected = streams(texts, tok, share=0.25, seed=0, bos=False)
    for split in SPLITS:
        ids, docs, mine = expected[split]
        rows = getattr(store, split)
        np.testing.assert_array_equal(rows.tokens, as_rows(ids, 16))
        np.testing.assert_array_equal(rows.documents(slice(None)), as_rows(docs, 16))
        keep = rows.keep(rows.batch(slice(0, 2)))
        assert not keep[:, 0].any() and keep[:, 1:].all()  # no BOS: only each row's first token is dropped
        stats = store.info["splits"][split]
        assert stats["tokens"] == len(ids) and stats["documents"] == len(mine)
        assert stats["bytes"] == sum(len(texts[i].encode()) for i in mine)


def test_token_counts_are_the_train_rows_counts(store, tok):
    stats = store.info["splits"]["train"]
    assert store.train.tokens.size < stats["tokens"] + stats["documents"]  # a partial last row was left out
    counts = store.token_counts()
    assert counts.dtype == np.int64 and counts.shape == (tok.get_vocab_size(),)
    np.testing.assert_array_equal(counts, np.bincount(np.asarray(store.train.tokens).ravel(),
                                                      minlength=tok.get_vocab_size()))


def test_rows_are_memory_mapped(store):
    reopened = open_token_store(store.folder)
    for split in SPLITS:
        rows = getattr(reopened, split)
        assert isinstance(rows.tokens, np.memmap) and isinstance(rows.row_doc, np.memmap)
        assert all(isinstance(v, np.memmap) for v in rows.labels.values())
        assert rows.tokens.dtype == np.uint16  # a vocabulary under 65536
        size = (store.folder / f"{split}.tokens.bin").stat().st_size
        assert size == rows.tokens.size * 2
        assert np.shares_memory(rows.head(3).tokens, rows.tokens)  # a view, not a copy
        batch = rows.batch(np.array([0, 2]))
        assert batch.dtype == torch.int64 and batch.shape == (2, N_CTX)
        np.testing.assert_array_equal(batch.numpy(), np.asarray(rows.tokens[[0, 2]], dtype=np.int64))
    with pytest.raises(FileNotFoundError, match="no token store"):
        open_token_store(store.folder / "nothing")


def test_keep_and_batches(store, tok):
    rows = store.train
    seen = []
    for part, batch in rows.iter_batches(5, limit=12):
        seen.append((part.start, part.stop))
        expected = batch != tok.token_to_id(BOS)
        expected[:, 0] = False  # a row's first token is an attention sink even mid-document
        assert torch.equal(rows.keep(batch), expected)
        assert torch.equal(batch, torch.from_numpy(np.asarray(rows.tokens[part], dtype=np.int64)))
    assert seen == [(0, 5), (5, 10), (10, 12)]


def test_too_small_corpora_are_refused_clearly(tmp_path, tok):
    (tmp_path / "few.jsonl").write_text("".join(json.dumps({"text": "Mia was happy. " * 3}) + "\n" for _ in range(30)))
    with pytest.raises(ValueError, match=r"too small: its 0 held-out documents.*no row of 64.*--held-out"):
        build_token_store(str(tmp_path / "few.jsonl"), tok, 64, CorpusConfig(held_out=0.001), tmp_path / "s")
    assert not (tmp_path / "s").exists() and not list(tmp_path.glob(".*"))
    (tmp_path / "blank.jsonl").write_text('{"text": " "}\n{"text": null}\n')
    with pytest.raises(ValueError, match=r"no documents with text \(2 empty or null\)"):
        build_token_store(str(tmp_path / "blank.jsonl"), tok, 8, CorpusConfig(), tmp_path / "s")
    with pytest.raises(ValueError, match="n_ctx=1"):
        build_token_store(str(tmp_path / "few.jsonl"), tok, 1, CorpusConfig(), tmp_path / "s")
