"""The stages of a run, each skipped when its outputs exist for the same configuration.

The command line and the demo call these; each takes a `RunPaths` and config dataclasses.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pandas as pd
from tokenizers import Tokenizer
from transformer_lens import HookedTransformer

from pipelines.corpus import load_corpus, write_story_corpus
from pipelines.data import TokenRows, pack_corpus, split_rows
from pipelines.lm_training import TRAIN_CONFIG_FILE, LMTrainConfig, is_trained, train_lm, unigram_entropy
from pipelines.model import ModelConfig, load_config, load_model
from pipelines.paths import RunPaths
from pipelines.stories import StoryConfig
from pipelines.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer
from pipelines.valence import valence_accuracy

HELD_OUT = 0.05  # share of packed rows kept out of LM training for its held-out loss


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
