"""Attribution graphs of a run's model on three negation prompts of the built-in corpus (the
corpus's next word as target) and one prompt of free text (the default targets): scores, the
strongest path from the negation, and the strongest AND hyperedge at its first feature.

    python benchmarks/graph_examples.py RUN   # a run with lm/, saes/ and tables/features (writes RUN/graphs)
"""

from __future__ import annotations

import sys
import time

import torch

from pipelines.demo import DemoConfig, cue_tokens, negation_prompts
from pipelines.engine.paths import RunPaths
from pipelines.graph.stage import describe, make_graphs
from pipelines.inputs import ModelInputs
from pipelines.jobs import GraphJob

FREE_TEXT = "The little dog was hungry, so he looked for some food in the kitchen. He found a big bone under the"


def main() -> None:
    torch.set_num_threads(1)
    run = RunPaths(sys.argv[1])
    lm = ModelInputs(run.lm)
    job = GraphJob()
    for prompt, word, cue in list(negation_prompts(DemoConfig().stories))[:3]:
        target = lm.tokenizer.id_to_token(lm.tokenizer.encode(word).ids[0])
        start = time.perf_counter()
        graph = make_graphs(run, lm, job.replace(graph=job.graph.replace(target=target)), [prompt], progress=False)[0]
        at = cue_tokens(graph, lm.tokenizer, cue)
        print(f"\n{prompt!r} -> {word!r}, negation at tokens {at} ({time.perf_counter() - start:.1f} s)")
        print("\n".join(describe(graph, at)))
        print("  from any token:" + describe(graph)[1].split(":", 1)[1])
    start = time.perf_counter()
    graph = make_graphs(run, lm, job, [FREE_TEXT], progress=False)[0]
    print(f"\n{FREE_TEXT!r} ({time.perf_counter() - start:.1f} s)")
    print("\n".join(describe(graph)))


if __name__ == "__main__":
    main()
