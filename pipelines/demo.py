"""The demo: every stage on the built-in corpus, ending with each layer's best circuit
candidates, pairs and group gates, checked on data, and the negation gates among them."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from circuits.config import Config, option
from circuits.layer import CircuitConfig
from circuits.sites import DEFAULT_SAE_SITES
from pipelines import summary
from pipelines.schemas import read
from pipelines.analysis.features import FeatureConfig
from pipelines.analysis.negation import scan_run
from pipelines.analysis.verdicts import VerdictConfig
from pipelines.data.stories import StoryConfig, generate_stories
from pipelines.data.story_corpus import story_lexicon
from pipelines.engine.files import write_json
from pipelines.engine.paths import RunPaths
from pipelines.explorer.site import write_explorer
from pipelines.graph.stage import describe, make_graphs
from pipelines.inputs import ModelInputs, StageInputs
from pipelines.jobs import CircuitsJob, FeaturesJob, GraphJob, LMJob, SAEJob, VerdictsJob
from pipelines.lm.model import PRESETS
from pipelines.lm.training import LMTrainConfig
from pipelines.report.config import ReportConfig
from pipelines.report.page import write_report
from pipelines.runtime import Runtime
from pipelines.stages import (CIRCUITS, FEATURES, VERDICTS, ensure, ensure_corpus, ensure_lm, ensure_saes,
                              ensure_tokens)
from sae.config import SAETrainConfig


@dataclass(frozen=True)
class DemoConfig(Config):
    """Every setting of the demo, written to `<run>/demo_config.json`."""

    stories: StoryConfig = option(doc="the built-in corpus", factory=lambda: StoryConfig(n_stories=40000))
    lm: LMJob = option(doc="the tokenizer and LM", factory=lambda: LMJob(
        model=PRESETS["demo"], train=LMTrainConfig(train_tokens=2_000_000)))
    # k 16 rather than the paper's share (8 of 512): with k 8 the input SAEs merge "not" with
    # the context's valence into conjunction features, hiding the AND the MLP computes.
    saes: SAEJob = option(doc="the SAEs", factory=lambda: SAEJob(
        sites=DEFAULT_SAE_SITES, sae=SAETrainConfig(k=16, train_tokens=1_000_000)))
    circuits: CircuitsJob = option(doc="circuit tables", factory=CircuitsJob)
    features: FeaturesJob = option(doc="feature descriptions", factory=lambda: FeaturesJob(sites=DEFAULT_SAE_SITES))
    verdicts: VerdictsJob = option(doc="group gates, ablations and verdicts", factory=VerdictsJob)
    report: ReportConfig = option(doc="the HTML report", factory=ReportConfig)
    graph: GraphJob = option(doc="the attribution graph of one negation prompt of the corpus", factory=GraphJob)
    n_candidates: int = option(8, "best circuit candidates per layer printed, pairs and groups each (at most the "
                                  "verdicts' n_ablate: every one printed is ablated)", low=1)
    explorer: bool = option(True, "write the interactive explorer too")

    def check(self) -> None:
        if self.n_candidates > self.verdicts.rules.n_ablate:
            raise ValueError(f"DemoConfig.n_candidates={self.n_candidates} exceeds verdicts.n_ablate="
                             f"{self.verdicts.rules.n_ablate}: the demo would print candidates never ablated")

    @classmethod
    def small(cls) -> "DemoConfig":
        """A miniature for the test suite: same stages, a minute or two."""
        # float32 whatever the hardware (`autocast="auto"` would train another model where bf16
        # is native): the tests that read this run's best candidates see one model everywhere
        return cls(
            stories=StoryConfig(n_stories=2000),
            lm=LMJob(model=PRESETS["tiny"],
                     train=LMTrainConfig(train_tokens=60_000, batch_size=16, eval_every=20, checkpoint_every=50,
                                         autocast="none")),
            saes=SAEJob(sites=DEFAULT_SAE_SITES, sae=SAETrainConfig(train_tokens=40_960, batch_size=1024, buffer_tokens=8192,
                                                        eval_rows=8, autocast="none")),
            circuits=CircuitsJob(corr_rows=64, analysis=CircuitConfig(top_n=10, n_gates=5, max_rank=4, min_active=5)),
            features=FeaturesJob(sites=DEFAULT_SAE_SITES, description=FeatureConfig(n_rows=64)),
            verdicts=VerdictsJob(rules=VerdictConfig(rows=64, n_ablate=2, min_cell=5)),
            n_candidates=2,
        )

    def with_seed(self, seed: int) -> "DemoConfig":
        """The same demo with one seed for every random choice of every stage."""
        return self.replace(
            stories=self.stories.replace(seed=seed),
            lm=self.lm.replace(corpus=self.lm.corpus.replace(split_seed=seed), model=self.lm.model.replace(seed=seed),
                               train=self.lm.train.replace(seed=seed)),
            saes=self.saes.replace(sae=self.saes.sae.replace(seed=seed)),
            circuits=self.circuits.replace(analysis=self.circuits.analysis.replace(seed=seed)),
            features=self.features.replace(description=self.features.description.replace(seed=seed)),
            verdicts=self.verdicts.replace(rules=self.verdicts.rules.replace(seed=seed)))


def run_demo(run: RunPaths, cfg: DemoConfig, runtime: Runtime) -> None:
    """Run every stage into `run`, keeping those already done, and print the circuits found."""
    start = time.perf_counter()
    run.root.mkdir(parents=True, exist_ok=True)
    write_json(run.demo_config, cfg.to_json())
    corpus = ensure_corpus(run, cfg.stories)
    lm_job = cfg.lm.replace(corpus=story_lexicon(corpus, cfg.lm.corpus))
    summary.lm(ensure_lm(run, source=str(corpus), job=lm_job, runtime=runtime))
    lm = ModelInputs(run.lm, runtime.device)
    work = StageInputs(run, lm, ensure_tokens(run, str(corpus), lm.tokenizer, lm.config.n_ctx, lm_job.corpus))
    layers = list(range(lm.config.n_layers))
    summary.sae_metrics(ensure_saes(work, job=cfg.saes, layers=layers, runtime=runtime), cfg.saes.dead_warning)
    ensure(CIRCUITS, work, cfg.circuits, cfg.circuits.plan(run, lm, layers), runtime)
    ensure(FEATURES, work, cfg.features, cfg.features.plan(run, lm, layers), runtime)
    plan = cfg.verdicts.plan(run, lm, layers)
    verdicts = ensure(VERDICTS, work, cfg.verdicts, plan, runtime)
    summary.verdicts(verdicts, cfg.n_candidates, time.perf_counter() - start, cfg.verdicts.rules.min_cell,
                     read(run.tables, "group_gates", layers))
    with runtime.torch_threads():
        summary.negation(scan_run(run, lm, work.store, plan, cfg.verdicts.rules))
    with runtime.torch_threads():
        print("\n".join(negation_graph(run, lm, cfg)))
    explorer = write_explorer(run) if cfg.explorer else None
    report = write_report(run, cfg.report, lm, plan, processes=runtime.threads)
    print(f"report: {report}")
    if explorer is not None:
        print(f"explorer: {explorer} (opens from the file system; `bilinear-circuits explore --out {run.root} --serve` "
              "or `graph --serve` also shows the graphs in circuit-tracer's viewer)")


def negation_graph(run: RunPaths, lm: ModelInputs, cfg: DemoConfig) -> list[str]:
    """Build the attribution graph of the corpus's first negation prompt, its target the word
    the corpus has next; returns its summary from the negation's tokens."""
    prompt, word, cue = negation_prompt(cfg.stories)
    target = lm.tokenizer.id_to_token(lm.tokenizer.encode(word).ids[0])  # the word's first piece: what comes next
    graph = make_graphs(run, lm, cfg.graph.replace(graph=cfg.graph.graph.replace(target=target)), [prompt])[0]
    at_cue = cue_tokens(graph, lm.tokenizer, cue)
    return [f"\nAttribution graph of {prompt!r} -> {word!r} (the corpus's next word; the negation is at tokens "
            f"{at_cue}), with the strongest path from the negation:", *describe(graph, at_cue)]


