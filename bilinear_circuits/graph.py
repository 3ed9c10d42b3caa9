"""A prompt's exact attribution graph as an object: its nodes, edges and AND hyperedges as
DataFrames, its strongest path and scores, circuit-tracer's files and viewer."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:  # annotations only: importing them takes seconds
    from transformer_lens import HookedTransformer

    from pipelines.graph.build import GraphConfig


class Graph:
    """The attribution graph of one prompt (built by `attribution_graph` or `Run.graph`).

    With attention patterns and norm scales frozen, every active SAE latent's pre-activation
    and every target logit split exactly over their sources; the MLP's quadratic form adds AND
    hyperedges (the cross term of two sources). Pruning keeps the most influential nodes and
    edges as circuit-tracer does.
    """

    def __init__(self, built, descriptions: pd.DataFrame | None = None):
        from pipelines.graph.export import feature_rows, graph_frames

        self._built = built
        self._descriptions = descriptions
        nodes, edges, ands = graph_frames(built, feature_rows(descriptions))
        # `save` writes these, not the public frames a notebook may filter or extend in place:
        # the written tables must match the feature files written beside them
        self._frames = (nodes, edges, ands)
        nodes, edges, ands = nodes.copy(), edges.copy(), ands.copy()
        self.nodes: pd.DataFrame = nodes
        """Every node of the unpruned graph (the `graph_nodes` table's columns)."""
        self.edges: pd.DataFrame = edges
        """The edges pruning kept: source, target, weight (the `graph_edges` table's columns)."""
        self.and_edges: pd.DataFrame = ands
        """The AND hyperedges kept per output feature (the `graph_and_edges` table's columns)."""

    def __repr__(self) -> str:
        return (f"Graph({self.prompt!r}: {len(self.nodes)} nodes, {int(self.nodes['kept'].sum())} kept; replacement "
                f"{self.replacement:.3f}, completeness {self.completeness:.3f})")

    @property
    def prompt(self) -> str:
        """The prompt's text."""
        return self._built.prompt

    @property
    def slug(self) -> str:
        """The graph's file name (without `.json`)."""
        return self._built.slug

    @property
    def tokens(self) -> list[str]:
        """The prompt's tokens (BOS first), as displayed."""
        return self._built.tokens

    @property
    def targets(self) -> list[str]:
        """The attributed next tokens, as displayed."""
        return self._built.targets

    @property
    def replacement(self) -> float:
        """circuit-tracer's replacement score: the share of influence on the targets that flows
        from tokens through features rather than error nodes."""
        return float(self._built.replacement)

    @property
    def completeness(self) -> float:
        """circuit-tracer's completeness score: the share of the nodes' inputs not from error nodes."""
        return float(self._built.completeness)

    @property
    def top_path(self) -> pd.DataFrame:
        """The strongest path from a token to the first target logit, a node per row."""
        path = self.nodes[self.nodes["path_step"] >= 0].sort_values("path_step")
        return path.reset_index(drop=True)

    @property
    def path_strength(self) -> float:
        """The strongest path's product of normalised edge weights."""
        return float(self._built.path_strength)

    def describe(self) -> str:
        """Lines as the `graph` command prints them: size, scores, strongest path and AND."""
        from pipelines.graph.stage import describe

        return "\n".join(describe(self._built))

    def save(self, folder: str | Path) -> Path:
        """Write circuit-tracer's files under `folder/graphs/` (the graph's JSON, the feature
        files, `graph-metadata.json`) and the graph tables under `folder/tables/`, as the
        `graph` command does for a run folder, from the frames the graph was built with (edits
        to `nodes`, `edges` or `and_edges` are not saved); returns the JSON's path."""
        from pipelines.engine.paths import RunPaths
        from pipelines.graph.export import write_graph

        return write_graph(self._built, RunPaths(folder), self._descriptions, self._frames)

    def serve(self, folder: str | Path, port: int = 0) -> "Viewer":
        """Save the graph under `folder` and serve `folder/graphs/` in circuit-tracer's viewer on
        127.0.0.1 from a background thread (`port` 0: any free one); `Viewer.url` opens it and
        `Viewer.stop()` ends it."""
        from pipelines.engine.paths import RunPaths
        from pipelines.graph.serve import graph_server, viewer_path

        self.save(folder)
        server = graph_server(RunPaths(folder), port)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        return Viewer(server.url + viewer_path(self.slug), server, thread)


class Viewer:
    """circuit-tracer's viewer serving a folder of graphs (from `Graph.serve`)."""

    def __init__(self, url: str, server, thread: threading.Thread):
        self.url = url
        """Where the viewer shows the graph."""
        self._server, self._thread = server, thread

    def __repr__(self) -> str:
        return f"Viewer({self.url})"

    def stop(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def attribution_graph(prompt: str, model: HookedTransformer, saes: dict, tokenizer: object,
                      config: GraphConfig | None = None, *, truncate: bool = False,
                      descriptions: pd.DataFrame | None = None) -> Graph:
    """The exact attribution graph of `prompt` (BOS first) through a bilinear `HookedTransformer`.

    Args:
        prompt: the text whose next token is attributed.
        model: the LM. The graph is computed on a float64 copy: `model` is not changed.
        saes: `{layer: (sae_in, sae_out)}`, sae-lens SAEs (or `circuits.SAEWeights`) of the layers
            whose latents become nodes; other layers' MLPs are error nodes.
        tokenizer: a `tokenizers.Tokenizer` or a Hugging Face fast tokenizer.
        config: a `GraphConfig` (target, pruning thresholds, precision).
        truncate: keep the prompt's first `n_ctx` tokens instead of refusing a longer prompt.
        descriptions: a `features` table whose descriptions label the nodes.
    """
    import torch

    from bilinear_circuits.layer import _sae
    from circuits.attribution import LayerSAETensors
    from circuits.sites import INPUT_SITES
    from pipelines.graph.build import GRAPH_DEVICE, GraphConfig, build_graph, check_graph_request, float64_copy

    cfg = config or GraphConfig()
    tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
    check_graph_request([prompt], ["prompt"], tokenizer, cfg, model.cfg.n_ctx, truncate)
    if not saes:
        raise ValueError("saes: give at least one layer's (sae_in, sae_out)")
    tensors = {}
    for layer, pair in saes.items():
        (w_in, p_in), (w_out, _) = _sae(pair[0], f"saes[{layer}][0]"), _sae(pair[1], f"saes[{layer}][1]")
        site = p_in[1] if p_in is not None and p_in[1] in INPUT_SITES else cfg.input_site
        f64 = lambda w: w.to(torch.float64, GRAPH_DEVICE)  # noqa: E731
        tensors[int(layer)] = LayerSAETensors(f64(w_in), site, f64(w_out))
    built = build_graph(prompt, float64_copy(model), tokenizer, tensors, cfg, truncate=truncate)
    return Graph(built, descriptions)
