"""Typed, frozen settings: the machinery every component's config uses (ground floor, like fsutil).

A component declares its settings as a frozen dataclass next to its code (``chexflow.data.config``,
``chexflow.train.config``, ...); a numeric field declares its allowed range with :func:`setting`.
:func:`from_dict` builds such a dataclass from a mapping and lists EVERY problem at once (unknown
key, wrong type, value out of range), each naming the dotted key, the value and what is allowed.
:func:`dataclass_schema` turns the same declarations into JSON schema (types, enums, ranges).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from chexflow.fsutil import read_text_regular, write_text_atomic


class ConfigError(ValueError):
    """Settings are missing, unknown, of the wrong type or out of range; the message names every key."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self.problems[0] if len(self.problems) == 1 else
                         f"{len(self.problems)} problems:\n  " + "\n  ".join(self.problems))


@dataclass(frozen=True)
class Range:
    """An interval of allowed numbers (for a list: of each item). ``None``: unbounded on that side."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, v: float) -> bool:
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    def text(self) -> str:
        lo = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        hi = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else None
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f"{'>=' if self.ge is not None else '>'} {lo[1:]}"
        return f"{'<=' if self.le is not None else '<'} {hi[:-1]}" if hi else "any number"

    def schema(self) -> dict:
        names = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}
        return {names[k]: getattr(self, k) for k in ("ge", "gt", "le", "lt") if getattr(self, k) is not None}


def setting(default: Any = MISSING, *, factory: Any = MISSING, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, unique: bool = False) -> Any:
    """A dataclass field with its allowed range (every numeric setting has one; a test holds the code
    to it). On a list the range applies to each item; ``unique``: no item twice."""
    meta: dict[str, Any] = {}
    if (ge, gt, le, lt) != (None, None, None, None):
        meta["range"] = Range(ge=ge, gt=gt, le=le, lt=lt)
    if unique:
        meta["unique"] = True
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def range_of(f: dataclasses.Field) -> Range | None:
    return f.metadata.get("range")


T = TypeVar("T")

# YAML 1.1 (PyYAML, Snakemake) reads 1e-3 (no dot) as a string; YAML 1.2 and JSON read it as a number
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _number_from_string(value: str, key: str) -> float | None:
    if not _NUMBER.fullmatch(value.strip()):
        return None
    number = float(value)
    print(f"chexflow config: {key}: {value!r} is a string in YAML 1.1 (an exponent without a dot); "
          f"read as the number {number!r}", file=sys.stderr)
    return number


class _Bad:
    """Marks a value that failed (the problem is already recorded)."""


BAD = _Bad()


# a plain setting's type -> (what it accepts, what a problem says it expected); a bool is no integer
_SCALARS = {bool: (lambda v: isinstance(v, bool), "true/false"),
            int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
            str: (lambda v: isinstance(v, str), "a string")}


def _convert(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        return _convert(value, args[0], key, problems)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            problems.append(f"{key}: {value!r} is not one of {list(allowed)}")
            return BAD
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{key}: expected a list, got {value!r}")
            return BAD
        inner = typing.get_args(tp)[0]
        items = tuple(_convert(v, inner, f"{key}[{i}]", problems) for i, v in enumerate(value))
        return BAD if any(v is BAD for v in items) else items
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
            problems.append(f"{key}: expected a mapping of names, got {value!r}")
            return BAD
        inner = typing.get_args(tp)[1]
        items = {k: _convert(v, inner, f"{key}.{k}", problems) for k, v in value.items()}
        return BAD if any(v is BAD for v in items.values()) else items
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, problems)
    if tp in _SCALARS:
        accepts, what = _SCALARS[tp]
        if not accepts(value):
            problems.append(f"{key}: expected {what}, got {value!r}")
            return BAD
        return value
    if tp is float:
        if isinstance(value, str):
            number = _number_from_string(value, key)
            if number is not None:
                return number
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{key}: expected a finite number, got {value!r}")
            return BAD
        return float(value)
    return value


def _check_range(value: Any, f: dataclasses.Field, key: str, problems: list[str]) -> None:
    rng = range_of(f)
    items = value if isinstance(value, tuple) else (value,)
    if rng is not None:
        for i, v in enumerate(items):
            if v is not None and not rng.contains(v):
                where = f"{key}[{i}]" if isinstance(value, tuple) else key
                problems.append(f"{where}: {v!r} is not {rng.text()}")
    if f.metadata.get("unique") and isinstance(value, tuple) and len(set(value)) != len(value):
        problems.append(f"{key}: {list(value)} lists a value twice (each must be distinct)")


def _build(cls: type[T], data: Any, key: str, problems: list[str]) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{key or cls.__name__}: expected a mapping, got {type(data).__name__}")
        return BAD
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = f"{key}." if key else ""
    for name in sorted(set(data) - set(fields), key=str):
        problems.append(f"{where}{name}: unknown key; known: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            continue
        converted = _convert(value, hints[name], where + name, problems)
        if converted is BAD:
            continue
        _check_range(converted, fields[name], where + name, problems)
        kwargs[name] = converted
    return cls(**kwargs)


def build(cls: type[T], data: Any, key: str, problems: list[str]) -> T | None:
    """``cls`` from a mapping, its problems appended to ``problems``: the form that lets a caller
    collect the problems of every section before failing. Built even with problems (an unknown key
    left out, a value of the wrong type left at its default, one out of range kept), so that the
    relations between the other settings can be checked in the same pass; None only when ``data``
    is no mapping."""
    out = _build(cls, data, key, problems)
    return None if out is BAD else out


def from_dict(cls: type[T], data: Any, key: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys, wrong types and values out of range fail
    together in one ``ConfigError`` naming each dotted key."""
    problems: list[str] = []
    out = _build(cls, data, key, problems)
    if problems:
        raise ConfigError(problems)
    return out


