"""Property: in any values written as YAML (block or flow style, in a values file or a HelmRelease's
`spec.values`), `Source.locate` puts each field at the line and column where its key (or, for a
list item, the item) is written, found here by reading the text at that place."""

from __future__ import annotations

import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from metax_operator.chart import values_sources
from metax_operator.chart.problems import field_path
from metax_operator.errors import UserError

# Keys as the chart's are (names, label keys with dots and slashes, node names with dashes).
keys = st.from_regex(r"[a-z][a-z0-9./-]{0,7}", fullmatch=True).filter(lambda k: not k.endswith((".", "/")))
scalars = st.one_of(st.integers(-5, 5), st.booleans(), st.text("ab1 :%#", max_size=4), st.none())


def _unambiguous(mapping: dict) -> bool:
    """No key is another's prefix followed by a dot: `a` beside `a.b` makes `a.b.c` ambiguous."""
    return not any(other.startswith(f"{key}.") for key in mapping for other in mapping)


values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3), st.dictionaries(keys, children, min_size=1, max_size=3).filter(_unambiguous)
    ),
    max_leaves=12,
)


def paths(node, prefix=()) -> list[tuple]:
    """Every key path and list index path under `node`."""
    found = []
    if isinstance(node, dict):
        for key, child in node.items():
            found += [(*prefix, key), *paths(child, (*prefix, key))]
    elif isinstance(node, list):
        for index, child in enumerate(node):
            found += [(*prefix, index), *paths(child, (*prefix, index))]
    return found


def written_at(text: str, line: int, column: int) -> str:
    return text.splitlines()[line - 1][column - 1 :]


def check(text: str, top: dict, where: tuple = ()) -> None:
    found = values_sources._Reader("f.yaml", text, "metax-operator").read()
    assert not found.problems, found.problems
    (source,) = found.sources
    for path in paths(top):
        problem = source.locate(UserError(field_path("", path), "p"))
        here = written_at(text, problem.line, problem.column)
        last = path[-1]
        if isinstance(last, str):
            assert here.startswith((last, f"'{last}'", f'"{last}"')), (path, problem, here)
        else:  # a list item: the item's own text (a scalar, or its first key), after `- ` or `[`/`, `
            line_text = text.splitlines()[problem.line - 1][: problem.column - 1]
            assert line_text.rstrip().endswith(("-", "[", ",")) or line_text.strip() == "", (path, problem, here)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(keys, values, min_size=1, max_size=4).filter(_unambiguous), st.booleans())
def test_each_field_of_a_values_file_is_located_at_its_key(top, flow):
    assume(top)
    check(yaml.safe_dump(top, default_flow_style=flow, width=10000), top)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(keys, values, min_size=1, max_size=4).filter(_unambiguous))
def test_each_field_of_a_helm_release_is_located_at_its_key(top):
    release = {
        "apiVersion": "helm.toolkit.fluxcd.io/v2",
        "kind": "HelmRelease",
        "metadata": {"name": "m"},
        "spec": {"chart": {"spec": {"chart": "metax-operator"}}, "values": top},
    }
    check(yaml.safe_dump(release, sort_keys=False, width=10000), top)
