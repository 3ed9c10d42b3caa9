"""The stages of a run. Each reuses its outputs exactly when their stamp matches.

The command line and the demo call these, each with the stage's job config
(`pipelines.jobs`) and an explicit `Runtime` (threads, device, Ray). A stage computes the
digests of its inputs (model weights, corpus or token content, SAE files, the tables it
reads) and its job's recipe into a `Stamp` (`pipelines.engine.stamps`); outputs whose stamp
equals it are reused, others are recomputed, and the stamp is written only once the new
outputs are complete. The analysis stages split their work into tasks (SAE groups, layers)
that `pipelines.engine.tasks` runs here or on Ray. The trained model is the one output that
is never replaced silently: a run directory holds one model, and replacing it needs `force`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from circuits.layer import analyse_layer
from circuits.weights import from_hooked_transformer
from pipelines import schemas
from pipelines.analysis.features import boosted_token_ids, feature_tables
from pipelines.analysis.judge import CIRCUIT_READS, judge_layer
from pipelines.analysis.outputs import parse_outputs
from pipelines.analysis.verdicts import InputFacts, has_negation_labels
from pipelines.data.corpus import CorpusConfig, corpus_digest, iter_documents, write_story_corpus
from pipelines.data.stories import StoryConfig
from pipelines.data.tokenizer import load_tokenizer, train_tokenizer
from pipelines.data.tokens import (TokenRows, TokenStore, bits_per_byte, build_token_store, held_out_mask,
                                   open_token_store, unigram_entropy)
from pipelines.engine import stamps
from pipelines.engine.files import atomic_dir, atomic_file, clean_temporaries, digest, read_json, remove, text_digest
from pipelines.engine.files import write_json
from pipelines.engine.paths import RunPaths, stamp_of
from pipelines.engine.stamps import Stamp
from pipelines.engine.tables import has_table, table_path
from pipelines.engine.tasks import Task, run_tasks
from pipelines.inputs import (LayerSAEs, StageInputs, feature_saes, layer_batches, layer_saes,
                              portable)
from pipelines.jobs import CircuitsJob, FeaturesJob, LMJob, SAEJob, VerdictsJob
from pipelines.lm.behaviour import lexicon_accuracy
from pipelines.lm.training import held_out_loss, train_lm
from pipelines.runtime import Runtime
from sae.config import SAETrainConfig
from sae.io import read_metrics, write_sae_extras
from sae.metrics import evaluate_sae
from circuits.sites import OUTPUT_SITE, SITES, Point, hook_name, point_name
from sae.topk import save_sae_lens
from sae.train import inference_weights, train_saes

# written into the stamps of the stages: outputs of an older format are recomputed (4: every
# SAE seeded by its point, not its place in the list; gate ablations by the verdicts stage)
TABLE_FORMAT = 4
SAE_PART = "sae"  # the output set whose features get data statistics, truth tables and verdicts


class ModelReplacementError(ValueError):
    """A stage would replace a trained model without `force`."""


# ------------------------------------------------------------------ corpus and tokens


def ensure_corpus(run: RunPaths, cfg: StoryConfig) -> Path:
    """The built-in story corpus of the run, generated unless it exists for `cfg`."""
    stamp = Stamp("corpus", {}, cfg.recipe())
    if stamps.is_current(stamp_of(run.corpus), stamp):
        return run.corpus
    write_story_corpus(cfg, run.corpus)
    stamps.finish(stamp_of(run.corpus), stamp)
    return run.corpus


def ensure_tokens(run: RunPaths, source: str, tok: Tokenizer, n_ctx: int, cfg: CorpusConfig) -> TokenStore:
    """The corpus tokenized and packed for this tokenizer and context (built once, reused)."""
    inputs = {"corpus": corpus_digest(source), "tokenizer": text_digest(tok.to_str())}
    if cfg.lexicon:
        inputs["lexicon"] = digest(cfg.lexicon)
    # the lexicon counts by its content (an input above), not by where its file lies
    stamp = Stamp("tokens", inputs, {"n_ctx": n_ctx, **cfg.recipe(), "lexicon": bool(cfg.lexicon)})
    folder = run.token_store(text_digest(stamp.to_json())[:16])
    if stamps.is_current(stamp_of(folder), stamp):
        return open_token_store(folder)
    store = build_token_store(source, tok, n_ctx, cfg, folder, corpus_name=source)
    stamps.finish(stamp_of(folder), stamp)
    return store


def _tokens_digest(rows: TokenRows) -> str:
    """Digest of the token ids of a split (what an LM or SAE trained on)."""
    return digest(rows.tokens.filename)


def _held_out_digest(store: TokenStore) -> str:
    """Digest of the held-out tokens and their labels (what descriptions are computed from)."""
    files = sorted(store.folder.glob("held_out.*.bin"))
    return text_digest([digest(f) for f in files], store.classes, store.lexicon_tokens)


# ------------------------------------------------------------------ the language model


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
    with runtime.torch_threads():
        if files.tokenizer.is_file():
            tok = load_tokenizer(lm)
        else:
            tok = train_tokenizer(_tokenizer_texts(source, job.corpus, job.tokenizer.train_docs), job.tokenizer)
            tok.save(str(files.tokenizer))
        store = ensure_tokens(run, source, tok, job.model.n_ctx, job.corpus)
        model_cfg = job.model.replace(d_vocab=tok.get_vocab_size())
        model, log = train_lm(model_cfg, store.train, store.held_out, job.train, lm, runtime.device)
        summary = _summarise_lm(model, store, log, job)
    write_json(files.train_config, job.train.to_json())
    write_json(files.summary, summary)
    np.save(files.token_counts, store.token_counts())
    corpus = job.corpus.replace(lexicon=portable(job.corpus.lexicon, lm)) if job.corpus.lexicon else job.corpus
    write_json(files.trained_corpus, {"source": portable(source, lm), "config": corpus.to_json()})
    files.train_state.unlink(missing_ok=True)
    stamps.begin(files.work_stamp)
    stamps.finish(files.stamp, stamp)
    return summary


def _summarise_lm(model, store: TokenStore, log: pd.DataFrame, job: LMJob) -> dict:
    """Held-out loss in nats and bits per byte, the unigram entropy, speed and behaviour."""
    loss = held_out_loss(model, store.held_out, min(len(store.held_out), 256), job.train.batch_size, job.train.autocast)
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


# ------------------------------------------------------------------ SAEs


def ensure_saes(work: StageInputs, *, job: SAEJob, layers: list[int], runtime: Runtime) -> pd.DataFrame:
    """Train every (layer, site) SAE whose folder is not current; returns all their metrics.

    The points still to train are split into groups (one per Ray worker; one here), each
    trained from one stream of the model with a checkpoint of its own.
    """
    run = work.run
    cfg = job.sae.resolve(work.lm.config.d_model)
    clean_temporaries(run.root)
    points = [(layer, site) for layer in layers for site in job.sites]
    todo = []
    for point in points:
        stamp = _sae_stamp(work, cfg, point)
        folder = run.sae(*point)
        if stamps.is_current(stamp_of(folder), stamp):
            continue
        changed = stamps.changes(stamp_of(folder), stamp)
        if changed:
            print(f"retraining {point_name(point)}: its {', '.join(changed)} changed")
        todo.append(point)
    n_groups = min(len(todo), runtime.workers if runtime.ray else 1)
    groups = [todo[i::n_groups] for i in range(n_groups)] if todo else []
    current = {_checkpoint_name(work, cfg, group) for group in groups}
    for name, stale in run.sae_checkpoints().items():  # of another grouping or recipe
        if name not in current:
            print(f"discarding {stale.name}: it resumes SAEs grouped or trained otherwise than now")
            stale.unlink()
            run.sae_checkpoint_stamp(name).unlink(missing_ok=True)
    tasks = [Task("SAEs " + ", ".join(point_name(p) for p in group), (cfg, group), _gpus(runtime)) for group in groups]
    run_tasks(runtime, _train_points, work, tasks, "train-saes")
    for layer in sorted({p[0] for p in points}):
        _write_metrics_table(run, layer)
    return pd.DataFrame([read_metrics(run.sae(*p)) for p in points])


def _gpus(runtime: Runtime) -> float:
    """What a task asks a Ray cluster for: a GPU each when the work runs on CUDA."""
    return 1.0 if runtime.device.startswith("cuda") else 0.0


def _sae_stamp(work: StageInputs, cfg: SAETrainConfig, point: Point) -> Stamp:
    return Stamp("train-saes", {"model": work.lm.digest, "tokens": _tokens_digest(work.store.train)},
                 {"format": TABLE_FORMAT, "recipe": cfg.recipe(), "point": list(point)})


def _group_stamp(work: StageInputs, cfg: SAETrainConfig, points: list[Point]) -> Stamp:
    """What one group's checkpoint resumes: these points, each with its own stamp."""
    return Stamp("train-saes", {point_name(p): text_digest(_sae_stamp(work, cfg, p).to_json()) for p in points}, {})


