"""Plain JSON values to and from the project's dataclasses, read off their fields.

`to_plain` writes a dataclass as a dict of its fields in declaration order (or in the order a
class states in `PLAIN_KEYS`), a str-Enum as its value, a tuple or list as a list, a dict with
its keys as strings. `from_plain` reads such a dict back by the fields' type hints: nested
dataclasses, Enums, `X | None`, tuples, lists and dicts (an int-keyed dict's keys back to ints),
numbers coerced to the declared type (JSON writes 25.0 as 25 nowhere, but a hand-written file
may).

Backward compatibility is stated per field: a key an older file lacks takes the field's
default, or the value its `OLDER_FILES` metadata names where files written before the field
existed meant something else than the default does now. A key without either that a file
lacks, and a key the class has no field for, are errors that name them. A class that lists
keys in `PLAIN_OMIT_AT_DEFAULT` writes them only where they differ from their defaults, so files
of the things that do not use a newer field read exactly as before.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Callable

OLDER_FILES = "older_files"
"""Field metadata key: the value a file written before the field existed means."""


def to_plain(value: Any) -> Any:
    """`value` as JSON-ready lists, dicts, strings, numbers, booleans and None."""
    kind = type(value)
    if kind in _AS_IS:
        return value
    return _writer(kind)(value)


def from_plain(cls: type, data: dict[str, Any]) -> Any:
    """The `cls` dataclass `to_plain` wrote as `data`; TypeError on a key `cls` has no field
    for, ValueError on a missing one no default covers."""
    return _reader(cls)(data)


_AS_IS = frozenset({str, int, float, bool, type(None)})
"""Types JSON holds as they are."""

_NO_DEFAULT = object()
"""Stands for "no default to omit at" (a key outside `PLAIN_OMIT_AT_DEFAULT`)."""


_WRITERS: dict[type, Callable[[Any], Any]] = {}
_READERS: dict[type, Callable[[dict[str, Any]], Any]] = {}
"""Each type's writer and reader, built once: a plan writes and reads thousands of rank placements."""


def _writer(kind: type) -> Callable[[Any], Any]:
    """How `to_plain` writes a value of `kind` (a plain field or item is taken as it is, without a call)."""
    found = _WRITERS.get(kind)
    if found is None:
        found = _WRITERS[kind] = _make_writer(kind)
    return found


def _make_writer(kind: type) -> Callable[[Any], Any]:
    if issubclass(kind, enum.Enum):
        return lambda value: value.value
    if dataclasses.is_dataclass(kind):
        keys = getattr(kind, "PLAIN_KEYS", None) or tuple(spec.name for spec in dataclasses.fields(kind) if spec.init)
        defaults = {spec.name: spec.default for spec in dataclasses.fields(kind)
                    if spec.name in getattr(kind, "PLAIN_OMIT_AT_DEFAULT", ())}
        if not defaults:
            return lambda value: {key: item if type(item := getattr(value, key)) in _AS_IS
                                  else _writer(type(item))(item) for key in keys}
        return lambda value: {key: item if type(item) in _AS_IS else _writer(type(item))(item)
                              for key in keys
                              if (item := getattr(value, key)) != defaults.get(key, _NO_DEFAULT)}
    if issubclass(kind, (list, tuple)):
        return lambda value: [item if type(item) in _AS_IS else _writer(type(item))(item) for item in value]
    if issubclass(kind, dict):
        return lambda value: {str(key.value if isinstance(key, enum.Enum) else key): to_plain(item)
                              for key, item in value.items()}
    return lambda value: value


def _reader(cls: type) -> Callable[[dict[str, Any]], Any]:
    """How `from_plain` reads a `cls`."""
    found = _READERS.get(cls)
    if found is None:
        found = _READERS[cls] = _make_reader(cls)
    return found


def _make_reader(cls: type) -> Callable[[dict[str, Any]], Any]:
    """A reader of `cls`, its fields' readers built once."""
    hints = typing.get_type_hints(cls)
    known = {spec.name: spec for spec in dataclasses.fields(cls) if spec.init}
    readers = {name: _value_reader(hints[name], f"{cls.__name__}.{name}") for name in known}
    absent = {}
    for name, spec in known.items():
        if OLDER_FILES in spec.metadata:
            absent[name] = spec.metadata[OLDER_FILES]
    required = [name for name, spec in known.items() if name not in absent
                and spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING]

    def read(data: dict[str, Any]) -> Any:
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__}: expected an object of its fields, got {type(data).__name__}")
        for name in required:
            if name not in data:
                raise ValueError(f"{cls.__name__}: key {name!r} is missing and has no default")
        # A key `cls` has no field for goes to its constructor as written, which refuses it
        # (TypeError: "unexpected keyword argument"), as constructing it by hand would.
        values = {key: readers.get(key, _identity)(value) for key, value in data.items()}
        for name, value in absent.items():
            values.setdefault(name, value)
        return cls(**values)

    return read


def _value_reader(hint: Any, where: str) -> Callable[[Any], Any]:
    """A function reading a JSON value as the type `hint` names."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [arg for arg in args if arg is not type(None)]
        if len(kinds) != 1:
            return lambda value: value  # a union of several kinds is read as written
        inner = _value_reader(kinds[0], where)
        if type(None) in args:
            return lambda value: None if value is None else inner(value)
        return inner
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _value_reader(args[0], where)
            return lambda value: tuple(item(x) for x in _not_null(value, hint, where))
        items = [_value_reader(arg, where) for arg in args]
        return lambda value: tuple(read(x) for read, x in zip(items, _not_null(value, hint, where))) if items \
            else tuple(_not_null(value, hint, where))
    if origin is list:
        item = _value_reader(args[0], where) if args else _identity
        return lambda value: [item(x) for x in _not_null(value, hint, where)]
    if origin is dict:
        key_reader, item_reader = (_value_reader(args[0], where), _value_reader(args[1], where)) if args \
            else (_identity, _identity)
        return lambda value: {key_reader(key): item_reader(item) for key, item in _not_null(value, hint, where).items()}
    if isinstance(hint, type):
        if dataclasses.is_dataclass(hint):
            return lambda value: from_plain(hint, _not_null(value, hint, where))
        if issubclass(hint, enum.Enum) or hint in (bool, int, float, str):
            def read(value: Any) -> Any:
                if type(value) is hint:
                    return value
                return hint(_not_null(value, hint, where))

            return read
    return _identity


def _identity(value: Any) -> Any:
    return value


def _not_null(value: Any, hint: Any, where: str) -> Any:
    if value is None:
        raise ValueError(f"{where}: expected {hint}, got null")
    return value
