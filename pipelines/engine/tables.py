"""Parquet tables: one folder per table, one folder per layer, written atomically.

A table lives at `<root>/<name>/layer<l>/<part>.parquet` (or `<root>/<name>/<part>.parquet`
without layers). Every file holds its own `layer` column as int64, so pandas, pyarrow and
DuckDB read the whole folder as one table with plain integer layers
(`pd.read_parquet("tables/gates")`; DuckDB `read_parquet('tables/gates/**/*.parquet')`).
Folders are not named `layer=<l>`: hive-style names make pandas return the layer as a
category. Several parts of one layer (say, SAE features and logit directions) sit side by
side. A file can carry provenance (a stamp: what it was computed from) in its metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.engine.files import atomic_file

DEFAULT_PART = "part"
PROVENANCE_KEY = b"bilinear_circuits.provenance"


def table_path(root: str | Path, name: str, layer: int | None = None, part: str = DEFAULT_PART) -> Path:
    folder = Path(root) / name
    if layer is not None:
        folder = folder / f"layer{layer}"
    return folder / f"{part}.parquet"


def write_table(
    df: pd.DataFrame,
    root: str | Path,
    name: str,
    layer: int | None = None,
    schema: pa.Schema | None = None,
    part: str = DEFAULT_PART,
    provenance: dict | None = None,
) -> Path:
    """Write `df` as table `name` (layer `layer`, part `part`), replacing that file.

    With a layer, the `layer` column is set to it. `schema` fixes column types (and
    order); a column it lacks, or one of its columns missing from `df`, is an error rather
    than silently dropped or filled with nulls.
    """
    path = table_path(root, name, layer, part)
    if layer is not None:
        df = df.assign(layer=int(layer))
    if schema is not None:
        extra = sorted(set(df.columns) - set(schema.names))
        if extra:
            raise ValueError(f"table {name} has columns {extra} that its schema lacks")
        missing = [c for c in schema.names if c not in df.columns]
        if missing:
            raise ValueError(f"table {name} lacks its schema's columns {missing}")
        df = df.reindex(columns=schema.names)
    table = pa.Table.from_pandas(df, schema=schema, preserve_index=False)
    if provenance is not None:
        metadata = dict(table.schema.metadata or {})
        metadata[PROVENANCE_KEY] = json.dumps(provenance, sort_keys=True).encode()
        table = table.replace_schema_metadata(metadata)
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp)
    return path


def read_table(root: str | Path, name: str, layers: list[int] | None = None) -> pd.DataFrame:
    """A whole table (all layers and parts, or only `layers`); FileNotFoundError if absent."""
    folder = Path(root) / name
    files = sorted(p for p in folder.rglob("*.parquet") if not p.name.startswith(".")) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no table {name!r} under {root}")
    df = pd.read_parquet(files)
    if layers is not None and "layer" in df.columns:
        df = df[df["layer"].isin(layers)].reset_index(drop=True)
    return df


def has_table(root: str | Path, name: str, layer: int | None = None, part: str = DEFAULT_PART) -> bool:
    return table_path(root, name, layer, part).is_file()


def provenance(path: str | Path) -> dict | None:
    """The provenance recorded in a table file, or None."""
    try:
        metadata = pq.read_schema(path).metadata or {}
    except (FileNotFoundError, pa.ArrowInvalid):
        return None
    raw = metadata.get(PROVENANCE_KEY)
    return None if raw is None else json.loads(raw)
