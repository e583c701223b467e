"""JSON-schema problems as `UserError`s: one per problem, naming the field path and the fix.

What every check of a document against (a fragment of) the values schema reports through: the
values themselves, the ClusterOperator spec, `driver.upgradePolicy` on its own (`rollout
simulate`), the ConfigMaps' contents. Patterns are matched with RE2, the syntax of Go's regexp
that Helm and the components use (the `google-re2` wheel): Python's `re` would also accept a
trailing newline before `$`, Unicode digits for `\\d`, lookarounds and backreferences.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping

import jsonschema
import re2

from metax_operator.errors import UserError

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


def regex_problem(pattern: str) -> str | None:
    """Why `pattern` is not a valid RE2 (Go) regular expression, or None."""
    try:
        re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as err:
        detail = err.args[0] if err.args else ""
        return detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
    return None


def schema_problems(instance: Any, schema: Mapping, prefix: str = "") -> list[UserError]:
    """Validate `instance` against a draft-07 schema; one `UserError` per problem, naming the
    field path under `prefix` and, where the schema has an `x-hint`, the valid values."""
    validator = _Draft7Re2(schema, format_checker=_FORMATS)
    errors = sorted(validator.iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path])
    out: list[UserError] = []
    for error in errors:
        out += _describe(error, prefix)
    return out


_FORMATS = jsonschema.FormatChecker(formats=())


@functools.lru_cache(maxsize=None)
def _re2(pattern: str):
    return re2.compile(pattern, _RE2_OPTIONS)


def _re2_pattern(validator, pattern: str, instance: Any, schema: Mapping):
    """`pattern` matched as Helm matches it, with Go's regexp syntax (RE2): Python's `re` would
    also accept a trailing newline before `$`, and Unicode digits for `\\d`."""
    if validator.is_type(instance, "string") and not _re2(pattern).search(instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_Draft7Re2 = jsonschema.validators.extend(jsonschema.Draft7Validator, {"pattern": _re2_pattern})


@_FORMATS.checks("regex", raises=ValueError)
def _is_re2(value: Any) -> bool:
    problem = isinstance(value, str) and regex_problem(value)
    if problem:
        raise ValueError(problem)
    return True


def field_path(prefix: str, path: Iterable) -> str:
    """("vfioConfig", 1, "nodeName") under "vfioManager" → "vfioManager.vfioConfig[1].nodeName"."""
    out = prefix
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _describe(error: jsonschema.ValidationError, prefix: str) -> list[UserError]:
    field = field_path(prefix, error.absolute_path)
    value, schema, kind = error.instance, error.schema, error.validator
    hint = schema.get("x-hint")
    if kind in ("anyOf", "oneOf"):
        deeper = [e for e in error.context if len(e.absolute_path) > len(error.absolute_path)]
        if deeper and isinstance(value, (list, dict)):  # e.g. a bad item in a list of tolerations
            return _describe(jsonschema.exceptions.best_match(deeper), prefix)
        return [UserError(field, f"{value!r} is not valid", f"use {hint}" if hint else error.message)]
    if kind == "additionalProperties" and "patternProperties" in schema:  # keys are node names
        return [
            UserError(field_path(field, [key]), "is not a valid node name", f"use {hint}")
            for key in sorted(value)
            if not any(re2.search(p, key) for p in schema["patternProperties"])
        ]
    if kind == "additionalProperties":
        allowed = ", ".join(schema.get("properties", {}))
        return [
            UserError(
                field_path(field, [key]),
                "is not a known option",
                f"remove it; {hint}" if hint else f"remove it (known: {allowed})",
            )
            for key in sorted(set(value) - set(schema.get("properties", {})))
        ]
    if kind == "required":
        missing = [key for key in error.validator_value if key not in value]
        return [UserError(field_path(field, [key]), "is required", f"set {key}") for key in missing]
    if kind == "enum":
        choices = ", ".join(str(c) for c in error.validator_value)
        return [UserError(field, f"{value!r} is not one of {choices}", "use one of them")]
    if kind == "type":
        wanted = error.validator_value
        wanted = " or ".join(wanted) if isinstance(wanted, list) else wanted
        return [
            UserError(
                field,
                f"must be {_a(wanted)}, not {_json_kind(value)} {value!r}",
                f"use {hint}" if hint else f"write {_a(wanted)}",
            )
        ]
    if kind == "format" and error.validator_value == "regex":
        return [
            UserError(
                field,
                f"{value!r} is not a valid regular expression: {error.cause}",
                f"use {hint}" if hint else "write it in Go (RE2) syntax",
            )
        ]
    if kind in ("minimum", "maximum"):
        word = "at least" if kind == "minimum" else "at most"
        fix = f"use {hint}" if hint else f"use a number {word} {error.validator_value}"
        return [UserError(field, f"{value!r} is out of range", fix)]
    if hint:
        return [UserError(field, f"{value!r} is not valid", f"use {hint}")]
    return [UserError(field, f"{value!r} is not valid: {error.message}")]


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _json_kind(value: Any) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "list",
        dict: "mapping",
        type(None): "null",
    }.get(type(value), type(value).__name__)