def to_dict(obj: Any) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(obj)))


def load_stage_config(cls: type[T], *, path: Path | None = None, text: str | None = None) -> T:
    """Load a stage config from a YAML/JSON file or string (exactly one of them)."""
    if (path is None) == (text is None):
        raise ConfigError("give exactly one of a config file or a config string")
    if path is not None:
        try:
            text = read_text_regular(path, what="config file")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config ({exc.strerror})") from exc
    try:
        data = json.loads(text)          # what the rules pass (YAML 1.1 misreads e.g. 5e-05)
    except json.JSONDecodeError:
        data = None
    try:
        data = yaml.safe_load(text) if data is None else data
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path or 'config string'}: not valid YAML/JSON: {exc}") from exc
    try:
        return from_dict(cls, data)
    except ConfigError as exc:
        raise ConfigError([f"{path or 'config'}: {p}" for p in exc.problems]) from exc


def write_yaml_atomic(obj: Any, path: Path) -> None:
    """Write ``obj`` (dataclass or mapping) as YAML, atomically."""
    data = to_dict(obj) if dataclasses.is_dataclass(obj) else obj
    write_text_atomic(path, yaml.safe_dump(data, sort_keys=False))


# --------------------------------------------------------------------------- JSON schema

def _schema_of(tp: Any, f: dataclasses.Field | None = None) -> dict:
    origin = typing.get_origin(tp)
    rng = range_of(f).schema() if f is not None and range_of(f) else {}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _schema_of(args[0], f)
        t = inner.get("type")
        return {**inner, "type": [t, "null"]} if isinstance(t, str) else {"anyOf": [inner, {"type": "null"}]}
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema_of(typing.get_args(tp)[1])}
    if origin is tuple:
        out = {"type": "array", "items": {**_schema_of(typing.get_args(tp)[0]), **rng}}
        return {**out, "uniqueItems": True} if f is not None and f.metadata.get("unique") else out
    if dataclasses.is_dataclass(tp):
        return dataclass_schema(tp)
    base = {bool: {"type": "boolean"}, int: {"type": "integer"}, float: {"type": "number"},
            str: {"type": "string"}}.get(tp, {})
    return {**base, **rng}


def dataclass_schema(cls: type, exclude: tuple[str, ...] = ()) -> dict:
    """JSON schema of ``cls``; ``exclude`` names fields left out, dotted for nested ones (``optim.x``)."""
    hints = typing.get_type_hints(cls)
    props = {}
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        inner = tuple(e.split(".", 1)[1] for e in exclude if e.startswith(f.name + "."))
        tp = hints[f.name]
        sub = dataclass_schema(tp, inner) if inner else _schema_of(tp, f)
        if not inner or sub["properties"]:          # a section with every key excluded is left out
            props[f.name] = sub
    return {"type": "object", "additionalProperties": False, "properties": props}


def normalize_numbers(data: Any, schema: dict, key: str = "") -> None:
    """Replace, in place, each string where ``schema`` (a generated one) wants a number and the
    string reads as one: YAML 1.1 reads ``1e-3`` as a string. A log line names each key."""
    if isinstance(data, dict):
        props = schema.get("properties") or {}
        other = schema.get("additionalProperties")      # a schema for the keys not listed, if any
        other = other if isinstance(other, dict) else None
        entries = [(name, props.get(name, other), f"{key}.{name}" if key else str(name)) for name in data]
    elif isinstance(data, list) and "items" in schema:
        entries = [(i, schema["items"], f"{key}[{i}]") for i in range(len(data))]
    else:
        return
    for at, sub, where in entries:
        if sub is None:
            continue
        if isinstance(data[at], str) and "number" in _types(sub):
            number = _number_from_string(data[at], where)
            if number is not None:
                data[at] = number
        else:
            normalize_numbers(data[at], sub, where)


def _types(schema: dict) -> tuple[str, ...]:
    t = schema.get("type", ())
    return (t,) if isinstance(t, str) else tuple(t)


class Problems:
    """The problems found so far and the dotted keys they are about: a relation is checked only
    between keys without a problem of their own, so that each bad value is reported once, by its key."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.bad: set[str] = set()

    def add(self, key: str, message: str) -> None:
        self.items.append(message)
        self.bad.add(key)

    def build(self, cls: type, data: Any, key: str) -> Any:
        n = len(self.items)
        out = build(cls, data, key, self.items)
        for message in self.items[n:]:          # each message starts with its dotted key
            self.bad.add(re.sub(r"\[\d+\]", "", message.split(":", 1)[0]))
        return out

    def ok(self, *keys: str) -> bool:
        """No problem with any of ``keys``, with a section holding one, or with a key inside one."""
        return not any(b == k or b.startswith(k + ".") or k.startswith(b + ".") for b in self.bad for k in keys)
