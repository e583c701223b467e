"""`metax-operator validate`: check chart values offline, as `helm install` would, with better words.

    metax-operator validate -f my-values.yaml [-f more.yaml] [--set k=v] [--set-string k=v]
                            [--set-file k=FILE] [--chart DIR]

Merges the chart's values.yaml with the files and `--set` flags the way Helm does (later wins;
maps merge key by key; lists are replaced; `null` removes a default), checks the result against
values.schema.json, then against the cross-field rules of `validation`. Prints one line per
problem, naming the field and the fix, and exits 1; exits 0 when the values are valid.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from . import validation
from .errors import UserError, UserErrors
from .schema import REPO_ROOT, load_values_schema


def register(subparsers) -> None:
    parser = subparsers.add_parser("validate", help="check chart values offline (schema and cross-field rules)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("-f", "--values", action="append", default=[], metavar="FILE",
                        help="a values file (repeatable; later files win)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a value as helm --set takes it (typed: true/false/null/integers)")
    parser.add_argument("--set-string", action="append", default=[], metavar="KEY=VALUE",
                        help="a value kept as a string")
    parser.add_argument("--set-file", action="append", default=[], metavar="KEY=FILE",
                        help="a value read from a file, e.g. --set-file tolerations=FILE")
    parser.add_argument("--chart", default=str(REPO_ROOT), help="the chart directory (default: this repo)")
    parser.set_defaults(func=run)


def run(args) -> int:
    chart = Path(args.chart)
    values = merged_values(chart, args.values, args.set, args.set_string, args.set_file)
    errors = validation.schema_problems(values, load_values_schema(chart))
    if not errors:  # the rules assume the schema's shapes, as the render does
        errors = validation.values_problems(values)
    if errors:
        raise UserErrors(errors)
    print("values are valid")
    return 0


def merged_values(chart: Path, files: list[str], sets: list[str] = (), set_strings: list[str] = (),
                  set_files: list[str] = ()) -> dict:
    """The chart's defaults with the user's files and flags applied, in Helm's order."""
    values = _load(chart / "values.yaml")
    for name in files:
        values = coalesce(values, _load(Path(name)))
    for flag, typed in [(s, True) for s in sets] + [(s, False) for s in set_strings]:
        for key, value in parse_set(flag, typed):
            values = coalesce(values, _nested(key, value))
    for flag in set_files:
        key, _, name = flag.partition("=")
        try:
            values = coalesce(values, _nested(key, Path(name).read_text()))
        except OSError as err:
            raise UserError(f"--set-file {flag}", f"cannot read {name}: {err.strerror}", "check the path") from None
    return values


def _load(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise UserError(str(path), f"cannot be read: {err.strerror}", "check the path") from None
    except yaml.YAMLError as err:
        raise UserError(str(path), f"is not valid YAML: {err}".replace("\n", " "), "fix the file") from None
    if data is not None and not isinstance(data, dict):
        raise UserError(str(path), "must be a mapping of values", "write `key: value` lines at the top level")
    return data or {}


# --- helm --set syntax (strvals): `a.b[0].c=v,d={x,y}`; backslash escapes the next character ---

_INT = re.compile(r"^-?[1-9][0-9]*$")


def parse_set(flag: str, typed: bool = True) -> list[tuple[list, Any]]:
    """The (key path, value) pairs of one `--set` argument."""
    out = []
    for assignment in _split(flag, ",", braces=True):
        key, sep, raw = _partition_unescaped(assignment, "=")
        if not sep:
            raise UserError(f"--set {flag}", f"{assignment!r} has no `=`", "write KEY=VALUE")
        if raw.startswith("{") and raw.endswith("}"):
            value: Any = [_typed(v, typed) for v in _split(raw[1:-1], ",")] if raw != "{}" else []
        else:
            value = _typed(raw, typed)
        out.append((_key_path(key, flag), value))
    return out


def _split(text: str, sep: str, braces: bool = False) -> list[str]:
    """Split on `sep` outside escapes (and braces); escapes are kept for the next stage."""
    parts, current, depth, i = [], "", 0, 0
    while i < len(text):
        char = text[i]
        if char == "\\" and i + 1 < len(text):
            current += text[i:i + 2]
            i += 2
            continue
        if braces and char in "{}":
            depth += 1 if char == "{" else -1
        if char == sep and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
        i += 1
    return parts + [current]


def _partition_unescaped(text: str, sep: str) -> tuple[str, str, str]:
    parts = _split(text, sep)
    return (parts[0], sep, sep.join(parts[1:])) if len(parts) > 1 else (text, "", "")


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def _typed(raw: str, typed: bool) -> Any:
    value = _unescape(raw)
    if not typed:
        return value
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "null":
        return None
    if value == "0" or _INT.match(value):
        return int(value)
    return value


def _key_path(key: str, flag: str) -> list:
    path: list = []
    for part in _split(key, "."):
        match = re.fullmatch(r"(.*?)((?:\[\d+\])*)", part)
        name, indexes = match.group(1), match.group(2)
        if not name:
            raise UserError(f"--set {flag}", f"key {key!r} has an empty part", "write a.b[0].c=VALUE")
        path.append(_unescape(name))
        path += [int(i) for i in re.findall(r"\[(\d+)\]", indexes)]
    return path


def _nested(path: list | str, value: Any) -> dict:
    """{a: {b: [None, {c: value}]}} for the path a.b[1].c; list items merge as maps do."""
    if isinstance(path, str):
        path = _key_path(path, path)
    return _build(path, value)


def _build(path: list, value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        return _IndexedList(head, _build(rest, value))
    return {head: _build(rest, value)}


class _IndexedList(dict):
    """One item of a list set by index (`a[1]=x`): merged into the existing list, not replacing it."""

    def __init__(self, index: int, item: Any):
        super().__init__()
        self.index, self.item = index, item


def coalesce(base: Any, override: Any) -> Any:
    """Helm's merge of user values over defaults: maps key by key, `null` deletes, `a[i]` sets one item."""
    if isinstance(override, _IndexedList):
        items = list(base) if isinstance(base, list) else []
        items += [None] * (override.index + 1 - len(items))
        items[override.index] = coalesce(items[override.index], override.item)
        return items
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return override
    out = dict(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = coalesce(base.get(key), value)
    return out
