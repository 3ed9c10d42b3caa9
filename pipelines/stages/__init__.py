"""The stages of a run, one module each; this is their index.

Every stage reuses its outputs exactly when their stamp matches (`pipelines.engine.stamps`):
the digests of its inputs (model weights, corpus or token content, SAE files, the tables it
reads) and its job's recipe (`pipelines.jobs`), the stamp written only once the outputs are
complete. The command line and the demo call them with an explicit `Runtime` (threads,
device, Ray) and, for the analysis stages, the command's per-layer plan
(`pipelines.inputs.LayerPlan`).

- `corpus`: the built-in story corpus; `tokens`: a corpus tokenized and packed;
- `lm`: the tokenizer and the LM (the one output never replaced silently);
- `saes`: the SAEs, trained in groups from one stream each, and `sae_metrics`;
- `circuits`, `features`, `verdicts`: table stages (`base.TableStage`), each module's
  `STAGE` run by the one generic `base.ensure` and offered as a command by its `COMMAND`.
  A new table stage is one more such module and its name in `pipelines.cli.TABLE_STAGES`.
"""

from pipelines.stages.base import ensure
from pipelines.stages.circuits import STAGE as CIRCUITS
from pipelines.stages.corpus import ensure_corpus
from pipelines.stages.features import STAGE as FEATURES
from pipelines.stages.lm import ModelReplacementError, ensure_lm
from pipelines.stages.saes import ensure_saes
from pipelines.stages.tokens import ensure_tokens
from pipelines.stages.verdicts import STAGE as VERDICTS

__all__ = ["CIRCUITS", "FEATURES", "VERDICTS", "ModelReplacementError", "ensure", "ensure_corpus", "ensure_lm",
           "ensure_saes", "ensure_tokens"]
