"""The stages of a run, each skipped when its outputs exist for the same configuration.

The command line and the demo call these; each takes a `RunPaths` and config dataclasses.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer

from circuits.layer import CircuitConfig, analyse_layer, write_layer_tables
from circuits.tables import has_table, read_table, write_table
from circuits.weights import from_hooked_transformer, from_sae_lens
from pipelines.corpus import load_corpus, write_story_corpus
from pipelines.data import TokenRows, pack_corpus, split_rows
from pipelines.features import FeatureConfig, feature_table
from pipelines.lm_training import TRAIN_CONFIG_FILE, LMTrainConfig, is_trained, train_lm, unigram_entropy
from pipelines.model import ModelConfig, load_config, load_model
from pipelines.paths import RunPaths
from pipelines.stories import StoryConfig
from pipelines.tokenizer import BOS, TokenizerConfig, load_tokenizer, train_tokenizer
from pipelines.train_saes import train_saes
from pipelines.valence import valence_accuracy
from sae.activations import iter_activations, keep_mask
from sae.cache import weights_digest
from sae.config import SAETrainConfig
from sae.io import load_sae

HELD_OUT = 0.05  # share of packed rows kept out of LM training for its held-out loss
CIRCUIT_TABLES = ("interactions", "gates", "eigen", "lowrank")
DATA_CONFIG_FILE = "data_config.json"  # in lm/: the corpus digest and tokenizer settings it was trained on


def ensure_corpus(run: RunPaths, cfg: StoryConfig) -> Path:
    """The built-in story corpus of the run, generated unless it exists for `cfg`."""
    cfg_file = run.corpus / "_story_config.json"
    if cfg_file.is_file() and json.loads(cfg_file.read_text()) == asdict(cfg):
        return run.corpus
    return write_story_corpus(cfg, run.root)


def corpus_source(run: RunPaths, corpus: str | None) -> str:
    """The corpus a stage reads: the explicit one, else the run's built-in corpus."""
    if corpus is not None:
        return corpus
    if not run.corpus.is_dir():
        raise FileNotFoundError(
            f"no corpus in {run.root}: run `bilinear-circuits corpus --out {run.root}` first "
            "or pass --corpus PATH"
        )
    return str(run.corpus)


def token_rows(corpus: str, tok: Tokenizer, n_ctx: int) -> tuple[TokenRows, TokenRows]:
    """The corpus tokenized and packed, split into (train, held-out) rows."""
    return _packed(corpus, tok.to_str(), n_ctx)


@functools.lru_cache(maxsize=2)
def _packed(corpus: str, tok_json: str, n_ctx: int) -> tuple[TokenRows, TokenRows]:
    # The demo runs every stage in one process: tokenize the corpus once, not per stage.
    tok = Tokenizer.from_str(tok_json)
    return split_rows(pack_corpus(load_corpus(corpus), tok, n_ctx), HELD_OUT)


def ensure_lm(
    run: RunPaths,
    corpus: str,
    model_cfg: ModelConfig,
    tok_cfg: TokenizerConfig,
    train_cfg: LMTrainConfig,
) -> tuple[HookedTransformer, ModelConfig, dict]:
    """Train the run's LM (and its tokenizer) unless it is already trained with these configs.

    Returns the model, its config and a summary with the held-out loss, the corpus's
    unigram entropy and, on the built-in corpus, the valence accuracy after negations.
    """
    data = {"corpus": files_digest(corpus), "tokenizer": asdict(tok_cfg)}
    data_file = run.lm / DATA_CONFIG_FILE
    if data_file.is_file() and json.loads(data_file.read_text()) != data:
        raise ValueError(
            f"{run.lm} was trained on another corpus or tokenizer setting; choose another --out "
            "or delete that folder"
        )
    run.lm.mkdir(parents=True, exist_ok=True)
    data_file.write_text(json.dumps(data, indent=2))
    tok_file = run.lm / "tokenizer.json"
    if tok_file.is_file():
        tok = load_tokenizer(tok_file)
    else:
        tok = train_tokenizer(load_corpus(corpus)["text"].astype(str), tok_cfg)
    model_cfg = ModelConfig(**{**asdict(model_cfg), "d_vocab": tok.get_vocab_size()})
    train, held_out = token_rows(corpus, tok, model_cfg.n_ctx)
    if is_trained(run.lm):
        saved_train = json.loads((run.lm / TRAIN_CONFIG_FILE).read_text())
        if load_config(run.lm) != model_cfg or saved_train != asdict(train_cfg):
            raise ValueError(
                f"{run.lm} holds a model trained with other settings; choose another --out "
                "or delete that folder"
            )
        model, _ = load_model(run.lm)
        log = pd.read_parquet(run.lm / "train_log.parquet")
    else:
        model, log = train_lm(model_cfg, tok, train, held_out, train_cfg, run.lm)
    summary = {
        "held_out_loss": float(log["held_out_loss"].iloc[-1]),
        "unigram_entropy": unigram_entropy(train.tokens, model_cfg.d_vocab),
        "tokens_per_s": float(log["tokens_per_s"].median()),
    }
    if "sentiment" in held_out.labels:
        summary.update(valence_accuracy(model, held_out, tok))
    return model, model_cfg, summary


