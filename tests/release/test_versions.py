"""The release version and the CHANGELOG (release/versions.py): this checkout is its release, and
each rule of `scripts/release check` fails where it should, on a copy of the files a release touches."""

from __future__ import annotations

import datetime
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from release import versions

TODAY = datetime.date(2027, 3, 4)


def test_this_checkout_is_its_release():
    assert versions.problems(versions.Repo()) == []
    done = subprocess.run([versions.REPO / "scripts" / "release", "check"], capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"release {versions.Repo().version()}: versions agree, CHANGELOG.md and the annotations are current\n"


def test_the_annotation_is_valid_artifacthub_changes():
    chart = yaml.safe_load((versions.REPO / "Chart.yaml").read_text())
    changes = yaml.safe_load(chart["annotations"]["artifacthub.io/changes"])
    entry = versions.Repo().entries()[chart["version"]]
    assert [c["description"] for c in changes] == [t for kind in versions.KINDS for t in entry.sections.get(kind, [])]
    assert {c["kind"] for c in changes} <= {kind.lower() for kind in versions.KINDS}
    assert chart["version"] == chart["appVersion"]


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> versions.Repo:
    """A git repository holding the files a release touches, as this checkout has them, less the
    CHANGELOG's Unreleased changes and recorded commits (of this repository's history)."""
    for name in {*(name for name, _ in versions.PLACES), versions.CHANGELOG}:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(versions.REPO / name, tmp_path / name)
    changelog = (tmp_path / versions.CHANGELOG).read_text()
    changelog = re.sub(r"^Commit: `[0-9a-f]{40}`\n\n", "", changelog, flags=re.MULTILINE)
    changelog = re.sub(r"(^## \[Unreleased\]\n).*?(?=^## \[)", r"\1\n", changelog, flags=re.MULTILINE | re.DOTALL)
    (tmp_path / versions.CHANGELOG).write_text(changelog)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "the current release")
    return versions.Repo(tmp_path)


def edit(repo: versions.Repo, name: str, old: str, new: str) -> None:
    text = repo.read(name)
    assert old in text
    repo.write(name, text.replace(old, new, 1))


def test_a_place_naming_another_version_is_found(repo):
    version = repo.version()
    edit(repo, "pyproject.toml", f'version = "{version}"', 'version = "9.9.9"')
    assert versions.problems(repo) == [
        f"pyproject.toml: names 9.9.9 where the release is {version}; run scripts/release bump {version}"
    ]


def test_a_place_that_moved_is_found(repo):
    edit(repo, "Chart.yaml", "appVersion: ", "appVersion:  ")
    (problem,) = versions.problems(repo)
    assert problem.startswith("Chart.yaml: no line matches '^appVersion: ")


def test_a_chart_version_without_a_changelog_entry_is_found(repo):
    version = repo.version()
    for name, pattern in versions.PLACES:
        repo.write(name, pattern.sub(lambda m: versions._swap(m, "0.99.0"), repo.read(name)))
    assert (
        "CHANGELOG.md: no entry `## [0.99.0] - DATE` for the chart's version; run scripts/release bump 0.99.0"
        in versions.problems(repo)
    )
    assert f"CHANGELOG.md: the {version} entry records no commit; run scripts/release record {version}" in versions.problems(repo)


def test_a_stale_annotation_is_found_and_regenerated(repo):
    entry = repo.entries()[repo.version()]
    first = next(text for kind in versions.KINDS for text in entry.sections.get(kind, []))
    words = " ".join(first.split()[:3])
    edit(repo, versions.CHANGELOG, f"- {words}", f"- Reworded: {words}")
    assert versions.problems(repo) == [
        f"Chart.yaml: artifacthub.io/changes is not the {repo.version()} entry of CHANGELOG.md; run scripts/release changes"
    ]
    versions.write_changes(repo)
    assert versions.problems(repo) == []
    assert "Reworded: " in versions.annotation(repo.read("Chart.yaml"), "artifacthub.io/changes")


def test_a_security_section_sets_contains_security_updates(repo):
    edit(repo, versions.CHANGELOG, "### Upgrade notes", "### Security\n\n- The runner's token is narrower.\n\n### Upgrade notes")
    assert any('containsSecurityUpdates is not "true"' in p for p in versions.problems(repo))
    versions.write_changes(repo)
    assert versions.problems(repo) == []
    assert versions.annotation(repo.read("Chart.yaml"), "artifacthub.io/containsSecurityUpdates") == '"true"'
    assert "- kind: security\n" in versions.annotation(repo.read("Chart.yaml"), "artifacthub.io/changes")


