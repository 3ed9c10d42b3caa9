"""The stages of a run. Each reuses its outputs exactly when their stamp matches.

The command line and the demo call these. A stage computes the digests of its inputs (model
weights, corpus or token content, SAE files) and its config's recipe into a `Stamp`
(`pipelines.engine.stamps`); outputs whose stamp equals it are reused, others are
recomputed, and the stamp is written only once the new outputs are complete. The trained
model is the one output that is never replaced silently: a run directory holds one model,
and replacing it needs `force`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer

from circuits.layer import CircuitConfig, LayerBatch, analyse_layer
from pipelines.analysis.ablation import gate_ablations
from pipelines.analysis.features import FEATURE_LABELS_SCHEMA, FEATURES_SCHEMA, boosted_token_ids, feature_tables
from pipelines.analysis.outputs import parse_outputs
from pipelines.analysis.verdicts import best_candidates
from circuits.sae_basis import token_scale
from circuits.tables import SCHEMAS
from circuits.weights import from_hooked_transformer
from pipelines.data.corpus import CorpusConfig, corpus_digest, iter_documents, write_story_corpus
from pipelines.data.stories import StoryConfig
from pipelines.data.tokenizer import TOKENIZER_FILE, TokenizerConfig, load_tokenizer, train_tokenizer
from pipelines.data.tokens import (TokenRows, TokenStore, bits_per_byte, build_token_store, held_out_mask,
                                   open_token_store, unigram_entropy)
from pipelines.engine import stamps
from pipelines.engine.files import (atomic_dir, atomic_file, clean_temporaries, digest, read_json, remove, text_digest,
                                    write_json)
from pipelines.engine.paths import RunPaths
from pipelines.engine.stamps import Stamp
from pipelines.engine.tables import has_table, provenance, read_table, table_path, write_table
from pipelines.lm.behaviour import lexicon_accuracy
from pipelines.lm.model import ModelConfig, load_config, load_model, model_digest
from pipelines.lm.training import STATE_FILE, LMTrainConfig, held_out_loss, train_lm
from sae.activations import iter_activations
from sae.config import SAETrainConfig
from sae.io import LoadedSAE, check_sae_point, load_sae, read_metrics, write_sae_extras
from sae.metrics import evaluate_sae
from sae.sites import INPUT_SITES, SITES, Point, hook_name, point_name
from sae.topk import save_sae_lens
from sae.train import inference_weights, train_saes

STAMP = ".stamp.json"  # hidden: a folder's content digest leaves it out
WORK_STAMP = ".work.json"  # stamp of an unfinished training run in the same folder
CORPUS_FILE = "corpus.json"  # in lm/: the corpus the model was trained on, for later stages' defaults
SUMMARY_FILE = "summary.json"  # in lm/: held-out loss, bits per byte, behaviour
SAE_CHECKPOINT_STAMP = ".checkpoint.json"
# written into the stamps of the stages: outputs of an older format are recomputed (3: BOS and
# each row's first token are left out of SAE training, statistics and descriptions)
TABLE_FORMAT = 3
ABLATION_ROWS = 256  # held-out rows searched for tokens where a candidate's inputs are both active
METRICS_TABLE = "sae_metrics"
SAE_METRICS_SCHEMA_COLUMNS = ["layer", "site", "hook", "d_in", "d_sae", "k", "train_tokens", "eval_tokens", "nmse",
                              "l0", "dead_fraction", "loss_clean", "loss_patched", "loss_added"]


class ModelReplacementError(ValueError):
    """A stage would replace a trained model without `force`."""


# ------------------------------------------------------------------ corpus and tokens


def ensure_corpus(run: RunPaths, cfg: StoryConfig) -> Path:
    """The built-in story corpus of the run, generated unless it exists for `cfg`."""
    stamp = Stamp("corpus", {}, cfg.recipe())
    if stamps.is_current(run.corpus / STAMP, stamp):
        return run.corpus
    write_story_corpus(cfg, run.corpus)
    stamps.finish(run.corpus / STAMP, stamp)
    return run.corpus


def ensure_tokens(run: RunPaths, source: str, tok: Tokenizer, n_ctx: int, cfg: CorpusConfig) -> TokenStore:
    """The corpus tokenized and packed for this tokenizer and context (built once, reused)."""
    inputs = {"corpus": corpus_digest(source), "tokenizer": text_digest(tok.to_str())}
    if cfg.lexicon:
        inputs["lexicon"] = digest(cfg.lexicon)
    # the lexicon counts by its content (an input above), not by where its file lies
    stamp = Stamp("tokens", inputs, {"n_ctx": n_ctx, **cfg.recipe(), "lexicon": bool(cfg.lexicon)})
    folder = run.tokens / text_digest(stamp.to_json())[:16]
    if stamps.is_current(folder / STAMP, stamp):
        return open_token_store(folder)
    store = build_token_store(source, tok, n_ctx, cfg, folder, corpus_name=source)
    stamps.finish(folder / STAMP, stamp)
    return store


def tokens_digest(rows: TokenRows) -> str:
    """Digest of the token ids of a split (what an LM or SAE trained on)."""
    return digest(rows.tokens.filename)


# ------------------------------------------------------------------ the language model


def _lm_stamp(source: str, corpus_cfg: CorpusConfig, model_cfg: ModelConfig, tok_cfg: TokenizerConfig,
              train_cfg: LMTrainConfig) -> Stamp:
    split = {"text_column": corpus_cfg.text_column, "held_out": corpus_cfg.held_out, "split_seed": corpus_cfg.split_seed}
    return Stamp("train-lm", {"corpus": corpus_digest(source)},
                 {"model": model_cfg.recipe(), "tokenizer": tok_cfg.recipe(), "train": train_cfg.recipe(), "split": split})


def ensure_lm(run: RunPaths, source: str, corpus_cfg: CorpusConfig, model_cfg: ModelConfig, tok_cfg: TokenizerConfig,
              train_cfg: LMTrainConfig, device: str = "cpu", force: bool = False) -> dict:
    """Train the run's tokenizer and LM unless `lm/` holds them for exactly these inputs.

    A finished model of other inputs (or a converted one) is replaced only with `force`.
    An unfinished run of the same inputs resumes from its checkpoint; one of other inputs
    is discarded. Returns the model's summary (`lm/summary.json`).
    """
    stamp = _lm_stamp(source, corpus_cfg, model_cfg, tok_cfg, train_cfg)
    lm = run.lm
    if stamps.is_current(lm / STAMP, stamp) and (lm / SUMMARY_FILE).is_file():
        return read_json(lm / SUMMARY_FILE)
    finished = (lm / STAMP).is_file() or (lm / "model.safetensors").is_file() and not (lm / STATE_FILE).exists()
    if finished and not force:
        changed = stamps.changes(lm / STAMP, stamp) or ["it was not trained by this run (converted or copied)"]
        raise ModelReplacementError(
            f"{lm} holds a trained model of other inputs ({', '.join(changed)}); every later stage depends on it, "
            "so it is not replaced silently: pass --force to retrain it, or use another --out")
    if finished or not stamps.is_current(lm / WORK_STAMP, stamp):
        if lm.exists():
            if (lm / STATE_FILE).exists() and not finished:
                print(f"discarding the unfinished training in {lm}: it was for other inputs")
            remove(lm)
    lm.mkdir(parents=True, exist_ok=True)
    stamps.finish(lm / WORK_STAMP, stamp)
    if (lm / TOKENIZER_FILE).is_file():
        tok = load_tokenizer(lm)
    else:
        tok = train_tokenizer(_tokenizer_texts(source, corpus_cfg, tok_cfg.train_docs), tok_cfg)
        tok.save(str(lm / TOKENIZER_FILE))
    store = ensure_tokens(run, source, tok, model_cfg.n_ctx, corpus_cfg)
    model_cfg = model_cfg.replace(d_vocab=tok.get_vocab_size())
    model, log = train_lm(model_cfg, store.train, store.held_out, train_cfg, lm, device)
    summary = summarise_lm(model, store, log, train_cfg)
    write_json(lm / "train_config.json", train_cfg.to_json())
    write_json(lm / SUMMARY_FILE, summary)
    np.save(lm / "token_counts.npy", store.token_counts())
    recorded = corpus_cfg.replace(lexicon=_portable(corpus_cfg.lexicon, lm)) if corpus_cfg.lexicon else corpus_cfg
    write_json(lm / CORPUS_FILE, {"source": _portable(source, lm), "config": recorded.to_json()})
    (lm / STATE_FILE).unlink(missing_ok=True)
    stamps.begin(lm / WORK_STAMP)
    stamps.finish(lm / STAMP, stamp)
    return summary


def summarise_lm(model: HookedTransformer, store: TokenStore, log: pd.DataFrame, cfg: LMTrainConfig) -> dict:
    """Held-out loss in nats and bits per byte, the unigram entropy, speed and behaviour."""
    loss = held_out_loss(model, store.held_out, min(len(store.held_out), 256), cfg.batch_size, cfg.autocast)
    summary = {
        "held_out_loss": loss,
        "bits_per_byte": bits_per_byte(loss, store.bytes_per_token()),
        "unigram_entropy": unigram_entropy(store.token_counts()),
        "tokens_per_s": float(log["tokens_per_s"].median()),
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


RUN_RELATIVE = "@run/"  # a recorded path inside the model's run directory: it moves with the run


def _portable(source: str, lm: Path) -> str:
    """A path as recorded next to the model: relative to the run when it lies in it."""
    path = Path(source)
    if source.startswith("hf:") or not path.exists():
        return source
    try:
        return RUN_RELATIVE + str(path.resolve().relative_to(lm.resolve().parent))
    except ValueError:
        return str(path.resolve())


def _resolved(recorded: str, model_dir: Path) -> str:
    if recorded.startswith(RUN_RELATIVE):
        return str(Path(model_dir).parent / recorded[len(RUN_RELATIVE):])
    return recorded


def trained_corpus(model_dir: Path) -> tuple[str, CorpusConfig] | None:
    """The corpus a model of this run was trained on, with its settings, if recorded."""
    data = read_json(Path(model_dir) / CORPUS_FILE)
    if data is None:
        return None
    cfg = CorpusConfig.from_json(data["config"])
    if cfg.lexicon:
        cfg = cfg.replace(lexicon=_resolved(cfg.lexicon, model_dir))
    return _resolved(data["source"], model_dir), cfg


# ------------------------------------------------------------------ the inputs of the analysis stages


@dataclass
class ModelInputs:
    """A model folder, loaded lazily, with its tokenizer and digest."""

    folder: Path
    device: str = "cpu"
    config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        self.config = load_config(self.folder)  # cheap: usage errors come before any loading

    @cached_property
    def model(self) -> HookedTransformer:
        model, _ = load_model(self.folder, self.device)
        return model

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.folder)

    @cached_property
    def digest(self) -> str:
        return model_digest(self.folder)

    @cached_property
    def token_counts(self) -> np.ndarray | None:
        """How often each token occurred in training (None for a foreign model)."""
        path = self.folder / "token_counts.npy"
        return np.load(path) if path.is_file() else None

    @cached_property
    def untrained(self) -> np.ndarray:
        """Token ids the model never saw in training (or, for a foreign model, none known)."""
        if self.token_counts is None:
            return np.zeros(0, dtype=np.int64)
        return np.nonzero(self.token_counts == 0)[0]


# ------------------------------------------------------------------ SAEs


def ensure_saes(run: RunPaths, inputs: ModelInputs, store: TokenStore, layers: list[int], sites: list[str],
                cfg: SAETrainConfig, device: str = "cpu") -> pd.DataFrame:
    """Train every (layer, site) SAE whose folder is not current; returns all their metrics."""
    if len(set(sites)) != len(sites):
        raise ValueError(f"--sites names a site twice: {','.join(sites)}")
    unknown = [s for s in sites if s not in SITES]
    if unknown:
        raise ValueError(f"unknown site {unknown[0]!r}; choose from {', '.join(SITES)}")
    cfg = cfg.resolve(inputs.config.d_model)
    clean_temporaries(run.root)
    points = [(layer, site) for layer in layers for site in sites]
    model_inputs = {"model": inputs.digest, "tokens": tokens_digest(store.train)}

    def stamp(point: Point) -> Stamp:
        return Stamp("train-saes", model_inputs, {"format": TABLE_FORMAT, "recipe": cfg.recipe(), "point": list(point)})

    todo = []
    for point in points:
        folder = run.sae(*point)
        if stamps.is_current(folder / STAMP, stamp(point)):
            continue
        changed = stamps.changes(folder / STAMP, stamp(point))
        if changed:
            print(f"retraining {point_name(point)}: its {', '.join(changed)} changed")
        todo.append(point)
    if todo:
        _train_points(run, inputs, store, todo, cfg, device, stamp)
    for layer in sorted({p[0] for p in points}):
        _write_metrics_table(run, layer)
    return pd.DataFrame([read_metrics(run.sae(*p)) for p in points])


def _train_points(run, inputs: ModelInputs, store: TokenStore, todo: list[Point], cfg: SAETrainConfig, device: str,
                  stamp) -> None:
    job = Stamp("train-saes", {point_name(p): text_digest(stamp(p).to_json()) for p in todo}, {})
    resume = None
    if stamps.is_current(run.saes / SAE_CHECKPOINT_STAMP, job) and run.sae_checkpoint.is_file():
        resume = torch.load(run.sae_checkpoint, weights_only=False, map_location=device)
        print(f"resuming SAE training at step {resume['step']} of {cfg.train_steps}")
    else:
        run.sae_checkpoint.unlink(missing_ok=True)
        stamps.finish(run.saes / SAE_CHECKPOINT_STAMP, job)

    def save_checkpoint(state: dict) -> None:
        with atomic_file(run.sae_checkpoint) as tmp:
            torch.save(state, tmp)

    model = inputs.model
    trainers = train_saes(model, store.train, todo, cfg, device, save_checkpoint, resume)
    eval_rows = store.held_out.head(cfg.eval_rows)
    tokens = eval_rows.batch(slice(None))
    keep = eval_rows.keep(tokens)
    for point, trainer in tqdm(trainers.items(), desc="evaluate SAEs", unit="SAE"):
        layer, site = point
        weights = inference_weights(trainer.sae)
        metrics = evaluate_sae(model, weights, tokens, layer, site, keep, cfg.model_batch_rows)
        row = {"layer": layer, "site": site, "hook": hook_name(layer, site), "d_in": weights.d_in,
               "d_sae": weights.d_sae, "k": cfg.k, "train_tokens": cfg.used_tokens, **metrics.to_json()}
        with atomic_dir(run.sae(*point)) as tmp:
            save_sae_lens(trainer.sae, tmp, {"hook_name": hook_name(layer, site), "model_name": "bilinear-lm",
                                             "context_size": inputs.config.n_ctx, "prepend_bos": True})
            write_sae_extras(tmp, cfg.to_json(), row, trainer.log_feature_sparsity)
            stamps.finish(tmp / STAMP, stamp(point))
    run.sae_checkpoint.unlink(missing_ok=True)
    stamps.begin(run.saes / SAE_CHECKPOINT_STAMP)


def _write_metrics_table(run: RunPaths, layer: int) -> None:
    """The layer's metrics table from every finished SAE of the layer."""
    rows = [read_metrics(run.sae(layer, s)) for s in SITES if (run.sae(layer, s) / STAMP).is_file()]
    if rows:
        write_table(pd.DataFrame(rows)[SAE_METRICS_SCHEMA_COLUMNS], run.tables, METRICS_TABLE, layer=layer)


