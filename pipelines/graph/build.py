"""Build a prompt's attribution graph from a model folder and its SAEs: checks of the input,
the frozen forward pass, the graph, its pruning and scores.

Which SAEs: for each layer with both an input SAE (at `input_site`) and an mlp_out SAE, their
active latents are nodes, two rows per layer (inputs, then outputs); a layer without them is
one error node per position holding its whole MLP output. See `circuits.attribution` for how
biases, `b_dec` and SAE errors enter.
"""

from __future__ import annotations

import contextlib
import copy
import io
from dataclasses import dataclass
from pathlib import Path

import torch

from circuits.attribution import (AttributionGraph, LayerSAETensors, attribute, frozen_from_cache, model_tensors,
                                  LOGIT, TOKEN, node_influence, prune, scores, strongest_path)
from circuits.config import Config, option
from circuits.sites import DEFAULT_INPUT_SITE, INPUT_SITES, OUTPUT_SITE
from pipelines.data.tokenizer import BOS, display_token
from pipelines.engine.files import read_text_lines, readable_name
from pipelines.engine.paths import RunPaths
from pipelines.inputs import LayerPlan, ModelInputs

# A graph is built on the CPU in float64 whatever --device says: it is one prompt's exact
# arithmetic, and circuits.attribution has run on no GPU yet (the stages before it have)
GRAPH_DEVICE = "cpu"


@dataclass(frozen=True)
class GraphConfig(Config):
    """How `graph` builds, prunes and writes attribution graphs."""

    target: str | None = option(None, "the next token whose logit is attributed (default: the most likely next "
                                      "tokens until their probability reaches --desired-probability)")
    max_logits: int = option(10, "most logits attributed when no --target is given (circuit-tracer's default)", low=1)
    desired_probability: float = option(0.95, "cumulative probability of the attributed logits when no --target is "
                                              "given (circuit-tracer's default)", low=0.0, high=1.0)
    input_site: str = option(DEFAULT_INPUT_SITE, "which of the run's input SAEs give the input rows", choices=INPUT_SITES)
    node_threshold: float = option(0.8, "keep the most influential nodes up to this share of all influence "
                                        "(circuit-tracer's default)", low=0.0, high=1.0)
    edge_threshold: float = option(0.98, "keep the most influential edges up to this share (circuit-tracer's default)",
                                   low=0.0, high=1.0)
    max_features: int = option(8192, "feature nodes at most (the weakest, by |activation| x |decoder row|, join "
                                     "their position's error node): bounds memory", low=1)
    n_and: int = option(3, "AND hyperedges (pairwise terms of the MLP's quadratic form) kept per output feature", low=0)
    dtype: str = option("float32", "precision of the attribution (the forward pass is float64; edges add up to each "
                                   "value to about 1e-6 relative in float32, 1e-12 in float64)",
                        choices=("float32", "float64"))
    chunk: int = option(256, "targets carried back through the model at once", low=1, runtime=True)


@dataclass
class PromptGraph:
    """One prompt's graph with what the files need."""

    prompt: str
    slug: str
    tokens: list[str]  # display form of each prompt token
    token_ids: list[int]
    targets: list[str]  # display form of each attributed token
    graph: AttributionGraph
    node_mask: torch.Tensor  # [N] kept by pruning
    edge_mask: torch.Tensor  # [N, N]
    cumulative: torch.Tensor  # [N] circuit-tracer's cumulative influence share
    replacement: float
    completeness: float
    sites: dict[int, str]  # layer -> input site, for the layers with SAEs
    top_path: list[int]  # node ids of the strongest path from a token to the first target logit
    path_strength: float  # its product of normalised edge weights


def graph_name(prompt: str, cfg: "GraphConfig", layers, sae_in=None, sae_out=None) -> str:
    """A graph's file name (its slug): the prompt's words and a digest of the prompt and what
    shapes its graph besides it (the graph options, the layers whose SAEs are nodes, explicit SAE
    paths; `pipelines.engine.files.readable_name`), so graphs of other prompts or settings never
    overwrite it, and one of the same prompt and settings replaces it."""
    settings = {"graph": cfg.recipe(), "layers": sorted(layers), "sae_in": sae_in, "sae_out": sae_out}
    return readable_name(prompt, settings)


def encode_prompt(prompt: str, tokenizer, n_ctx: int, truncate: bool = False, name: str = "prompt") -> list[int]:
    """Token ids of `prompt` after BOS (a document's start, as in training), its first `n_ctx`
    when `truncate`; one-line errors naming the argument `name` (the CLI: its flag) for an
    empty prompt and, without `truncate`, one longer than the context."""
    if not prompt.strip():
        raise ValueError(f"{name} is empty: give some text to attribute")
    ids = tokenizer.encode(prompt).ids
    bos = tokenizer.token_to_id(BOS)
    if bos is not None:
        ids = [bos] + ids
    if len(ids) > n_ctx:
        if truncate:
            return ids[:n_ctx]
        raise ValueError(f"{name} has {len(ids)} tokens, more than the model's context of {n_ctx}: shorten it"
                         + ("" if name.startswith("-") else " or pass truncate=True"))
    return ids


def target_id(target: str, tokenizer, name: str = "target") -> int:
    """The vocabulary id of `target`: text the tokenizer makes one token of (a word, with its
    word-start mark), else a piece of the vocabulary as written. Errors name the argument
    `name` (the CLI: its flag)."""
    ids = tokenizer.encode(target).ids
    if len(ids) == 1:
        return ids[0]
    direct = tokenizer.token_to_id(target)
    if direct is not None:
        return direct
    pieces = [tokenizer.id_to_token(i) for i in ids]
    raise ValueError(f"{name} {target!r} is not a token of the vocabulary (it splits into {pieces})")