def test_a_release_from_bump_to_record(repo):
    """The procedure of docs/release.md: changes under Unreleased, bump, fill in, commit, record."""
    old = repo.version()
    edit(repo, versions.CHANGELOG, "## [Unreleased]\n", "## [Unreleased]\n\n### Fixed\n\n- The exporter's port\n  is 9400.\n")
    versions.bump(repo, "0.11.0", TODAY)
    for name, pattern in versions.PLACES:
        assert {m["version"] for m in pattern.finditer(repo.read(name))} == {"0.11.0"}, name
    entry = repo.entries()["0.11.0"]
    assert (entry.date, entry.sections) == ("2027-03-04", {"Fixed": ["The exporter's port is 9400."], "Upgrade notes": [""]})
    assert repo.entries()["Unreleased"].sections == {}
    assert versions.problems(repo) == [
        "CHANGELOG.md: the 0.11.0 entry has an empty bullet; fill in or delete the skeleton's `-` lines",
        "CHANGELOG.md: the 0.11.0 entry has no ### Upgrade notes; say what an administrator does",
        f"CHANGELOG.md: the {old} entry records no commit; run scripts/release record {old}",
    ]
    edit(repo, versions.CHANGELOG, "### Upgrade notes\n\n-\n", "### Upgrade notes\n\n- None.\n")
    assert versions.problems(repo) == [f"CHANGELOG.md: the {old} entry records no commit; run scripts/release record {old}"]
    released = git(repo.root, "rev-parse", "HEAD")
    assert versions.record(repo, old) == released
    git(repo.root, "commit", "-qam", "Release 0.11.0")
    assert versions.problems(repo) == []
    assert versions.annotation(repo.read("Chart.yaml"), "artifacthub.io/changes") == (
        '- kind: fixed\n  description: "The exporter\'s port is 9400."\n'
    )
    assert versions.record(repo, None) == git(repo.root, "rev-parse", "HEAD")
    assert versions.problems(repo) == []


def test_bump_with_nothing_unreleased_writes_a_skeleton(repo):
    versions.bump(repo, "1.0.0-rc.1", TODAY)
    assert repo.entries()["1.0.0-rc.1"].sections == {"Changed": [""], "Upgrade notes": [""]}
    assert "the 1.0.0-rc.1 entry lists no change; write them under ### Added, Changed, ..." in " ".join(versions.problems(repo))


def test_a_recorded_commit_of_another_version_is_found(repo):
    version = repo.version()
    versions.bump(repo, "0.11.0", TODAY)
    skeleton = "### Changed\n\n-\n\n### Upgrade notes\n\n-\n"
    edit(repo, versions.CHANGELOG, skeleton, skeleton.replace("-\n", "- Done.\n"))
    versions.write_changes(repo)
    git(repo.root, "commit", "-qam", "Release 0.11.0")
    wrong = git(repo.root, "rev-parse", "HEAD")
    edit(repo, versions.CHANGELOG, f"## [{version}] - ", f"## [{version}] - ")
    text = repo.read(versions.CHANGELOG)
    heading = text.index(f"## [{version}]")
    end = text.index("\n", heading) + 1
    repo.write(versions.CHANGELOG, text[:end] + f"\nCommit: `{wrong}`\n" + text[end:])
    assert versions.problems(repo) == [
        f"CHANGELOG.md: the {version} entry's commit {wrong[:12]} is chart 0.11.0; record the commit the release was made from"
    ]
    repo.write(versions.CHANGELOG, text[:end] + "\nCommit: `" + "0" * 40 + "`\n" + text[end:])
    assert versions.problems(repo) == [
        f"CHANGELOG.md: the {version} entry's commit {'0' * 40} is not in this repository's history; "
        "fetch it (git fetch --unshallow) or record the right one"
    ]


@pytest.mark.parametrize(
    "version, message",
    [
        ("0.11", "'0.11' is not a version MAJOR.MINOR.PATCH[-rc.N|-alpha.N|-beta.N]: e.g. 0.11.0"),
        ("0.9.9", "0.9.9 is not after the current version 0.10.0: pick a later one"),
        ("0.10.0-rc.1", "0.10.0-rc.1 is not after the current version 0.10.0: pick a later one"),
    ],
)
def test_bump_refuses_a_version_that_is_not_later(repo, version, message):
    if repo.version() != "0.10.0":
        pytest.skip("the cases are written against the first release")
    with pytest.raises(versions.ReleaseError) as err:
        versions.bump(repo, version, TODAY)
    assert str(err.value) == message


def test_the_command_says_what_is_wrong_in_one_line_each(repo, capsys, monkeypatch):
    monkeypatch.setattr(versions, "Repo", lambda: repo)
    edit(repo, "pyproject.toml", f'version = "{repo.version()}"', 'version = "9.9.9"')
    assert versions.main(["check"]) == 1
    assert capsys.readouterr().err.startswith("error: pyproject.toml: names 9.9.9 where the release is ")
    assert versions.main(["bump", "x"]) == 1
    assert capsys.readouterr().err == "error: 'x' is not a version MAJOR.MINOR.PATCH[-rc.N|-alpha.N|-beta.N]: e.g. 0.11.0\n"
    assert versions.main(["nonsense"]) == 2
    assert capsys.readouterr().err == versions.USAGE + "\n"


def test_an_exported_tree_without_history_skips_the_recorded_commits(repo):
    version = repo.version()
    text = repo.read(versions.CHANGELOG)
    end = text.index("\n", text.index(f"## [{version}]")) + 1
    repo.write(versions.CHANGELOG, text[:end] + "\nCommit: `" + "0" * 40 + "`\n" + text[end:])
    assert len(versions.problems(repo)) == 1
    shutil.rmtree(repo.root / ".git")
    assert not repo.has_history() and versions.problems(repo) == []
