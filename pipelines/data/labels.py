"""Per-token labels from what the user (or the story generator) supplies, one mechanism for all.

Three sources of labels, each a *channel* with a few *classes*:

- labelled character spans in the corpus (`spans` column): a span labelled `negation`
  gives channel `negation` (class `negation`); `context=positive` gives channel `context`,
  class `positive`. The built-in stories carry `negation`, `context=...` and
  `sentiment=...` spans;
- a document class (`--label-column polarity`): channel `polarity`, every token of a
  document labelled with the document's class;
- a lexicon (`--lexicon words.tsv`, `word<TAB>class`): channel `lexicon`, the tokens of
  each listed word labelled with its class. The lexicon also names, per class, the
  vocabulary pieces that are whole listed words, for logit effects ("boosts positive
  words"). The built-in corpus ships its sentiment words as such a file;
- negation cues (`--negation english` or a file of cues): channel `negation`, each cue and
  the words after it up to the word it flips (the first lexicon word), the clause's end or
  `NEGATION_SCOPE` words, as the stories' `negation` spans run from the cue to that word;
- the context's valence (`--context lexicon`): channel `context`, each sentence labelled
  with the lexicon class most of its words and the previous sentence's have (a word a
  negation flips is left out of the count; a tie labels nothing), or (`--context column`)
  every token with the document's class. With cues and a sentiment lexicon (VADER's) any
  English text carries the two channels the negation gate tag reads.

A token's label in a channel is stored as an int8, 0 for none and i + 1 for class i.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from bisect import bisect_left, bisect_right
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pipelines.data.corpus import NEGATION_SETTINGS
from pipelines.data.tokenizer import WORD_START
from pipelines.engine.files import read_text_lines

MAX_CLASSES = 127  # int8 codes
LEXICON_CHANNEL = "lexicon"
NEGATION_CHANNEL, CONTEXT_CHANNEL = "negation", "context"
# a common English list: plain negators, negative pronouns and adverbs, and any word ending in
# n't (`is_cue`); "no" and "not" included, the quantifier "none" too
ENGLISH_NEGATION_CUES = frozenset({
    "not", "no", "never", "nobody", "nothing", "none", "neither", "nor", "nowhere", "without", "cannot",
    "noone", "nay", "hardly", "barely", "scarcely", "seldom", "rarely", "lack", "lacks", "lacked", "unable",
})
# words after a cue that a negation's scope reaches at most (short clauses: "did not feel glad")
NEGATION_SCOPE = 3
_WORD = re.compile(r"\w+(?:['’]\w+)*")
_CLAUSE_END = re.compile(r"[.,;:!?\n\"()\u201c\u201d]")
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]*")


def read_lexicon(path: str | Path, lowercase: bool = True) -> dict[str, str]:
    """`word -> class` from lines `word<TAB>class` (or whitespace-separated). A numeric class
    becomes `positive` or `negative` by its sign (VADER's and AFINN's files work as they are);
    phrases, zeros, lines without a class and `#` comments are skipped (counted on stderr); an
    empty word or class (`<TAB>positive`, `nice<TAB>`) is an error naming the line."""
    path = Path(path)
    words: dict[str, str] = {}
    lines = read_text_lines(path, "lexicon")
    skipped = {"phrase": 0, "zero score": 0, "without a class": 0}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t") if "\t" in line else line.split()
        if len(parts) < 2:
            skipped["without a class"] += 1
            continue
        word, label = parts[0].strip(), parts[1].strip()
        for what, value in (("word", word), ("class", label)):
            if not value:
                raise ValueError(f"lexicon {path}, line {number}: {line!r} has an empty {what}; lines are "
                                 "'word<TAB>class'")
        if " " in word:
            skipped["phrase"] += 1
            continue
        try:
            score = float(label)
        except ValueError:
            pass
        else:
            if score == 0:
                skipped["zero score"] += 1
                continue
            label = "positive" if score > 0 else "negative"
        words[word.lower() if lowercase else word] = label
    if not words:
        raise ValueError(f"lexicon {path} has no 'word<TAB>class' lines")
    if sum(skipped.values()):
        plural = {"phrase": "phrases", "zero score": "zero scores"}
        counts = ", ".join(f"{n} {plural.get(what, what) if n > 1 else what}" for what, n in skipped.items() if n)
        print(f"lexicon {path}: skipped {sum(skipped.values())} lines ({counts})", file=sys.stderr)
    return words


def negation_cues(setting: str, lowercase: bool = True) -> frozenset[str] | None:
    """The cue words of `CorpusConfig.negation`: None for 'none', the built-in English list
    for 'english', else the words of a file (one per line, `#` comments skipped)."""
    if setting in NEGATION_SETTINGS:
        return None if setting == "none" else ENGLISH_NEGATION_CUES
    path = Path(setting)
    if not path.is_file():
        raise FileNotFoundError(f"negation cue file {path} does not exist (CorpusConfig.negation is 'english', "
                                "'none' or a file of cue words)")
    lines = read_text_lines(path, "negation cue file")
    words = {line.strip().lower() if lowercase else line.strip() for line in lines}
    words = {w for w in words if w and not w.startswith("#")}
    if not words:
        raise ValueError(f"negation cue file {path} lists no cue word (one per line)")
    return frozenset(words)


def is_cue(word: str, cues: frozenset[str]) -> bool:
    """Whether a (lower-cased) word is a negation cue: listed, or a contraction in n't."""
    return word in cues or word.endswith(("n't", "n’t"))


