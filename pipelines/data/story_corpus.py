"""The built-in corpus as a corpus: its files, its lexicon and its gate tag.

The generator (`pipelines.data.stories`) makes stories with ground truth; here they become
a corpus folder any stage reads like a user's (`part.parquet` with text and labelled
spans, the sentiment words as `lexicon.tsv`, `story_config.json`), the lexicon a run of
that folder reads unless it names another (`story_lexicon`, the one place that choice is
made), and the corpus's plug-in of the gate verdicts: the *negation gate* (`NEGATION_GATE`,
`pipelines.data.tags`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.data.corpus import SPANS_COLUMN, CorpusConfig
from pipelines.data.stories import NEGATIVE, POSITIVE, Story, StoryConfig, generate_stories
from pipelines.data.tags import GateTag, TagFacts, side_labels
from pipelines.engine.files import atomic_dir, write_json
from pipelines.engine.paths import CORPUS_PART, LEXICON, STORY_CONFIG

NEGATION, CONTEXT = "negation", "context"  # the span labels' channels the negation gate reads
STORY_SCHEMA = pa.schema([
    ("text", pa.string()),
    (SPANS_COLUMN, pa.list_(pa.struct([("start", pa.int64()), ("end", pa.int64()), ("label", pa.string())]))),
])


def story_spans(story: Story) -> list[tuple[int, int, str]]:
    """A story's ground truth as labelled character spans: `negation` (from the cue to the
    word it flips), `context=positive|negative` and `sentiment=positive|negative`."""
    name = {1: "positive", -1: "negative"}
    spans = [(a, b, NEGATION) for a, b in story.negation_spans]
    spans += [(a, b, f"{CONTEXT}={name[v]}") for a, b, v in story.context_spans]
    spans += [(a, b, f"sentiment={name[v]}") for a, b, v in story.sentiment_spans]
    return sorted(spans)


def stories_frame(stories: list[Story]) -> pd.DataFrame:
    return pd.DataFrame({
        "text": [s.text for s in stories],
        SPANS_COLUMN: [[{"start": a, "end": b, "label": label} for a, b, label in story_spans(s)]
                       for s in stories],
    })


def write_story_corpus(cfg: StoryConfig, folder: str | Path) -> Path:
    """Generate the built-in corpus into `folder`: `part.parquet` (text and spans), the
    sentiment words as `lexicon.tsv`, and `story_config.json`. Returns the folder."""
    folder = Path(folder)
    with atomic_dir(folder) as tmp:
        table = pa.Table.from_pandas(stories_frame(generate_stories(cfg)), schema=STORY_SCHEMA,
                                     preserve_index=False)
        pq.write_table(table, tmp / CORPUS_PART)
        lines = [f"{w}\tpositive" for w in POSITIVE] + [f"{w}\tnegative" for w in NEGATIVE]
        (tmp / LEXICON).write_text("\n".join(lines) + "\n")
        write_json(tmp / STORY_CONFIG, cfg.to_json())
    return folder


def story_lexicon(folder: str | Path, cfg: CorpusConfig) -> CorpusConfig:
    """`cfg` reading the lexicon the built-in corpus in `folder` ships, unless it names
    another or the folder has none (a user's corpus)."""
    lexicon = Path(folder) / LEXICON
    return cfg.replace(lexicon=str(lexicon)) if cfg.lexicon is None and lexicon.is_file() else cfg


def negation_gate(rows: pd.DataFrame, facts: TagFacts) -> np.ndarray:
    """Per gate row: one side labelled `negation`, the other `context=C`, and the output
    boosting the lexicon words of a class other than C by at least `facts.least_boost` sd."""
    return np.array([_negation_gate(int(f), a, b, facts)
                     for f, a, b in zip(rows["out_feature"], rows["label_a"], rows["label_b"])], dtype=bool)


def _negation_gate(out_feature: int, label_a, label_b, facts: TagFacts) -> bool:
    cls, sd = facts.boost.get(out_feature, (None, float("nan")))
    for neg, ctx in ((label_a, label_b), (label_b, label_a)):
        contexts = [c[len(CONTEXT) + 1:] for c in side_labels(ctx) if c.startswith(f"{CONTEXT}=")]
        if NEGATION in side_labels(neg) and contexts and cls is not None and cls not in contexts \
                and sd >= facts.least_boost:
            return True
    return False


NEGATION_GATE = GateTag(
    "negation gate", "negation_gate",
    "one side labelled negation, the other a context class, the output boosting another class's words",
    (NEGATION, CONTEXT), negation_gate)
STORY_TAGS = (NEGATION_GATE,)
