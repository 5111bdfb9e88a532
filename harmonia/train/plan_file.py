"""A plan file read strictly, before any process starts.

`check_plan_file` reads the JSON of ``parallel.plan`` against the `Plan` and `Layout` fields and
their types (an integer is not a boolean, ``"no"`` is not ``false``, an unknown key is an error),
then against the job: the plan's model must be the job's (``model.source``), and the config's
fixed degrees (``parallel.llm_pp``) must be the plan's. Each error names the file, the key path
and what to do.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from harmonia.config import Config
from harmonia.errors import ConfigError
from harmonia.schedule.plan import Plan

REQUIRED = ("model", "layouts")


def _expected(hint: Any) -> str:
    """``hint`` in the words of JSON."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if isinstance(hint, type) and issubclass(hint, Enum):
        return "one of " + ", ".join(repr(m.value) for m in hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _expected(a) for a in args)
    if origin in (list, tuple):
        return "a list of " + {int: "integers", str: "strings", float: "numbers"}.get(args[0], "values")
    if origin is dict:
        return "an object"
    if dataclasses.is_dataclass(hint):
        return "an object"
    return str(hint)


def _check(where: str, value: Any, hint: Any) -> None:
    """Raise ConfigError unless ``value`` (parsed JSON) has the type ``hint`` exactly."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        inner = [a for a in args if a is not type(None)]
        for alternative in inner:
            try:
                return _check(where, value, alternative)
            except ConfigError:
                continue
        _require(where, value, False, hint)
    if dataclasses.is_dataclass(hint):
        return _check_object(where, value, hint)
    if origin in (list, tuple):
        _require(where, value, isinstance(value, list), hint)
        for i, item in enumerate(value):
            _check(f"{where}[{i}]", item, args[0])
        return
    if origin is dict:
        _require(where, value, isinstance(value, dict), hint)
        for key, item in value.items():
            _check(f"{where}.{key}", item, args[1])
        return
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(hint, type) and issubclass(hint, Enum):
        ok = value in [m.value for m in hint]
    else:
        ok = isinstance(value, hint)
    _require(where, value, ok, hint)


def _require(where: str, value: Any, ok: bool, hint: Any) -> None:
    if not ok:
        raise ConfigError(f"{where} = {json.dumps(value)} is invalid: expected {_expected(hint)}")


def _check_object(where: str, value: Any, cls: type) -> None:
    """``value`` must be a JSON object whose keys are ``cls``'s init fields, each of its type."""
    _require(where, value, isinstance(value, dict), cls)
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{where} has unknown keys {unknown}; its keys are {sorted(known)}")
    for key, item in value.items():
        _check(f"{where}.{key}", item, hints[key])


def read_plan_json(path: str | Path) -> dict:
    """The plan file's JSON, checked key by key against `Plan` and `Layout` (raises ConfigError)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"plan file {path} cannot be read ({err}); write it with `harmonia plan`") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"plan file {path} is not JSON ({err}); write it with `harmonia plan`") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"plan file {path} holds a JSON {type(raw).__name__}, not an object; write it with "
                          "`harmonia plan`")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"plan file {path} has no {missing}; write it with `harmonia plan`")
    try:
        _check_object("plan", raw, Plan)
    except ConfigError as err:
        raise ConfigError(f"plan file {path}: {err}") from None
    return raw


def check_plan_file(config: Config) -> None:
    """Check ``parallel.plan`` (when it is a file) against its schema and against the job.

    Raises:
        ConfigError: naming the file, the key and what to do.
    """
    if config.parallel.plan == "auto":
        return
    path = config.parallel.plan
    raw = read_plan_json(path)
    if raw["model"] != config.model.source:
        raise ConfigError(f"plan file {path} was made for model {raw['model']!r} but this job trains "
                          f"{config.model.source!r}; plan again for this model or set parallel.plan=auto")
    llm = raw["layouts"].get("llm")
    if llm is None:
        raise ConfigError(f"plan file {path} has no layout for 'llm'; every plan lays out the LLM")
    want = config.parallel.llm_pp
    if want and llm.get("pp", 1) != want:
        raise ConfigError(f"plan file {path} pipelines the LLM over pp={llm.get('pp', 1)} stages but "
                          f"parallel.llm_pp={want}; plan again with that degree, or set parallel.llm_pp=0 to "
                          "take the plan's")
