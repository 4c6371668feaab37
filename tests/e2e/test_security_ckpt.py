"""Issue 18 #3 (checkpoint part) against a real ``dsec serve``: sparse files must not turn a
checkpoint or a restore into unbounded server memory or unbounded disk outside every quota.

Measured: the server's peak RSS (VmHWM of the serve process this module started, reset via
/proc/PID/clear_refs before the attack) and the disk blocks under DSEC_HOME."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_server import Server, running_server
from sec_helpers import status_kib

pytestmark = pytest.mark.integration

MIB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Grace 0: an unpacked layer no mounted sandbox uses goes at the next sweep.
    with running_server(tmp_path_factory, "dsec-home-ckpt", {"DSEC_CHECKPOINT_LAYER_GC_GRACE_S": "0"}) as srv:
        yield srv


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {server.token}"}, timeout=300) as c:
        yield c


def _reset_peak(pid: int) -> int:
    """Reset the process's VmHWM to its current RSS (kernel clear_refs 5); returns RSS KiB."""
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")
    return status_kib(pid, "VmRSS")


def disk_bytes(root: Path) -> int:
    """Blocks actually allocated under ``root`` (holes cost nothing), not apparent sizes."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _create(api: httpx.Client, isolation: str) -> str:
    r = api.post("/v1/sandboxes", json={"image": "busybox", "disk": "64M", "memory": "128M", "cpu": 0.5,
                                        "isolation": isolation})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _exec(api: httpx.Client, sid: str, cmd: str) -> dict:
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout": 60})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    return dict(r.json())


@pytest.mark.parametrize("isolation", ["container", pytest.param("gvisor", marks=pytest.mark.gvisor)])
def test_sparse_file_checkpoint_is_bounded_by_disk_quota(server: Server, api: httpx.Client,
                                                         isolation: str) -> None:
    """``truncate -s 1G`` in a 64M-disk sandbox: the checkpoint is refused with 413 naming
    the disk quota, before any file is read. The server's peak RSS grows < 128 MiB (it was
    +2.3 GiB: the file read, tarred and compressed in memory) and nothing sizeable is written
    under DSEC_HOME."""
    sid = _create(api, isolation)
    try:
        _exec(api, sid, "echo warm > /warm")
        assert api.post(f"/v1/sandboxes/{sid}/checkpoints").status_code == 201  # code paths loaded
        _exec(api, sid, "truncate -s 1G /big && ls -ls /big")
        disk_before = disk_bytes(server.home)
        base_kib = _reset_peak(server.proc.pid)
        r = api.post(f"/v1/sandboxes/{sid}/checkpoints")
        growth_mib = (status_kib(server.proc.pid, "VmHWM") - base_kib) / 1024
        disk_growth_mib = (disk_bytes(server.home) - disk_before) / MIB
        print(f"[{isolation}] sparse 1G checkpoint: HTTP {r.status_code}, server peak RSS +{growth_mib:.1f} MiB, "
              f"DSEC_HOME disk +{disk_growth_mib:.1f} MiB")
        assert r.status_code == 413, r.text
        assert r.json()["code"] == "payload_too_large" and "disk quota" in r.json()["message"]
        assert growth_mib < 128, growth_mib
        assert disk_growth_mib < 16, disk_growth_mib
        # The sandbox is thawed and usable; removing the file makes it checkpointable again.
        _exec(api, sid, "rm /big")
        assert api.post(f"/v1/sandboxes/{sid}/checkpoints").status_code == 201
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_sparse_file_in_default_disk_sandbox_is_capped(server: Server, api: httpx.Client) -> None:
    """With the default 10G disk quota, a 4G sparse file is still refused (413): the bound
    is the disk quota capped by checkpoint_max_bytes (1 GiB), and the peak RSS stays flat."""
    r = api.post("/v1/sandboxes", json={"image": "busybox", "memory": "128M", "cpu": 0.5})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        _exec(api, sid, "truncate -s 4G /big")
        base_kib = _reset_peak(server.proc.pid)
        r = api.post(f"/v1/sandboxes/{sid}/checkpoints")
        growth_mib = (status_kib(server.proc.pid, "VmHWM") - base_kib) / 1024
        print(f"[default disk] sparse 4G checkpoint: HTTP {r.status_code}, server peak RSS +{growth_mib:.1f} MiB")
        assert r.status_code == 413 and "checkpoint_max_bytes" in r.json()["message"], r.text
        assert growth_mib < 128, growth_mib
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_restore_keeps_holes_and_sweeps_layers(server: Server, api: httpx.Client) -> None:
    """A checkpoint of a sparse file within quota (40M apparent in a 64M sandbox) restores
    byte for byte with the holes kept: the unpacked layer under DSEC_HOME/ckpt-layers takes
    < 4 MiB of disk (it was a 40 MiB non-sparse file). Once the restored sandbox is killed
    and the checkpoint deleted, no unpacked layer is left (they used to stay forever)."""
    layers = server.home / "ckpt-layers"
    sid = _create(api, "container")
    try:
        _exec(api, sid, "truncate -s 40M /sparse && printf 'tail' >> /sparse && echo small > /small")
        r = api.post(f"/v1/sandboxes/{sid}/checkpoints")
        assert r.status_code == 201, r.text
        ck = r.json()["id"]
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
    r = api.post(f"/v1/checkpoints/{ck}/restore", json={})
    assert r.status_code == 201, r.text
    sid2 = r.json()["id"]
    try:
        out = _exec(api, sid2, "stat -c %s /sparse; tail -c 4 /sparse; echo; cat /small; "
                               "head -c 40M /sparse | tr -d '\\000' | wc -c")["stdout"].split()
        assert out == [str(40 * MIB + 4), "tail", "small", "0"], out
        used = disk_bytes(layers)
        print(f"restore of a 40M sparse file: ckpt-layers disk {used / MIB:.2f} MiB")
        assert used < 4 * MIB, used
        assert [p for p in layers.iterdir() if not p.name.startswith(".")], "layer dirs exist while mounted"
    finally:
        assert api.delete(f"/v1/sandboxes/{sid2}").status_code == 204
    assert api.delete(f"/v1/checkpoints/{ck}").status_code == 204
    # A debounced sweep armed by an earlier teardown may be deleting a renamed
    # ".<layer>.gc-..." dir right now (outside its lock): gone within moments, not leaked.
    end = time.monotonic() + 10
    while (left := sorted(p.name for p in layers.iterdir()) if layers.is_dir() else []) and time.monotonic() < end:
        time.sleep(0.1)
    assert left == [], left


def test_sparse_file_episode_step_is_bounded(server: Server, api: httpx.Client) -> None:
    """An episode step that makes a 1 GiB sparse file in a 64M-disk sandbox: its checkpoint
    unit is refused (413) from the stat walk (server peak RSS < 128 MiB), nothing is logged,
    and the next step runs in a sandbox restored from the last unit (the file is gone)."""
    spec = {"image": "busybox", "disk": "64M", "memory": "128M", "cpu": 0.5}
    r = api.post("/v1/episodes/sparse-ep/open", json={"spec": spec})
    assert r.status_code == 200, r.text
    hdr = {"x-dsec-episode-epoch": str(r.json()["epoch"])}

    def step(n: int, cmd: str) -> httpx.Response:
        return api.post("/v1/episodes/sparse-ep/steps", json={"step": n, "request": {"cmd": cmd}}, headers=hdr)

    try:
        assert step(0, "echo base > /base").status_code == 200
        base_kib = _reset_peak(server.proc.pid)
        r = step(1, "truncate -s 1G /big")
        growth_mib = (status_kib(server.proc.pid, "VmHWM") - base_kib) / 1024
        print(f"episode step with a sparse 1G file: HTTP {r.status_code}, server peak RSS +{growth_mib:.1f} MiB")
        assert r.status_code == 413 and "disk quota" in r.json()["message"], r.text
        assert growth_mib < 128, growth_mib
        r = step(1, "cat /base; ls /big")
        assert r.status_code == 200, r.text
        assert r.json()["stdout"] == "base\n" and "No such file" in r.json()["stderr"]
        assert api.get("/v1/episodes/sparse-ep").json()["steps"] == 2
    finally:
        api.delete("/v1/episodes/sparse-ep", headers=hdr)


def test_layers_swept_after_restored_sandbox_expires(server: Server, api: httpx.Client) -> None:
    """A restored sandbox that dies by its TTL (no kill call) does not leave its unpacked
    layers behind: the teardown schedules a sweep, even while the checkpoint still exists."""
    import time

    layers = server.home / "ckpt-layers"
    sid = _create(api, "container")
    try:
        _exec(api, sid, "echo ttl > /ttl-file")
        r = api.post(f"/v1/sandboxes/{sid}/checkpoints")
        assert r.status_code == 201, r.text
        ck = r.json()["id"]
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
    r = api.post(f"/v1/checkpoints/{ck}/restore", json={"timeout": 3})
    assert r.status_code == 201, r.text
    sid2 = r.json()["id"]
    assert _exec(api, sid2, "cat /ttl-file")["stdout"] == "ttl\n"
    assert [p for p in layers.iterdir() if not p.name.startswith(".")]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and [p for p in layers.iterdir() if not p.name.startswith(".")]:
        time.sleep(1)
    left = [p.name for p in layers.iterdir()]
    assert left == [], left
    assert api.get(f"/v1/sandboxes/{sid2}").json().get("state") in (None, "destroyed", "stopped")
    assert api.delete(f"/v1/checkpoints/{ck}").status_code == 204
