"""The strict JSON converter: what it refuses at every depth, and the field it names."""

from __future__ import annotations

import attrs
import cattrs
import pytest

from lamploop.strict_json import field_errors, strict_converter


@attrs.frozen
class Inner:
    count: int
    names: tuple[str, ...]
    pairs: list[tuple[int, ...]] = attrs.field(factory=list)


@attrs.frozen
class Outer:
    items: tuple[Inner, ...]
    extra: Inner | None = None


def _errors(value: object) -> list[str]:
    with pytest.raises(cattrs.BaseValidationError) as caught:
        strict_converter().structure(value, Outer)
    return field_errors(caught.value)


def test_well_formed_values_load_at_every_depth() -> None:
    loaded = strict_converter().structure({"items": [{"count": 1, "names": ["a"], "pairs": [[1, 2]]}]}, Outer)
    assert loaded == Outer(items=(Inner(count=1, names=("a",), pairs=[(1, 2)]),))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"items": [{"count": 1, "names": "ab"}]}, "items[0].names: expected a list, got 'ab' (str)"),
        (
            {"items": [{"count": 1, "names": [], "pairs": ["12"]}]},
            "items[0].pairs[0]: expected a list, got '12' (str)",
        ),
        ({"items": [3]}, "items[0]: expected an object, got 3 (int)"),
        ({"items": [{"count": "1", "names": []}]}, "items[0].count: expected an integer, got '1' (str)"),
        ({"items": [], "bogus": 1}, "unknown field bogus"),
        ({"items": "x"}, "items: expected a list, got 'x' (str)"),
    ],
)
def test_a_malformed_value_is_refused_naming_the_field(value: object, expected: str) -> None:
    assert expected in _errors(value)


def test_a_value_that_is_not_an_object_where_an_attrs_class_belongs_says_so() -> None:
    errors = _errors({"items": [], "extra": [1]})
    assert any(e.startswith("extra:") and "expected an object" in e for e in errors), errors
