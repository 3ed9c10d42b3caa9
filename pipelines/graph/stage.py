"""The `graph` stage: build, write and summarise the attribution graphs of prompts."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from circuits.attribution import INPUT, INPUT_ERROR, LOGIT, OUTPUT, TOKEN, strongest_path
from circuits.sites import OUTPUT_SITE
from pipelines.engine.paths import RunPaths
from pipelines.graph.build import (PromptGraph, build_graph, check_graph_request, float64_copy, graph_name,
                                   load_layer_saes)
from pipelines.graph.export import write_graph
from pipelines.inputs import ModelInputs, check_features_describe
from pipelines.schemas import read


def make_graphs(run: RunPaths, inputs: ModelInputs, job, prompts: list[str], layer: int | None = None,
                progress: bool = True, where: list[str] | None = None,
                target_name: str = "config.target") -> list[PromptGraph]:
    """Build and write the graph of each prompt under `run.graphs` and `run.tables`. `job` is a
    `GraphJob`; with `layer`, only that layer's SAEs are nodes (explicit ones, --sae-in/--sae-out,
    or the run's own), the other layers' MLPs error nodes. `where` names each prompt's source in
    errors (`read_prompts`), and `target_name` the target (the CLI's `--target`). Every prompt,
    the target and the SAEs and their labels are checked before any graph is written."""
    cfg = job.graph
    if where is None:
        where = ["--prompt"] if len(prompts) == 1 else [f"prompt {i} of {len(prompts)}" for i in range(1, len(prompts) + 1)]
    check_graph_request(prompts, where, inputs.tokenizer, cfg, inputs.config.n_ctx, target_name=target_name)
    plan = job.plan(run, inputs, _layers(run, inputs, job, layer))
    saes = load_layer_saes(run, inputs, plan)
    for mine in plan.values():
        if mine.layer in saes:
            check_features_describe(run, mine)
    model = float64_copy(inputs.model)
    features = read(run.tables, "features")
    done = []
    for prompt in tqdm(prompts, desc="attribution graphs", unit="prompt", disable=not progress or len(prompts) < 2):
        name = graph_name(prompt, cfg, saes, job.sae_in, job.sae_out)
        pg = build_graph(prompt, model, inputs.tokenizer, saes, cfg, name)
        write_graph(pg, run, features)
        done.append(pg)
    return done


def _layers(run: RunPaths, inputs: ModelInputs, job, layer: int | None) -> list[int]:
    """The layers whose SAEs the graph uses: every one, or `layer` (--layer), which must exist
    and, without --sae-in, have the run's SAEs."""
    every = list(range(inputs.config.n_layers))
    if layer is None:
        return every
    if layer not in every:
        raise ValueError(f"--layer {layer} does not exist: the model's layers are 0 to {every[-1]}")
    if not (job.sae_in or job.sae_out):
        have = [mine.layer for mine in job.plan(run, inputs, every).values() if mine.has_saes()]
        if layer not in have:
            raise FileNotFoundError(f"--layer {layer}: the run has no {job.read_site()} and {OUTPUT_SITE} SAEs of "
                                    f"layer {layer} in {run.saes} (layers with both: "
                                    f"{', '.join(map(str, have)) or 'none'}); train them with `train-saes --layer "
                                    f"{layer}` or pass --sae-in and --sae-out")
    return [layer]


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
