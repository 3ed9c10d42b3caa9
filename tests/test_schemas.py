"""The registry of tables: the docs' tables reference is rendered from it, the stages write
through it, and its rows are sorted and typed as it says."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipelines import schemas

def test_the_tables_reference_has_a_row_per_column_group():
    text = schemas.markdown()
    for table in schemas.TABLES.values():
        for column in table.columns + table.optional:
            assert f"| {', '.join(column.names)} |" in text, (table.name, column.names)


def test_every_table_names_its_keys_sort_and_categories_among_its_columns():
    for table in schemas.TABLES.values():
        names = set(table.names)
        assert len(names) == len(table.names), table.name  # no column twice
        assert set(table.keys) <= names and set(table.sort) <= names and set(table.categories) <= names, table.name
        assert table.stage in ("train-saes", "circuits", "features", "verdicts", "graph"), table.name


def test_write_sorts_rows_and_fixes_types(tmp_path):
    frame = pd.DataFrame({"layer": [0, 0, 0], "outputs": "sae", "input_site": "resid_mid", "out_feature": [2, 0, 1],
                          "n_eigs": [1, 1, 1], "n_active": [5, 6, 7], "corr_active": [0.5, None, 0.25]})
    path = schemas.write(frame, tmp_path, "lowrank", layer=3, part="resid_mid-sae")
    back = pd.read_parquet(path)
    assert back["out_feature"].tolist() == [0, 1, 2] and (back["layer"] == 3).all()
    assert pq.read_schema(path).remove_metadata().equals(schemas.TABLES["lowrank"].schema)
    with pytest.raises(ValueError, match="schema lacks"):
        schemas.write(frame.assign(stray=1), tmp_path, "lowrank", layer=3)


def test_write_refuses_missing_columns_and_repeated_keys(tmp_path):
    frame = pd.DataFrame({"layer": [0, 0], "outputs": "sae", "input_site": "resid_mid", "out_feature": [2, 0],
                          "n_eigs": [1, 1], "n_active": [5, 6], "corr_active": [0.5, 0.25]})
    with pytest.raises(ValueError, match=r"lacks its schema's columns \['corr_active'\]"):
        schemas.write(frame.drop(columns="corr_active"), tmp_path, "lowrank", layer=3)
    with pytest.raises(ValueError, match="2 rows share their keys"):
        schemas.write(frame.assign(out_feature=1), tmp_path, "lowrank", layer=3)
    assert not list(tmp_path.rglob("*.parquet"))  # nothing written


def test_select_picks_one_input_site_and_output_set():
    frame = pd.DataFrame({"outputs": ["sae", "sae", "hosvd"], "input_site": ["resid_mid", "mlp_in", "resid_mid"],
                          "v": [1, 2, 3]})
    assert schemas.select(frame)["v"].tolist() == [1]
    assert schemas.select(frame, "mlp_in")["v"].tolist() == [2]
    assert schemas.select(frame, None, None)["v"].tolist() == [1, 2, 3]
    assert schemas.select(None) is None


def test_a_gate_tags_column_is_written_only_where_the_run_has_it(tmp_path):
    table = schemas.TABLES["gate_verdicts"]
    assert "negation_gate" not in table.names  # not a column of every run's table
    assert [t.column for t in schemas.GATE_TAGS] == [c for o in table.optional for c in o.names] == ["negation_gate"]
    row = {name: None for name in table.names} | {"layer": 0, "outputs": "sae", "input_site": "resid_mid",
                                                   "out_feature": 3, "kind": "pair", "in_a": 1, "in_b": 2}
    bare = schemas.write(pd.DataFrame([row]), tmp_path, "gate_verdicts", 0, part="bare")
    assert pq.read_schema(bare).remove_metadata().equals(table.schema)
    tagged = schemas.write(pd.DataFrame([row | {"negation_gate": True}]), tmp_path, "gate_verdicts", 1, part="tagged")
    assert pq.read_schema(tagged).names == [*table.names, "negation_gate"]
    assert pd.read_parquet(tagged)["negation_gate"].tolist() == [True]
    with pytest.raises(ValueError, match="schema lacks"):
        schemas.write(pd.DataFrame([row | {"other_gate": True}]), tmp_path, "gate_verdicts", 0, part="bare")


def test_a_layer_without_verdicts_keeps_the_tags_column_for_readers_of_every_layer(tmp_path):
    # pyarrow reads a folder with the first file's columns: an empty layer written without the
    # tag's column would drop it from every layer (judge_layer writes empty layers with it)
    table = schemas.TABLES["gate_verdicts"]
    empty = table.schema_with(["negation_gate"]).empty_table().to_pandas()
    row = {name: None for name in table.names} | {"outputs": "sae", "input_site": "resid_mid", "out_feature": 3,
                                                   "kind": "pair", "in_a": 1, "in_b": 2, "negation_gate": True}
    schemas.write(empty, tmp_path, "gate_verdicts", 0, part="resid_mid-sae")
    schemas.write(pd.DataFrame([row]), tmp_path, "gate_verdicts", 1, part="resid_mid-sae")
    back = schemas.read(tmp_path, "gate_verdicts")
    assert back["negation_gate"].tolist() == [True] and back["layer"].tolist() == [1]
