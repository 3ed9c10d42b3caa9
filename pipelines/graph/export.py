"""A prompt's graph as files: circuit-tracer's graph JSON (its viewer reads `<run>/graphs/`),
`graph-metadata.json`, feature files for the viewer's detail pane, and Parquet tables.

Viewer rows: the viewer draws one row per `layer` string, so a model layer l has two rows, the
input SAE's latents (and input errors) at row 2l and the mlp_out SAE's latents (and output
errors) at row 2l+1; logits are row 2 n_layers. A feature's `feature` number is the Cantor
pairing of (row, latent), as circuit-tracer numbers them (schema version 1), and the viewer
reads its details from `features/<that number>.json` under the graphs folder.
"""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import torch

from circuits.attribution import INPUT, INPUT_ERROR, KINDS, LOGIT, OUTPUT, OUTPUT_ERROR, TOKEN
from circuits.sites import OUTPUT_SITE
from pipelines.engine.files import read_json, write_json
from pipelines.engine.paths import RunPaths
from pipelines.graph.build import PromptGraph
from pipelines.schemas import write

FEATURES_FOLDER = "features"
SCAN = "./graph_data/" + FEATURES_FOLDER  # the viewer fetches `<scan>/<feature>.json`; the server maps graph_data/


def cantor(x: int, y: int) -> int:
    """Circuit-tracer's number of latent y of row x (Cantor pairing)."""
    return (x + y) * (x + y + 1) // 2 + y


def node_frame(pg: PromptGraph, descriptions: dict[tuple[int, str, int], str]) -> pd.DataFrame:
    """One row per node of the unpruned graph: ids, where it is, its value and terms, its
    influence and whether pruning kept it. `descriptions` maps (layer, site, latent) to text."""
    g = pg.graph
    n_layers = int(g.layer[g.kind == LOGIT][0])
    kind, layer, pos, index = (t.tolist() for t in (g.kind, g.layer, g.pos, g.index))
    ids, sites, rows, tokens, labels = [], [], [], [], []
    first_logit = len(kind) - len(pg.targets)
    for j, (k, l, p, i) in enumerate(zip(kind, layer, pos, index)):
        site = _site(k, l, pg.sites)
        row = 2 * n_layers if k == LOGIT else -1 if k == TOKEN else 2 * l + (k in (OUTPUT, OUTPUT_ERROR))
        token = pg.targets[j - first_logit] if k == LOGIT else pg.tokens[p]
        if k == TOKEN:
            ids.append(f"E_{i}_{p}")
            labels.append(f"Emb: {token!r}")
        elif k in (INPUT, OUTPUT):
            ids.append(f"{row}_{i}_{p}")
            labels.append(f"L{l} {site} #{i}: {descriptions.get((l, site, i), 'no description')}")
        elif k == LOGIT:
            ids.append(f"{row}_{i}_{p}")
            labels.append(f'Output "{token}" (p={float(g.probability[j]):.3f})')
        else:
            ids.append(f"{row}_err_{p}")
            labels.append(f"Err: L{l} {site} {token!r}" if l in pg.sites or k == INPUT_ERROR else f"Err: L{l} whole MLP {token!r}")
        sites.append(site)
        rows.append(row)
        tokens.append(token)
    incoming = g.adjacency.to(torch.float64).sum(1)
    step = torch.full((len(kind),), -1)
    step[pg.top_path] = torch.arange(len(pg.top_path))
    return pd.DataFrame({
        "prompt": pg.slug, "node_id": ids, "kind": [KINDS[k] for k in kind], "layer": layer, "site": sites,
        "viewer_row": rows, "pos": pos, "feature": [i if k in (INPUT, OUTPUT) else -1 for k, i in zip(kind, index)],
        "token": tokens, "value": g.value.double().numpy(), "constant": g.constant.double().numpy(),
        "incoming": incoming.numpy(), "influence": pg.cumulative.double().numpy(),
        "kept": pg.node_mask.numpy(), "path_step": step.numpy(), "description": labels,
    })


def _site(kind: int, layer: int, sites: dict[int, str]) -> str:
    if kind == TOKEN:
        return "embed"
    if kind == LOGIT:
        return "logits"
    if kind in (INPUT, INPUT_ERROR):
        return sites[layer]
    return OUTPUT_SITE


