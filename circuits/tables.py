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

# Circuit tables written per layer by `circuits.layer`. Feature indices are 0-based;
# ranks are 1-based (rank 1 is the strongest). The constant coordinate of the input side
# (z'_{n_in} = 1) is written as index -1: a `linear` term is (in_a=b, in_b=-1) and the
# `constant` term is (in_a=-1, in_b=-1).
INTERACTIONS_SCHEMA = pa.schema(
    [
        ("layer", pa.int64()),
        ("out_feature", pa.int64()),
        ("rank", pa.int64()),  # 1 = largest |coefficient| of this output feature and kind
        ("in_a", pa.int64()),
        ("in_b", pa.int64()),
        ("kind", pa.string()),  # self | cross | linear | constant
        ("coefficient", pa.float64()),  # multiplies z_a^2, z_a z_b, z_a or 1 respectively
    ]
)
EIGEN_SCHEMA = pa.schema(
    [
        ("layer", pa.int64()),
        ("out_feature", pa.int64()),
        ("rank", pa.int64()),  # 1 = largest |eigenvalue|
        ("eigenvalue", pa.float64()),
    ]
)
LOWRANK_SCHEMA = pa.schema(
    [
        ("layer", pa.int64()),
        ("out_feature", pa.int64()),
        ("n_eigs", pa.int64()),  # r: eigenpairs in the approximation
        ("n_active", pa.int64()),  # tokens where the feature is active
        ("corr_active", pa.float64()),  # Pearson over active tokens; NaN if too few
    ]
)
GATES_SCHEMA = pa.schema(
    [
        ("layer", pa.int64()),
        ("out_feature", pa.int64()),
        ("in_a", pa.int64()),
        ("in_b", pa.int64()),  # in_a < in_b
        ("and_score", pa.float64()),  # cross - |self_a| - |self_b|
        ("self_a", pa.float64()),
        ("self_b", pa.float64()),
        ("cross", pa.float64()),  # coefficient of z_a z_b
    ]
)
HOSVD_SCHEMA = pa.schema(
    [
        ("layer", pa.int64()),
        ("component", pa.int64()),  # 0-based; the out_feature of the other tables
        ("singular_value", pa.float64()),
    ]
)
SCHEMAS = {
    "interactions": INTERACTIONS_SCHEMA,
    "eigen": EIGEN_SCHEMA,
    "lowrank": LOWRANK_SCHEMA,
    "gates": GATES_SCHEMA,
    "hosvd": HOSVD_SCHEMA,
}


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
