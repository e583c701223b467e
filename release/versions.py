"""The release version, in every place that names it, and the CHANGELOG it is released with.

    scripts/release bump VERSION     every place below names VERSION; the CHANGELOG's Unreleased
                                     changes become VERSION's entry (a skeleton when there are none)
    scripts/release record           writes the commit of the release in its CHANGELOG entry
    scripts/release check            the versions agree, the CHANGELOG has the entry, the
                                     artifacthub.io annotations are the entry's

One version names a release: the chart's `version` and `appVersion` (the default tag of every
component image and of the tools image), the Python package's, and the examples in the docs. The
offline package, the chart archive in it and the image bundle MetaX ships beside it all carry that
version (`metax-operator-0.13.0.tgz` in `metax-gpu-k8s-package.0.13.0.tar.gz`), so a chart
version that is not the appVersion would name an image set that does not exist.

Standard library only: the release tools run before the package is installed.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHANGELOG = "CHANGELOG.md"
#: A release version: MAJOR.MINOR.PATCH, a pre-release `-rc.N`, `-alpha.N` or `-beta.N` (a
#: narrower form than Semantic Versioning's, so a version in a file name ends before `.tar`).
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-(?:alpha|beta|rc)\.(0|[1-9]\d*))?$")
#: Keep a Changelog's kinds of change, as its headings spell them; Artifact Hub's `kind` is the
#: heading in lowercase.
KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
#: Not a kind of change: what an administrator does to upgrade to the release (not in Artifact Hub).
UPGRADE_NOTES = "Upgrade notes"

_VERSION = r"(?P<version>\d+\.\d+\.\d+(?:-(?:alpha|beta|rc)\.\d+)?)"
#: Every place that names the release version: (file, pattern whose `version` group is it). Each
#: pattern must match at least once (`check`), so a moved line cannot escape a bump.
PLACES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (path, re.compile(pattern, re.MULTILINE))
    for path, pattern in (
        ("Chart.yaml", rf"^version: {_VERSION}$"),
        ("Chart.yaml", rf'^appVersion: "{_VERSION}"$'),
        ("pyproject.toml", rf'^version = "{_VERSION}"$'),
        ("image/Dockerfile", rf"metax-operator-tools:{_VERSION}"),
        ("docs/image.md", rf"metax-operator-tools[-:]{_VERSION}"),
        ("docs/image.md", rf"chart {_VERSION}"),
        ("docs/image.md", rf"oci:{_VERSION}"),
        ("docs/control-plane.md", rf"metax-operator-tools:{_VERSION}"),
        ("docs/gitops.md", rf"targetRevision: {_VERSION}$"),
        ("docs/gitops.md", rf"^      version: {_VERSION}$"),
        ("docs/values-review.md", rf"targetRevision: {_VERSION}$"),
        ("docs/values-review.md", rf"^      version: {_VERSION}$"),
        ("docs/values-review.md", rf"rev: {_VERSION}$"),
        ("docs/values-review.md", rf"--version {_VERSION}"),
        ("docs/release.md", rf"the archive is `metax-operator-{_VERSION}\.tgz`"),
    )
)


class ReleaseError(Exception):
    """A release step cannot be done; the message says what and the fix."""


@dataclass
class Entry:
    """One release in the CHANGELOG: its version, date, commit (None until recorded) and its
    sections (heading -> bullet texts, each bullet's lines joined)."""

    version: str
    date: str
    commit: str | None
    sections: dict[str, list[str]] = field(default_factory=dict)


_HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?\s*$")
_COMMIT = re.compile(r"^Commit: `(?P<commit>[0-9a-f]{40})`\s*$")


def parse_changelog(text: str) -> dict[str, Entry]:
    """The CHANGELOG's entries by version (`Unreleased` included), in the file's order."""
    entries: dict[str, Entry] = {}
    entry: Entry | None = None
    section: list[str] | None = None
    for line in text.splitlines():
        if heading := _HEADING.match(line):
            entry = entries.setdefault(heading["version"], Entry(heading["version"], heading["date"] or "", None))
            section = None
        elif entry is None or line.startswith("[") or line.startswith("# "):
            continue  # the preamble and the link definitions
        elif commit := _COMMIT.match(line):
            entry.commit = commit["commit"]
        elif line.startswith("### "):
            section = entry.sections.setdefault(line[4:].strip(), [])
        elif section is not None and re.match(r"^-( |$)", line):
            section.append(line[1:].strip())  # "" for a skeleton's bullet not filled in
        elif section is not None and section and line.startswith("  ") and line.strip():
            section[-1] += " " + line.strip()
    return entries


def artifacthub_changes(entry: Entry) -> str:
    """Artifact Hub's `artifacthub.io/changes` for an entry: one `kind`/`description` per bullet."""
    lines = []
    for kind in KINDS:
        for text in filter(None, entry.sections.get(kind, [])):
            lines += [f"- kind: {kind.lower()}", f"  description: {_yaml_string(text)}"]
    return "\n".join(lines) + "\n" if lines else ""


def _yaml_string(text: str) -> str:
    """`text` as a double-quoted YAML scalar (JSON's escaping is YAML's)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class Repo:
    """The files of a checkout that a release touches."""

    root: Path = REPO

    def read(self, name: str) -> str:
        try:
            return (self.root / name).read_text()
        except FileNotFoundError:
            raise ReleaseError(f"{name} is missing from {self.root}: restore it from git") from None

    def write(self, name: str, text: str) -> None:
        (self.root / name).write_text(text)

    def has_history(self) -> bool:
        """Whether the checkout has its git history (an exported tree has none to check commits in)."""
        return subprocess.run(["git", "-C", str(self.root), "rev-parse", "--git-dir"], capture_output=True).returncode == 0

    def version(self) -> str:
        """The chart's version (Chart.yaml `version`)."""
        return PLACES[0][1].search(self.read("Chart.yaml"))["version"]

    def entries(self) -> dict[str, Entry]:
        return parse_changelog(self.read(CHANGELOG))


def problems(repo: Repo) -> list[str]:
    """Why this checkout is not releasable as its chart version: versions that disagree, no
    CHANGELOG entry, stale annotations, an entry whose recorded commit is not that release."""
    version = repo.version()
    found = []
    for name, pattern in PLACES:
        seen = {m["version"] for m in pattern.finditer(repo.read(name))}
        if not seen:
            found.append(f"{name}: no line matches {pattern.pattern!r}; update release/versions.py PLACES with the file")
        elif seen != {version}:
            others = ", ".join(sorted(seen - {version}))
            found.append(f"{name}: names {others} where the release is {version}; run scripts/release bump {version}")
    entries = repo.entries()
    entry = entries.get(version)
    if entry is None:
        found.append(f"{CHANGELOG}: no entry `## [{version}] - DATE` for the chart's version; run scripts/release bump {version}")
    else:
        if not any(text for kind in KINDS for text in entry.sections.get(kind, [])):
            found.append(f"{CHANGELOG}: the {version} entry lists no change; write them under ### Added, Changed, ...")
        if any("" in bullets for bullets in entry.sections.values()):
            found.append(f"{CHANGELOG}: the {version} entry has an empty bullet; fill in or delete the skeleton's `-` lines")
        if not any(entry.sections.get(UPGRADE_NOTES, [])):
            found.append(f"{CHANGELOG}: the {version} entry has no ### {UPGRADE_NOTES}; say what an administrator does")
        chart = repo.read("Chart.yaml")
        if (annotation(chart, "artifacthub.io/changes") or "") != artifacthub_changes(entry):
            found.append(
                f"Chart.yaml: artifacthub.io/changes is not the {version} entry of {CHANGELOG}; run scripts/release changes"
            )
        security = '"true"' if entry.sections.get("Security") else '"false"'
        if annotation(chart, "artifacthub.io/containsSecurityUpdates") != security:
            found.append(f"Chart.yaml: artifacthub.io/containsSecurityUpdates is not {security}; run scripts/release changes")
    for other in entries.values():
        if other.version != "Unreleased" and other.commit is None and other.version != version:
            found.append(f"{CHANGELOG}: the {other.version} entry records no commit; run scripts/release record {other.version}")
        elif other.commit is not None and repo.has_history():
            found += commit_problems(repo, other)
    return found


def commit_problems(repo: Repo, entry: Entry) -> list[str]:
    """The recorded commit must be in the history and be that release (its Chart.yaml names it)."""
    try:
        _git(repo, "cat-file", "-e", f"{entry.commit}^{{commit}}")
    except ReleaseError:
        return [
            f"{CHANGELOG}: the {entry.version} entry's commit {entry.commit} is not in this repository's history; "
            "fetch it (git fetch --unshallow) or record the right one"
        ]
    chart = _git(repo, "show", f"{entry.commit}:Chart.yaml")
    named = PLACES[0][1].search(chart)
    if not named or named["version"] != entry.version:
        return [
            f"{CHANGELOG}: the {entry.version} entry's commit {entry.commit[:12]} is chart "
            f"{named['version'] if named else 'without a version'}; record the commit the release was made from"
        ]
    return []


def _git(repo: Repo, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo.root), *args], capture_output=True, text=True)
    if result.returncode:
        raise ReleaseError((result.stderr.strip().splitlines() or ["git failed"])[-1])
    return result.stdout