# ------------------------------------------------------------------ circuit tables


CIRCUIT_TABLES = ("interactions", "gates", "eigen", "eigen_inputs")
ACTIVE_TABLES = ("lowrank", "lowrank_samples", "gate_truth", "gate_ablation")  # only for outputs that are SAE features


@dataclass
class LayerSAEs:
    """The SAEs of one layer's analysis and where the input one reads."""

    layer: int
    sae_in: LoadedSAE
    input_site: str
    sae_out: LoadedSAE | None


def layer_saes(run: RunPaths, inputs: ModelInputs, layer: int, explicit: tuple[Path, Path | None] | None,
               input_site: str, need_output: bool, allow_hookless: bool = False) -> LayerSAEs:
    """Load and check a layer's SAEs: explicit paths, or the run's own for `input_site`."""
    path_in, path_out = explicit or (run.sae(layer, input_site), run.sae(layer, "mlp_out"))
    d_model = inputs.config.d_model
    sae_in = load_sae(path_in, inputs.device)
    sites = INPUT_SITES if explicit else (input_site,)
    if sae_in.point is None and allow_hookless:
        sites = (input_site,)
    site = check_sae_point(sae_in, d_model, layer, sites, "input", allow_hookless)
    sae_out = None
    if need_output:
        if path_out is None:
            raise ValueError(f"layer {layer}: outputs 'sae' need an output SAE (--sae-out)")
        sae_out = load_sae(path_out, inputs.device)
        check_sae_point(sae_out, d_model, layer, ("mlp_out",), "output", allow_hookless)
    return LayerSAEs(layer, sae_in, site, sae_out)


