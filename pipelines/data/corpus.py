"""Corpora: write the built-in stories to Parquet, and read any supported source as text.

A corpus source is one of:
- a Parquet file or folder with a `text` column (the built-in corpus is one),
- a JSONL file with a `text` field per line,
- a plain text file, one document per blank-line-separated paragraph,
- a folder saved by `datasets.Dataset.save_to_disk`,
- `hf:<name>[:<split>]`, a `datasets` dataset by name (local cache or network).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa

from circuits.tables import write_table
from pipelines.stories import Story, StoryConfig, generate_stories

TEXT_COLUMN = "text"
CORPUS_TABLE = "corpus"


def stories_frame(stories: list[Story]) -> pd.DataFrame:
    """Stories as a table: text plus ground-truth spans as list columns."""
    return pd.DataFrame(
        {
            TEXT_COLUMN: [s.text for s in stories],
            "negation_spans": [[list(x) for x in s.negation_spans] for s in stories],
            "sentiment_spans": [[list(x) for x in s.sentiment_spans] for s in stories],
            "context_spans": [[list(x) for x in s.context_spans] for s in stories],
        }
    )


def frame_stories(df: pd.DataFrame) -> list[Story]:
    """Inverse of `stories_frame`."""
    return [
        Story(
            text=row.text,
            negation_spans=[tuple(x) for x in row.negation_spans],
            sentiment_spans=[tuple(x) for x in row.sentiment_spans],
            context_spans=[tuple(x) for x in row.context_spans],
        )
        for row in df.itertuples(index=False)
    ]


SPAN_TYPE = pa.list_(pa.list_(pa.int64()))
STORY_SCHEMA = pa.schema(
    [
        (TEXT_COLUMN, pa.string()),
        ("negation_spans", SPAN_TYPE),
        ("sentiment_spans", SPAN_TYPE),
        ("context_spans", SPAN_TYPE),
    ]
)


def write_story_corpus(cfg: StoryConfig, out_dir: str | Path) -> Path:
    """Generate the built-in corpus and write it as a Parquet table; returns the folder."""
    df = stories_frame(generate_stories(cfg))
    write_table(df, out_dir, CORPUS_TABLE, schema=STORY_SCHEMA)
    (Path(out_dir) / CORPUS_TABLE / "_story_config.json").write_text(
        json.dumps(cfg.__dict__, indent=2)
    )
    return Path(out_dir) / CORPUS_TABLE


def has_ground_truth(df: pd.DataFrame) -> bool:
    return {"negation_spans", "sentiment_spans", "context_spans"} <= set(df.columns)


def load_corpus(source: str | Path) -> pd.DataFrame:
    """Read a corpus source (see the module docstring) as a frame with a `text` column.

    Ground-truth columns of the built-in corpus come along when present.
    """
    source_str = str(source)
    if source_str.startswith("hf:"):
        df = _load_hub_dataset(source_str[3:])
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"corpus {path} does not exist")
        if path.is_dir() and (path / "dataset_info.json").exists():
            import datasets

            df = datasets.load_from_disk(str(path)).to_pandas()
        elif path.is_dir() or path.suffix == ".parquet":
            df = pd.read_parquet(path)
        elif path.suffix in (".jsonl", ".json"):
            df = pd.read_json(path, lines=True)
        else:
            paragraphs = path.read_text(encoding="utf-8").split("\n\n")
            df = pd.DataFrame({TEXT_COLUMN: [p.strip() for p in paragraphs if p.strip()]})
    if TEXT_COLUMN not in df.columns:
        raise ValueError(f"corpus {source} has no '{TEXT_COLUMN}' column; columns: {list(df.columns)}")
    df = df[df[TEXT_COLUMN].astype(str).str.strip().astype(bool)].reset_index(drop=True)
    if df.empty:
        raise ValueError(f"corpus {source} is empty: no non-blank '{TEXT_COLUMN}' entries")
    return df


def _load_hub_dataset(spec: str) -> pd.DataFrame:
    """`name[:split]` through `datasets`; offline this works only for cached datasets."""
    import datasets

    name, _, split = spec.partition(":")
    return datasets.load_dataset(name, split=split or "train").to_pandas()