def cue_tokens(graph, tokenizer, cue: tuple[int, int]) -> list[int]:
    """Positions of the negation cue's tokens in a graph of a `negation_prompts` prompt (the
    corpus's span runs from the cue on to the flipped word, "didn't feel": only the cue's)."""
    encoding = tokenizer.encode(graph.prompt)
    offsets = [(0, 0)] * (len(graph.token_ids) - len(encoding.ids)) + encoding.offsets  # BOS first
    return [i for i, (a, b) in enumerate(offsets) if a < cue[1] and b > cue[0] and NEGATION.search(graph.tokens[i])]


NEGATION = re.compile(r"not|n't|^##'t$|never")  # the pieces of the corpus's negation cues


def negation_prompts(stories: StoryConfig, n_stories: int = 50):
    """The negated sentiment words of the first `n_stories` stories of the demo's corpus, each as
    (prompt: the story's text up to that word, from the sentence before the negation's; the
    word; the negation's character span in the prompt)."""
    for story in generate_stories(stories.replace(n_stories=min(stories.n_stories, n_stories))):
        for cue_start, cue_end in story.negation_spans:
            word = next(s for s in story.sentiment_spans if s[0] > cue_end)
            text = story.text[:word[0]].rstrip()
            start = _sentence_start(text, _sentence_start(text, cue_start) - 2)
            yield text[start:], story.text[word[0]:word[1]], (cue_start - start, cue_end - start)


def negation_prompt(stories: StoryConfig) -> tuple[str, str, tuple[int, int]]:
    """The first of `negation_prompts`."""
    found = next(negation_prompts(stories), None)
    if found is None:
        raise ValueError("the corpus has no negation: raise --negation-rate")
    return found


def _sentence_start(text: str, at: int) -> int:
    """Where the sentence holding character `at` starts."""
    end = text.rfind(". ", 0, max(at, 0))
    return 0 if end < 0 else end + 2