def annotation(chart: str, key: str) -> str | None:
    """The text of a Chart.yaml annotation: a block scalar's lines unindented, or the plain value."""
    match = _annotation(key).search(chart)
    if match is None:
        return None
    if match["inline"] != "|":
        return match["inline"]
    return "".join(line[4:] + "\n" for line in match["block"].splitlines())


def _annotation(key: str) -> re.Pattern:
    return re.compile(rf"^  {re.escape(key)}: (?P<inline>.*)\n(?P<block>(?:    .*\n)*)", re.MULTILINE)


def set_annotation(chart: str, key: str, text: str) -> str:
    """Chart.yaml with the annotation `key` set to `text` (a block scalar when it has lines;
    removed when empty), added at the end of `annotations:` when absent."""
    block = "" if not text else f"  {key}: |\n" + "".join(f"    {line}\n" for line in text.splitlines())
    if "\n" not in text and text:
        block = f"  {key}: {text}\n"
    pattern = _annotation(key)
    if pattern.search(chart):
        return pattern.sub(lambda _: block, chart, count=1)
    if not re.search(r"^annotations:\n", chart, re.MULTILINE):
        raise ReleaseError("Chart.yaml has no `annotations:` mapping: add one")
    head, _, tail = chart.partition("\nannotations:\n")
    rest = re.match(r"(?:  .*\n|\s*\n)*", tail)
    return f"{head}\nannotations:\n{tail[: rest.end()]}{block}{tail[rest.end() :]}"


