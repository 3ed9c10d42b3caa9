"""Negation and context labels for a corpus without spans: cues from a lexicon of English
negators, the context's valence from a sentiment lexicon or a document class, and the
negation gate tag they let speak on plain English text (the King James Bible)."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pandas as pd
import pytest

from pipelines.data.corpus import CorpusConfig
from pipelines.data.labels import (CONTEXT_CHANNEL, ENGLISH_NEGATION_CUES, NEGATION_CHANNEL, Labeller,
                                   negation_cues, negation_scopes, sentence_contexts)
from pipelines.data.story_corpus import NEGATION_GATE
from pipelines.summary import tag_counts
from tests.real_text import kjv_chapters, vader_lexicon_file, write_corpus_files

LEXICON = {"glad": "positive", "happy": "positive", "sad": "negative", "angry": "negative", "lost": "negative"}


def words_marked(text: str, codes: np.ndarray, classes: list[str]) -> dict[str, list[str]]:
    """Per class, the words (whitespace pieces) whose characters carry it, from per-character codes."""
    out: dict[str, list[str]] = {}
    start = 0
    for piece in text.split(" "):
        code = codes[start]
        if code:
            out.setdefault(classes[code - 1], []).append(piece.strip(".,"))
        start += len(piece) + 1
    return out


def char_labels(labeller: Labeller, text: str, doc_class=None) -> dict[str, np.ndarray]:
    """Codes per character: every character its own token."""
    return labeller.label(text, [(i, i + 1) for i in range(len(text))], doc_class, None)


def test_scope_runs_from_the_cue_to_the_word_it_flips():
    text = "lily was sad. she was not glad at all, and she didn't feel happy. nothing was lost"
    spans, flipped = negation_scopes(text, ENGLISH_NEGATION_CUES, LEXICON)
    assert [text[a:b] for a, b in spans] == ["not", "didn't feel", "nothing was"]
    assert sorted(text[i:].split()[0].strip(".,") for i in flipped) == ["glad", "happy", "lost"]
    # without a lexicon the scope ends at the clause's end or after NEGATION_SCOPE words
    spans, flipped = negation_scopes("he did not go to the town, no", ENGLISH_NEGATION_CUES, None)
    assert [("he did not go to the town, no")[a:b] for a, b in spans] == ["not go to the", "no"]
    assert flipped == set()


def test_context_is_the_leading_class_of_a_sentence_and_the_one_before():
    text = "the dog was sad and angry. she was happy. it was glad. and then"
    found = [(text[a:b].strip(), label) for a, b, label in sentence_contexts(text, LEXICON, set())]
    # sentence 2: sad, angry, happy -> negative; sentence 3: happy, glad -> positive; the fourth
    # has none of its own but inherits the third's
    assert found == [("the dog was sad and angry.", "negative"), ("she was happy.", "negative"),
                     ("it was glad.", "positive"), ("and then", "positive")]
    # a negated word does not vote: "not glad" leaves the sentence without a class (a tie is nothing)
    text = "he was not glad. nor sad"
    _, flipped = negation_scopes(text, ENGLISH_NEGATION_CUES, LEXICON)
    assert sentence_contexts(text, LEXICON, flipped) == []


def test_labeller_marks_negation_and_context_channels():
    labeller = Labeller(LEXICON, None, True, ENGLISH_NEGATION_CUES, "lexicon")
    text = "Lily was sad. She was not glad."
    out = char_labels(labeller, text)
    assert set(out) == {"lexicon", NEGATION_CHANNEL, CONTEXT_CHANNEL}
    neg = words_marked(text, out[NEGATION_CHANNEL], labeller.classes[NEGATION_CHANNEL])
    assert neg == {"negation": ["not"]}
    ctx = words_marked(text, out[CONTEXT_CHANNEL], labeller.classes[CONTEXT_CHANNEL])
    assert ctx == {"negative": ["Lily", "was", "sad", "She", "was", "not", "glad"]}
    # a document class as the context: every token
    by_column = Labeller(None, "polarity", True, None, "column")
    out = char_labels(by_column, "a fine day", "positive")
    assert by_column.classes[CONTEXT_CHANNEL] == ["positive"] and out[CONTEXT_CHANNEL].all()


def test_cue_settings(tmp_path):
    assert negation_cues("none") is None and negation_cues("english") == ENGLISH_NEGATION_CUES
    path = tmp_path / "cues.txt"
    path.write_text("# mine\nNe\npas\n\n")
    assert negation_cues(str(path)) == {"ne", "pas"}
    with pytest.raises(FileNotFoundError, match="negation cue file"):
        negation_cues(str(tmp_path / "absent.txt"))
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ValueError, match="lists no cue word"):
        negation_cues(str(tmp_path / "empty.txt"))
    # a misspelt setting is refused where the config is made, naming the flag, not later by a digest
    with pytest.raises(FileNotFoundError, match=r"CorpusConfig.negation \(--negation\).*'englsh' is neither"):
        CorpusConfig(negation="englsh")
    assert CorpusConfig(negation=str(path)).negation == str(path)
    (tmp_path / "latin1.txt").write_bytes("n\xe9gation\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"negation cue file .* is not UTF-8 text \(byte 0xe9"):
        negation_cues(str(tmp_path / "latin1.txt"))
    with pytest.raises(ValueError, match=r"CorpusConfig.context 'lexicon' needs CorpusConfig.lexicon"):
        CorpusConfig(context="lexicon")
    with pytest.raises(ValueError, match=r"needs CorpusConfig.label_column"):
        CorpusConfig(context="column")


def test_tag_counts_say_formed_tested_and_why_not():
    rows = pd.DataFrame({
        "kind": ["group"] * 5 + ["pair"],
        "layer": [0, 1, 1, 2, 2, 0],
        "out_feature": [1, 2, 3, 4, 5, 6],
        "label_a": ["negation", "negation", "context=negative", "negation", "lexicon=positive", "negation"],
        "label_b": ["context=positive", "context=positive", "negation | lexicon=negative", "context=negative",
                    "context=positive", "context=negative"],
        "gate_type": ["untested", "untested", "and", "or", "and", "untested"],
        "both_tokens": [3, 5, 40, 60, 80, 0],
        "drop_a": [np.nan, np.nan, 0.8, np.nan, 0.9, np.nan],
        "drop_b": [np.nan, np.nan, 0.7, np.nan, 0.9, np.nan],
        "is_and": [False, False, True, False, True, False],
        NEGATION_GATE.column: [True, False, True, True, False, True],
    })
    line = tag_counts(rows, NEGATION_GATE, "group", min_cell=20)
    # the lexicon x context row is no candidate of the tag: 4 formed, 2 tested, 2 untested and why
    assert line.startswith("negation gates (groups): 4 formed with sides labelled negation and context in layers "
                           "[0, 1, 2]; 2 tested by intervention; 2 untested: ")
    assert "(--min-cell 20); at most 5 held-out tokens had both sides on" in line
    assert "3 of them negation gates by the tag's rule; interventions say and for 1 (layers [1])" in line
    assert "1 ablated in the model, 1 confirmed as AND gates (layers [1])" in line
    pairs = tag_counts(rows, NEGATION_GATE, "pair")
    assert "in layers []" not in pairs and "1 untested" in pairs and "at most 0 held-out tokens" in pairs
    # gate_verdicts holds the ranked candidates only: every group gate formed comes from group_gates
    formed = rows[rows["kind"] == "group"].drop(columns=["both_tokens"]).assign(iv_tokens=[3, 5, 40, 60, 80])
    extra = formed.iloc[:1].assign(out_feature=9, gate_type="untested", iv_tokens=7)
    line = tag_counts(rows, NEGATION_GATE, "group", 20, pd.concat([formed, extra]))
    assert "5 formed" in line and "3 untested" in line and "(--min-cell 20); at most 7 such tokens" in line
    assert tag_counts(rows.iloc[:0], NEGATION_GATE, "pair") == \
        "negation gates (pairs): 0 formed with sides labelled negation and context."


@pytest.mark.slow
def test_negation_gate_tag_on_the_king_james_bible(tmp_path):
    """Plain English text, no spans: the lexicon cues and VADER's valence give the negation
    and context channels, the verdicts form negation x context group gates, and the summary
    counts them."""
    from pipelines.cli import main

    corpus = write_corpus_files(kjv_chapters(limit=400)[["text"]], tmp_path / "kjv")["jsonl"]
    vader = str(vader_lexicon_file())
    out = tmp_path / "run"
    base = ["--out", str(out), "--device", "cpu", "--threads", "1"]
    labels = ["--lexicon", vader, "--negation", "english", "--context", "lexicon"]
    assert main(["train-lm", *base, "--corpus", str(corpus), *labels, "--preset", "tiny", "--train-tokens", "60000",
                 "--vocab-size", "1000"]) == 0
    assert main(["train-saes", *base, "--layers", "all", "--sites", "resid_mid,mlp_out", "--train-tokens", "40960",
                 "--batch-size", "1024", "--k", "4"]) == 0
    assert main(["circuits", *base, "--top-n", "10", "--max-rank", "4", "--corr-rows", "64", "--min-active", "5"]) == 0
    assert main(["features", *base, "--rows", "64"]) == 0
    printed = io.StringIO()
    # this tiny model's SAEs (128 latents, k 4) spread "not" over several latents, none with half
    # its activation on negations: a lower --label-share lets the classes form groups
    with contextlib.redirect_stdout(printed):
        assert main(["verdicts", *base, "--rows", "64", "--n-ablate", "2", "--min-cell", "5", "--label-share", "0.3"]) == 0
    labels_table = pd.read_parquet(out / "tables" / "feature_labels")
    assert {NEGATION_CHANNEL, CONTEXT_CHANNEL} <= set(labels_table["channel"])
    groups = pd.read_parquet(out / "tables" / "group_gates")
    label_gates = groups[groups["source"] == "labels"]
    sides = lambda a, b: ("negation" in a.split(" | ") and any(x.startswith("context=") for x in b.split(" | ")))  # noqa: E731
    formed = label_gates[[sides(a, b) or sides(b, a) for a, b in zip(label_gates["label_a"], label_gates["label_b"])]]
    assert len(formed) > 0, "no negation x context group gate formed"
    verdicts = pd.read_parquet(out / "tables" / "gate_verdicts")
    assert NEGATION_GATE.column in verdicts.columns
    text = printed.getvalue()
    assert tag_counts(verdicts, NEGATION_GATE, "pair", 5) in text
    groups_line = tag_counts(verdicts, NEGATION_GATE, "group", 5, groups)
    assert groups_line in text
    assert f"negation gates (groups): {len(formed)} formed with sides labelled negation and context" in groups_line
    assert "tested by intervention" in groups_line and "in layers []" not in text