def ensure_saes(
    run: RunPaths, model: HookedTransformer, tok: Tokenizer, corpus: str,
    layers: list[int], sites: list[str], cfg: SAETrainConfig,
) -> pd.DataFrame:
    """Train every (layer, site) SAE not yet finished; returns all their metrics."""
    train, _ = token_rows(corpus, tok, model.cfg.n_ctx)
    return train_saes(model, train.tokens, run.root, layers, sites, cfg, bos_id=tok.token_to_id(BOS))


def _done_marker(run: RunPaths, stage: str, layer: int) -> Path:
    return run.tables / "_stages" / f"{stage}-layer{layer}.json"


def _is_done(marker: Path, settings: dict) -> bool:
    try:
        return json.loads(marker.read_text()) == settings
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def _mark_done(marker: Path, settings: dict) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(settings, indent=2))
    tmp.replace(marker)


def files_digest(source: str | Path) -> str:
    """A hash of a file's or folder's bytes (or of the name, for a hub dataset)."""
    path = Path(source)
    digest = hashlib.sha256(str(source).encode())
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if f.is_file():
            digest.update(f.name.encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()


def _sae_digest(path: Path) -> str:
    return files_digest(path) if Path(path).is_dir() else "missing"


def mlp_batches(model: HookedTransformer, rows: torch.Tensor, keep: torch.Tensor, layer: int, sae_out):
    """(MLP input x [n, d_model], output SAE activations [n, d_sae]) per batch of rows."""
    points = [(layer, "mlp_in"), (layer, "mlp_out")]
    for acts in iter_activations(model, rows, points, keep=keep):
        with torch.no_grad():
            yield acts[(layer, "mlp_in")], sae_out.encode(acts[(layer, "mlp_out")])


def ensure_circuits(
    run: RunPaths, model: HookedTransformer, tok: Tokenizer, corpus: str,
    layers: list[int], cfg: CircuitConfig, corr_rows: int = 1024,
    sae_paths: dict[int, tuple[Path, Path]] | None = None,
) -> list[int]:
    """Circuit tables for each layer not yet done with these settings; returns those analysed.

    `sae_paths[layer] = (input SAE, output SAE)` overrides the run's SAEs. Correlations use
    up to `corr_rows` held-out rows of the corpus.
    """
    _, held_out = token_rows(corpus, tok, model.cfg.n_ctx)
    rows = held_out.tokens[:corr_rows]
    keep = keep_mask(rows, bos_id=tok.token_to_id(BOS))
    inputs = {"model": weights_digest(model), "corpus": files_digest(corpus)}
    analysed = []
    for layer in tqdm(layers, desc="circuits", unit="layer"):
        path_in, path_out = (sae_paths or {}).get(layer, (run.sae(layer, "resid_mid"), run.sae(layer, "mlp_out")))
        settings = {"config": json.loads(cfg.to_json()), "corr_rows": len(rows), **inputs,
                    "sae_in": _sae_digest(path_in), "sae_out": _sae_digest(path_out)}
        marker = _done_marker(run, "circuits", layer)
        if _is_done(marker, settings) and all(has_table(run.tables, t, layer) for t in CIRCUIT_TABLES):
            continue
        marker.unlink(missing_ok=True)  # a rewrite interrupted half-way must not count as done
        sae_in, sae_out = load_sae(path_in, model=model), load_sae(path_out, model=model)
        tables = analyse_layer(
            from_hooked_transformer(model, layer), from_sae_lens(sae_in), from_sae_lens(sae_out),
            mlp_batches(model, rows, keep, layer, sae_out), cfg, layer, progress=True,
        )
        write_layer_tables(tables, run.tables, layer)
        _mark_done(marker, settings)
        analysed.append(layer)
    return analysed


def ensure_features(
    run: RunPaths, model: HookedTransformer, tok: Tokenizer, corpus: str,
    layers: list[int], sites: list[str], cfg: FeatureConfig,
) -> pd.DataFrame:
    """The features table of every (layer, site) SAE, unless done with these settings."""
    inputs = {"config": cfg.to_json(), "model": weights_digest(model), "corpus": files_digest(corpus)}

    def settings(layer: int) -> dict:
        return {**inputs, "saes": {s: _sae_digest(run.sae(layer, s)) for s in sites}}

    todo = [l for l in layers if not (_is_done(_done_marker(run, "features", l), settings(l))
                                      and has_table(run.tables, "features", l))]
    for layer in todo:
        _done_marker(run, "features", layer).unlink(missing_ok=True)
    if todo:
        _, held_out = token_rows(corpus, tok, model.cfg.n_ctx)
        saes = {(l, s): load_sae(run.sae(l, s), model=model) for l in todo for s in sites}
        df = feature_table(model, tok, held_out, saes, cfg)
        for layer in todo:
            write_table(df[df["layer"] == layer], run.tables, "features", layer=layer)
            _mark_done(_done_marker(run, "features", layer), settings(layer))
    return read_table(run.tables, "features")