def layer_batches(model: HookedTransformer, rows: TokenRows, n_rows: int, saes: LayerSAEs, batch_rows: int = 32):
    """A callable giving a fresh pass of `LayerBatch`es over the first `n_rows` rows."""
    layer, site = saes.layer, saes.input_site
    points = sorted({(layer, "mlp_in"), (layer, "mlp_out"), (layer, site)})
    eps = float(model.cfg.eps)

    def batches():
        for _, tokens in rows.iter_batches(batch_rows, n_rows):
            for acts in iter_activations(model, tokens, points, rows.keep(tokens), batch_rows):
                source = acts[(layer, site)]
                yield LayerBatch(x=acts[(layer, "mlp_in")], z=saes.sae_in.weights.encode(source),
                                 scale=token_scale(source, eps, site),
                                 acts=saes.sae_out.weights.encode(acts[(layer, "mlp_out")]))

    return batches


def ensure_circuits(run: RunPaths, inputs: ModelInputs, store: TokenStore, layers: list[int], cfg: CircuitConfig,
                    corr_rows: int, sae_paths: dict[int, tuple[Path, Path | None]] | None = None,
                    input_site: str = "resid_mid", outputs: tuple[str, ...] = ("sae",), output_basis: str = "encoder",
                    allow_hookless: bool = False) -> list[str]:
    """Circuit tables of each layer and output set not yet current; returns those computed."""
    held_digest = tokens_digest(store.held_out)
    done = []
    for layer in tqdm(layers, desc="circuits", unit="layer"):
        explicit = (sae_paths or {}).get(layer)
        saes = layer_saes(run, inputs, layer, explicit, input_site, "sae" in outputs, allow_hookless)
        mlp = None
        for spec in outputs:
            part = _part_name(saes.input_site, spec, output_basis)
            stamp = Stamp("circuits", {
                "model": inputs.digest, "held_out_tokens": held_digest, "sae_in": digest(saes.sae_in.path),
                "outputs": digest(saes.sae_out.path) if spec == "sae" else text_digest(spec, _spec_file_digest(spec)),
            }, {"format": TABLE_FORMAT, "circuits": cfg.recipe(), "corr_rows": corr_rows, "input_site": saes.input_site,
                "outputs": spec, "output_basis": output_basis})
            names = CIRCUIT_TABLES + (ACTIVE_TABLES if spec == "sae" else ()) + (("hosvd",) if spec == "hosvd" else ())
            marker = run.stamp("circuits", layer, part)
            if stamps.is_current(marker, stamp) and all(has_table(run.tables, n, layer, part) for n in names):
                continue
            stamps.begin(marker)
            model = inputs.model
            mlp = mlp or from_hooked_transformer(model, layer)
            out = parse_outputs([spec], output_basis, inputs, mlp, saes, cfg)[0]
            batches = layer_batches(model, store.held_out, corr_rows, saes) if out.sae is not None else None
            tables = analyse_layer(mlp, saes.sae_in.weights, out, batches, cfg, layer, saes.input_site, progress=True)
            if out.sae is not None:
                boosted = boosted_token_ids(model, out.sae.W_dec, inputs.tokenizer, inputs.untrained)
                tables["gate_ablation"] = gate_ablations(
                    model, layer, saes, mlp, out, best_candidates(tables["gates"], cfg.n_ablate), boosted,
                    store.held_out, min(corr_rows, ABLATION_ROWS)).assign(outputs=out.name, input_site=saes.input_site)
            for name, frame in tables.items():
                write_table(frame, run.tables, name, layer, SCHEMAS[name], part=part, provenance=stamp.to_json())
            stamps.finish(marker, stamp)
            done.append(f"layer {layer} {part}")
    return done


