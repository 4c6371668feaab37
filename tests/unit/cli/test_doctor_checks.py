"""`dsec doctor`'s verdicts (pure decisions) and the checks that need no root, each on a
healthy input and with its fault injected. Root-only faults (read-only DSEC_HOME, a
clashing route, a refused token...) are in tests/e2e/test_first_hour.py."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dsec.cli import doctor
from dsec.config import Settings


def test_root_verdict() -> None:
    """Non-root fails with the sudo command to run instead."""
    assert doctor.decide_root(0).status == "ok"
    c = doctor.decide_root(1000)
    assert c.status == "fail" and "uid 1000" in c.detail and "sudo .venv/bin/dsec" in (c.fix or "")


def test_cgroups_v2_v1_and_missing(tmp_path: Path) -> None:
    """v2 with cpu/memory/pids, or v1 with cpu/memory/pids/freezer, is usable; anything less
    fails naming what is missing and how to mount it."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert doctor.decide_cgroups(v2).status == "ok"
    (v2 / "cgroup.controllers").write_text("cpuset io\n")
    c = doctor.decide_cgroups(v2)
    assert c.status == "fail" and "['cpu', 'memory', 'pids']" in c.detail and "subtree_control" in (c.fix or "")
    v1 = tmp_path / "v1"
    for ctl in ("cpu", "memory", "pids", "freezer"):
        (v1 / ctl).mkdir(parents=True)
    assert doctor.decide_cgroups(v1).status == "ok"
    (v1 / "freezer").rmdir()
    c = doctor.decide_cgroups(v1)
    assert c.status == "fail" and "freezer" in c.detail and "mount -t cgroup2" in (c.fix or "")
    assert doctor.decide_cgroups(tmp_path / "nothing").status == "fail"


def test_missing_binary_via_path(tmp_path: Path) -> None:
    """A binary absent from PATH fails (runc) or warns (runsc, only its tier) with the
    apt-get line; one that exits non-zero is reported as not working."""
    empty = str(tmp_path)
    c = doctor.check_binary("runc", "runc", "runc", required=True, path_env=empty)
    assert c.status == "fail" and "not found on PATH" in c.detail and "apt-get install -y runc" in (c.fix or "")
    assert doctor.check_binary("runsc", "runsc", "runsc", required=False, path_env=empty).status == "warn"
    broken = tmp_path / "runc"
    broken.write_text("#!/bin/sh\necho 'segfault' >&2\nexit 139\n")
    broken.chmod(0o755)
    c = doctor.check_binary("runc", "runc", "runc", required=True, path_env=empty)
    assert c.status == "fail" and "does not run" in c.detail and "segfault" in c.detail and "--reinstall" in (c.fix or "")
    ok = tmp_path / "runc"
    ok.write_text("#!/bin/sh\necho 'runc version 9'\n")
    c = doctor.check_binary("runc", "runc", "runc", required=True, path_env=empty)
    assert c.status == "ok" and "runc version 9" in c.detail


def test_disk_and_nofile_thresholds() -> None:
    """Low free space and a low open-file hard limit warn with the fix; enough is ok."""
    assert doctor.decide_disk(Path("/x"), 10 * 2**30, 5 * 2**30).status == "ok"
    c = doctor.decide_disk(Path("/x"), 2**30, 5 * 2**30)
    assert c.status == "warn" and "1.0 GiB" in c.detail and "dsec image gc" in (c.fix or "")
    assert doctor.decide_nofile(1024, 65536, 16384).status == "ok"  # serve raises soft to hard
    c = doctor.decide_nofile(1024, 4096, 16384)
    assert c.status == "warn" and "ulimit -Hn 16384" in (c.fix or "")


def test_home_not_writable(tmp_path: Path) -> None:
    """A DSEC_HOME that cannot be created or written fails naming the path and the fix."""
    assert doctor.check_home(tmp_path / "home").status == "ok"
    (tmp_path / "file").write_text("")
    c = doctor.check_home(tmp_path / "file" / "home")
    assert c.status == "fail" and "Not a directory" in c.detail and "DSEC_HOME" in (c.fix or "")


def test_port_taken() -> None:
    """A port something else listens on fails with how to find it and another --port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        c = doctor.check_port("127.0.0.1", port)
        assert c.status == "fail" and "in use" in c.detail and f"sport = :{port}" in (c.fix or "")
        assert "--port" in (c.fix or "")
        assert doctor.check_port("127.0.0.1", port, ours=True).status == "ok"  # our own running server
    assert doctor.check_port("127.0.0.1", port).status == "ok"


def test_cidr_verdict() -> None:
    """An overlap names the routes and a free range; no overlap is ok."""
    assert doctor.decide_cidr("10.213.0.0/16", [], None).status == "ok"
    c = doctor.decide_cidr("10.213.0.0/16", ["10.213.1.0/24 dev eth1"], None)
    assert c.status == "fail" and "eth1" in c.detail and "DSEC_NET_CIDR=" in (c.fix or "")


def test_stock_images_missing(tmp_path: Path) -> None:
    """A fresh DSEC_HOME has no stock images: a warning with `dsec image ensure-stock`."""
    c = doctor.check_stock_images(Settings(home=tmp_path))
    assert c.status == "warn" and "dsec image ensure-stock" in (c.fix or "")


def test_configured_services_unreachable() -> None:
    """Redis configured but down fails naming host:port; unconfigured services are not checked."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        checks = doctor.check_services(Settings(state_url=f"redis://127.0.0.1:{port}/0"))
    assert [c.name for c in checks] == ["redis"]
    assert checks[0].status == "fail" and f"127.0.0.1:{port}" in checks[0].detail
    assert doctor.check_services(Settings()) == []
    if "cluster" in Settings.model_fields:  # the Ray cluster setting (cluster issue)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            (ray,) = doctor.check_services(Settings(cluster=f"ray://127.0.0.1:{port}"))
        assert ray.name == "ray" and ray.status == "fail" and "ray start --head" in (ray.fix or "")


def test_server_not_running(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No server at DSEC_URL: the server check fails with `dsec serve`; the token is not asked."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("DSEC_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    server, token = doctor.check_server()
    assert server.status == "fail" and f"127.0.0.1:{port}" in server.detail and "dsec serve" in (server.fix or "")
    assert token.status == "skip"


def test_render_shows_fixes_only_for_problems() -> None:
    checks = [doctor.Check(name="a", status="ok", detail="fine", fix="never shown"),
              doctor.Check(name="b", status="fail", detail="broken", fix="do this")]
    text = doctor.render(checks)
    assert "never shown" not in text and "FAIL  b" in text and "fix: do this" in text