def negation_scopes(text: str, cues: frozenset[str], lexicon: dict[str, str] | None
                    ) -> tuple[list[tuple[int, int]], set[int]]:
    """The negations of a (lower-cased) text: character spans from each cue to the word it
    flips (excluded), the clause's end or `NEGATION_SCOPE` words; and the start offsets of the
    flipped words (lexicon words inside a scope's reach)."""
    words = list(_WORD.finditer(text))
    spans, flipped = [], set()
    for i, cue in enumerate(words):
        if not is_cue(cue.group(), cues):
            continue
        end = cue.end()
        for word in words[i + 1: i + 1 + NEGATION_SCOPE]:
            if _CLAUSE_END.search(text, end, word.start()) or is_cue(word.group(), cues):
                break
            if lexicon is not None and word.group() in lexicon:
                flipped.add(word.start())
                break
            end = word.end()
        spans.append((cue.start(), end))
    return spans, flipped


def sentence_contexts(text: str, lexicon: dict[str, str], skip: set[int]) -> list[tuple[int, int, str]]:
    """Each sentence of a (lower-cased) text with the lexicon class most of its words and the
    previous sentence's words have, words starting at an offset in `skip` left out; sentences
    where no class leads are left out."""
    out, previous = [], Counter()
    for sentence in _SENTENCE.finditer(text):
        votes = Counter(lexicon[w.group()] for w in _WORD.finditer(text, sentence.start(), sentence.end())
                        if w.group() in lexicon and w.start() not in skip)
        ranked = (previous + votes).most_common(2)
        if ranked and (len(ranked) == 1 or ranked[0][1] > ranked[1][1]):
            out.append((sentence.start(), sentence.end(), ranked[0][0]))
        previous = votes
    return out


def lexicon_token_ids(tok: Tokenizer, lexicon: dict[str, str]) -> dict[str, list[int]]:
    """Per lexicon class, the vocabulary pieces that are one whole listed word (`▁word`)."""
    classes: dict[str, list[int]] = {}
    for piece, index in tok.get_vocab().items():
        if piece.startswith(WORD_START) and piece[1:] in lexicon:
            classes.setdefault(lexicon[piece[1:]], []).append(index)
    return {c: sorted(ids) for c, ids in sorted(classes.items())}


