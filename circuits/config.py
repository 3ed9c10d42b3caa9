"""Configuration dataclasses: one documented, validated line per field, saved as JSON.

Every config of the project subclasses `Config` and declares its fields with `option`:

    train_tokens: int = option(4_000_000, "tokens to train on", low=1)

The one line carries the default, the documentation (which the command line shows as its
help) and the bounds, so each default exists once. A config is frozen and validated when
built: a wrong type (a string where a number belongs), a value out of bounds or an unknown
field in a JSON file is a `ValueError` that names the field. This module lives in
`circuits` because every package has configs and `circuits` depends on no other package.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

# the largest seed: the stages derive seeds from it (seed * a prime + a step, under 2**32),
# which torch's generators (at most 2**64 - 1), numpy's and Python's all take
SEED_MAX = 2**32 - 1

def option(default: Any = dataclasses.MISSING, doc: str = "", *, low: float | None = None,
           high: float | None = None, choices: tuple | None = None, runtime: bool = False,
           factory: Any = None):
    """A documented config field. `low`/`high` bound numbers (inclusive), `choices` lists the
    allowed values, `runtime` marks settings that change how work runs but not its result
    (threads, devices, batch sizes of inference), which stamps leave out."""
    metadata = {"doc": doc, "low": low, "high": high, "choices": choices, "runtime": runtime}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def seed_option(doc: str):
    """A documented seed field, bounded to what every random generator of the project takes."""
    return option(0, doc, low=0, high=SEED_MAX)


@dataclass(frozen=True)
class Config:
    """Base of every config: validation on construction, JSON in and out."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            where = f"{type(self).__name__}.{f.name}"
            _check_type(value, hints[f.name], where)
            meta = f.metadata
            for number in value if isinstance(value, tuple) else (value,):
                # NaN passes every comparison below, and infinities are no setting
                if isinstance(number, float) and not math.isfinite(number):
                    raise ValueError(f"{where} must be a finite number, got {number!r}")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if meta.get("low") is not None and value < meta["low"]:
                    raise ValueError(f"{where} must be at least {meta['low']}, got {value!r}")
                if meta.get("high") is not None and value > meta["high"]:
                    raise ValueError(f"{where} must be at most {meta['high']}, got {value!r}")
            if meta.get("choices") and value is not None and value not in meta["choices"]:
                raise ValueError(f"{where} must be one of {', '.join(map(str, meta['choices']))}, got {value!r}")
        self.check()

    def check(self) -> None:
        """Checks across fields, for subclasses; raise ValueError naming the fields."""

    def to_json(self) -> dict:
        """Plain JSON-able dict, nested configs included."""
        return _jsonable(self)

    def recipe(self) -> dict:
        """`to_json` without the runtime fields: what determines the result."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("runtime"):
                continue
            value = getattr(self, f.name)
            out[f.name] = value.recipe() if isinstance(value, Config) else _jsonable(value)
        return out

    @classmethod
    def from_json(cls, data: dict):
        """Inverse of `to_json`; unknown fields and wrong types are ValueErrors."""
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__} must be a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {unknown}")
        hints = typing.get_type_hints(cls)
        values = {}
        for name, value in data.items():
            kind = hints[name]
            if isinstance(kind, type) and issubclass(kind, Config):
                value = kind.from_json(value)
            elif isinstance(value, list):
                value = tuple(value)
            values[name] = value
        return cls(**values)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def _jsonable(value):
    if isinstance(value, Config):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def _check_type(value, kind, where: str) -> None:
    """Raise ValueError unless `value` fits the annotation `kind` (int, float, str, bool,
    Optional, tuple[...], nested Config)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        errors = []
        for option_kind in options:
            try:
                _check_type(value, option_kind, where)
                return
            except ValueError as err:
                errors.append(err)
        raise errors[-1]
    if kind is type(None):
        if value is not None:
            raise ValueError(f"{where} must be null, got {value!r}")
        return
    if origin is tuple:
        if not isinstance(value, tuple):
            raise ValueError(f"{where} must be a list, got {value!r}")
        args = typing.get_args(kind)
        item = args[0] if args else Any
        for v in value:
            _check_type(v, item, where)
        return
    if kind is Any:
        return
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ValueError(f"{where} must be {getattr(kind, '__name__', kind)}, got {value!r}")
