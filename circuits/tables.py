"""Parquet tables: one folder per table, hive-partitioned by layer, written atomically.

A partitioned table lives at `<root>/<name>/layer=<l>/part-0.parquet`; an unpartitioned one
at `<root>/<name>/part-0.parquet`. pandas, pyarrow and DuckDB all read the folder as one
table (DuckDB with `read_parquet('<root>/<name>/**/*.parquet', hive_partitioning=true)`).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

PART_FILE = "part-0.parquet"


def table_path(root: str | Path, name: str, layer: int | None = None) -> Path:
    """Path of the one Parquet file of table `name` (for `layer`, if partitioned)."""
    folder = Path(root) / name
    if layer is not None:
        folder = folder / f"layer={layer}"
    return folder / PART_FILE


def write_table(
    df: pd.DataFrame,
    root: str | Path,
    name: str,
    layer: int | None = None,
    schema: pa.Schema | None = None,
) -> Path:
    """Write `df` as table `name` (partition `layer`), replacing any earlier partition.

    The layer lives in the folder name, as hive partitioning wants, so a `layer` column in
    `df` is dropped. The file is written under a temporary name in the same folder and
    renamed, so readers never see a half-written file and a crash leaves the old one intact.
    """
    path = table_path(root, name, layer)
    path.parent.mkdir(parents=True, exist_ok=True)
    if layer is not None and "layer" in df.columns:
        df = df.drop(columns="layer")
    if schema is not None and layer is not None and "layer" in schema.names:
        schema = schema.remove(schema.get_field_index("layer"))
    table = pa.Table.from_pandas(df, schema=schema, preserve_index=False)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_table(root: str | Path, name: str) -> pd.DataFrame:
    """Read a whole table (all partitions); the partition key comes back as a column."""
    folder = Path(root) / name
    if not folder.is_dir():
        raise FileNotFoundError(f"no table {name!r} under {root}")
    df = pd.read_parquet(folder)
    if "layer" in df.columns:
        df["layer"] = df["layer"].astype("int64")
    return df


def has_table(root: str | Path, name: str, layer: int | None = None) -> bool:
    return table_path(root, name, layer).is_file()
