"""The chart values a file in a GitOps repository holds, and where each field of them is written.

A file is one of:

- a values file (one YAML document, a mapping): Helm reads it as `-f FILE`;
- Kubernetes manifests (one or several documents), of which these carry the chart's values:
  an Argo CD `Application` (`spec.source`, or each of `spec.sources`, whose chart is this one:
  `helm.valuesObject`, else the YAML text `helm.values`, and `helm.parameters` as `--set`) and a
  Flux `HelmRelease` (`spec.values`). Other objects (a Namespace, a HelmRepository, a release of
  another chart) are skipped.

The documents are parsed once with PyYAML, the parser `validate` already uses for values files: its
composed nodes give the line and column of every key and list item, and it reads YAML 1.1 (`yes`
and `on` are booleans), as the Go YAML library of Helm and Kubernetes does. A second parser for the
positions (ruamel.yaml reads YAML 1.2 by default) could disagree with the first about what a value
is.

`read(path, chart)` returns each `Source` (the values as the text Helm should read, and
`Source.locate` turning a problem's field path into file:line:column) and the file's own
`Problem`s (not YAML, a key repeated, several documents of values, Argo CD's `values` hidden by
`valuesObject`, nothing of this chart in the file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from metax_operator.errors import UserError
from metax_operator.yamltext import duplicate_keys, nesting_problem, read_text

#: The chart's name, as Argo CD's `chart:` and Flux's `chart.spec.chart` name it.
CHART_NAME = "metax-operator"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class Problem:
    """A `UserError` at a place: file, line and column (1-based; None where the file has none)."""

    file: str | None
    line: int | None
    column: int | None
    error: UserError

    @property
    def where(self) -> str:
        return ":".join(str(part) for part in (self.file, self.line, self.column) if part is not None)

    def __str__(self) -> str:
        return f"{self.where}: {self.error}" if self.where else str(self.error)

    def as_dict(self) -> dict:
        return {
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "field": self.error.field,
            "problem": self.error.problem,
            "fix": self.error.fix,
            "message": str(self),
        }


@dataclass(frozen=True)
class Source:
    """One set of chart values in a file."""

    file: str
    what: str  # "values file", "HelmRelease gpu/metax-operator spec.values", ...
    line: int  # where the values are written (their key, or the file's start)
    column: int
    text: str  # the values as the YAML text Helm reads with -f
    flags: tuple[str, ...] = ()  # Helm flags the manifest adds (Argo CD's parameters)
    node: yaml.Node | None = field(default=None, compare=False)  # the values' node, for positions
    offset: tuple[int, int] = (0, 0)  # lines and columns to add to the node's marks
    parameters: tuple[tuple[str, yaml.Node], ...] = field(default=(), compare=False)  # (name, its item)

    def locate(self, error: UserError) -> Problem:
        """`error` at the parameter that sets its field (parameters win over values), else at the
        key or list item its field path names, else at the values themselves (a rule about a field
        the file does not set, such as `registry: is required`)."""
        parameter = next(
            (node for name, node in self.parameters if error.field == name or error.field.startswith((f"{name}.", f"{name}["))),
            None,
        )
        if parameter is not None:
            return Problem(self.file, parameter.start_mark.line + 1, parameter.start_mark.column + 1, error)
        found = _find(self.node, error.field) if self.node is not None else None
        if found is None:
            return Problem(self.file, self.line, self.column, error)
        return Problem(self.file, found.start_mark.line + 1 + self.offset[0], found.start_mark.column + 1 + self.offset[1], error)


@dataclass
class FileValues:
    """What `read` found in one file."""

    sources: list[Source] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # releases of other charts: file, line, what, chart


def read(path: str, chart: str = CHART_NAME) -> FileValues:
    """The values of chart `chart` that the file at `path` holds, and the file's problems."""
    try:
        text = read_text(path, "check the path")
    except UserError as err:
        return FileValues(problems=[Problem(path, None, None, UserError("", err.problem, err.fix))])
    return _Reader(path, text, chart).read()