def _checkpoint_name(work: StageInputs, cfg: SAETrainConfig, points: list[Point]) -> str:
    return text_digest(_group_stamp(work, cfg, points).to_json())[:12]


def _train_points(work: StageInputs, unit: tuple[SAETrainConfig, list[Point]]) -> None:
    """Train one group of SAEs from one stream, resuming its own checkpoint if it has one."""
    cfg, todo = unit
    run, device = work.run, work.lm.device
    job = _group_stamp(work, cfg, todo)
    name = _checkpoint_name(work, cfg, todo)
    checkpoint, marker = run.sae_checkpoint(name), run.sae_checkpoint_stamp(name)
    resume = None
    if stamps.is_current(marker, job) and checkpoint.is_file():
        resume = torch.load(checkpoint, weights_only=False, map_location=device)
        print(f"resuming SAE training at step {resume['step']} of {cfg.train_steps}")
    else:
        checkpoint.unlink(missing_ok=True)
        stamps.finish(marker, job)

    def save_checkpoint(state: dict) -> None:
        with atomic_file(checkpoint) as tmp:
            torch.save(state, tmp)

    model = work.lm.model
    trainers = train_saes(model, work.store.train, todo, cfg, device, save_checkpoint, resume,
                          on_step=lambda: work.report(cfg.batch_size * len(todo)))
    eval_rows = work.store.held_out.head(cfg.eval_rows)
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
                                             "context_size": work.lm.config.n_ctx, "prepend_bos": True})
            write_sae_extras(tmp, cfg.to_json(), row, trainer.log_feature_sparsity)
            stamps.finish(stamp_of(tmp), _sae_stamp(work, cfg, point))
    checkpoint.unlink(missing_ok=True)
    stamps.begin(marker)


