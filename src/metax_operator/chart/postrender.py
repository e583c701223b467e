"""The Helm post-renderer: applies the podTemplateSpec rules (`merge`) at render time.

Helm 3 runs `postrender/metax-postrender` (`--post-renderer ./postrender/metax-postrender`);
Helm 4 runs the same executable as the `metax-postrender` plugin (`postrender/plugin.yaml`,
`--post-renderer metax-postrender`). Both pipe the rendered manifests through stdin/stdout.

Contract with the chart: every component DaemonSet carries the annotations
- `gpu.metax-tech.com/component`: its values key (`maca`, `driver`, ...);
- `gpu.metax-tech.com/scheduling-base`: compact JSON of the pod template's `nodeSelector`,
  `affinity`, `tolerations` as the chart renders them before any merge (absent keys: none);
- `gpu.metax-tech.com/scheduling-inputs`: compact JSON `{"global": <podTemplateSpec or null>,
  "component": <<key>.podTemplateSpec or null>, "tolerations": <deprecated tolerations or null>}`.
For each, `spec.template.spec.{nodeSelector,affinity,tolerations}` becomes
merge(base, inputs), except in a DaemonSet whose `gpu.metax-tech.com/shared-fields` annotation is
`live`: the chart rendered those fields as the installed DaemonSet holds them, which the runner
keeps as the CR says; because the base comes from the annotation, a second run gives the
same bytes. Every other document, and every DaemonSet whose fields are already right,
passes through as the exact text it came in (separators and `# Source:` comments too).
In a changed DaemonSet only the text of the changed fields is rewritten (`_splice`), so every
other byte, comment and key order stays. One way of editing: the parser's marks locate a node's
text, and new text replaces it. A block-style pod spec gets each changed field replaced by its
lines; a flow-style pod spec (`spec: {...}`), whose fields share one line, is replaced as one node
by the new pod spec in flow style (key order kept; the text outside the braces, comments
included, stays). A round-trip YAML library would keep a flow spec's own quoting too, but at
a price: ruamel.yaml's round trip of every changed DaemonSet took 220 ms against 12.8 ms for the
splice (median CPU time in process, the seed example's render, 17x), for a case the chart never
renders, and a second YAML dependency.

Speed: documents are found by a substring test for the inputs annotation before any
parsing; candidates are parsed with PyYAML's C loader, whose node marks locate the lines
to edit. Nothing else is imported on this path (no argparse, dataclasses or
kubernetes client), since it runs inside every `helm template`.

A candidate is refused, not parsed, when it is nested too deeply for the C parser (which would
crash with SIGSEGV), and refused after parsing when a mapping repeats a key (`yamltext`).

Errors name the document (kind/name and its `# Source:` file) and the field. Helm 3 shows
our stderr; Helm 4 throws a plugin's stderr away and prints only "plugin exited with
error", so the plugin runs with `--error-document`: on error it exits 0 and outputs one
document that Helm 4 refuses with a message quoting our text (see `error_document`).
"""

from __future__ import annotations

import json
import re
import sys

from metax_operator.chart.merge import MANAGED_FIELDS, inputs_from_annotations, merge_scheduling
from metax_operator.contract import SCHEDULING_INPUTS_ANNOTATION, SHARED_FIELDS_ANNOTATION
from metax_operator.errors import UserError, UserErrors
from metax_operator.lookup import lookup
from metax_operator.yamltext import duplicate_keys, nesting_problem

# A YAML document marker at the start of a line (`---`, `--- # c`, `--- |`), with its line end.
_SEPARATOR = re.compile(r"^---(?=[ \t\r\n]|$)[^\n]*(?:\n|$)", re.MULTILINE)
_SOURCE = re.compile(r"^# Source: (.+)$", re.MULTILINE)
_HELM4_FILENAME = "postrenderer.helm.sh/postrender-filename"
# How far a block sequence's dash sits right of its parent key ("key:\n  - a" is 2).
_SEQUENCE_OFFSET = re.compile(r"^( *)[^\s#-][^\n]*:[ \t]*\n( *)- ", re.MULTILINE)


def split_documents(text: str) -> list[str]:
    """Cut the stream before each document marker; the pieces join back to `text` exactly."""
    cuts = [m.start() for m in _SEPARATOR.finditer(text)]
    if not cuts or cuts[0] != 0:
        cuts.insert(0, 0)
    return [text[start:end] for start, end in zip(cuts, cuts[1:] + [len(text)], strict=True)]