class _Reader:
    """One file's documents, read into a FileValues."""

    def __init__(self, path: str, text: str, chart: str):
        self.path, self.text, self.chart = path, text, chart
        self.found = FileValues()

    def read(self) -> FileValues:
        documents = self.documents(self.text)
        if documents is None:
            return self.found
        if len(documents) <= 1 and not any(_is_object(data) for _, data in documents):
            node, data = documents[0] if documents else (None, None)
            if isinstance(data, (dict, type(None))):
                self.found.sources.append(Source(self.path, "values file", 1, 1, self.text, node=node))
            else:
                self.problem(None, "values", "must be a mapping of values", "write `key: value` lines at the top level")
            return self.found
        for node, data in documents:
            if not _is_object(data):
                self.problem(
                    node,
                    "document",
                    f"is not a Kubernetes object, and the file holds {len(documents)} YAML documents",
                    "keep chart values in a file of their own, one document: Helm 3 reads the first, Helm 4 the last",
                )
            elif data["apiVersion"].startswith("argoproj.io/") and data["kind"] == "Application":
                self.application(node, data)
            elif data["apiVersion"].startswith("helm.toolkit.fluxcd.io/") and data["kind"] == "HelmRelease":
                self.helm_release(node, data)
        if not self.found.sources and not self.found.problems:
            self.problem(
                None,
                "file",
                f"holds no values of the {self.chart} chart (neither a values file nor "
                f"an Argo CD Application or Flux HelmRelease of chart {self.chart})",
                "give only the files that do (the pre-commit hook's `files:` pattern), or name the chart with --chart-name",
            )
        return self.found

    def documents(
        self, text: str, offset: tuple[int, int] = (0, 0), anchor: yaml.Node | None = None
    ) -> list[tuple[yaml.Node, Any]] | None:
        """Every non-empty document of `text`: its composed node and its value; None, with the
        problems recorded, for text nested too deeply, not YAML, or repeating a key. `text` is
        written `offset` lines and columns into the file, or, when its lines are not the file's
        (a quoted string), at `anchor`, where its problems are reported."""

        def place(line: int, column: int) -> tuple[int, int]:  # 0-based in `text` -> 1-based in the file
            if anchor is not None:
                return anchor.start_mark.line + 1, anchor.start_mark.column + 1
            return line + 1 + offset[0], column + 1 + offset[1]

        if problem := nesting_problem(text):
            self.problem(anchor, "", problem, "flatten it")
            return None
        loader = _LOADER(text)
        documents = []
        try:
            while loader.check_node():
                node = loader.get_node()
                if node is not None:
                    documents.append((node, loader.construct_document(node)))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line, column = place(mark.line, mark.column) if mark else (None, None)
            self.found.problems.append(
                Problem(
                    self.path,
                    line,
                    column,
                    UserError("", f"is not valid YAML: {getattr(err, 'problem', None) or err}", "fix the YAML syntax"),
                )
            )
            return None
        finally:
            loader.dispose()
        repeated = [(key, line, first) for node, _ in documents for key, line, first in duplicate_keys(node)]
        for key, line, first in repeated:
            line, column = place(line - 1, 0)
            if anchor is None:
                column = self.indent(line, item=True) + 1
            self.found.problems.append(
                Problem(
                    self.path,
                    line,
                    column,
                    UserError(
                        "",
                        f"key {key!r} is repeated (first at line {place(first - 1, 0)[0]})",
                        "remove one of them: a parser would keep only the last, silently",
                    ),
                )
            )
        return None if repeated else documents

    def application(self, node: yaml.Node, data: dict) -> None:
        """The values of each of the Application's sources whose chart is this one:
        `helm.valuesObject`, else `helm.values` (Argo CD reads one: a `values` beside a
        `valuesObject` is never read), then `helm.parameters` (Helm's --set, which win)."""
        spec = data.get("spec") if isinstance(data.get("spec"), dict) else {}
        name = _name(data)
        if isinstance(spec.get("sources"), list):
            sources = [(f"spec.sources[{i}]", ["spec", "sources", i], s) for i, s in enumerate(spec["sources"])]
        else:
            sources = [("spec.source", ["spec", "source"], spec.get("source"))]
        for where, keys, source in sources:
            if not isinstance(source, dict) or ("ref" in source and not {"helm", "chart", "path"} & set(source)):
                continue  # a `ref:` source only lends value files to the others
            source_chart = _argo_chart(source)
            if source_chart != self.chart:
                self.skip(node, f"Application {name} {where}", source_chart)
                continue
            source_node = _child(node, keys)
            helm = source.get("helm") if isinstance(source.get("helm"), dict) else {}
            helm_node = _child(source_node, ["helm"])
            flags, parameters = _parameters(helm.get("parameters"), _child(helm_node, ["parameters"]))
            if helm.get("valuesObject") is not None:
                if helm.get("values"):
                    self.problem(
                        _key(helm_node, "values"),
                        f"{where}.helm.values",
                        "is not read by Argo CD when valuesObject is set",
                        "move these values into valuesObject, or remove one of the two",
                    )
                self.add_object(
                    f"Application {name}",
                    f"{where}.helm.valuesObject",
                    _key(helm_node, "valuesObject"),
                    _child(helm_node, ["valuesObject"]),
                    helm["valuesObject"],
                    flags,
                    parameters,
                )
            elif helm.get("values") is not None:
                self.add_text(
                    f"Application {name}",
                    f"{where}.helm.values",
                    _key(helm_node, "values"),
                    _child(helm_node, ["values"]),
                    helm["values"],
                    flags,
                    parameters,
                )
            else:
                self.add_object(
                    f"Application {name}", f"{where} (no helm values)", source_node or node, None, {}, flags, parameters
                )

    def helm_release(self, node: yaml.Node, data: dict) -> None:
        """The HelmRelease's `spec.values` when its chart is this one. (`spec.valuesFrom` names
        ConfigMaps and Secrets in the cluster, which a file cannot show: give them with -f.)"""
        spec = data.get("spec") if isinstance(data.get("spec"), dict) else {}
        name = _name(data)
        release_chart = _flux_chart(spec)
        if release_chart != self.chart:
            self.skip(node, f"HelmRelease {name}", release_chart)
            return
        spec_node = _child(node, ["spec"])
        self.add_object(
            f"HelmRelease {name}",
            "spec.values",
            _key(spec_node, "values") or spec_node or node,
            _child(spec_node, ["values"]),
            spec.get("values") or {},
        )

    def add_object(
        self,
        owner: str,
        field_name: str,
        key: yaml.Node,
        node: yaml.Node | None,
        values: Any,
        flags: tuple[str, ...] = (),
        parameters: tuple = (),
    ) -> None:
        """Values written as YAML inside the manifest: Kubernetes hands them to Helm as JSON."""
        if not isinstance(values, dict):
            self.problem(key, field_name, "must be a mapping of values", "write `key: value` lines under it")
            return
        self.found.sources.append(
            Source(
                self.path,
                f"{owner} {field_name}",
                key.start_mark.line + 1,
                key.start_mark.column + 1,
                json.dumps(values, default=str),
                flags,
                node,
                parameters=parameters,
            )
        )

    def add_text(
        self, owner: str, field_name: str, key: yaml.Node, node: yaml.Node, values: Any, flags: tuple[str, ...], parameters: tuple
    ) -> None:
        """Values written as a YAML string (Argo CD's `helm.values`), which Helm reads as a values
        file. A literal block (`values: |`) keeps its lines, so a field inside it is located
        exactly; the fields of another string (quoted, or a folded `>` block, whose lines are
        joined) are located at the string."""
        if not isinstance(values, str):
            self.problem(key, field_name, "must be a string of YAML values", "write `values: |` and the values under it")
            return
        literal = node.style == "|"
        offset = (node.start_mark.line + 1, self.indent(node.start_mark.line + 2))  # of a literal block's lines
        documents = self.documents(values, offset) if literal else self.documents(values, anchor=key)
        if documents is None:
            return
        if len(documents) > 1:
            self.problem(
                key,
                field_name,
                f"holds {len(documents)} YAML documents",
                "keep one (remove the `---` between them): Helm 3 reads the first, Helm 4 the last",
            )
            return
        inner, data = documents[0] if documents else (None, None)
        if not isinstance(data, (dict, type(None))):
            self.problem(key, field_name, "must be a mapping of values", "write `key: value` lines in it")
            return
        self.found.sources.append(
            Source(
                self.path,
                f"{owner} {field_name}",
                key.start_mark.line + 1,
                key.start_mark.column + 1,
                values,
                flags,
                inner if literal else None,
                offset,
                parameters,
            )
        )

    def indent(self, line: int, item: bool = False) -> int:
        """The indentation of the first non-blank line from `line` (1-based) on, with a list
        item's `- ` when `item`: where a repeated key starts, or the content of a block scalar."""
        first = next((text for text in self.text.splitlines()[line - 1 :] if text.strip()), "")
        return len(first) - len(first.lstrip(" -" if item else " "))

    def skip(self, node: yaml.Node, what: str, chart: str | None) -> None:
        self.found.skipped.append({"file": self.path, "line": node.start_mark.line + 1, "what": what, "chart": chart})

    def problem(self, node: yaml.Node | None, field_name: str, problem: str, fix: str) -> None:
        """A problem at `node` (None: the file's start)."""
        line, column = (node.start_mark.line + 1, node.start_mark.column + 1) if node is not None else (1, 1)
        self.found.problems.append(Problem(self.path, line, column, UserError(field_name, problem, fix)))


