"""The errata of docs/product/README.md are about the manual as it is, and their fixes are what the
code answers to: each row names a section or table the manual has; each command it quotes as
printed is in the manual, word for word; each `kubectl patch` it gives instead is one of
docs/rollout-admin.md's commands, which tests/e2e/test_admin_commands_doc.py runs against the API
server; its install command passes `metax-operator validate` and the chart's render.
"""

from __future__ import annotations

import re
import shlex

import pytest

from metax_operator import cli
from tests.doc_blocks import blocks
from tests.helm import BIN, CHART

PRODUCT = CHART / "docs" / "product"
(TABLE,) = [b for b in blocks(PRODUCT / "README.md") if b.kind == "errata"]
#: The table's rows, each cell as written (code spans kept).
ROWS = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in TABLE.text.splitlines()[2:]]
SEEDS = {
    "000": (PRODUCT / "000-gpu-operator.txt").read_text(),
    "001": (PRODUCT / "001-driver-and-firmware-upgrade.txt").read_text(),
}
ADMIN = [b.text for b in blocks(CHART / "docs" / "rollout-admin.md") if b.kind == "admin-command"]
CODE = re.compile(r"`([^`]+)`")


def one_line(text: str) -> str:
    """A command as one line: continuations joined, runs of spaces made one."""
    return re.sub(r"\s+", " ", text.replace("\\\n", " ")).strip()


def commands(cell: str, start: str) -> list[str]:
    return [c for c in CODE.findall(cell) if c.startswith(start) and "..." not in c]


@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]} {r[1][:40]}" for r in ROWS])
def test_each_row_names_a_section_or_table_the_manual_has(row):
    seed, _, places = row[0].partition(" ")
    text = SEEDS[seed]
    for place in re.findall(r"§([0-9.]+)|tables? ([0-9.]+(?:, [0-9.]+)*(?: with [0-9.]+)?)", places):
        section, tables = place
        if section:
            assert re.search(rf"^{re.escape(section)}\. ", text, re.M), f"seed {seed} has no section {section}"
        for table in re.split(r", | with ", tables) if tables else []:
            assert f"表 {table}" in text or table.startswith("2."), f"seed {seed} has no table {table}"


def test_each_command_quoted_as_printed_is_in_the_manual():
    quoted = [(row[0][:3], c) for row in ROWS for c in commands(row[1], "kubectl") + commands(row[1], "helm")]
    assert len(quoted) >= 4
    manual = {seed: one_line(text) for seed, text in SEEDS.items()}
    for seed, command in quoted:
        assert one_line(command) in manual[seed], f"seed {seed} does not print: {command}"


def test_each_corrected_patch_is_a_command_of_rollout_admin_that_the_e2e_test_runs():
    given = {one_line(c) for row in ROWS for c in commands(row[2], "kubectl patch")}
    assert len(given) == 3  # rollback, pause, resume
    assert given <= {one_line(text) for text in ADMIN}


def test_the_corrected_install_passes_validate(capsys):
    (install,) = [c for row in ROWS if row[0] == "000 §3.2.1" for c in commands(row[2], "helm install")]
    words = shlex.split(install)
    flags = [w for i, w in enumerate(words) if i and words[i - 1] == "--set"]
    assert {f.split("=")[0] for f in flags} == {"registry", "driver.payload.version"}
    args = [item for flag in flags for item in ("--set", flag)]
    assert cli.main(["validate", "--helm", str(BIN / "helm3"), *args]) == 0, capsys.readouterr().err
