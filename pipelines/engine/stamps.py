"""The one rule for reusing a stage's outputs: the digests of its inputs must match.

A stamp records what a stage's outputs were computed from: a digest per input (model
weights, corpus content, SAE files, tokens) and the stage's config without its runtime
fields. It is written only after the outputs are complete and removed before they are
rewritten, so a stamp that exists always describes complete outputs. Outputs are reused
exactly when their stamp equals the one the stage would write now.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipelines.engine.files import read_json, write_json


@dataclass(frozen=True)
class Stamp:
    """What one stage's outputs were computed from."""

    stage: str  # e.g. "train-saes"
    inputs: dict[str, str] = field(default_factory=dict)  # input name -> content digest
    config: dict = field(default_factory=dict)  # the stage's config (its recipe)

    def to_json(self) -> dict:
        return {"stage": self.stage, "inputs": dict(self.inputs), "config": self.config}


def read(path: str | Path) -> Stamp | None:
    data = read_json(path)
    if not isinstance(data, dict) or "stage" not in data:
        return None
    return Stamp(data["stage"], data.get("inputs", {}), data.get("config", {}))


def is_current(path: str | Path, stamp: Stamp) -> bool:
    """Whether the outputs stamped at `path` were computed from exactly `stamp`'s inputs."""
    saved = read(path)
    return saved is not None and saved.to_json() == _normalised(stamp)


def changes(path: str | Path, stamp: Stamp) -> list[str]:
    """What differs from the saved stamp: input names and config keys ('config.k')."""
    saved = read(path)
    if saved is None:
        return []
    now = _normalised(stamp)
    names = [name for name in sorted(set(saved.inputs) | set(now["inputs"]))
             if saved.inputs.get(name) != now["inputs"].get(name)]
    names += [f"config.{key}" for key in sorted(set(saved.config) | set(now["config"]))
              if saved.config.get(key) != now["config"].get(key)]
    return names


def begin(path: str | Path) -> None:
    """Remove the stamp before outputs are rewritten: a half-done rewrite is never current."""
    Path(path).unlink(missing_ok=True)


def finish(path: str | Path, stamp: Stamp) -> None:
    """Record `stamp` once the outputs are complete."""
    write_json(path, _normalised(stamp))


def _normalised(stamp: Stamp) -> dict:
    # through JSON, so tuples and lists (and int/float spellings) compare as they are saved
    import json

    return json.loads(json.dumps(stamp.to_json(), sort_keys=True))