def _parameters(parameters: Any, node: yaml.Node | None) -> tuple[tuple[str, ...], tuple[tuple[str, yaml.Node], ...]]:
    """Argo CD's `helm.parameters`: the --set / --set-string flags Argo CD passes Helm, and the
    (name, list item) of each, for positions."""
    items = node.value if node is not None and node.id == "sequence" else []
    if not isinstance(parameters, list) or len(items) != len(parameters):
        return (), ()
    flags, positions = [], []
    for parameter, item in zip(parameters, items, strict=False):
        if isinstance(parameter, dict) and parameter.get("name"):
            flag = "--set-string" if parameter.get("forceString") else "--set"
            flags += [flag, f"{parameter['name']}={parameter.get('value', '')}"]
            positions.append((str(parameter["name"]), item))
    return tuple(flags), tuple(positions)


def _argo_chart(source: dict) -> str | None:
    """The chart an Argo CD source deploys: `chart` (a Helm repository), else the last part of
    `path` (a Git repository), else of an `oci://` repoURL (an OCI source)."""
    if source.get("chart"):
        return str(source["chart"])
    for key in ("path", "repoURL"):
        value = str(source.get(key) or "").rstrip("/")
        if value and value != "." and (key == "path" or value.startswith("oci://")):
            return value.rsplit("/", 1)[-1]
    return None


