"""The project stands alone: no code, comment, document, template or `--help` text refers to
what is outside the repository (design notes, issue trackers, sibling directories of a checkout)."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from metax_operator import cli

REPO = Path(__file__).resolve().parents[1]
#: What points outside the repository, each with the reason it is refused.
OUTSIDE = [
    (re.compile(r"\bDESIGN(\.md\b|\s*§)"), "a design document the repository does not hold"),
    (re.compile(r"\bSTYLE\.md\b"), "a style guide the repository does not hold"),
    (re.compile(r"\bissues?\s+(#\s*)?\d+\b|\bissues\s+(show|note|resolved|blocked)\b", re.I), "an issue tracker"),
    (
        re.compile(r"\.\./shared\b|(^|[\s\"'`(])/work/|\bshared/(cases|seeds)\b|/\s*[\"']shared[\"']"),
        "a directory outside the repository",
    ),
]


#: The one exception: CI's entry point may take build sources CI lays beside the checkout (Flux's
#: helm-controller, which no registry serves); the project itself never needs them.
CI_ENTRY, CI_SOURCES = ".ci/run", re.compile(r"\.\./shared/vendor/[\w.+-]+\.tar\.gz\b")


def outside_references(text: str, name: str = "") -> list[str]:
    """The lines of `text` (of the file `name`) that refer outside the repository, with the reason."""
    return [
        f"line {number}: {line.strip()} ({reason})"
        for number, line in enumerate(text.splitlines(), 1)
        for pattern, reason in OUTSIDE
        if pattern.search(CI_SOURCES.sub("", line) if name == CI_ENTRY else line)
    ]


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    return [REPO / name for name in listed if name and (REPO / name).is_file() and REPO / name != Path(__file__)]


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def test_no_file_refers_outside_the_repository():
    found = {}
    for path in tracked_files():
        text = _text(path)
        name = str(path.relative_to(REPO))
        if text is not None and (lines := outside_references(text, name)):
            found[name] = lines
    assert not found, "references outside the repository:\n" + "\n".join(
        f"{name}: {line}" for name, lines in sorted(found.items()) for line in lines
    )


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _parsers(sub)


def help_texts() -> dict[str, str]:
    """`metax-operator [COMMAND [SUBCOMMAND]] --help` for every command, by its prog name."""
    return {parser.prog: parser.format_help() for parser in _parsers(cli.build_parser())}


def test_no_help_text_refers_outside_the_repository():
    texts = help_texts()
    assert set(cli.COMMANDS) <= {prog.split()[1] for prog in texts if " " in prog}, "a command's help is missing"
    found = {prog: lines for prog, text in texts.items() if (lines := outside_references(text))}
    assert not found, f"--help refers outside the repository: {found}"


@pytest.mark.parametrize(
    "line",
    [
        "the loop (DESIGN §1, §3, §4)",
        "see DESIGN.md",
        "as STYLE.md says",
        "fixed in issue #12",
        "issue 15 says",
        "cases = ROOT.parent / 'shared' / 'cases'",
        "see ../shared/seeds",
        "open /work/shared/DESIGN.md",
    ],
)
def test_a_reference_outside_is_found(line):
    assert outside_references(f"fine\n{line}\n") != []


@pytest.mark.parametrize(
    "line",
    [
        "an unchanged CR issues no request that writes",
        "seed §3.2.6",
        "/etc/metax-operator/values",
        "https://github.com/helm/helm/issues",
        "tests/data/rollout-worked-examples.yaml",
    ],
)
def test_references_inside_are_not_reported(line):
    assert outside_references(line) == []


def test_only_ci_s_entry_point_may_take_a_source_tarball_beside_the_checkout():
    tarball = "flux=../shared/vendor/fluxcd-helm-controller-v1.6.2.tar.gz"
    assert outside_references(tarball, CI_ENTRY) == []
    assert outside_references(tarball, "scripts/setup.d/35-flux") != []
    assert outside_references("cases=../shared/cases/install.md", CI_ENTRY) != []