def ensure_ablations(run: RunPaths, inputs: ModelInputs, store: TokenStore, candidates: pd.DataFrame,
                     corr_rows: int, input_site: str = "resid_mid") -> pd.DataFrame:
    """Ablations of given gate candidates (rows of the gates table) that the layer's
    gate_ablation table lacks, added to it; returns the rows of all the candidates."""

    part = _part_name(input_site, "sae", "encoder")
    found = []
    for layer, chosen in candidates.groupby("layer"):
        path = table_path(run.tables, "gate_ablation", layer, part)
        done = pd.read_parquet(path) if path.is_file() else pd.DataFrame(columns=SCHEMAS["gate_ablation"].names)
        keys = set(zip(done["out_feature"], done["in_a"], done["in_b"]))
        todo = chosen[[(f, a, b) not in keys for f, a, b in zip(chosen["out_feature"], chosen["in_a"], chosen["in_b"])]]
        if len(todo):
            saes = layer_saes(run, inputs, int(layer), None, input_site, True)
            mlp = from_hooked_transformer(inputs.model, int(layer))
            out = parse_outputs(["sae"], "encoder", inputs, mlp, saes, CircuitConfig())[0]
            boosted = boosted_token_ids(inputs.model, out.sae.W_dec, inputs.tokenizer, inputs.untrained)
            new = gate_ablations(inputs.model, int(layer), saes, mlp, out, todo, boosted, store.held_out,
                                 min(corr_rows, ABLATION_ROWS))
            done = pd.concat([done, new.assign(outputs="sae", input_site=saes.input_site)], ignore_index=True)
            write_table(done, run.tables, "gate_ablation", int(layer), SCHEMAS["gate_ablation"], part=part,
                        provenance=provenance(path))
        wanted = set(zip(chosen["out_feature"], chosen["in_a"], chosen["in_b"]))
        sel = [(f, a, b) in wanted for f, a, b in zip(done["out_feature"], done["in_a"], done["in_b"])]
        found.append(done[sel])
    return pd.concat(found, ignore_index=True) if found else pd.DataFrame(columns=SCHEMAS["gate_ablation"].names)