def check_graph_request(prompts: list[str], where: list[str], tokenizer, cfg: GraphConfig, n_ctx: int,
                        truncate: bool = False, target_name: str = "config.target") -> None:
    """The usage errors of graphs to build, before any work, for every caller (the command, the
    demo, the Python API): each prompt (`encode_prompt`, named by its entry of `where`) and the
    target of `cfg` (`target_id`, named `target_name`)."""
    if cfg.target is not None:
        target_id(cfg.target, tokenizer, name=target_name)
    for prompt, source in zip(prompts, where, strict=True):
        encode_prompt(prompt, tokenizer, n_ctx, truncate, name=source)


def load_layer_saes(run: RunPaths, inputs: ModelInputs, plan: dict[int, LayerPlan]) -> dict[int, LayerSAETensors]:
    """The SAEs of every planned layer that has both sides (the run's, or the named ones of one
    layer), checked to read this model's layer and site; float64."""
    found = {}
    for layer, mine in plan.items():
        if not (mine.explicit or mine.has_saes()):
            continue
        s = mine.saes(inputs)
        found[layer] = LayerSAETensors(s.sae_in.weights.to(torch.float64, GRAPH_DEVICE), s.input_site,
                                       s.sae_out.weights.to(torch.float64, GRAPH_DEVICE))
    if not found:
        sites = sorted({mine.input_site for mine in plan.values()})
        raise FileNotFoundError(f"no pairs of {' or '.join(sites)} and {OUTPUT_SITE} SAEs in {run.saes}: run "
                                "`train-saes` first or pass --sae-in and --sae-out with --layer")
    return found


def float64_copy(model):
    """A float64 copy of a `HookedTransformer` on `GRAPH_DEVICE`, the model itself untouched
    (TransformerLens prints when it casts)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return copy.deepcopy(model).to(GRAPH_DEVICE).to(torch.float64)


def build_graph(prompt: str, model, tokenizer, saes: dict[int, LayerSAETensors], cfg: GraphConfig,
                name: str | None = None, progress=None, truncate: bool = False) -> PromptGraph:
    """The pruned, scored attribution graph of `prompt` (`model` in float64, its first `n_ctx`
    tokens when `truncate`), named `name` (default: `graph_name` of the prompt, `cfg` and the
    layers of `saes`)."""
    name = name or graph_name(prompt, cfg, saes)
    ids = encode_prompt(prompt, tokenizer, model.cfg.n_ctx, truncate)
    tokens = torch.tensor(ids)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens.unsqueeze(0), names_filter=_frozen_hooks)
    last = logits[0, -1]
    if cfg.target is not None:
        targets = torch.tensor([target_id(cfg.target, tokenizer)])
    else:
        probs = torch.softmax(last, -1)
        top = probs.topk(min(cfg.max_logits, probs.shape[0]))
        cut = int(torch.searchsorted(top.values.cumsum(0), torch.tensor(cfg.desired_probability, dtype=probs.dtype))) + 1
        targets = top.indices[:cut]
    dtype = getattr(torch, cfg.dtype)
    m = model_tensors(model, dtype)
    frozen = frozen_from_cache(tokens, cache, model.cfg.n_layers, dtype)
    cast = {layer: LayerSAETensors(s.sae_in.to(dtype), s.site, s.sae_out.to(dtype)) for layer, s in saes.items()}
    graph = attribute(m, frozen, cast, targets, max_features=cfg.max_features, n_and=cfg.n_and, chunk=cfg.chunk,
                      progress=progress)
    inf = node_influence(graph)
    node_mask, edge_mask, cumulative = prune(graph, cfg.node_threshold, cfg.edge_threshold, inf)
    replacement, completeness = scores(graph, inf)
    path, strength = strongest_path(graph, torch.nonzero(graph.kind == TOKEN).squeeze(1).tolist(),
                                    int(torch.nonzero(graph.kind == LOGIT)[0]))
    return PromptGraph(prompt=prompt, slug=name, tokens=[_display(tokenizer, i) for i in ids],
                       token_ids=ids, targets=[_display(tokenizer, int(i)) for i in targets], graph=graph,
                       node_mask=node_mask, edge_mask=edge_mask, cumulative=cumulative, replacement=replacement,
                       completeness=completeness, sites={layer: s.site for layer, s in saes.items()},
                       top_path=path, path_strength=strength)


def _frozen_hooks(name: str) -> bool:
    return name.endswith(("hook_pattern", "hook_scale"))


def _display(tokenizer, token: int) -> str:
    piece = tokenizer.id_to_token(token)
    return display_token(piece) if piece is not None else str(token)


def read_prompts(prompt: str | None, prompts: Path | None) -> tuple[list[str], list[str]]:
    """The prompts of `--prompt` or `--prompts FILE` (UTF-8, one per line, blank lines skipped),
    and where each comes from, for errors (`--prompts FILE, line 3`)."""
    if (prompt is None) == (prompts is None):
        raise ValueError("give one of --prompt TEXT and --prompts FILE")
    if prompt is not None:
        return [prompt], ["--prompt"]
    lines = [line.strip() for line in read_text_lines(prompts, "--prompts")]
    found = [(line, f"--prompts {prompts}, line {number}") for number, line in enumerate(lines, 1) if line]
    if not found:
        raise ValueError(f"--prompts {prompts} holds no prompt (every line is empty)")
    return [text for text, _ in found], [where for _, where in found]