def _write_metrics_table(run: RunPaths, layer: int) -> None:
    """The layer's metrics table from every finished SAE of the layer."""
    rows = [read_metrics(run.sae(layer, s)) for s in SITES if stamp_of(run.sae(layer, s)).is_file()]
    if rows:
        schemas.write(pd.DataFrame(rows), run.tables, "sae_metrics", layer=layer)


# ------------------------------------------------------------------ circuit tables


def ensure_circuits(work: StageInputs, *, job: CircuitsJob, layers: list[int], runtime: Runtime) -> list[str]:
    """Circuit tables of each layer and output set not yet current; returns those computed."""
    explicit = job.explicit(layers) or {}
    todo = []
    for layer in layers:
        saes = layer_saes(work.run, work.lm, layer, explicit.get(layer), job.input_site, "sae" in job.outputs,
                          job.allow_hookless_saes)
        stale = [spec for spec in job.outputs if not _circuits_current(work, job, saes, spec)]
        if stale:
            todo.append(Task(f"layer {layer}", (job, layer, stale, runtime.threads), _gpus(runtime)))
    done = run_tasks(runtime, _circuits_layer, work, todo, "circuits")
    return [name for names in done for name in names]


def _circuits_stamp(work: StageInputs, job: CircuitsJob, saes: LayerSAEs, spec: str) -> Stamp:
    outputs = digest(saes.sae_out.path) if spec == "sae" else text_digest(spec, _spec_file_digest(spec))
    return Stamp("circuits", {"model": work.lm.digest, "held_out_tokens": _tokens_digest(work.store.held_out),
                              "sae_in": digest(saes.sae_in.path), "outputs": outputs},
                 {"format": TABLE_FORMAT, **job.recipe(), "outputs": spec})


def _circuits_current(work: StageInputs, job: CircuitsJob, saes: LayerSAEs, spec: str) -> bool:
    part = _part_name(saes.input_site, spec, job.output_basis)
    names = [t.name for t in schemas.TABLES.values() if t.stage == "circuits" and t.outputs in ("any", spec)]
    return (stamps.is_current(work.run.table_stamp("circuits", saes.layer, part), _circuits_stamp(work, job, saes, spec))
            and all(has_table(work.run.tables, n, saes.layer, part) for n in names))