def _part_name(input_site: str, spec: str, basis: str) -> str:
    """File name of one output set's tables within a layer's folder."""
    if spec == "sae":
        name = "sae" if basis == "encoder" else "sae-decoder"
    elif spec == "hosvd":
        name = "hosvd"
    else:
        name = spec.split(":", 1)[0] + "-" + text_digest(spec)[:8]
    return f"{input_site}-{name}"


def _spec_file_digest(spec: str) -> str:
    if spec.startswith("file:"):
        return digest(spec[5:])
    return ""


def check_tables_match(run: RunPaths, layer: int, part: str, sae_in: Path, sae_out: Path | None) -> None:
    """Refuse to show a layer's tables next to SAEs other than those they were computed with."""
    recorded = provenance(table_path(run.tables, "gates", layer, part))
    if recorded is None:
        return
    now = {"sae_in": digest(sae_in)}
    if sae_out is not None:
        now["outputs"] = digest(sae_out)
    changed = [name for name, value in now.items() if recorded["inputs"].get(name) != value]
    if changed:
        raise ValueError(f"the layer {layer} tables in {run.tables} were computed with other SAEs than "
                         f"{', '.join(str(p) for p in (sae_in, sae_out) if p)} ({', '.join(changed)} differ); "
                         "rerun `circuits` with these SAEs or pass the ones the tables were computed with")


