"""Circuit tables: the frames `analyse_layer` returns, their schemas, and reading them back
after `pipelines.engine.tables.write_table` with pandas, pyarrow and DuckDB."""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch

from circuits import CircuitConfig, LayerBatch, MLPWeights, Outputs, SAEWeights, hosvd_outputs
from pipelines.analysis.circuit_tables import analyse_layer
from pipelines.schemas import TABLES
from pipelines.engine.tables import write_table

D, H, N_IN, N_OUT, T = 8, 12, 10, 6, 200
ACTIVE_TABLES = {"lowrank", "lowrank_samples", "gate_truth"}  # only for outputs that are SAE features, with tokens
WEIGHT_TABLES = {"interactions", "gates", "eigen", "eigen_inputs"}


def layer_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    mlp = MLPWeights(
        W_gate=r(D, H), W_in=r(D, H), W_out=r(H, D), b_in=r(H), b_out=r(D),
        g=1 + 0.1 * r(D), eps=1e-5,
    )
    sae_in, sae_out = (
        SAEWeights(W_enc=r(D, n), b_enc=r(n), W_dec=r(n, D), b_dec=r(D), apply_b_dec_to_input=True, k=k)
        for n, k in ((N_IN, 3), (N_OUT, None))
    )
    resid = r(T, D)
    z = sae_in.encode(resid)
    acts = r(T, N_OUT).relu() * (torch.rand(T, N_OUT, generator=gen) < 0.5)
    acts[:, 0] = 0  # a feature that never fires: reported with n_active 0 and NaN
    acts[5:, 1] = 0  # one that fires on at most 5 tokens: too few for min_active 10
    acts[:5, 1] = 1.0
    scale = 1 / (resid.square().mean(-1) + mlp.eps)
    x = mlp.g * resid * scale.sqrt()[:, None]
    def batches():
        return [LayerBatch(x=x[i : i + 64], z=z[i : i + 64], scale=scale[i : i + 64], acts=acts[i : i + 64])
                for i in range(0, T, 64)]

    return mlp, sae_in, sae_out, batches


