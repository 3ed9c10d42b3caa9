"""Per-token labels: lexicon files, the Labeller's channels and codes, whole-word lexicon pieces.

Offsets are written by hand here (the token store's own alignment is tested in
test_tokens.py), so each expected label follows from the planted spans and words alone.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from pipelines.data.labels import LEXICON_CHANNEL, MAX_CLASSES, Labeller, lexicon_token_ids, read_lexicon
from pipelines.data.tokenizer import WORD_START
from tests.real_text import vader_lexicon_file


def words_and_offsets(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """A hand tokenization: words (with inner apostrophes) and single punctuation marks."""
    matches = list(re.finditer(r"\w+(?:'\w+)*|[^\w\s]", text))
    return [m.group() for m in matches], [m.span() for m in matches]


# ------------------------------------------------------------------ lexicon files


def test_read_lexicon_tab_and_space_formats(tmp_path):
    (tmp_path / "tab.tsv").write_text(
        "# word\tclass\n\ngood\tpositive\nBad\tnegative\nnot bad\tpositive\nso-so\tneutral\textra\tcolumns\n"
        "lonely\n", encoding="utf-8")
    assert read_lexicon(tmp_path / "tab.tsv") == {"good": "positive", "bad": "negative", "so-so": "neutral"}
    assert read_lexicon(tmp_path / "tab.tsv", lowercase=False) == {
        "good": "positive", "Bad": "negative", "so-so": "neutral"}
    (tmp_path / "space.txt").write_text("happy   positive\nsad negative\n  \n#sad positive\n", encoding="utf-8")
    assert read_lexicon(tmp_path / "space.txt") == {"happy": "positive", "sad": "negative"}
    (tmp_path / "bom.tsv").write_bytes("\ufeffjoy\tpositive\n".encode("utf-8"))
    assert read_lexicon(tmp_path / "bom.tsv") == {"joy": "positive"}


def test_read_lexicon_numeric_scores_by_sign(tmp_path):
    (tmp_path / "afinn.txt").write_text("nice\t2.5\nawful\t-3\nmeh\t0\ngrand\t+1\nfed up\t-2\n")
    assert read_lexicon(tmp_path / "afinn.txt") == {"nice": "positive", "awful": "negative", "grand": "positive"}


def test_read_lexicon_refusals(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.tsv"):
        read_lexicon(tmp_path / "nowhere.tsv")
    (tmp_path / "empty.tsv").write_text("# only a comment\n\nlonely\nfed up\t-2\nmeh\t0\n")
    with pytest.raises(ValueError, match="empty.tsv.*no 'word<TAB>class'"):
        read_lexicon(tmp_path / "empty.tsv")
    (tmp_path / "latin1.tsv").write_bytes(b"caf\xe9\tpositive\n")
    with pytest.raises(ValueError, match="latin1.tsv.*not UTF-8"):
        read_lexicon(tmp_path / "latin1.tsv")


def test_vader_lexicon_by_sign():
    path = vader_lexicon_file()
    lexicon = read_lexicon(path)
    scores: dict[str, float] = {}
    phrases = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        word, mean = line.split("\t")[:2]
        if " " in word:
            phrases += 1
        elif float(mean) != 0:
            scores[word.lower()] = float(mean)
    assert phrases > 0 and not any(" " in w for w in lexicon)  # phrases are skipped
    assert set(lexicon) == set(scores)
    assert set(lexicon.values()) == {"positive", "negative"}
    for word in ("good", "great", "love", "happy", "joy"):
        assert lexicon[word] == "positive"
    for word in ("bad", "sad", "evil", "hate", "awful"):
        assert lexicon[word] == "negative"
    assert all((lexicon[w] == "positive") == (s > 0) for w, s in scores.items())  # by sign, last line wins


# ------------------------------------------------------------------ the Labeller


def test_spans_label_exactly_the_tokens_inside():
    text = "He was not sad at all, she was happy."
    words, offsets = words_and_offsets(text)
    spans = [(7, 10, "negation"), (11, 14, "sentiment=negative"), (31, 36, "sentiment=positive"),
             (3, 9, "partial")]  # covers "was" and half of "not"
    labeller = Labeller(None, None, lowercase=True)
    out = labeller.label(text, offsets, None, spans)
    assert set(out) == {"negation", "sentiment", "partial"}
    assert all(v.dtype == np.int8 and v.shape == (len(words),) for v in out.values())
    by_word = {ch: {w: int(c) for w, c in zip(words, codes) if c} for ch, codes in out.items()}
    assert by_word == {"negation": {"not": 1}, "sentiment": {"sad": 1, "happy": 2}, "partial": {"was": 1}}
    assert labeller.classes == {"negation": ["negation"], "sentiment": ["negative", "positive"], "partial": ["partial"]}
    # codes stay fixed across documents: a class seen first later gets the next code
    again = labeller.label("happy", [(0, 5)], None, [(0, 5, "sentiment=positive")])
    assert again["sentiment"].tolist() == [2]
    # a token that is only partly inside, or empty, is not labelled
    assert labeller.label("abcdef", [(0, 3), (3, 6), (4, 4)], None, [(2, 6, "x")])["x"].tolist() == [0, 1, 0]
    assert labeller.label("plain", [(0, 5)], None, []) == {}


def test_spans_label_the_tokens_inside_whatever_the_offsets():
    # ordered offsets take a shortcut (bisection over the non-empty tokens); offsets that step back
    # do not: both must give exactly the definition, a non-empty token [s, e) taking the label of
    # the last span [a, b] with a <= s and e <= b, whatever the tokens' overlaps, repeats and gaps
    rng = np.random.default_rng(0)
    ordered_trials = 0
    for trial in range(600):
        n, kind = int(rng.integers(1, 30)), trial % 5
        starts = np.sort(rng.integers(0, 80, n))
        ends = np.maximum.accumulate(starts + rng.integers(0, 12, n))  # overlapping and repeated
        if kind == 3:  # starts in order, ends not (nested tokens)
            ends = starts + rng.integers(1, 12, n)
        if kind == 4:  # ends in order, starts not
            starts = ends - rng.integers(1, 12, n)
        offsets = [(int(a), int(b)) for a, b in zip(starts, ends)]
        if kind == 1:  # empty tokens
            offsets = [(a, a) if rng.random() < 0.2 else (a, b) for a, b in offsets]
        if kind == 2:  # out of order
            offsets = [offsets[i] for i in rng.permutation(n)]
        full = [(a, b) for a, b in offsets if a < b]
        ordered_trials += [a for a, _ in full] == sorted(a for a, _ in full) and \
            [b for _, b in full] == sorted(b for _, b in full)
        spans = [(int(a), int(b), str(rng.choice(["c=x", "c=y", "d"]))) for a, b in rng.integers(-5, 90, (6, 2))]
        labeller = Labeller(None, None, lowercase=True)
        out = labeller.label("x" * 80, offsets, None, spans)
        for channel in ("c", "d"):
            want = [None] * n
            for a, b, name in spans:
                if name.partition("=")[0] == channel:
                    for i, (s, e) in enumerate(offsets):
                        if a <= s < e <= b:
                            want[i] = name.partition("=")[2] or channel
            codes = out.get(channel, np.zeros(n, dtype=np.int8)).tolist()
            got = [labeller.classes[channel][c - 1] if c else None for c in codes]
            assert got == want, (offsets, spans, channel)
    assert ordered_trials >= 200  # the shortcut was taken often enough to be tested


def test_document_class_labels_every_token():
    labeller = Labeller(None, "polarity", lowercase=True)
    pos = labeller.label("great film", [(0, 5), (6, 10)], "pos", None)
    neg = labeller.label("dull", [(0, 4)], "neg", None)
    none = labeller.label("unknown", [(0, 7)], None, None)
    assert pos["polarity"].tolist() == [1, 1] and neg["polarity"].tolist() == [2]
    assert none == {} and labeller.classes == {"polarity": ["pos", "neg"]}


def test_lexicon_words_are_labelled_whole():
    lexicon = {"unhappiness": "negative", "good": "positive", "didn't": "negative"}
    text = "Good goodness, UNHAPPINESS: it didn't help. good"
    # "unhappiness" in three pieces, "didn't" in two, "goodness" holds "good" but is another word
    offsets = [(0, 4), (5, 9), (9, 13), (13, 14), (15, 17), (17, 22), (22, 26), (26, 27), (28, 30), (31, 35),
               (35, 37), (38, 42), (42, 43), (44, 48)]
    pieces = [text[a:b] for a, b in offsets]
    assert pieces == ["Good", "good", "ness", ",", "UN", "HAPPI", "NESS", ":", "it", "didn", "'t", "help", ".", "good"]
    labeller = Labeller(lexicon, None, lowercase=True)
    codes = labeller.label(text, offsets, None, None)[LEXICON_CHANNEL]
    expected = {"Good": "positive", "UN": "negative", "HAPPI": "negative", "NESS": "negative", "didn": "negative",
                "'t": "negative"}
    for i, piece in enumerate(pieces):
        label = "positive" if i == 13 else expected.get(piece)
        assert codes[i] == (0 if label is None else labeller.classes[LEXICON_CHANNEL].index(label) + 1), piece
    cased = Labeller(lexicon, None, lowercase=False).label(text, offsets, None, None)[LEXICON_CHANNEL]
    assert [p for p, c in zip(pieces, cased) if c] == ["didn", "'t", "good"]  # case must match


def test_lexicon_labels_survive_characters_that_lower_case_longer():
    """'İ' lower-cases to two characters; the words after it must still be found where they are."""
    text = "İstanbul was good, Straße was bad"
    assert len(text.lower()) == len(text) + 1
    words, offsets = words_and_offsets(text)
    labeller = Labeller({"good": "positive", "bad": "negative", "straße": "negative"}, None, lowercase=True)
    codes = labeller.label(text, offsets, None, None)[LEXICON_CHANNEL]
    classes = labeller.classes[LEXICON_CHANNEL]
    assert {w: classes[c - 1] for w, c in zip(words, codes) if c} == {
        "good": "positive", "Straße": "negative", "bad": "negative"}


def test_class_codes_are_bounded():
    labeller = Labeller(None, "id", lowercase=True)
    for i in range(MAX_CLASSES):
        assert labeller.label("x", [(0, 1)], f"c{i}", None)["id"].tolist() == [i + 1]
    with pytest.raises(ValueError, match="more than 127 classes"):
        labeller.label("x", [(0, 1)], "one too many", None)


# ------------------------------------------------------------------ whole-word lexicon pieces


def test_lexicon_token_ids_are_whole_word_pieces():
    pieces = [WORD_START + "good", "good", WORD_START + "bad", WORD_START + "goodness", WORD_START + "sad",
              "ly", WORD_START + "un", WORD_START]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token=WORD_START))
    lexicon = {"good": "positive", "bad": "negative", "sad": "negative", "unhappy": "negative"}
    assert lexicon_token_ids(tok, lexicon) == {"negative": [2, 4], "positive": [0]}


def test_lexicon_token_ids_on_real_text(kjv_tokenizer):
    lexicon = read_lexicon(vader_lexicon_file())
    ids = lexicon_token_ids(kjv_tokenizer, lexicon)
    assert set(ids) == {"negative", "positive"}
    assert not set(ids["positive"]) & set(ids["negative"])
    for label, token_ids in ids.items():
        for i in token_ids:
            piece = kjv_tokenizer.id_to_token(i)
            assert piece.startswith(WORD_START) and lexicon[piece[1:]] == label
    for word, label in (("good", "positive"), ("love", "positive"), ("happy", "positive"), ("sad", "negative"),
                        ("bad", "negative"), ("evil", "negative")):
        assert kjv_tokenizer.token_to_id(WORD_START + word) in ids[label], word
    # every whole-word piece of the vocabulary that VADER rates is found
    rated = {i for piece, i in kjv_tokenizer.get_vocab().items()
             if piece.startswith(WORD_START) and piece[1:] in lexicon}
    assert rated == set(ids["positive"]) | set(ids["negative"]) and len(rated) > 100
