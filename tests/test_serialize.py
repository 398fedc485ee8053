"""The generic serialisation: dataclasses to plain JSON values and back by their fields."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from orchestrator.choices import Compression, Strategy
from orchestrator.serialize import OLDER_FILES, from_plain, to_plain


@dataclass(frozen=True)
class Inner:
    strategy: Strategy
    """A str-Enum: written as its value."""
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Outer:
    inner: Inner
    ratio: float
    paths: dict[int, str] = field(default_factory=dict)
    compression: Compression | None = None
    legacy: bool = field(default=True, metadata={OLDER_FILES: False})
    """Files written before it existed meant False; new ones default to True."""


def test_to_plain_writes_values_lists_and_string_keys():
    value = Outer(Inner(Strategy.zero3, (1, 2)), 0.5, {3: "pix"}, Compression.bf16)
    assert to_plain(value) == {"inner": {"strategy": "zero3", "sizes": [1, 2]}, "ratio": 0.5, "paths": {"3": "pix"},
                               "compression": "bf16", "legacy": True}


def test_from_plain_reads_back_by_the_type_hints():
    value = Outer(Inner(Strategy.hsdp, (4,)), 2.0, {0: "sys"}, None, True)
    back = from_plain(Outer, to_plain(value))
    assert back == value
    assert isinstance(back.inner.strategy, Strategy) and isinstance(back.inner.sizes, tuple)
    assert list(back.paths) == [0]


def test_numbers_are_coerced_to_the_declared_type():
    back = from_plain(Outer, {"inner": {"strategy": "ddp"}, "ratio": 3})
    assert back.ratio == 3.0 and isinstance(back.ratio, float)


def test_an_absent_key_takes_its_default_or_what_older_files_meant():
    back = from_plain(Outer, {"inner": {"strategy": "ddp"}, "ratio": 1.0})
    assert back.paths == {} and back.compression is None and back.inner.sizes == ()
    assert back.legacy is False


def test_a_missing_required_key_and_an_unknown_key_are_named():
    with pytest.raises(ValueError, match="Outer: key 'ratio' is missing and has no default"):
        from_plain(Outer, {"inner": {"strategy": "ddp"}})
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        from_plain(Inner, {"strategy": "ddp", "colour": "red"})