def edge_frame(pg: PromptGraph, nodes: pd.DataFrame) -> pd.DataFrame:
    """The edges pruning kept: source, target, weight."""
    tgt, src = torch.nonzero(pg.edge_mask, as_tuple=True)
    ids = nodes["node_id"].to_numpy()
    return pd.DataFrame({"prompt": pg.slug, "source": ids[src.numpy()], "target": ids[tgt.numpy()],
                         "weight": pg.graph.adjacency[tgt, src].double().numpy()})


def and_frame(pg: PromptGraph, nodes: pd.DataFrame) -> pd.DataFrame:
    """Every kept AND hyperedge (`n_and` per output feature), ranked per target by |weight|."""
    g = pg.graph
    ids = nodes["node_id"].to_numpy()
    frame = pd.DataFrame({"prompt": pg.slug, "target": ids[g.and_target.numpy()], "source_a": ids[g.and_a.numpy()],
                          "source_b": ids[g.and_b.numpy()], "weight": g.and_weight.double().numpy()})
    frame["rank"] = frame["weight"].abs().groupby(frame["target"]).rank(ascending=False, method="first").astype(int)
    return frame


def feature_rows(features: pd.DataFrame | None) -> dict[tuple[int, str, int], dict]:
    """Each row of a `features` table (None: none) by its (layer, site, latent)."""
    if features is None:
        return {}
    return {(int(r["layer"]), r["site"], int(r["feature"])): r for r in features.to_dict("records")}


def graph_frames(pg: PromptGraph, rows: dict[tuple[int, str, int], dict]) -> tuple[pd.DataFrame, ...]:
    """The graph's three tables, `(nodes, edges, ands)`: `node_frame` labelled with the
    descriptions of `rows` (`feature_rows`), `edge_frame` and `and_frame`."""
    nodes = node_frame(pg, {key: r["description"] for key, r in rows.items()})
    return nodes, edge_frame(pg, nodes), and_frame(pg, nodes)


def graph_json(pg: PromptGraph, nodes: pd.DataFrame, edges: pd.DataFrame, ands: pd.DataFrame) -> dict:
    """The graph in circuit-tracer's schema (`circuit_tracer.frontend.graph_models.Model`), its
    nodes the kept ones, plus our AND hyperedges among them under `and_edges` (ignored by the viewer)."""
    kept = nodes[nodes["kept"]]
    out = []
    for r in kept.itertuples():
        node = {"node_id": r.node_id, "layer": "E" if r.kind == "token" else str(r.viewer_row), "ctx_idx": int(r.pos),
                "influence": float(r.influence), "clerp": viewer_html(r.description)}
        if r.kind == "token":
            node.update(feature=int(r.pos), feature_type="embedding", jsNodeId=f"E_{r.node_id.split('_')[1]}-{r.pos}")
        elif r.kind in ("input", "output"):
            number = cantor(int(r.viewer_row), int(r.feature))
            node.update(feature=number, feature_type="cross layer transcoder", activation=float(r.value),
                        jsNodeId=f"{r.viewer_row}_{r.feature}-0")
        elif r.kind == "logit":
            vocab = int(r.node_id.split("_")[1])
            node.update(feature=vocab, feature_type="logit", is_target_logit=bool(r.Index == len(nodes) - len(pg.targets)),
                        token_prob=float(pg.graph.probability[r.Index]), jsNodeId=f"L_{vocab}-{r.pos}")
        else:
            node.update(feature=-1, feature_type="mlp reconstruction error", jsNodeId=f"{r.viewer_row}_{r.pos}-0")
        out.append(node)
    keep = set(kept["node_id"])
    ands = ands[ands["target"].isin(keep) & ands["source_a"].isin(keep) & ands["source_b"].isin(keep)]
    return {
        "metadata": {"slug": pg.slug, "scan": SCAN, "transcoder_list": [],
                     "prompt_tokens": [viewer_html(t) for t in pg.tokens],
                     "prompt": pg.prompt, "node_threshold": None, "schema_version": 1,
                     "replacement_score": pg.replacement, "completeness_score": pg.completeness},
        "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
        "nodes": out,
        "links": [{"source": s, "target": t, "weight": float(w)} for s, t, w in
                  edges[["source", "target", "weight"]].itertuples(index=False)],
        "and_edges": ands.drop(columns="prompt").to_dict("records"),
    }


