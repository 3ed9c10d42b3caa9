"""The `train-lm` stage: the run's tokenizer and bilinear LM.

The trained model is the one output that is never replaced silently: a run directory holds
one model, and replacing it needs `force`. An unfinished training resumes from its
checkpoint when it is for the same inputs (its work stamp says so).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipelines.data.corpus import CorpusConfig, corpus_digest, iter_documents
from pipelines.data.corpus import NEGATION_SETTINGS
from pipelines.data.tokenizer import load_tokenizer, train_tokenizer
from pipelines.data.tokens import TokenStore, bits_per_byte, held_out_mask, unigram_entropy
from pipelines.engine import stamps
from pipelines.engine.files import read_json, remove, write_json
from pipelines.engine.paths import RunPaths
from pipelines.engine.stamps import Stamp
from pipelines.inputs import portable
from pipelines.jobs import LMJob
from pipelines.lm.behaviour import lexicon_accuracy
from pipelines.lm.training import SHARD_ROWS, held_out_loss, train_lm
from pipelines.runtime import Runtime
from pipelines.stages.tokens import ensure_tokens


class ModelReplacementError(ValueError):
    """A stage would replace a trained model without `force`."""


def ensure_lm(run: RunPaths, *, source: str, job: LMJob, runtime: Runtime, force: bool = False) -> dict:
    """Train the run's tokenizer and LM unless `lm/` holds them for exactly these inputs.

    A finished model of other inputs (or a converted one) is replaced only with `force`.
    An unfinished run of the same inputs resumes from its checkpoint; one of other inputs
    is discarded. Returns the model's summary (`lm/summary.json`).
    """
    split = {"text_column": job.corpus.text_column, "held_out": job.corpus.held_out,
             "split_seed": job.corpus.split_seed}
    stamp = Stamp("train-lm", {"corpus": corpus_digest(source)},
                  {"model": job.model.recipe(), "tokenizer": job.tokenizer.recipe(), "train": job.train.recipe(),
                   "split": split})
    lm, files = run.lm, run.model
    if stamps.is_current(files.stamp, stamp) and files.summary.is_file():
        return read_json(files.summary)
    finished = files.stamp.is_file() or (files.weights.is_file() and not files.train_state.exists())
    if finished and not force:
        changed = stamps.changes(files.stamp, stamp) or ["it was not trained by this run (converted or copied)"]
        raise ModelReplacementError(
            f"{lm} holds a trained model of other inputs ({', '.join(changed)}); every later stage depends on it, "
            "so it is not replaced silently: pass --force to retrain it, or use another --out")
    if finished or not stamps.is_current(files.work_stamp, stamp):
        if lm.exists():
            if files.train_state.exists() and not finished:
                print(f"discarding the unfinished training in {lm}: it was for other inputs")
            remove(lm)
    lm.mkdir(parents=True, exist_ok=True)
    stamps.finish(files.work_stamp, stamp)
    shards = runtime.tasks_at_once(job.train.batch_size // SHARD_ROWS)
    shards = shards if shards == runtime.threads else 1  # fewer shards than threads would leave cores idle
    with runtime.torch_threads():
        if files.tokenizer.is_file():
            tok = load_tokenizer(lm)
        else:
            tok = train_tokenizer(_tokenizer_texts(source, job.corpus, job.tokenizer.train_docs), job.tokenizer)
            tok.save(str(files.tokenizer))
        store = ensure_tokens(run, source, tok, job.model.n_ctx, job.corpus)
        model_cfg = job.model.replace(d_vocab=tok.get_vocab_size())
        model, log = train_lm(model_cfg, store.train, store.held_out, job.train, lm, runtime.device, shards)
        summary = _summarise_lm(model, store, log, job)
    write_json(files.train_config, job.train.to_json())
    write_json(files.summary, summary)
    np.save(files.token_counts, store.token_counts())
    corpus = job.corpus.replace(lexicon=portable(job.corpus.lexicon, lm)) if job.corpus.lexicon else job.corpus
    if corpus.negation not in NEGATION_SETTINGS:  # a cue file, recorded as the lexicon is
        corpus = corpus.replace(negation=portable(corpus.negation, lm))
    write_json(files.trained_corpus, {"source": portable(source, lm), "config": corpus.to_json()})
    files.train_state.unlink(missing_ok=True)
    stamps.begin(files.work_stamp)
    stamps.finish(files.stamp, stamp)
    return summary


def _summarise_lm(model, store: TokenStore, log: pd.DataFrame, job: LMJob) -> dict:
    """Held-out loss in nats and bits per byte, the unigram entropy, speed and behaviour."""
    loss = held_out_loss(model, store.held_out, min(len(store.held_out), 256), job.train.batch_size)
    summary = {
        "held_out_loss": loss,
        "bits_per_byte": bits_per_byte(loss, store.bytes_per_token()),
        "unigram_entropy": unigram_entropy(store.token_counts()),
        "tokens_per_s": float(log["tokens_per_s"].median()),
        # every precision the steps ran in (a resumed run can mix them); a log of before the column: float32
        "train_precision": ", ".join(sorted(set(log.get("precision", pd.Series(["none"])).fillna("none")))),
        "corpus": store.info["corpus"],
        "documents": store.info["documents"],
        "train_tokens_available": store.info["splits"]["train"]["tokens"],
        "held_out_tokens_available": store.info["splits"]["held_out"]["tokens"],
    }
    lexicon = store.lexicon_tokens
    if len(lexicon) >= 2 and "lexicon" in store.classes:
        summary.update(lexicon_accuracy(model, store.held_out, lexicon, store.classes["lexicon"]))
    return summary


def _tokenizer_texts(source: str, cfg: CorpusConfig, limit: int):
    """The first `limit` training documents (held-out ones are left out)."""
    seen = 0
    index = 0
    for batch in iter_documents(source, cfg):
        held = held_out_mask(np.arange(index, index + len(batch.texts)), cfg.held_out, cfg.split_seed)
        index += len(batch.texts)
        for text, is_held in zip(batch.texts, held):
            if not is_held:
                yield text
                seen += 1
                if seen >= limit:
                    return
