"""`metax-operator check-node` on fake /sys trees: every passed check's line, every failure's line
on stderr and in the termination log, and never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from metax_operator.cli import main


def node(root: Path, version: str | None = "2.32.0.6", metax: int = 8, vfio: int | None = 0, unbound: int = 0) -> Path:
    """A /sys with the metax module loaded (reporting `version`; None: no version file) and
    `metax` and `vfio` MetaX GPUs bound (None: vfio-pci not registered), `unbound` more bound to
    no driver, as the kernel shows them: each GPU under bus/pci/devices with its vendor and its
    `driver` link, each bound one in its driver's directory beside the files every driver's
    directory holds; plus a NIC (another vendor) bound to its own driver, and an unbound
    virtual function of the first GPU."""
    (root / "module" / "metax").mkdir(parents=True)
    if version is not None:
        (root / "module" / "metax" / "version").write_text(f"{version}\n")
    devices = root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True)
    gpus = [*(["metax"] * metax), *(["vfio-pci"] * (vfio or 0)), *([None] * unbound)]
    for driver in ("metax", "vfio-pci", "mlx5_core"):
        if driver == "vfio-pci" and vfio is None:
            continue
        directory = root / "bus" / "pci" / "drivers" / driver
        directory.mkdir(parents=True)
        for name in ("bind", "unbind", "new_id", "remove_id", "uevent", "module"):
            (directory / name).touch()
    functions = [(f"0000:{i + 10:02x}:00.0", "0x9999", driver) for i, driver in enumerate(gpus)]
    functions.append(("0000:c1:00.0", "0x15b3", "mlx5_core"))
    for address, vendor, driver in functions:
        device = devices / address
        device.mkdir()
        (device / "vendor").write_text(f"{vendor}\n")
        if driver is not None:
            (device / "driver").symlink_to(f"../../../../bus/pci/drivers/{driver}")
            (root / "bus" / "pci" / "drivers" / driver / address).symlink_to(f"../../devices/{address}")
    if gpus:
        vf = devices / "0000:10:00.1"
        vf.mkdir()
        (vf / "vendor").write_text("0x9999\n")
        (vf / "physfn").symlink_to("../0000:10:00.0")
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
        "ok: all 8 MetaX GPUs on the bus are bound",
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


def test_a_gpu_the_driver_left_unbound_fails_naming_it(tmp_path, capsys):
    """Six GPUs bound, two the new driver did not claim: the node has lost them."""
    node(tmp_path / "sys", metax=5, vfio=1, unbound=2)
    assert check(tmp_path, "--driver-version", "2.32.0.6") == 1
    line = "2 of 8 MetaX GPUs are bound to neither metax nor vfio-pci: 0000:10:00.0, 0000:11:00.0"
    assert failed(tmp_path, capsys, line).splitlines()[-1] == "ok: 5 GPU functions bound to metax, 1 to vfio-pci"


def test_a_bus_without_metax_functions_skips_the_count(tmp_path, capsys):
    """The functions bound to metax but no vendor 0x9999 on the bus (another vendor ID): the count is skipped."""
    root = node(tmp_path / "sys", metax=1)
    for device in (root / "bus" / "pci" / "devices").iterdir():
        (device / "vendor").write_text("0x1d17\n")
    assert check(tmp_path) == 0
    devices = root / "bus" / "pci" / "devices"
    assert capsys.readouterr().out.splitlines()[-1] == f"skipped: no PCI function of MetaX's vendor ID 0x9999 in {devices}"


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
