"""`metax-operator validate`: check chart values offline, as `helm install` would, with better words.

    metax-operator validate [FILE]... [-f FILE]... [--set K=V]... [--set-string K=V]...
                            [--set-json K=JSON]... [--set-literal K=V]... [--set-file K=FILE]...
                            [--output text|github|json] [--chart-name NAME] [--chart DIR] [--helm PATH]

Each FILE (what a pre-commit hook or a CI job hands over) is a values file or Kubernetes manifests:
every set of values it holds for this chart (a values file; an Argo CD Application's
`helm.valuesObject` or `helm.values` and `helm.parameters`; a Flux HelmRelease's `spec.values`,
values_sources.py) is checked on its own, over the `-f` files and under the `--set*` flags, and
each problem is reported at the file, line and column of its field. Without FILEs, the `-f` files
and flags are checked together, as one `helm install` takes them.

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
Output (`--output`): `text`, one line per problem on stderr (`FILE:LINE:COLUMN: field: problem;
fix`) and one line per valid source on stdout; `github`, one workflow-command annotation per
problem on stdout; `json`, one object on stdout. Exit 0 when every source is valid, 1 when a
problem was found or nothing could be checked (a bad option, no Helm: one line on stderr).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import yaml

from metax_operator.chart import seed_spellings, validation, values_sources
from metax_operator.chart.problems import field_path
from metax_operator.chart.schema import REPO_ROOT, load_values_defaults, load_values_schema
from metax_operator.errors import UserError, UserErrors
from metax_operator.yamltext import load_one, read_text

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
    parser = subparsers.add_parser(
        "validate", help="check chart values offline (schema and cross-field rules)", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="a values file, or manifests holding Argo CD Applications or Flux HelmReleases of the "
        "chart: each set of values checked on its own, over the -f files and under the flags, "
        "problems reported at FILE:LINE:COLUMN",
    )
    add_values_arguments(parser)
    parser.add_argument(
        "--output", choices=OUTPUTS, default="text", help="text (default), github (workflow-command annotations) or json"
    )
    parser.add_argument(
        "--chart-name",
        default=values_sources.CHART_NAME,
        metavar="NAME",
        help="the chart's name in Applications and HelmReleases (default: %(default)s)",
    )
    parser.set_defaults(func=run)


def add_values_arguments(parser) -> None:
    """The values as `helm install` takes them (-f and the --set* flags), the chart and the Helm
    binary: what every command that has Helm render the chart offline takes."""
    parser.add_argument(
        "-f",
        "--values",
        action="append",
        default=[],
        metavar="FILE",
        help="a values file, as helm -f takes it (repeatable; later files win)",
    )
    for flag in SET_FLAGS:
        parser.add_argument(
            f"--{flag}", action="append", default=[], metavar="KEY=VALUE", help=f"as helm --{flag} takes it (repeatable)"
        )
    parser.add_argument(
        "--chart",
        default=None,
        metavar="DIR",
        help="the chart directory (default: the checkout this command runs from, or the directory "
        "pip installed it from, as a pre-commit hook does)",
    )
    parser.add_argument("--helm", default=None, metavar="PATH", help="the helm binary (default: $HELM_BIN, else helm on PATH)")


def run(args) -> int:
    chart = chart_dir(args.chart)
    helm = find_helm(args.helm)
    with tempfile.TemporaryDirectory(prefix="metax-validate-") as tmp:
        files, sets = values_flags(args, Path(tmp))
        if not args.files:
            errors, notices = checked(chart, helm, [*files, *sets])
            report = Report(
                checked=[] if errors else [{"file": None, "line": None, "column": None, "what": "the -f files and --set flags"}],
                problems=[values_sources.Problem(None, None, None, e) for e in errors],
                notices=[values_sources.Problem(None, None, None, n) for n in notices],
            )
        else:
            report = Report()
            for name in args.files:
                found = values_sources.read(name, args.chart_name)
                report.problems += found.problems
                report.skipped += found.skipped
                for source in found.sources:
                    values = Path(tmp) / "source-values.yaml"
                    values.write_text(source.text)
                    errors, notices = checked(chart, helm, [*files, "--values", str(values), *source.flags, *sets])
                    report.problems += [source.locate(e) for e in errors]
                    report.notices += [source.locate(n) for n in notices]
                    if not errors:
                        report.checked.append(
                            {"file": source.file, "line": source.line, "column": source.column, "what": source.what}
                        )
    return OUTPUTS[args.output](report)


def problems(chart: Path, helm: str, flags: list[str]) -> list[UserError]:
    """What is wrong with the values Helm merges from `flags`: the schema's and the cross-field
    rules' problems, else the render's."""
    return checked(chart, helm, flags)[0]


def checked(chart: Path, helm: str, flags: list[str]) -> tuple[list[UserError], list[UserError]]:
    """`problems`, and the notices of the product manual's spellings the values use (each names
    the chart's key to write)."""
    try:
        values = merged_values(chart, flags, helm)
    except UserErrors as err:
        return err.errors, []
    defaults = load_values_defaults(chart)
    errors = validation.values_problems(values, load_values_schema(chart), defaults)
    notices = seed_spellings.normalise(values, defaults).notices
    return errors or render_problems(chart, flags, helm), notices


