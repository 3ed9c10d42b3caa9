"""The `graph` stage: build, write and summarise the attribution graphs of prompts."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from circuits.attribution import INPUT, INPUT_ERROR, LOGIT, OUTPUT, TOKEN, strongest_path
from pipelines.engine.paths import RunPaths
from pipelines.graph.build import (PromptGraph, build_graph, float64_model, graph_name, load_layer_saes,
                                   target_id)
from pipelines.graph.export import write_graph
from pipelines.inputs import ModelInputs
from pipelines.schemas import read


def make_graphs(run: RunPaths, inputs: ModelInputs, job, prompts: list[str], layer: int | None = None,
                progress: bool = True) -> list[PromptGraph]:
    """Build and write the graph of each prompt under `run.graphs` and `run.tables`. `job` is a
    `GraphJob`; explicit SAEs (--sae-in/--sae-out) are those of `layer`."""
    cfg = job.graph
    named = (job.sae_in or job.sae_out) and layer is not None
    layers = [layer] if named else list(range(inputs.config.n_layers))
    saes = load_layer_saes(run, inputs, job.plan(run, inputs, layers))
    model = float64_model(inputs)
    if cfg.target is not None:  # a bad target is a usage error before any work
        target_id(cfg.target, inputs.tokenizer)
    features = read(run.tables, "features")
    # what shapes a graph besides its prompt names it: a rerun with the same replaces it, nothing else does
    settings = {"graph": cfg.recipe(), "layers": sorted(saes), "sae_in": job.sae_in, "sae_out": job.sae_out}
    done = []
    for prompt in tqdm(prompts, desc="attribution graphs", unit="prompt", disable=not progress or len(prompts) < 2):
        pg = build_graph(prompt, model, inputs.tokenizer, saes, cfg, graph_name(prompt, settings))
        write_graph(pg, run, features)
        done.append(pg)
    return done


def label(pg: PromptGraph, node: int) -> str:
    """A short name of a node: `"not"@5`, `L1.in#12@5`, `L1.out#3@5`, `L1.in-err@5`, `logit "happy"`."""
    g = pg.graph
    kind, layer, pos, index = int(g.kind[node]), int(g.layer[node]), int(g.pos[node]), int(g.index[node])
    if kind == TOKEN:
        return f'"{pg.tokens[pos]}"@{pos}'
    if kind == LOGIT:
        return f'logit "{pg.targets[node - (len(g.kind) - len(pg.targets))]}"'
    if kind in (INPUT, OUTPUT):
        return f"L{layer}.{'in' if kind == INPUT else 'out'}#{index}@{pos}"
    return f"L{layer}.{'in' if kind == INPUT_ERROR else 'out'}-err@{pos}"


def top_path(pg: PromptGraph, positions: list[int]) -> tuple[list[int], float]:
    """The strongest path from the tokens at `positions` to the first attributed logit, and its
    product of normalised edge weights."""
    g = pg.graph
    tokens = torch.nonzero((g.kind == TOKEN) & torch.isin(g.pos, torch.tensor(positions))).squeeze(1)
    return strongest_path(g, tokens.tolist(), int(torch.nonzero(g.kind == LOGIT)[0]))


def strongest_and(pg: PromptGraph, node: int) -> tuple[int, int, int, float] | None:
    """The AND hyperedge of largest |weight| with `node` as one of its two sources:
    (target, a, b, weight), or None."""
    g = pg.graph
    hit = (g.and_a == node) | (g.and_b == node)
    if not hit.any():
        return None
    i = int(torch.nonzero(hit).squeeze(1)[g.and_weight[hit].abs().argmax()])
    return int(g.and_target[i]), int(g.and_a[i]), int(g.and_b[i]), float(g.and_weight[i])


def describe(pg: PromptGraph, positions: list[int] | None = None) -> list[str]:
    """Lines describing a graph: size, scores, the strongest path to the first target (from the
    tokens at `positions`, default any token) and the strongest AND hyperedge at the first
    feature on that path."""
    g = pg.graph
    path, strength = (pg.top_path, pg.path_strength) if positions is None else top_path(pg, positions)
    lines = [f"{pg.slug}: {len(g.kind)} nodes ({int(pg.node_mask.sum())} kept), {int(pg.edge_mask.sum())} edges kept; "
             f"replacement {pg.replacement:.3f}, completeness {pg.completeness:.3f}; targets {pg.targets}",
             "  strongest path: " + (" -> ".join(label(pg, n) for n in path) + f" (strength {strength:.3g})" if path
                                     else "none")]
    first = next((n for n in path if int(g.kind[n]) in (INPUT, OUTPUT)), None)
    found = None if first is None else strongest_and(pg, first)
    if found is not None:
        t, a, b, w = found
        lines.append(f"  strongest AND at {label(pg, first)}: {label(pg, a)} x {label(pg, b)} -> {label(pg, t)}: "
                     f"{w:+.4g} (of its value {float(g.value[t]):.4g})")
    return lines