def write_changes(repo: Repo) -> None:
    """Chart.yaml's Artifact Hub annotations from the CHANGELOG entry of the chart's version."""
    version = repo.version()
    entry = repo.entries().get(version)
    if entry is None:
        raise ReleaseError(f"{CHANGELOG} has no entry for {version}: run scripts/release bump {version}")
    chart = set_annotation(repo.read("Chart.yaml"), "artifacthub.io/changes", artifacthub_changes(entry))
    security = '"true"' if entry.sections.get("Security") else '"false"'
    repo.write("Chart.yaml", set_annotation(chart, "artifacthub.io/containsSecurityUpdates", security))


def bump(repo: Repo, new: str, today: datetime.date) -> None:
    """Every place names `new`; the CHANGELOG's Unreleased changes become `new`'s entry, dated
    `today` (with a skeleton of its sections where Unreleased had none); the annotations follow."""
    if not SEMVER.match(new):
        raise ReleaseError(f"{new!r} is not a version MAJOR.MINOR.PATCH[-rc.N|-alpha.N|-beta.N]: e.g. 0.11.0")
    old = repo.version()
    if _order(new) <= _order(old):
        raise ReleaseError(f"{new} is not after the current version {old}: pick a later one")
    changelog = repo.read(CHANGELOG)
    if new in repo.entries():
        raise ReleaseError(f"{CHANGELOG} already has an entry for {new}: pick another version")
    for name in dict.fromkeys(name for name, _ in PLACES):
        text = repo.read(name)
        for place, pattern in PLACES:
            if place == name:
                text = pattern.sub(lambda m: _swap(m, new), text)
        repo.write(name, text)
    repo.write(CHANGELOG, _new_entry(changelog, new, today.isoformat()))
    write_changes(repo)