def _flux_chart(spec: dict) -> str | None:
    """The chart a HelmRelease deploys: `chart.spec.chart` (a name, or a path in a Git or bucket
    source: its last part), else the name of its `chartRef` (an OCIRepository or HelmChart)."""
    chart = spec.get("chart")
    chart_spec = chart.get("spec") if isinstance(chart, dict) and isinstance(chart.get("spec"), dict) else {}
    if chart_spec.get("chart"):
        return str(chart_spec["chart"]).rstrip("/").rsplit("/", 1)[-1]
    reference = spec.get("chartRef")
    return str(reference["name"]) if isinstance(reference, dict) and reference.get("name") else None


def _name(data: dict) -> str:
    metadata = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    return "/".join(str(part) for part in (metadata.get("namespace"), metadata.get("name")) if part) or "(no name)"


def _is_object(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("apiVersion"), str) and isinstance(data.get("kind"), str)


def _key(node: yaml.Node | None, name: str) -> yaml.Node | None:
    """The key node `name` of mapping `node`."""
    if node is None or node.id != "mapping":
        return None
    return next((k for k, _ in node.value if k.id == "scalar" and k.value == name), None)


def _child(node: yaml.Node | None, keys: list) -> yaml.Node | None:
    """The node at `keys` (mapping keys and list indices) under `node`."""
    for key in keys:
        if node is None:
            return None
        if isinstance(key, int):
            node = node.value[key] if node.id == "sequence" and key < len(node.value) else None
        else:
            node = next((v for k, v in node.value if k.id == "scalar" and k.value == key), None) if node.id == "mapping" else None
    return node


def _find(node: yaml.Node, path: str) -> yaml.Node | None:
    """The key or list item that a field path (`a.b[0].c`, as problems.field_path writes it)
    names under `node`, or the deepest of its parents written there; None when not even the first
    is. Keys may hold dots (label keys, node names): the longest key that fits is taken."""
    found, rest = None, path
    while rest and node is not None:
        if rest.startswith("["):
            index, _, rest = rest[1:].partition("]")
            rest = rest.removeprefix(".")
            if node.id != "sequence" or not index.isdigit() or int(index) >= len(node.value):
                break
            node = found = node.value[int(index)]
        elif node.id == "mapping":
            fits = [
                (k, v)
                for k, v in node.value
                if k.id == "scalar" and (rest == k.value or rest.startswith((f"{k.value}.", f"{k.value}[")))
            ]
            if not fits:
                break
            found, node = max(fits, key=lambda kv: len(kv[0].value))
            rest = rest[len(found.value) :].removeprefix(".")
        else:
            break
    return found