class Labeller:
    """Turns one document's spans, class and words into per-token label codes."""

    def __init__(self, lexicon: dict[str, str] | None, class_channel: str | None, lowercase: bool,
                 cues: frozenset[str] | None = None, context: str = "none"):
        self.lexicon = lexicon
        self.class_channel = class_channel
        self.lowercase = lowercase
        self.cues = cues  # negation cues (`negation_cues`), or None
        self.context = context  # `CorpusConfig.context`
        self.classes: dict[str, list[str]] = {}  # channel -> its classes in code order

    def _code(self, channel: str, label: str) -> int:
        classes = self.classes.setdefault(channel, [])
        if label not in classes:
            if len(classes) == MAX_CLASSES:
                raise ValueError(f"label channel {channel!r} has more than {MAX_CLASSES} classes")
            classes.append(label)
        return classes.index(label) + 1

    def label(self, text: str, offsets: list[tuple[int, int]], doc_class: str | None,
              spans: list[tuple[int, int, str]] | None, lead: int = 0) -> dict[str, np.ndarray]:
        """Codes `[lead + n_tokens]` int8 per channel for a document's tokens with char
        `offsets`, after `lead` unlabelled tokens (a BOS)."""
        n = len(offsets)
        # an empty token is never labelled: the others, where neither bound ever steps back (a
        # tokenizer's offsets, read in order), lie inside a span in one run, found by bisection (a
        # mask over the document per span was most of the time it took to tokenize the demo's corpus)
        kept = [i for i, (a, b) in enumerate(offsets) if a < b]
        starts, ends = [offsets[i][0] for i in kept], [offsets[i][1] for i in kept]
        ordered = starts == sorted(starts) and ends == sorted(ends)
        if not ordered:
            starts, ends = np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)
        whole = len(kept) == n  # no empty token: the run is a slice of the document's tokens
        out: dict[str, np.ndarray] = {}

        def mark(channel: str, label: str, a: int, b: int) -> None:
            if ordered:
                lo, hi = bisect_left(starts, a), bisect_right(ends, b)
                run = slice(lo, hi) if whole else kept[lo:hi]
                found = lo < hi
            else:
                run = [kept[i] for i in np.flatnonzero((starts >= a) & (ends <= b))]
                found = bool(run)
            if found:
                codes = out.setdefault(channel, np.zeros(lead + n, dtype=np.int8))
                codes[lead:][run] = self._code(channel, label)

        for a, b, name in spans or ():
            channel, _, label = name.partition("=")
            mark(channel, label or channel, a, b)
        if self.class_channel is not None and doc_class is not None:
            codes = out.setdefault(self.class_channel, np.zeros(lead + n, dtype=np.int8))
            codes[lead:] = self._code(self.class_channel, doc_class)
        if self.context == "column" and doc_class is not None:
            mark(CONTEXT_CHANNEL, doc_class, 0, len(text))
        if not (self.lexicon or self.cues):
            return out
        # words are found in the text lower-cased whole where that keeps every offset, else
        # case-folded character by character: a character such as 'İ' lower-cases to two, which
        # would shift every offset after it
        lowered = text.lower() if self.lowercase else text
        if len(lowered) != len(text):
            lowered = "".join(c if len(c.lower()) != 1 else c.lower() for c in text)
        if self.lexicon:
            for match in _WORD.finditer(lowered):
                label = self.lexicon.get(match.group())
                if label is not None:
                    mark(LEXICON_CHANNEL, label, match.start(), match.end())
        flipped: set[int] = set()
        if self.cues:
            scopes, flipped = negation_scopes(lowered, self.cues, self.lexicon)
            for a, b in scopes:
                mark(NEGATION_CHANNEL, NEGATION_CHANNEL, a, b)
        if self.context == "lexicon" and self.lexicon:
            for a, b, label in sentence_contexts(lowered, self.lexicon, flipped):
                mark(CONTEXT_CHANNEL, label, a, b)
        return out