def _circuits_layer(work: StageInputs, unit: tuple[CircuitsJob, int, list[str], int]) -> list[str]:
    """The circuit tables of one layer for each stale output set, its weight analysis on
    `threads` threads."""
    job, layer, specs, threads = unit
    explicit = (job.explicit([layer]) or {}).get(layer)
    saes = layer_saes(work.run, work.lm, layer, explicit, job.input_site, "sae" in job.outputs, job.allow_hookless_saes)
    model = work.lm.model
    mlp = from_hooked_transformer(model, layer)
    done = []
    for spec in specs:
        part = _part_name(saes.input_site, spec, job.output_basis)
        stamp = _circuits_stamp(work, job, saes, spec)
        marker = work.run.table_stamp("circuits", layer, part)
        stamps.begin(marker)
        out = parse_outputs([spec], job.output_basis, work.lm, mlp, saes, job.circuits)[0]
        batches = layer_batches(model, work.store.held_out, job.corr_rows, saes) if out.sae is not None else None
        tables = analyse_layer(mlp, saes.sae_in.weights, out, batches, job.circuits, layer=layer,
                               input_site=saes.input_site, progress=True, workers=threads)
        for name, frame in tables.items():
            schemas.write(frame, work.run.tables, name, layer, part=part, provenance=stamp.to_json())
        stamps.finish(marker, stamp)
        done.append(f"layer {layer} {part}")
    work.report(job.corr_rows * work.store.held_out.n_ctx)
    return done


def _part_name(input_site: str, spec: str, basis: str) -> str:
    """File name of one output set's tables within a layer's folder."""
    if spec == "sae":
        name = SAE_PART if basis == "encoder" else "sae-decoder"
    elif spec == "hosvd":
        name = "hosvd"
    else:
        name = spec.split(":", 1)[0] + "-" + text_digest(spec)[:8]
    return f"{input_site}-{name}"


def _spec_file_digest(spec: str) -> str:
    if spec.startswith("file:"):
        return digest(spec[5:])
    return ""


# ------------------------------------------------------------------ feature descriptions


def ensure_features(work: StageInputs, *, job: FeaturesJob, layers: list[int], runtime: Runtime) -> pd.DataFrame:
    """The `features` and `feature_labels` tables of each (layer, site) not yet current.

    Each (layer, site) is its own part (`features/layer2/mlp_out.parquet`), so describing
    one site's SAEs leaves the others' descriptions as they are. Here every SAE still to do
    is described in one pass over the held-out rows; on Ray, each layer is a task.
    """
    explicit = job.explicit(layers) or {}
    todo: dict[int, list[str]] = {}
    for layer in layers:
        for point, sae in feature_saes(work.run, work.lm, layer, job.sites, explicit.get(layer),
                                       job.allow_hookless_saes).items():
            if not (stamps.is_current(work.run.table_stamp("features", layer, point[1]), _features_stamp(work, job, sae.path))
                    and has_table(work.run.tables, "features", layer, point[1])):
                todo.setdefault(layer, []).append(point[1])
    if runtime.ray is None and todo:  # one pass for every layer
        tasks = [Task("layers " + ", ".join(map(str, todo)), (job, todo))]
    else:
        tasks = [Task(f"layer {layer}", (job, {layer: sites}), _gpus(runtime)) for layer, sites in todo.items()]
    run_tasks(runtime, _features_of, work, tasks, "features")
    return schemas.read(work.run.tables, "features", layers)


def _features_stamp(work: StageInputs, job: FeaturesJob, sae_path: Path) -> Stamp:
    return Stamp("features", {"model": work.lm.digest, "held_out": _held_out_digest(work.store), "sae": digest(sae_path)},
                 {"format": TABLE_FORMAT, "features": job.features.recipe()})


def _features_of(work: StageInputs, unit: tuple[FeaturesJob, dict[int, list[str]]]) -> None:
    job, todo = unit
    explicit = job.explicit(sorted(todo)) if len(todo) == 1 else None
    saes = {}
    for layer, sites in todo.items():
        found = feature_saes(work.run, work.lm, layer, tuple(sites), (explicit or {}).get(layer),
                             job.allow_hookless_saes)
        saes.update({p: s for p, s in found.items() if p[1] in sites})
    for (layer, site) in saes:
        stamps.begin(work.run.table_stamp("features", layer, site))
    features, labels = feature_tables(work.lm.model, work.lm.tokenizer, work.store.held_out,
                                      {p: s.weights for p, s in saes.items()}, job.features, work.store.classes,
                                      work.store.lexicon_tokens, work.lm.token_counts)
    for (layer, site), sae in saes.items():
        stamp = _features_stamp(work, job, sae.path)
        mine = lambda frame: frame[(frame["layer"] == layer) & (frame["site"] == site)]  # noqa: E731
        schemas.write(mine(features), work.run.tables, "features", layer, part=site, provenance=stamp.to_json())
        schemas.write(mine(labels), work.run.tables, "feature_labels", layer, part=site, provenance=stamp.to_json())
        stamps.finish(work.run.table_stamp("features", layer, site), stamp)
    work.report(job.features.n_rows * work.store.held_out.n_ctx)