@dataclass
class Report:
    """What `validate` found: the sets of values it found valid (file, line, column, what), the
    problems, the notices (the product manual's spellings used: valid, but write the chart's
    key), and the Applications and HelmReleases of other charts it skipped (file, line, what,
    chart)."""

    checked: list[dict] = field(default_factory=list)
    problems: list[values_sources.Problem] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    notices: list[values_sources.Problem] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The valid and skipped sets of values, one line each."""
        return [
            *(
                f"{e['file']}:{e['line']}:{e['column']}: {e['what']}: values are valid" if e["file"] else "values are valid"
                for e in self.checked
            ),
            *(f"{e['file']}:{e['line']}: {e['what']} (chart {e['chart'] or 'not named'}): skipped" for e in self.skipped),
        ]


def text_output(report: Report) -> int:
    for notice in report.notices:
        print(f"warning: {notice}", file=sys.stderr)
    for line in report.lines():
        print(line)
    if report.problems:
        raise UserErrors([UserError("", str(problem)) for problem in report.problems])
    return 0


def github_output(report: Report) -> int:
    """GitHub Actions workflow commands: an `::error` annotation per problem (on the file's line
    and column in the pull request's diff), then the lines of the text output."""
    for problem in report.problems:
        where = {"file": problem.file, "line": problem.line, "col": problem.column}
        properties = ",".join(f"{key}={_escape(str(value), True)}" for key, value in where.items() if value is not None)
        properties += ("," if properties else "") + "title=metax-operator validate"
        print(f"::error {properties}::{_escape(str(problem.error))}")
    for notice in report.notices:
        where = {"file": notice.file, "line": notice.line, "col": notice.column}
        properties = ",".join(f"{key}={_escape(str(value), True)}" for key, value in where.items() if value is not None)
        properties += ("," if properties else "") + "title=metax-operator validate"
        print(f"::warning {properties}::{_escape(str(notice.error))}")
    for line in report.lines():
        print(line)
    return 1 if report.problems else 0


def _escape(text: str, in_property: bool = False) -> str:
    """Text for a workflow command: `%`, CR and LF escaped, and in a property `:` and `,` too."""
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if in_property else text


def json_output(report: Report) -> int:
    print(
        json.dumps(
            {
                "valid": not report.problems,
                "checked": report.checked,
                "skipped": report.skipped,
                "problems": [p.as_dict() for p in report.problems],
                "warnings": [n.as_dict() for n in report.notices],
            },
            indent=2,
        )
    )
    return 1 if report.problems else 0


OUTPUTS = {"text": text_output, "github": github_output, "json": json_output}


def chart_dir(name: str | None) -> Path:
    """The chart `--chart` names, else the chart this package came with."""
    path = Path(name) if name is not None else installed_chart()
    if path is None:
        raise UserError(
            "--chart",
            "is not given, and this installation of metax-operator holds no chart",
            "pass --chart DIR: a checkout of the chart, or the directory `helm pull "
            "oci://DOMAIN/PROJECT/metax-operator --untar` writes",
        )
    if not (path / "Chart.yaml").is_file():
        raise UserError(
            "--chart",
            f"{name} is not a chart directory (no Chart.yaml)",
            "pass --chart with the metax-operator chart's directory",
        )
    return path


def installed_chart() -> Path | None:
    """The chart beside this package: the checkout it runs from, else the directory pip installed
    it from (recorded in the distribution's `direct_url.json`, PEP 610): a pre-commit hook's clone
    of this repository, or a `pip install DIR`."""
    if (REPO_ROOT / "Chart.yaml").is_file():
        return REPO_ROOT
    try:
        origin = json.loads(metadata.distribution("metax-operator").read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        return None
    url = urllib.parse.urlparse(origin.get("url", ""))
    if url.scheme != "file" or "dir_info" not in origin:
        return None
    path = Path(urllib.parse.unquote(url.path))
    return path if (path / "Chart.yaml").is_file() else None


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
        raise UserError(source, problem, "install Helm 3 (3.18 or later) or Helm 4, or pass --helm PATH (or set $HELM_BIN)")
    return found


def values_flags(args, tmp: Path) -> tuple[list[str], list[str]]:
    """The helm flags for the user's -f files (each checked first), and for the --set* flags."""
    errors: list[UserError] = []
    files: list[str] = []
    for name in args.values:
        try:
            files += ["--values", checked_values_file(name, tmp)]
        except UserErrors as err:
            errors += err.errors
        except UserError as err:
            errors.append(err)
    if errors:
        raise UserErrors(errors)
    sets = [item for flag in SET_FLAGS for value in getattr(args, flag.replace("-", "_")) for item in (f"--{flag}", value)]
    return files, sets


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
        render(chart, flags, helm)
    except UserErrors as err:
        return err.errors
    return []


def render(chart: Path, flags: list[str], helm: str) -> str:
    """`helm template` of the chart for `flags`, hooks and test pods included; Helm's errors raised
    as UserErrors."""
    return _helm(helm, "template", RELEASE, str(chart), "--namespace", NAMESPACE, *flags)


def _helm(helm: str, *args: str) -> str:
    try:
        result = subprocess.run([helm, *args], capture_output=True, text=True, errors="replace", timeout=HELM_TIMEOUT)
    except OSError as err:
        raise UserError("--helm", f"cannot run {helm}: {err.strerror}", "pass --helm with a Helm binary") from None
    except subprocess.TimeoutExpired:
        raise UserError("helm template", f"did not finish within {HELM_TIMEOUT} s", "check the values files and flags") from None
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
            return [UserError(*rule.partition(": ")[::2]) for rule in lines[i + 1 :]]
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
    return field_path("", [int(p) if p.isdigit() else p for p in parts])
