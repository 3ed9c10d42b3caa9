"""The tokens stage: a corpus tokenized and packed for one tokenizer and context, built
once per (corpus, tokenizer, context, reading settings) and shared by every later stage."""

from __future__ import annotations

from tokenizers import Tokenizer

from pipelines.data.corpus import CorpusConfig, corpus_digest
from pipelines.data.corpus import NEGATION_SETTINGS
from pipelines.data.tokens import TokenStore, build_token_store, open_token_store
from pipelines.engine import stamps
from pipelines.engine.files import digest, text_digest
from pipelines.engine.paths import RunPaths, stamp_of
from pipelines.engine.stamps import Stamp


def ensure_tokens(run: RunPaths, source: str, tok: Tokenizer, n_ctx: int, cfg: CorpusConfig) -> TokenStore:
    """The corpus tokenized and packed for this tokenizer and context (built once, reused)."""
    inputs = {"corpus": corpus_digest(source), "tokenizer": text_digest(tok.to_str())}
    if cfg.lexicon:
        inputs["lexicon"] = digest(cfg.lexicon)
    files = cfg.negation not in NEGATION_SETTINGS
    if files:
        inputs["negation"] = digest(cfg.negation)
    # the lexicon and a cue file count by their content (inputs above), not by where their files lie
    stamp = Stamp("tokens", inputs, {"n_ctx": n_ctx, **cfg.recipe(), "lexicon": bool(cfg.lexicon),
                                     "negation": "file" if files else cfg.negation})
    folder = run.token_store(text_digest(stamp.to_json())[:16])
    if stamps.is_current(stamp_of(folder), stamp):
        return open_token_store(folder)
    store = build_token_store(source, tok, n_ctx, cfg, folder, corpus_name=source)
    stamps.finish(stamp_of(folder), stamp)
    return store