def postrender(text: str) -> tuple[str, list[str]]:
    """The post-rendered stream and the notices for the user; UserErrors for every bad document."""
    pieces, notices, errors, reported = [], [], [], set()
    for piece in split_documents(text):
        marker = _SEPARATOR.match(piece)
        head = marker.group(0) if marker else ""
        try:
            new_body, doc_notices = render_document(piece[len(head) :])
        except UserError as err:
            for one in getattr(err, "errors", [err]):
                if str(one) not in reported:  # a bad global input is reported once, not per DaemonSet
                    reported.add(str(one))
                    errors.append(_located(one, describe(piece)))
            continue
        pieces.append(piece if new_body is None else head + new_body)
        notices.extend(n for n in doc_notices if n not in notices)
    if errors:
        raise errors[0] if len(errors) == 1 else UserErrors(errors)
    return "".join(pieces), notices


def render_document(body: str) -> tuple[str | None, list[str]]:
    """The new text of one document, or None when it passes through unchanged."""
    if SCHEDULING_INPUTS_ANNOTATION not in body:
        return None, []
    import yaml

    if problem := nesting_problem(body):
        raise UserError("", problem, "fix the template or values that produced it")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(body)
    try:
        root = loader.get_single_node()
        if root is not None:
            repeated = [
                UserError(
                    f"line {line}",
                    f"key {key!r} is repeated (first at line {first})",
                    "remove one of them: YAML forbids duplicate keys and Helm keeps only the last",
                )
                for key, line, first in duplicate_keys(root)
            ]
            if repeated:
                raise repeated[0] if len(repeated) == 1 else UserErrors(repeated)
        doc = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as err:
        raise UserError(
            "", f"is not valid YAML: {err}".replace("\n", " "), "fix the template or values that produced it"
        ) from None
    finally:
        loader.dispose()
    annotations = lookup(doc, "metadata", "annotations")
    if lookup(doc, "kind") != "DaemonSet" or not isinstance(annotations, dict) or SCHEDULING_INPUTS_ANNOTATION not in annotations:
        return None, []
    if annotations.get(SHARED_FIELDS_ANNOTATION) == "live":  # the runner's, as the live DaemonSet holds them
        return None, []
    result, notices = merge_scheduling(inputs_from_annotations(annotations))
    pod_spec = lookup(doc, "spec", "template", "spec")
    if not isinstance(pod_spec, dict):
        raise UserError("spec.template.spec", "is missing", "render the DaemonSet with the metax-operator chart")
    current = {key: pod_spec[key] for key in MANAGED_FIELDS if key in pod_spec}
    if current == result:
        return None, notices
    pod_node = _child(root, "spec", "template", "spec")
    if pod_node.flow_style:
        return _replace_flow(body, pod_node, pod_spec, result), notices
    return _splice(body, pod_node, current, result), notices


def _line_starts(body: str) -> list[int]:
    """The offset of each line of `body` (a mark's line and column give `starts[line] + column`)."""
    starts = [0]
    for line in body.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _splice(body: str, pod_node, current: dict, result: dict) -> str:
    """`body` with the changed scheduling fields of the (block-style) pod spec replaced in the text.

    Only the lines of a changed field are rewritten; every other byte, comments and key order
    included, stays: a round-trip YAML library's guarantee without its cost (a pure-Python parse
    of every changed DaemonSet), which inside `helm template` was most of our time.
    """
    starts = _line_starts(body)

    def end_of(node) -> int:
        """Where the text of `node` ends: the end of its last line, a trailing comment included."""
        while isinstance(node.value, list) and node.value and not node.flow_style:
            node = node.value[-1][1] if isinstance(node.value[-1], tuple) else node.value[-1]
        at = starts[node.end_mark.line] + node.end_mark.column
        if getattr(node, "style", None) in ("|", ">"):  # a block scalar ends past its line break
            return len(body[:at].rstrip("\n"))
        found = body.find("\n", at)
        return len(body) if found < 0 else found

    indent = " " * pod_node.value[0][0].start_mark.column
    guess = _SEQUENCE_OFFSET.search(body)
    indented = bool(guess) and len(guess.group(2)) > len(guess.group(1))  # "key:\n  - a", not "key:\n- a"
    entries = {key.value: (key, value) for key, value in pod_node.value}
    edits, inserted = [], ""
    for field in MANAGED_FIELDS:
        if field in entries and current.get(field) != result.get(field):
            key, value = entries[field]
            start, end = starts[key.start_mark.line] + key.start_mark.column, end_of(value)
            if field in result:
                own_style = value.tag.endswith(":seq") and not value.flow_style  # keep this list's own style
                style = value.start_mark.column > key.start_mark.column if own_style else indented
                edits.append((start, end, _block_text(field, result[field], indent, style)[len(indent) :]))
            else:  # the whole lines go
                edits.append((starts[key.start_mark.line], min(end + 1, len(body)), ""))
        elif field in result and field not in entries:
            inserted += "\n" + _block_text(field, result[field], indent, indented)
    if inserted:
        at = end_of(pod_node.value[-1][1])
        edits.append((at, at, inserted))
    for start, end, text in sorted(edits, reverse=True):
        body = body[:start] + text + body[end:]
    return body


