"""values.schema.json says each pattern in words where Helm prints it (schema.readable_patterns):
no pattern is left where Helm would print the regular expression, and the words change nothing
the schema accepts. What each Helm prints for each bad value: tests/chart/test_bad_values.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from metax_operator.chart import schema
from tests.helm import CHART

VALUES_SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def walk(node, path=()):
    """(path, node) for every mapping in the schema."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from walk(value, (*path, key))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from walk(item, (*path, i))


def test_every_pattern_is_a_test_with_words():
    patterns = [path for path, node in walk(VALUES_SCHEMA) if "pattern" in node and isinstance(node["pattern"], str)]
    assert patterns, "the schema has patterns"
    bare = [path for path in patterns if "if" not in path]
    assert bare == [], "patterns Helm would print as regular expressions"


def test_the_words_refuse_every_value_themselves_included():
    folded = [node for _, node in walk(VALUES_SCHEMA) if "if" in node]
    assert len(folded) > 30
    for node in folded:
        otherwise = node["else"]
        said = otherwise["const"]
        assert otherwise["x-hint"] in said and said.strip()
        checker = jsonschema.Draft7Validator(otherwise)
        assert not checker.is_valid(said) and not checker.is_valid("anything else"), said


@pytest.mark.parametrize(
    "node, field, says",
    [
        ({"type": "string", "pattern": "^a$", "x-hint": "the letter a"}, "x", "the letter a"),
        ({"propertyNames": {"allOf": [{"pattern": "^a", "x-hint": "a key"}, {"pattern": "b$"}]}}, "m", "a key of m: a key"),
        ({"propertyNames": {"pattern": "^a", "not": {"enum": ["ab"]}, "x-hint": "not ab"}}, "m", "a key of m: not ab"),
    ],
)
def test_a_pattern_becomes_if_else_with_the_hint(node, field, says):
    out = schema.readable_patterns(node, None, field)
    inner = out.get("propertyNames", out)
    assert "pattern" not in inner and "not" not in inner and inner["else"]["const"] == says
    original, readable = jsonschema.Draft7Validator(node), jsonschema.Draft7Validator(out)
    for value in ("a", "ab", "b", "abb", "", says):
        instance = {value: 1} if "propertyNames" in node else value
        assert readable.is_valid(instance) == original.is_valid(instance), value


def test_a_pattern_without_words_is_refused():
    with pytest.raises(ValueError, match="registry has a pattern and no x-hint"):
        schema.readable_patterns({"properties": {"registry": {"pattern": "^a$"}}}, None, "values")