# ------------------------------------------------------------------ feature descriptions


def held_out_digest(store: TokenStore) -> str:
    """Digest of the held-out tokens and their labels (what descriptions are computed from)."""
    files = sorted(store.folder.glob("held_out.*.bin"))
    return text_digest([digest(f) for f in files], store.classes, store.lexicon_tokens)


def ensure_features(run: RunPaths, inputs: ModelInputs, store: TokenStore, layers: list[int], sites: list[str],
                    cfg, sae_paths: dict[int, tuple[Path, Path | None]] | None = None,
                    allow_hookless: bool = False, seed: int = 0) -> pd.DataFrame:
    """The `features` and `feature_labels` tables of each (layer, site) not yet current.

    Each (layer, site) is its own part (`features/layer2/mlp_out.parquet`), so describing
    one site's SAEs leaves the others' descriptions as they are; all the SAEs still to do
    are described in one pass over the held-out rows.
    """
    held = held_out_digest(store)
    todo: dict[Point, tuple[LoadedSAE, Stamp, Path]] = {}
    for layer in layers:
        for point, sae in _feature_saes(run, inputs, layer, sites, (sae_paths or {}).get(layer), allow_hookless).items():
            stamp = Stamp("features", {"model": inputs.digest, "held_out": held, "sae": digest(sae.path)},
                          {"format": TABLE_FORMAT, "features": cfg.recipe(), "seed": seed})
            marker = run.stamp("features", layer, point[1])
            if stamps.is_current(marker, stamp) and has_table(run.tables, "features", layer, point[1]):
                continue
            stamps.begin(marker)
            todo[point] = (sae, stamp, marker)
    if todo:
        features, labels = feature_tables(inputs.model, inputs.tokenizer, store.held_out,
                                          {p: s.weights for p, (s, _, _) in todo.items()}, cfg, store.classes,
                                          store.lexicon_tokens, inputs.token_counts, seed)
        for (layer, site), (_, stamp, marker) in todo.items():
            mine = lambda frame: frame[(frame["layer"] == layer) & (frame["site"] == site)]  # noqa: E731
            write_table(mine(features), run.tables, "features", layer, FEATURES_SCHEMA, part=site,
                        provenance=stamp.to_json())
            write_table(mine(labels), run.tables, "feature_labels", layer, FEATURE_LABELS_SCHEMA, part=site,
                        provenance=stamp.to_json())
            stamps.finish(marker, stamp)
    return read_table(run.tables, "features", layers)