def viewer_html(text: str) -> str:
    """`text` escaped for the viewer, which inserts node labels (`clerp`) and the prompt's tokens
    (in the labels it makes for token and error nodes) into its tooltips as HTML. Quotes stay:
    they are no markup there, and the viewer reads a logit's token between them."""
    return html.escape(text, quote=False)


def feature_file(layer: int, site: str, latent: int, row: dict) -> dict:
    """The viewer's feature detail (`circuit_tracer.frontend.feature_models.Model`) from our
    `features` table row: its top contexts (the active token marked, no per-token activations
    are stored, so only that token carries the feature's maximum) and boosted tokens."""
    examples = []
    for text in _strings(row.get("top_contexts")):
        words = text.split(" ")
        at = next((i for i, w in enumerate(words) if w.startswith("[") and w.endswith("]")), 0)
        words = [w[1:-1] if i == at else w for i, w in enumerate(words)]
        examples.append({"tokens_acts_list": [float(row["max_activation"]) if i == at else 0.0 for i in range(len(words))],
                         "train_token_ind": at, "is_repeated_datapoint": False, "tokens": words})
    return {"transcoder_id": f"layer{layer}_{site}", "index": latent,
            "examples_quantiles": [{"quantile_name": "Top activations (one per document)", "examples": examples}],
            "top_logits": _strings(row.get("boosted_tokens")), "bottom_logits": _strings(row.get("suppressed_tokens")),
            "act_min": 0.0, "act_max": float(row["max_activation"]), "quantile_values": [], "histogram": [],
            "activation_frequency": float(row["frequency"])}


def _strings(value) -> list[str]:
    """A list column's value (an array, or None when null) as a list."""
    return [] if value is None else [str(v) for v in value]


def write_graph(pg: PromptGraph, run: RunPaths, features: pd.DataFrame | None,
                frames: tuple[pd.DataFrame, ...] | None = None) -> Path:
    """Write the JSON under `run.graphs`, the feature files of its kept features, update
    `graph-metadata.json`, and write the Parquet tables (part = the prompt's slug). `frames`:
    the graph's `graph_frames` from `features` where the caller holds them already. Returns the
    JSON's path."""
    folder = run.graphs
    rows = feature_rows(features)
    nodes, edges, ands = frames if frames is not None else graph_frames(pg, rows)
    data = graph_json(pg, nodes, edges, ands)
    path = write_json(folder / f"{pg.slug}.json", data)
    for r in nodes[nodes["kept"] & nodes["kind"].isin(["input", "output"])].itertuples():
        key = (int(r.layer), r.site, int(r.feature))
        if key in rows:
            write_json(folder / FEATURES_FOLDER / f"{cantor(int(r.viewer_row), int(r.feature))}.json",
                       feature_file(*key, rows[key]))
    add_metadata(run.graph_index, data["metadata"])
    write(nodes, run.tables, "graph_nodes", part=pg.slug)
    write(edges, run.tables, "graph_edges", part=pg.slug)
    write(ands, run.tables, "graph_and_edges", part=pg.slug)
    return path


def read_index(index: Path) -> list[dict]:
    """The graph entries of `graph-metadata.json` (empty when the file is missing); a one-line
    error naming the file when it is unreadable or not the viewer's index."""
    if not index.exists():
        return []
    data = read_json(index)
    graphs = data.get("graphs") if isinstance(data, dict) else None
    if not isinstance(graphs, list) or not all(isinstance(g, dict) and isinstance(g.get("slug"), str) for g in graphs):
        raise ValueError(f"{index} is not a graph index (a JSON object whose 'graphs' list has a 'slug' per graph): "
                         "delete it and rerun `bilinear-circuits graph` for the prompts you want")
    return graphs


def add_metadata(index: Path, metadata: dict) -> None:
    """Add (or replace, by slug) one graph's entry in `graph-metadata.json`, the viewer's index."""
    graphs = [g for g in read_index(index) if g["slug"] != metadata["slug"]] + [metadata]
    write_json(index, {"graphs": graphs})