# ------------------------------------------------------------------ verdicts

VERDICT_TABLES = tuple(name for name, table in schemas.TABLES.items() if table.stage == "verdicts")


def ensure_verdicts(work: StageInputs, *, job: VerdictsJob, layers: list[int], runtime: Runtime) -> pd.DataFrame:
    """Group gates, ablations and the `gate_verdicts` table of each layer not yet current;
    returns the verdicts of every layer asked for."""
    explicit = job.explicit(layers) or {}
    todo = []
    for layer in layers:
        saes = layer_saes(work.run, work.lm, layer, explicit.get(layer), job.input_site, True, job.allow_hookless_saes)
        part = f"{saes.input_site}-{SAE_PART}"
        marker = work.run.table_stamp("verdicts", layer, part)
        if not (stamps.is_current(marker, _verdicts_stamp(work, job, saes))
                and all(has_table(work.run.tables, n, layer, part) for n in VERDICT_TABLES)):
            todo.append(Task(f"layer {layer}", (job, layer), _gpus(runtime)))
    run_tasks(runtime, _verdicts_layer, work, todo, "verdicts")
    return schemas.select(schemas.read(work.run.tables, "gate_verdicts", layers), job.input_site)


def _verdicts_stamp(work: StageInputs, job: VerdictsJob, saes: LayerSAEs) -> Stamp:
    return Stamp("verdicts", {"model": work.lm.digest, "held_out": _held_out_digest(work.store),
                              "sae_in": digest(saes.sae_in.path), "sae_out": digest(saes.sae_out.path),
                              **_read_digests(work.run, saes)},
                 {"format": TABLE_FORMAT, **job.recipe()})


def _read_digests(run: RunPaths, saes: LayerSAEs) -> dict[str, str]:
    """Digests of the tables the verdicts of a layer read (their files for this layer)."""
    found = {}
    for name in CIRCUIT_READS:
        path = table_path(run.tables, name, saes.layer, f"{saes.input_site}-{SAE_PART}")
        if not path.is_file():
            raise FileNotFoundError(f"layer {saes.layer}: no {name} table of the output SAE's features read by their "
                                    f"encoder rows, for input site {saes.input_site}, in {run.tables}: run `circuits` "
                                    "first (with --outputs sae and --output-basis encoder)")
        found[name] = digest(path)
    for site in (saes.input_site, OUTPUT_SITE):
        for name in ("features", "feature_labels"):
            path = table_path(run.tables, name, saes.layer, site)
            found[f"{name}:{site}"] = digest(path) if path.is_file() else "absent"
    return found


def _verdicts_layer(work: StageInputs, unit: tuple[VerdictsJob, int]) -> None:
    """Rank, group, ablate and judge one layer's gate candidates (`pipelines.analysis.judge`)."""
    job, layer = unit
    run = work.run
    explicit = (job.explicit([layer]) or {}).get(layer)
    saes = layer_saes(run, work.lm, layer, explicit, job.input_site, True, job.allow_hookless_saes)
    part = f"{saes.input_site}-{SAE_PART}"
    marker = run.table_stamp("verdicts", layer, part)
    stamp = _verdicts_stamp(work, job, saes)
    stamps.begin(marker)
    circuits = {name: schemas.select(schemas.read(run.tables, name, [layer]), saes.input_site)
                for name in CIRCUIT_READS}
    features, labels = (schemas.read(run.tables, name, [layer]) for name in ("features", "feature_labels"))
    model = work.lm.model
    boosted = boosted_token_ids(model, saes.sae_out.weights.W_dec, work.lm.tokenizer, work.lm.untrained)
    facts = InputFacts.of(features, labels, layer, saes.input_site, job.verdicts)
    frames = judge_layer(model, saes, work.store.held_out, circuits, facts=facts,
                         negation=has_negation_labels(labels), boosted=boosted, cfg=job.verdicts)
    for name, frame in frames.items():
        schemas.write(frame, run.tables, name, layer, part=part, provenance=stamp.to_json())
    stamps.finish(marker, stamp)
    work.report(job.verdicts.rows * work.store.held_out.n_ctx)