def _feature_saes(run: RunPaths, inputs: ModelInputs, layer: int, sites: list[str],
                  explicit: tuple[Path, Path | None] | None, allow_hookless: bool) -> dict[Point, LoadedSAE]:
    """The SAEs of a layer to describe: explicit ones, or the run's for `sites` that exist."""
    d_model = inputs.config.d_model
    found = {}
    if explicit is not None:
        path_in, path_out = explicit
        sae_in = load_sae(path_in, inputs.device)
        found[(layer, check_sae_point(sae_in, d_model, layer, INPUT_SITES, "input", allow_hookless))] = sae_in
        if path_out is not None:
            sae_out = load_sae(path_out, inputs.device)
            check_sae_point(sae_out, d_model, layer, ("mlp_out",), "output", allow_hookless)
            found[(layer, "mlp_out")] = sae_out
        return found
    for site in sites:
        folder = run.sae(layer, site)
        if folder.is_dir():
            sae = load_sae(folder, inputs.device)
            check_sae_point(sae, d_model, layer, (site,), "input" if site != "mlp_out" else "output")
            found[(layer, site)] = sae
    if not found:
        raise FileNotFoundError(f"no SAEs of layer {layer} in {run.saes} for sites {', '.join(sites)}: "
                                "run `train-saes` first or pass --sae-in/--sae-out")
    return found
