"""`metax-operator check-node` on fake /sys trees: every passed check's line, every failure's line
on stderr and in the termination log, and never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from metax_operator.cli import main


def node(root: Path, version: str | None = "2.32.0.6", metax: int = 8, vfio: int | None = 0) -> Path:
    """A /sys with the metax module loaded (reporting `version`; None: no version file) and
    `metax` and `vfio` PCI functions bound (None: vfio-pci not registered), beside the files
    every driver's directory holds."""
    (root / "module" / "metax").mkdir(parents=True)
    if version is not None:
        (root / "module" / "metax" / "version").write_text(f"{version}\n")
    for driver, count in (("metax", metax), ("vfio-pci", vfio)):
        if count is None:
            continue
        directory = root / "bus" / "pci" / "drivers" / driver
        directory.mkdir(parents=True)
        for name in ("bind", "unbind", "new_id", "remove_id", "uevent", "module"):
            (directory / name).touch()
        for function in range(count):
            (directory / f"0000:{function + 10:02x}:00.0").touch()
    return root


def check(tmp_path: Path, *options: str) -> int:
    return main(["check-node", "--sys", str(tmp_path / "sys"), "--termination-log", str(tmp_path / "termination-log"), *options])


def failed(tmp_path: Path, capsys, line: str) -> str:
    """The command failed with `line` (on stderr after `error: `, alone in the termination log);
    returns its stdout: the lines of the checks passed before."""
    out, err = capsys.readouterr()
    assert err == f"error: {line}\n"
    assert (tmp_path / "termination-log").read_text() == f"{line}\n"
    return out


@pytest.mark.parametrize("tag", ["2.32.0.6", "2.32.0.6-amd64"])
def test_a_node_running_the_payload_passes_every_check(tmp_path, capsys, tag):
    node(tmp_path / "sys")
    assert check(tmp_path, "--driver-version", tag) == 0
    assert capsys.readouterr().out.splitlines() == [
        "ok: the metax kernel module is loaded",
        f"ok: driver version 2.32.0.6 matches the payload {tag}",
        "ok: 8 GPU functions bound to metax, 0 to vfio-pci",
    ]
    assert not (tmp_path / "termination-log").exists()


def test_without_a_payload_version_the_version_is_not_compared(tmp_path, capsys):
    node(tmp_path / "sys", version="9.9")
    assert check(tmp_path) == 0
    assert capsys.readouterr().out.splitlines()[1] == "skipped: no --driver-version to compare the driver's version with"


@pytest.mark.parametrize("version", [None, ""])
def test_a_driver_reporting_no_version_skips_the_comparison(tmp_path, capsys, version):
    root = node(tmp_path / "sys", version=version)
    assert check(tmp_path, "--driver-version", "2.32.0.6") == 0
    path = root / "module" / "metax" / "version"
    assert capsys.readouterr().out.splitlines()[1] == f"skipped: the driver reports no version ({path} is missing or empty)"


def test_gpus_handed_to_virtual_machines_count(tmp_path, capsys):
    node(tmp_path / "sys", metax=0, vfio=2)
    assert check(tmp_path) == 0
    assert capsys.readouterr().out.splitlines()[2] == "ok: 0 GPU functions bound to metax, 2 to vfio-pci"


def test_a_node_without_vfio_pci_registered_passes(tmp_path, capsys):
    node(tmp_path / "sys", metax=1, vfio=None)
    assert check(tmp_path) == 0
    assert capsys.readouterr().out.splitlines()[2] == "ok: 1 GPU functions bound to metax, 0 to vfio-pci"


def test_the_module_not_loaded_fails_first(tmp_path, capsys):
    (tmp_path / "sys" / "module").mkdir(parents=True)
    assert check(tmp_path, "--driver-version", "2.32.0.6") == 1
    module = tmp_path / "sys" / "module" / "metax"
    assert failed(tmp_path, capsys, f"the metax kernel module is not loaded ({module} is missing)") == ""


@pytest.mark.parametrize("tag", ["2.33.0.9-amd64", "2.32.0.60", "2.32.0"])
def test_a_driver_of_another_version_fails(tmp_path, capsys, tag):
    node(tmp_path / "sys")
    assert check(tmp_path, "--driver-version", tag) == 1
    line = f"the loaded metax driver reports version 2.32.0.6, the payload is {tag}"
    assert failed(tmp_path, capsys, line) == "ok: the metax kernel module is loaded\n"


def test_no_gpu_bound_fails(tmp_path, capsys):
    node(tmp_path / "sys", metax=0)
    assert check(tmp_path, "--driver-version", "2.32.0.6") == 1
    assert failed(tmp_path, capsys, "no PCI device is bound to the metax driver (nor to vfio-pci)").splitlines() == [
        "ok: the metax kernel module is loaded",
        "ok: driver version 2.32.0.6 matches the payload 2.32.0.6",
    ]


def test_an_unreadable_version_file_fails_naming_it(tmp_path, capsys):
    root = node(tmp_path / "sys", version=None)
    (root / "module" / "metax" / "version").mkdir()  # reading it fails whoever we run as
    assert check(tmp_path, "--driver-version", "2.32.0.6") == 1
    failed(tmp_path, capsys, f"cannot read {root / 'module' / 'metax' / 'version'}: Is a directory")


def test_an_unreadable_driver_directory_fails_naming_it(tmp_path, capsys):
    vfio = node(tmp_path / "sys", vfio=None) / "bus" / "pci" / "drivers" / "vfio-pci"
    vfio.touch()  # listing it fails whoever we run as
    assert check(tmp_path) == 1
    failed(tmp_path, capsys, f"cannot read {vfio}: Not a directory")


def test_the_termination_log_is_written_only_where_it_can_be(tmp_path, capsys):
    assert main(["check-node", "--sys", str(tmp_path / "sys"), "--termination-log", str(tmp_path / "no" / "log")]) == 1
    assert not (tmp_path / "no").exists()
    (tmp_path / "log").mkdir()
    assert main(["check-node", "--sys", str(tmp_path / "sys"), "--termination-log", str(tmp_path / "log")]) == 1
    assert capsys.readouterr().err.count("error: the metax kernel module is not loaded") == 2
