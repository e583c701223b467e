"""`metax-operator validate`: check chart values offline, as `helm install` would, with better words.

    metax-operator validate [-f FILE]... [--set K=V]... [--set-string K=V]... [--set-json K=JSON]...
                            [--set-literal K=V]... [--set-file K=FILE]... [--chart DIR] [--helm PATH]

Helm itself merges the values: the chart's values.yaml, then the files and flags, exactly as
`helm install` takes them (`helm template` of a chart holding only the chart's Chart.yaml and
values.yaml and one template printing `.Values` as JSON, the way the hook values ConfigMap
does). Then `validation.values_problems` checks them, as the pre-install hook does: the schema,
then the cross-field rules. Values that pass are rendered with the chart too, so that `validate`
never accepts what the chart refuses; Helm's own errors are shown one line each.

Before Helm reads a values file, `validate` refuses what Helm takes silently: a key repeated in
a mapping (Helm keeps the last), several YAML documents (Helm 3 reads the first, Helm 4 the
last); and text that is not UTF-8 or nested too deeply to parse.

Helm is `--helm PATH`, else $HELM_BIN (what Helm sets for its plugins), else `helm` on PATH.
One line per problem, naming the field (or file and line) and the fix; exit 1. Exit 0 when valid.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from . import validation
from .errors import UserError, UserErrors
from .schema import REPO_ROOT, load_values_schema
from .yamltext import load_one, read_text

#: Helm's value flags, passed to Helm as given (Helm applies them in its own order).
SET_FLAGS = ("set", "set-string", "set-json", "set-literal", "set-file")
RELEASE, NAMESPACE = "metax", "metax-operator"
#: Seconds one `helm template` may take.
HELM_TIMEOUT = 120
VALUES_TEMPLATE = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: values
data:
  values.json: {{ toJson .Values | quote }}
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser("validate", help="check chart values offline (schema and cross-field rules)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("-f", "--values", action="append", default=[], metavar="FILE",
                        help="a values file, as helm -f takes it (repeatable; later files win)")
    for flag in SET_FLAGS:
        parser.add_argument(f"--{flag}", action="append", default=[], metavar="KEY=VALUE",
                            help=f"as helm --{flag} takes it (repeatable)")
    parser.add_argument("--chart", default=str(REPO_ROOT), help="the chart directory (default: this repo)")
    parser.add_argument("--helm", default=None, metavar="PATH",
                        help="the helm binary (default: $HELM_BIN, else helm on PATH)")
    parser.set_defaults(func=run)


def run(args) -> int:
    chart = chart_dir(args.chart)
    helm = find_helm(args.helm)
    with tempfile.TemporaryDirectory(prefix="metax-validate-") as tmp:
        flags = values_flags(args, Path(tmp))
        values = merged_values(chart, flags, helm)
        errors = validation.values_problems(values, load_values_schema(chart))
        if not errors:
            errors = render_problems(chart, flags, helm)
    if errors:
        raise UserErrors(errors)
    print("values are valid")
    return 0


def chart_dir(name: str) -> Path:
    path = Path(name)
    if not (path / "Chart.yaml").is_file():
        raise UserError("--chart", f"{name} is not a chart directory (no Chart.yaml)",
                        "pass --chart with the metax-operator chart's directory")
    return path


def find_helm(explicit: str | None) -> str:
    """The helm binary: `explicit`, else $HELM_BIN, else `helm` on PATH."""
    if explicit:
        source, name = "--helm", explicit
    elif os.environ.get("HELM_BIN"):
        source, name = "$HELM_BIN", os.environ["HELM_BIN"]
    else:
        source, name = "helm", "helm"
    found = shutil.which(name)
    if found is None:
        problem = "is not on PATH" if source == "helm" else f"{name} is not an executable file"
        raise UserError(source, problem, "install Helm 3 (3.18 or later) or Helm 4, or pass --helm PATH "
                                         "(or set $HELM_BIN)")
    return found


def values_flags(args, tmp: Path) -> list[str]:
    """The helm flags for the user's files (each checked first) and --set* flags."""
    errors: list[UserError] = []
    flags: list[str] = []
    for name in args.values:
        try:
            flags += ["--values", checked_values_file(name, tmp)]
        except UserErrors as err:
            errors += err.errors
        except UserError as err:
            errors.append(err)
    if errors:
        raise UserErrors(errors)
    for flag in SET_FLAGS:
        for value in getattr(args, flag.replace("-", "_")):
            flags += [f"--{flag}", value]
    return flags


