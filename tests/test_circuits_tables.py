"""Circuit tables: written per layer as hive partitions, read back by pandas and DuckDB."""

from __future__ import annotations

import duckdb
import pandas as pd
import pytest
import torch

from circuits import CircuitConfig, MLPWeights, SAEWeights, analyse_layer, write_layer_tables
from circuits.tables import SCHEMAS, read_table

COLUMNS = {
    "interactions": ["layer", "out_feature", "rank", "in_a", "in_b", "kind", "coefficient"],
    "eigen": ["layer", "out_feature", "rank", "eigenvalue"],
    "lowrank": ["layer", "out_feature", "n_eigs", "n_active", "corr_active"],
    "gates": ["layer", "out_feature", "in_a", "in_b", "and_score", "self_a", "self_b", "cross"],
}
D, H, N_IN, N_OUT = 8, 12, 10, 6


def layer_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    mlp = MLPWeights(
        W_gate=r(D, H), W_in=r(D, H), W_out=r(H, D), b_in=r(H), b_out=r(D),
        g=1 + 0.1 * r(D), eps=1e-5,
    )
    sae_in, sae_out = (
        SAEWeights(W_enc=r(D, n), b_enc=r(n), W_dec=r(n, D), b_dec=r(D), apply_b_dec_to_input=True)
        for n in (N_IN, N_OUT)
    )
    acts = r(200, N_OUT).relu() * (torch.rand(200, N_OUT, generator=gen) < 0.5)
    acts[:, 0] = 0  # a feature that never fires: reported with n_active 0 and NaN
    return mlp, sae_in, sae_out, [(r(200, D), acts)]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("tables")
    cfg = CircuitConfig(top_n=5, n_gates=3, max_rank=4, n_eigen_store=6, min_active=10)
    per_layer = {}
    for layer in (0, 2):
        mlp, sae_in, sae_out, batches = layer_inputs(layer)
        per_layer[layer] = analyse_layer(mlp, sae_in, sae_out, batches, cfg, layer)
        paths = write_layer_tables(per_layer[layer], root, layer)
        for name, path in paths.items():
            assert path.parent.name == f"layer={layer}" and path.parent.parent.name == name
    return root, per_layer


@pytest.mark.parametrize("name", list(COLUMNS))
def test_tables_read_back_with_documented_columns(written, name):
    root, per_layer = written
    frame = read_table(root, name)
    assert sorted(frame.columns) == sorted(COLUMNS[name])
    assert sorted(frame.layer.unique()) == [0, 2]
    expected = pd.concat([per_layer[0][name], per_layer[2][name]])
    assert len(frame) == len(expected)
    for field in SCHEMAS[name]:
        column = frame[field.name]
        if field.type == "string":
            assert pd.api.types.is_string_dtype(column), field.name
        else:
            expected_dtype = {"int64": "int64", "double": "float64"}[str(field.type)]
            assert str(column.dtype) == expected_dtype, field.name

    sql = f"select * from read_parquet('{root}/{name}/**/*.parquet', hive_partitioning=true)"
    via_duckdb = duckdb.sql(sql).df()
    assert sorted(via_duckdb.columns) == sorted(COLUMNS[name])
    assert len(via_duckdb) == len(frame)


def test_table_contents_follow_conventions(written):
    _, per_layer = written
    tables = per_layer[0]
    inter = tables["interactions"]
    assert set(inter.kind) <= {"self", "cross", "linear", "constant"}
    assert (inter[inter.kind == "linear"].in_b == -1).all()
    assert ((inter[inter.kind == "constant"][["in_a", "in_b"]]) == -1).all().all()
    cross = inter[inter.kind == "cross"]
    assert (cross.in_a < cross.in_b).all() and (cross.in_b < N_IN).all()
    by_kind = inter.groupby(["out_feature", "kind"])
    assert by_kind["rank"].apply(lambda s: s.tolist() == list(range(1, len(s) + 1))).all()
    assert by_kind.coefficient.apply(lambda s: s.abs().is_monotonic_decreasing).all()
    assert by_kind.size().max() == 5 and (inter.kind == "constant").sum() == N_OUT

    eigen = tables["eigen"]
    assert len(eigen) == N_OUT * 6
    by_feature = eigen.groupby("out_feature").eigenvalue
    assert by_feature.apply(lambda s: s.abs().is_monotonic_decreasing).all()

    gates = tables["gates"]
    assert len(gates) == N_OUT * 3 and (gates.in_a < gates.in_b).all()
    score = gates.cross - gates.self_a.abs() - gates.self_b.abs()
    assert ((score - gates.and_score).abs() < 1e-5).all()

    low = tables["lowrank"]
    assert len(low) == N_OUT * 4
    silent = low[low.out_feature == 0]
    assert (silent.n_active == 0).all() and silent.corr_active.isna().all()


def test_hosvd_directions_stand_in_without_output_sae(tmp_path):
    mlp, sae_in, _, _ = layer_inputs(5)
    cfg = CircuitConfig(top_n=4, n_gates=2, n_hosvd=3, max_rank=2)
    tables = analyse_layer(mlp, sae_in, None, None, cfg, layer=1)
    assert set(tables) == {"hosvd", "interactions", "eigen", "gates"}
    assert tables["hosvd"].component.tolist() == [0, 1, 2]
    assert tables["hosvd"].singular_value.is_monotonic_decreasing
    assert sorted(tables["interactions"].out_feature.unique()) == [0, 1, 2]
    write_layer_tables(tables, tmp_path, 1)
    assert read_table(tmp_path, "hosvd").layer.tolist() == [1, 1, 1]


def test_config_round_trips_through_json():
    cfg = CircuitConfig(top_n=7, dtype="float64", n_workers=1)
    assert CircuitConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        CircuitConfig.from_json('{"top_k": 3}')
    with pytest.raises(ValueError):
        CircuitConfig(chunk_size=0)
    with pytest.raises(ValueError):
        CircuitConfig(dtype="float17")