def _swap(match: re.Match, new: str) -> str:
    start, end = match.span("version")
    whole = match.group(0)
    return whole[: start - match.start()] + new + whole[end - match.start() :]


def _order(version: str) -> tuple:
    """A sort key: a pre-release comes before its release, alpha before beta before rc."""
    core, _, pre = version.partition("-")
    kind, _, number = pre.partition(".")
    return (*map(int, core.split(".")), not pre, kind, int(number or 0))


_SKELETON = "### Changed\n\n-\n\n### Upgrade notes\n\n-\n"


def _new_entry(changelog: str, version: str, date: str) -> str:
    """The CHANGELOG with `## [Unreleased]`'s body moved under a new `## [version] - date`."""
    match = re.search(r"^## \[Unreleased\]\s*\n(?P<body>.*?)(?=^## \[|^\[|\Z)", changelog, re.MULTILINE | re.DOTALL)
    if match is None:
        raise ReleaseError(f"{CHANGELOG} has no `## [Unreleased]` section: add one above the releases")
    body = match["body"].strip()
    if UPGRADE_NOTES not in body:
        body = (body + "\n\n" if body else "") + (_SKELETON if not body else f"### {UPGRADE_NOTES}\n\n-\n")
    new = f"## [Unreleased]\n\n## [{version}] - {date}\n\n{body.strip()}\n\n"
    return changelog[: match.start()] + new + changelog[match.end() :]


def record(repo: Repo, version: str | None) -> str:
    """Write into the `version` entry (default: the chart's) the commit it was released from: the
    latest commit whose Chart.yaml names that version. Returns the commit."""
    version = version or repo.version()
    entry = repo.entries().get(version)
    if entry is None:
        raise ReleaseError(f"{CHANGELOG} has no entry for {version}")
    commits = _git(repo, "log", "--format=%H", "-G", rf"^version: {re.escape(version)}$", "--", "Chart.yaml").split()
    if not commits:
        raise ReleaseError(f"no commit has chart version {version}: commit the bump first")
    commit = commits[-1]  # the oldest: the commit that made the release (later ones may add to it)
    changelog = repo.read(CHANGELOG)
    heading = re.search(rf"^## \[{re.escape(version)}\].*\n", changelog, re.MULTILINE)
    after = changelog[heading.end() :]
    after = re.sub(r"\A\s*Commit: `[0-9a-f]{40}`\s*\n", "\n", after)
    repo.write(CHANGELOG, changelog[: heading.end()] + f"\nCommit: `{commit}`\n" + after)
    return commit


USAGE = "usage: scripts/release bump VERSION | record [VERSION] | changes | check | sign-image --key KEY DOMAIN/PROJECT PACKAGE"


def main(argv: list[str]) -> int:
    repo = Repo()
    try:
        match argv:
            case ["bump", version]:
                bump(repo, version, datetime.date.today())
                print(f"version {version}: edit the {CHANGELOG} entry (changes, upgrade notes), then scripts/release changes")
            case ["record", *version] if len(version) <= 1:
                print(record(repo, version[0] if version else None))
            case ["changes"]:
                write_changes(repo)
            case ["check"]:
                found = problems(repo)
                for line in found:
                    print(f"error: {line}", file=sys.stderr)
                if not found:
                    print(f"release {repo.version()}: versions agree, {CHANGELOG} and the annotations are current")
                return 1 if found else 0
            case _:
                print(USAGE, file=sys.stderr)
                return 2
    except ReleaseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