def _block_text(field: str, value: object, indent: str, indented_sequences: bool) -> str:
    """`field: value` in block style, each line indented by `indent`."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def increase_indent(self, flow=False, indentless=False):
            return super().increase_indent(flow, indentless and not indented_sequences)

    text = yaml.dump({field: value}, Dumper=Dumper, default_flow_style=False, sort_keys=False, allow_unicode=True, width=1 << 20)
    return "\n".join(indent + line for line in text.rstrip("\n").split("\n"))


def _child(node, *path):
    for key in path:
        node = next(value for k, value in node.value if k.value == key)
    return node


def _replace_flow(body: str, pod_node, pod_spec: dict, result: dict) -> str:
    """`body` with the flow-style pod spec node replaced by the pod spec with `result`'s scheduling
    fields, in flow style: each existing key in its place, new ones last, removed ones gone."""
    import yaml

    new_spec = {
        key: result.get(key) if key in MANAGED_FIELDS else value
        for key, value in pod_spec.items()
        if key not in MANAGED_FIELDS or key in result
    }
    new_spec.update({key: result[key] for key in MANAGED_FIELDS if key in result and key not in new_spec})
    text = yaml.dump(
        new_spec, Dumper=yaml.SafeDumper, default_flow_style=True, sort_keys=False, allow_unicode=True, width=1 << 20
    ).rstrip("\n")
    starts = _line_starts(body)
    start = starts[pod_node.start_mark.line] + pod_node.start_mark.column
    end = starts[pod_node.end_mark.line] + pod_node.end_mark.column
    return body[:start] + text + body[end:]


def describe(piece: str) -> str:
    """`DaemonSet/metax-maca (chart/templates/maca.yaml)`: kind/name and source, read from the text
    (it may not parse)."""

    def first(key: str) -> str | None:
        found = re.search(rf"""(?:^|[{{,\s])['"]?{re.escape(key)}['"]?:[ \t]*['"]?([^'",}}\s#]+)""", piece, re.MULTILINE)
        return found.group(1) if found else None

    source = _SOURCE.search(piece)
    where = source.group(1).strip() if source else first(_HELM4_FILENAME)
    text = f"{first('kind') or 'document'}/{first('name') or '?'}"
    return f"{text} ({where})" if where else text


def error_document(message: str) -> str:
    """One document Helm 4 cannot sort, so that it prints `message` in its own error.

    Helm 4 (4.1.4) files each post-rendered document under its
    `postrenderer.helm.sh/postrender-filename` annotation and fails on a document whose
    apiVersion is not a string with "YAML parse error on <that file name>: ...": the file
    name we give is the message.
    """
    name = "metax-postrender failed:\n" + message + "\n(Helm's own words follow)"
    return (
        "apiVersion: {error: metax-postrender failed, see the message}\n"
        "kind: MetaxPostRenderError\n"
        "metadata:\n"
        "  name: metax-postrender-error\n"
        "  annotations:\n"
        f"    {_HELM4_FILENAME}: {json.dumps(name)}\n"
    )


def _located(err: UserError, where: str) -> UserError:
    return UserError(f"{where}: {err.field}" if err.field else where, err.problem, err.fix)


ERROR_DOCUMENT_FLAG = "--error-document"


def run(error_document_mode: bool = False) -> int:
    """Filter stdin to stdout; with `error_document_mode` an error becomes `error_document`."""
    try:
        try:
            text = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError("stdin", f"is not UTF-8 text ({err})", "pass the output of helm template") from None
        output, notices = postrender(text)
    except UserError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        if error_document_mode:
            sys.stdout.write(error_document(str(err)))
            return 0
        return 1
    for notice in notices:
        print(f"warning: {notice}", file=sys.stderr)
    sys.stdout.buffer.write(output.encode("utf-8"))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "postrender", help="the Helm post-renderer (stdin to stdout)", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        ERROR_DOCUMENT_FLAG,
        action="store_true",
        dest="error_document",
        help="on error, exit 0 and output a document that makes Helm 4 print the error "
        "(Helm 4 discards a plugin's stderr); postrender/plugin.yaml sets it",
    )
    parser.set_defaults(func=lambda args: run(args.error_document))


def main(argv: list[str] | None = None) -> int:
    """`python -m metax_operator.chart.postrender [--error-document] [release args...]`.

    What postrender/metax-postrender runs. The arguments are read by hand, not with
    argparse, to keep the start-up inside every `helm template` short; anything else
    (release name/namespace passed as --post-renderer-args) is accepted and not needed,
    since the inputs are in the manifests.
    """
    argv = sys.argv[1:] if argv is None else argv
    return run(ERROR_DOCUMENT_FLAG in argv)


if __name__ == "__main__":
    sys.exit(main())