CFG = CircuitConfig(top_n=5, n_gates=3, max_rank=4, n_eigen_store=D, n_eigen_inputs=3, min_active=10, n_hosvd=3)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Layers 0 and 2, each as SAE outputs (part `resid_mid-sae`) and HOSVD outputs (part
    `resid_mid-hosvd`), written side by side."""
    root = tmp_path_factory.mktemp("tables")
    per_layer = {}
    for layer in (0, 2):
        mlp, sae_in, sae_out, batches = layer_inputs(layer)
        sae_tables = analyse_layer(mlp, sae_in, Outputs("sae", sae_out.W_enc.T, sae=sae_out), batches, CFG, layer=layer)
        hosvd_tables = analyse_layer(mlp, sae_in, hosvd_outputs(mlp, CFG.n_hosvd), batches, CFG, layer=layer)
        per_layer[layer] = {"resid_mid-sae": sae_tables, "resid_mid-hosvd": hosvd_tables}
        for part, tables in per_layer[layer].items():
            for name, frame in tables.items():
                path = write_table(frame, root, name, layer, TABLES[name].schema, part=part)
                assert path.is_file() and path.parent.parent.name == name
    return root, per_layer


def test_the_registry_names_the_tables_each_output_set_gets(written):
    _, per_layer = written
    registry = lambda spec: {t.name for t in TABLES.values()  # noqa: E731
                             if t.stage == "circuits" and t.outputs in ("any", spec)}
    for parts in per_layer.values():
        assert set(parts["resid_mid-sae"]) == registry("sae")
        assert set(parts["resid_mid-hosvd"]) == registry("hosvd")
    assert registry("file:dirs.npy") == WEIGHT_TABLES


def test_frames_match_the_schemas_exactly(written):
    _, per_layer = written
    for layer, parts in per_layer.items():
        assert set(parts["resid_mid-sae"]) == WEIGHT_TABLES | ACTIVE_TABLES
        assert set(parts["resid_mid-hosvd"]) == WEIGHT_TABLES | {"hosvd"}
        for part, tables in parts.items():
            for name, frame in tables.items():
                schema = TABLES[name].schema
                assert sorted(frame.columns) == sorted(schema.names), (part, name)
                inferred = pa.Schema.from_pandas(frame[schema.names], preserve_index=False)
                inferred = pa.schema([(f.name, pa.string() if f.type == pa.large_string() else f.type)
                                      for f in inferred])  # pandas 3's str dtype is large_string
                assert inferred.equals(schema), (part, name, inferred)
                assert len(frame) > 0, (part, name)
                assert (frame.layer == layer).all()
                assert (frame.outputs == part.split("-", 2)[-1]).all() and (frame.input_site == "resid_mid").all()


@pytest.mark.parametrize("name", sorted(WEIGHT_TABLES | ACTIVE_TABLES | {"hosvd"}))
def test_tables_read_back_with_pandas_pyarrow_and_duckdb(written, name):
    root, per_layer = written
    expected = pd.concat([tables[name] for layer in (0, 2) for tables in per_layer[layer].values() if name in tables])
    schema = TABLES[name].schema

    frame = pd.read_parquet(root / name)
    assert sorted(frame.columns) == sorted(schema.names)
    assert str(frame.layer.dtype) == "int64"  # not a category from folder names
    assert sorted(frame.layer.unique()) == [0, 2]
    assert len(frame) == len(expected)
    for field in schema:
        column = frame[field.name]
        if field.type == pa.string():
            assert pd.api.types.is_string_dtype(column), field.name
        elif field.type == pa.float64():
            assert str(column.dtype) == "float64", field.name
        else:  # int64, nullable ones (data_rank, layer_rank) as float with NaN or Int64
            assert pd.api.types.is_integer_dtype(column) or column.isna().any(), field.name

    table = ds.dataset(root / name, format="parquet").to_table()
    assert table.schema.remove_metadata().equals(schema)
    assert table.num_rows == len(expected)
    files = sorted((root / name).rglob("*.parquet"))
    assert all(pq.read_schema(f).remove_metadata().equals(schema) for f in files)

    via_duckdb = duckdb.sql(f"select * from read_parquet('{root}/{name}/**/*.parquet')").df()
    assert sorted(via_duckdb.columns) == sorted(schema.names) and len(via_duckdb) == len(expected)
    assert str(via_duckdb.layer.dtype) == "int64"
    keys = [c for c in schema.names if schema.field(c).type != pa.float64()]
    ours = expected.sort_values(keys).reset_index(drop=True)[schema.names]
    theirs = via_duckdb.sort_values(keys).reset_index(drop=True)[schema.names]
    for column in schema.names:  # the values survive the round trip
        if schema.field(column).type == pa.float64():
            np.testing.assert_array_equal(ours[column].to_numpy(float), theirs[column].to_numpy(float))
        else:
            assert ours[column].astype(object).where(ours[column].notna(), None).tolist() == \
                theirs[column].astype(object).where(theirs[column].notna(), None).tolist(), column


def test_table_contents_follow_conventions(written):
    _, per_layer = written
    tables = per_layer[0]["resid_mid-sae"]
    inter = tables["interactions"]
    assert set(inter.kind) == {"self", "cross", "linear", "constant"}
    assert (inter[inter.kind == "linear"].in_b == -1).all() and (inter[inter.kind == "linear"].in_a >= 0).all()
    assert ((inter[inter.kind == "constant"][["in_a", "in_b"]]) == -1).all().all()
    assert (inter[inter.kind == "self"].in_a == inter[inter.kind == "self"].in_b).all()
    cross = inter[inter.kind == "cross"]
    assert (cross.in_a < cross.in_b).all() and (cross.in_b < N_IN).all()
    by_kind = inter.groupby(["out_feature", "kind"])
    assert by_kind["rank"].apply(lambda s: s.tolist() == list(range(1, len(s) + 1))).all()
    assert by_kind.coefficient.apply(lambda s: s.abs().is_monotonic_decreasing).all()
    assert by_kind.size().max() == CFG.top_n and (inter.kind == "constant").sum() == N_OUT

    eigen = tables["eigen"]
    assert len(eigen) == N_OUT * CFG.n_eigen_store
    assert eigen.groupby("out_feature").eigenvalue.apply(lambda s: s.abs().is_monotonic_decreasing).all()
    np.testing.assert_allclose(eigen.groupby("out_feature").energy_share.sum(), 1.0, rtol=1e-5)  # all D stored
    measured = eigen[eigen["rank"] <= CFG.max_rank]
    assert measured[measured.out_feature >= 2].activation_share.notna().all()
    assert eigen[eigen["rank"] > CFG.max_rank].activation_share.isna().all()
    reads = tables["eigen_inputs"]
    assert len(reads) == N_OUT * CFG.max_rank * CFG.n_eigen_inputs
    assert ((reads.cosine.abs() <= 1 + 1e-6) & (reads.in_feature < N_IN) & (reads.in_feature >= 0)).all()

    gates = tables["gates"]
    assert (gates.in_a < gates.in_b).all()
    assert (gates.groupby("out_feature").size() >= CFG.n_gates).all()
    score = gates.cross - gates.self_a.abs() - gates.self_b.abs()
    np.testing.assert_allclose(score, gates.and_score, rtol=1e-6, atol=1e-6)

    low = tables["lowrank"]
    assert len(low) == N_OUT * CFG.max_rank
    for f, n in [(0, 0), (1, 5)]:  # too few active tokens: NaN correlation, no data rank
        silent = low[low.out_feature == f]
        assert (silent.n_active == n).all() and silent.corr_active.isna().all()
        assert gates[gates.out_feature == f].data_rank.isna().all()
        assert gates[gates.out_feature == f].layer_rank.isna().all()
    busy = low[low.out_feature >= 2]
    assert (busy.n_active >= CFG.min_active).all() and busy.corr_active.notna().all()


def test_outputs_without_sae_give_weight_tables_only():
    mlp, sae_in, _, batches = layer_inputs(5)
    tables = analyse_layer(mlp, sae_in, hosvd_outputs(mlp, 3), batches, CFG, layer=1)
    assert set(tables) == WEIGHT_TABLES | {"hosvd"}
    assert tables["hosvd"].component.tolist() == [0, 1, 2]
    # the singular values of B reshaped to (d_out, d_in^2), from its definition
    B = torch.einsum("ho,ih,jh->oij", mlp.W_out.double(), mlp.W_gate.double(), mlp.W_in.double())
    B = 0.5 * (B + B.transpose(1, 2))
    S = torch.linalg.svdvals(B.reshape(D, D * D))
    np.testing.assert_allclose(tables["hosvd"].singular_value, S[:3].numpy(), rtol=1e-4)
    for name in WEIGHT_TABLES:
        assert sorted(tables[name].out_feature.unique()) == [0, 1, 2], name
        assert (tables[name].outputs == "hosvd").all()
    gates = tables["gates"]
    assert gates[["n_active", "coactivation", "coactivation_lift", "mean_contribution", "contribution_share",
                  "and_data"]].isna().all().all()
    assert gates.data_rank.isna().all() and gates.layer_rank.isna().all()

    gen = torch.Generator().manual_seed(6)
    directions = torch.randn(4, D, generator=gen)
    plain = analyse_layer(mlp, sae_in, Outputs("file:dirs.npy", directions), batches, CFG, layer=1, input_site="mlp_in")
    assert set(plain) == WEIGHT_TABLES
    for name, frame in plain.items():
        assert (frame.outputs == "file:dirs.npy").all() and (frame.input_site == "mlp_in").all()
        assert sorted(frame.out_feature.unique()) == [0, 1, 2, 3]


def test_results_do_not_depend_on_chunk_size_or_workers():
    mlp, sae_in, sae_out, batches = layer_inputs(3)
    outputs = Outputs("sae", sae_out.W_enc.T, sae=sae_out)
    settings = [(64, 64, 1), (1, 1, 2), (4, 3, 3)]
    frames = [analyse_layer(mlp, sae_in, outputs, batches, CFG.replace(chunk_size=c, block_size=b, dtype="float64"),
                            layer=0,
                            workers=w) for c, b, w in settings]
    for other in frames[1:]:
        assert set(other) == set(frames[0])
        for name in frames[0]:
            pd.testing.assert_frame_equal(frames[0][name], other[name], rtol=1e-9, atol=1e-12)


def test_analyse_layer_refuses_bad_inputs():
    mlp, sae_in, sae_out, batches = layer_inputs(4)
    with pytest.raises(ValueError, match="input site"):
        analyse_layer(mlp, sae_in, Outputs("sae", sae_out.W_enc.T, sae=sae_out), batches, CFG, layer=0, input_site="mlp_out")
    with pytest.raises(ValueError, match="output directions"):
        analyse_layer(mlp, sae_in, Outputs("file:x", torch.zeros(3, D + 1)), None, CFG, layer=0)


def test_config_round_trips_through_json():
    cfg = CircuitConfig(top_n=7, dtype="float64", seed=3)
    assert CircuitConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        CircuitConfig.from_json({"top_k": 3})
    with pytest.raises(ValueError):
        CircuitConfig(chunk_size=0)
    with pytest.raises(ValueError):
        CircuitConfig(dtype="float17")
    assert "chunk_size" not in cfg.recipe() and "top_n" in cfg.recipe()