def checked_values_file(name: str, tmp: Path) -> str:
    """The path Helm should read for `-f name` (`-`: stdin), after refusing what Helm would take
    silently (yamltext.load_one)."""
    if "://" in name:
        raise UserError(f"-f {name}", "is a URL", "download it first: validate reads local files only")
    text = read_text(name, "check the path")
    where = "stdin" if name == "-" else name
    if not isinstance(load_one(text, where), (dict, type(None))):
        raise UserError(where, "must be a mapping of values", "write `key: value` lines at the top level")
    if name != "-":
        return name
    copy = tmp / "stdin-values.yaml"
    copy.write_text(text)
    return str(copy)


def merged_values(chart: Path, flags: list[str], helm: str) -> dict:
    """The values Helm gives the chart's templates for `flags`, as the hook ConfigMap holds them."""
    with tempfile.TemporaryDirectory(prefix="metax-values-") as tmp:
        dump = Path(tmp) / "chart"
        (dump / "templates").mkdir(parents=True)
        for name in ("Chart.yaml", "values.yaml"):
            shutil.copyfile(chart / name, dump / name)
        (dump / "templates" / "values.yaml").write_text(VALUES_TEMPLATE)
        output = _helm(helm, "template", RELEASE, str(dump), "--namespace", NAMESPACE, *flags)
    document = next(d for d in yaml.safe_load_all(output) if d)
    return json.loads(document["data"]["values.json"])


def render_problems(chart: Path, flags: list[str], helm: str) -> list[UserError]:
    """What `helm template` of the chart says about the values (none when it renders)."""
    try:
        _helm(helm, "template", RELEASE, str(chart), "--namespace", NAMESPACE, *flags)
    except UserErrors as err:
        return err.errors
    return []


def _helm(helm: str, *args: str) -> str:
    try:
        result = subprocess.run([helm, *args], capture_output=True, text=True, errors="replace",
                                timeout=HELM_TIMEOUT)
    except OSError as err:
        raise UserError("--helm", f"cannot run {helm}: {err.strerror}", "pass --helm with a Helm binary") from None
    except subprocess.TimeoutExpired:
        raise UserError("helm template", f"did not finish within {HELM_TIMEOUT} s",
                        "check the values files and flags") from None
    if result.returncode:
        raise UserErrors(helm_problems(result.stderr or result.stdout))
    return result.stdout


# Helm 3 (gojsonschema) `- a.b.0.c: message`; Helm 4 (santhosh-tekuri) `- at '/a/b/0/c': message`.
_SCHEMA_LINE = re.compile(r"^\s*- (?:at '(?P<pointer>[^']*)'|(?P<dotted>[^:]+)): (?P<message>.*)$")


def helm_problems(stderr: str) -> list[UserError]:
    """Helm's error output as one UserError per problem: the chart's rules (already `field:
    problem; fix` lines), schema violations (their field in our spelling), else Helm's first line."""
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("Use --debug")]
    for i, line in enumerate(lines):
        if line.rstrip().endswith("invalid values:"):  # _validations.tpl's `fail`
            return [UserError(*rule.partition(": ")[::2]) for rule in lines[i + 1:]]
    schema = [m for m in map(_SCHEMA_LINE.match, lines) if m]
    if schema:
        return [UserError(_field(m["pointer"], m["dotted"]), m["message"], "see docs/validation.md") for m in schema]
    first = lines[0].removeprefix("Error: ") if lines else "failed without a message"
    return [UserError("helm", first, "fix the values or flags Helm names")]


def _field(pointer: str | None, dotted: str | None) -> str:
    """`/a/b/0/c` or `a.b.0.c` -> `a.b[0].c`; the whole values -> `values`."""
    parts = [p for p in (pointer.split("/") if pointer is not None else dotted.split(".")) if p]
    if parts in ([], ["(root)"]):
        return "values"
    return validation.field_path("", [int(p) if p.isdigit() else p for p in parts])
