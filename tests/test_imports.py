"""The package's import graph: no cycle (a module that imports another, directly or through others,
is never imported back by it, not even from inside a function), and every import runs down the
layers of docs/architecture.md, never up and never sideways between packages of one floor."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "metax_operator"
ROOT = "metax_operator"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports anywhere in it (top level or inside functions)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) for p in paths}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component that has one (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in sorted(edges.get(node, ())):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(_path(edges, set(component), node))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _path(edges: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A cycle from `start` back to it inside `component` (breadth-first: the shortest)."""
    previous: dict[str, str] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(edges[node] & component):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if child not in previous:
                previous[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")


def test_the_package_has_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_a_cycle_is_found_and_named():
    """The check above can fail: two modules importing each other, a third in a longer loop."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(edges) == [["a", "b", "c", "a"]]
    assert cycles({"x": {"y"}, "y": {"x"}}) == [["x", "y", "x"]]


def test_function_level_and_relative_imports_count(tmp_path):
    package = tmp_path / ROOT
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "one.py").write_text("def f():\n    from metax_operator.sub import two\n")
    (package / "sub" / "two.py").write_text("from . import one\n")
    modules = {"metax_operator", "metax_operator.sub", "metax_operator.sub.one", "metax_operator.sub.two"}
    global PACKAGE
    saved, PACKAGE = PACKAGE, package
    try:
        assert imports(package / "sub" / "one.py", modules) == {"metax_operator.sub", "metax_operator.sub.two"}
        assert imports(package / "sub" / "two.py", modules) == {"metax_operator.sub", "metax_operator.sub.one"}
    finally:
        PACKAGE = saved


#: The floors of docs/architecture.md, bottom up: each holds packages (a folder) or modules, named
#: under the package root. A module may import its own package and any floor below, nothing else.
FLOORS = [
    ("base", ["__init__", "conditions", "contract", "errors", "jsonlog", "lookup", "yamltext", "cli"]),
    ("chart rules", ["chart"]),
    ("workload rules", ["workloads"]),
    ("rollout rules", ["rollout"]),
    ("runtime", ["runtime"]),
    ("entry points", ["hooks", "commands"]),
]


def floor_of(module: str, floors: list = FLOORS) -> tuple[int, str]:
    """(floor number, the package or module it is listed as) of a module of the package."""
    parts = module.split(".")[1:] or ["__init__"]
    for number, (_, members) in enumerate(floors):
        for member in members:
            if parts[: len(member.split("."))] == member.split("."):
                return number, member
    raise AssertionError(f"{module} is on no floor: add it to FLOORS and to docs/architecture.md")


def against_the_layers(edges: dict[str, set[str]], floors: list = FLOORS) -> list[str]:
    """Each import that runs up a floor, or sideways between two packages of the same floor
    (the base's modules count as one package), as `importer -> imported (floor -> floor)`."""
    found = []
    for module, imported in sorted(edges.items()):
        here, own = floor_of(module, floors)
        for target in sorted(imported):
            there, other = floor_of(target, floors)
            if there > here or (there == here and own != other and here != 0):
                found.append(f"{module} -> {target} ({floors[here][0]} -> {floors[there][0]})")
    return found


def test_every_import_runs_down_the_layers():
    found = against_the_layers(graph())
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_an_import_up_or_sideways_is_found_and_named():
    """The check above can fail: a rule importing the runtime, two rule packages importing each
    other, the base importing a rule; downward imports and the base among itself pass."""
    edges = {
        f"{ROOT}.rollout.engine": {f"{ROOT}.runtime.kube", f"{ROOT}.chart.schema", f"{ROOT}.contract"},
        f"{ROOT}.chart.schema": {f"{ROOT}.workloads"},
        f"{ROOT}.workloads": {f"{ROOT}.errors"},
        f"{ROOT}.errors": {f"{ROOT}.commands.nodes"},
        f"{ROOT}.yamltext": {f"{ROOT}.errors"},
        f"{ROOT}.commands.nodes": {f"{ROOT}.runtime.kube", f"{ROOT}.hooks.common"},
    }
    assert against_the_layers(edges) == [
        f"{ROOT}.chart.schema -> {ROOT}.workloads (chart rules -> workload rules)",
        f"{ROOT}.commands.nodes -> {ROOT}.hooks.common (entry points -> entry points)",
        f"{ROOT}.errors -> {ROOT}.commands.nodes (base -> entry points)",
        f"{ROOT}.rollout.engine -> {ROOT}.runtime.kube (rollout rules -> runtime)",
    ]


def test_every_module_is_on_a_floor_the_architecture_document_names():
    doc = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    for name, members in FLOORS:
        assert name in doc, f"docs/architecture.md does not name the floor {name!r}"
        for member in members:
            shown = f"{member}/" if (PACKAGE / member).is_dir() else f"{member}.py"
            assert shown in doc, f"docs/architecture.md does not place {shown} on the floor {name!r}"
    for module in graph():
        floor_of(module)


#: The pure rules: functions of what a pass observed (no client, no runtime).
DECISION_MODULES = [
    f"{ROOT}.{name}"
    for name in (
        "chart.upgrade_policy",
        "rollout.status",
        "rollout.engine",
        "rollout.restore",
        "rollout.simulate",
        "workloads",
    )
]


def test_the_pure_rules_reach_neither_the_runtime_nor_the_kubernetes_client():
    edges = graph()
    reached, todo = set(), list(DECISION_MODULES)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += edges[module]
    assert not {m for m in reached if m.startswith(f"{ROOT}.runtime")}
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys, {', '.join(DECISION_MODULES)}; print(sorted(sys.modules))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "'kubernetes'" not in loaded


def public_classes(paths) -> dict[str, list[str]]:
    """Each public class name defined at the top level of `paths`, with the modules defining it."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found.setdefault(node.name, []).append(module_name(path))
    return found


def test_no_two_modules_define_a_public_class_of_the_same_name():
    """One word, one thing: a reader meeting `Observed` or `Condition` knows which it is."""
    twice = {name: modules for name, modules in public_classes(sorted(PACKAGE.rglob("*.py"))).items() if len(modules) > 1}
    assert not twice, f"public classes defined in more than one module: {twice}"


def test_a_class_name_defined_twice_is_found(tmp_path):
    package = tmp_path / ROOT
    package.mkdir()
    (package / "one.py").write_text("class Observed:\n    pass\n\n\nclass _Private:\n    pass\n")
    (package / "two.py").write_text("class Observed:\n    pass\n\n\nclass _Private:\n    pass\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, package
    try:
        assert public_classes(sorted(package.glob("*.py"))) == {"Observed": [f"{ROOT}.one", f"{ROOT}.two"]}
    finally:
        PACKAGE = saved
