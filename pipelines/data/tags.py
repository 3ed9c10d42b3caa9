"""Label-based gate tags: what a corpus's own labels say of a gate candidate, as a plug-in of
the corpus.

A corpus whose labels carry a known structure can name the candidates that fit it: the
built-in stories (`pipelines.data.story_corpus`) supply the *negation gate*. A `GateTag`
declares the label channels its rule reads; a run's `gate_verdicts` table has the tag's
column only when the corpus's feature labels (`feature_labels`) carry every one of them,
so a corpus without such labels gets no column rather than a column of nulls. The tags a
run may write are listed once, in `pipelines.schemas.GATE_TAGS`, where each is an optional
column of `gate_verdicts`; the report, the explorer and the printed summary show a tag only
when its column is present (`present_tags`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

LABEL_JOIN = " | "  # a side whose label classes hold the same members is named by all of them


@dataclass(frozen=True)
class TagFacts:
    """What a tag's rule may read besides the gate rows: the output features' logit effects."""

    boost: dict[int, tuple[str, float]]  # output feature -> (lexicon class it boosts most, by how many sd)
    least_boost: float  # least boost (sd) for an output to count as boosting a class (`--boost-sd`)


@dataclass(frozen=True)
class GateTag:
    """A label-based tag of gate candidates, supplied by a corpus."""

    name: str  # what the report and the explorer call a tagged candidate ("negation gate")
    column: str  # the bool column of gate_verdicts it writes
    doc: str  # one line: what a true value says (the docs' tables reference)
    channels: tuple[str, ...]  # label channels the rule reads: without every one the corpus has no such column
    rule: Callable[[pd.DataFrame, TagFacts], np.ndarray]  # gate_verdicts rows (out_feature, label_a, label_b) -> bool each


def side_labels(label) -> list[str]:
    """The label classes of one side of a gate row (`label_a`, `label_b`; none when null)."""
    return label.split(LABEL_JOIN) if isinstance(label, str) else []


def labelled(rows: pd.DataFrame, tag: GateTag) -> pd.DataFrame:
    """The gate rows whose sides carry the label channels the tag reads, each side some of them
    and both together all: the candidates its rule looks at."""
    def fits(a, b) -> bool:
        sides = [{c.partition("=")[0] for c in side_labels(x)} & set(tag.channels) for x in (a, b)]
        return all(sides) and sides[0] | sides[1] == set(tag.channels)

    keep = [fits(a, b) for a, b in zip(rows["label_a"], rows["label_b"])]
    return rows[np.array(keep, dtype=bool)] if len(rows) else rows


def tags_of(labels: pd.DataFrame | None, known: tuple[GateTag, ...]) -> tuple[GateTag, ...]:
    """The tags of `known` that a run's feature labels let speak: those carry every channel
    the tag reads."""
    channels = set() if labels is None else set(labels["channel"].astype(str))
    return tuple(t for t in known if set(t.channels) <= channels)


def present_tags(verdicts: pd.DataFrame | None, known: tuple[GateTag, ...]) -> tuple[GateTag, ...]:
    """The tags of `known` whose column a `gate_verdicts` table has (with a value: tables
    written before tags were optional hold a column of nulls for a corpus without them)."""
    if verdicts is None or verdicts.empty:
        return ()
    return tuple(t for t in known if t.column in verdicts.columns and verdicts[t.column].notna().any())


def tagged(rows: pd.DataFrame, tag: GateTag) -> pd.DataFrame:
    """The rows the tag marks."""
    return rows[rows[tag.column].fillna(False).astype(bool)]
