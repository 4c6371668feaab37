"""A new user's first hour against a real server: `dsec doctor` on the healthy host and
with each fault injected, and the first-hour errors (no server, wrong token, unknown
image, image not built yet, port taken, DSEC_HOME not writable) naming the problem and
the next command to run, never a traceback."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_server import DSEC, Server

pytestmark = pytest.mark.integration

ALL_CHECKS = {"root", "home", "cgroups", "overlayfs", "runc", "runsc", "nftables", "net_cidr", "disk", "nofile",
              "port", "stock_images", "server", "token"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(server: Server, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in server.env.items() if not k.startswith("DSEC_") or k == "DSEC_HOME"}
    env.update({"DSEC_URL": server.url, "DSEC_TOKEN": server.token, **extra})
    return env


def _doctor(env: dict[str, str], **kw: object) -> tuple[int, dict[str, dict[str, str]]]:
    r = subprocess.run([DSEC, "doctor", "--json"], env=env, capture_output=True, text=True, timeout=120,
                       check=False, **kw)  # type: ignore[call-overload]
    assert "Traceback" not in r.stderr, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] == (r.returncode == 0)
    return r.returncode, {c["name"]: c for c in report["checks"]}


def test_doctor_on_the_healthy_host(server: Server) -> None:
    """Every check runs; none fails on the machine the suite runs on; the human form says so."""
    code, checks = _doctor(_env(server))
    assert code == 0, checks
    assert ALL_CHECKS <= set(checks)
    assert all(c["status"] in ("ok", "warn", "skip") for c in checks.values())
    for name in ("root", "home", "cgroups", "overlayfs", "runc", "server", "token"):
        assert checks[name]["status"] == "ok", checks[name]
    r = server.cli("doctor", env=_env(server))
    assert "all checks passed" in r.stdout


@pytest.mark.parametrize("fault", ["no_runc", "low_nofile", "small_disk", "redis_down", "no_server", "bad_token"])
def test_doctor_names_each_injected_fault(server: Server, fault: str) -> None:
    """Each fault shows up in its own check with the command that fixes it."""
    env, kw = _env(server), {}
    if fault == "no_runc":
        env["PATH"] = "/nonexistent"  # neither runc nor runsc can be found
    elif fault == "low_nofile":
        kw["preexec_fn"] = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    elif fault == "small_disk":
        env["DSEC_DOCTOR_MIN_FREE_DISK"] = "1000000T"
    elif fault == "redis_down":
        env["DSEC_STATE_URL"] = f"redis://127.0.0.1:{_free_port()}/0"
    elif fault == "no_server":
        env["DSEC_URL"] = f"http://127.0.0.1:{_free_port()}"
    elif fault == "bad_token":
        env["DSEC_TOKEN"] = "not-a-token"
    code, checks = _doctor(env, **kw)
    name, status, fix = {"no_runc": ("runc", "fail", "apt-get install -y runc"),
                         "low_nofile": ("nofile", "warn", "ulimit -Hn"),
                         "small_disk": ("disk", "warn", "dsec image gc"),
                         "redis_down": ("redis", "fail", "redis-server"),
                         "no_server": ("server", "fail", "dsec serve"),
                         "bad_token": ("token", "fail", "unset DSEC_TOKEN")}[fault]
    assert checks[name]["status"] == status, checks[name]
    assert fix in checks[name]["fix"]
    assert code == (1 if status == "fail" else 0)


@pytest.fixture
def clashing_route() -> Iterator[str]:
    """A test "remote host" (the net lab's netns + veth on 10.250.N.0/24): its route is
    what a clashing DSEC_NET_CIDR would overlap. Removed afterwards."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "net"))
    from netlab import _free_octet, _make_remote, _remove_remote

    remote = _make_remote(f"f{os.getpid() % 1000:03d}", _free_octet(set()))
    try:
        yield remote.cidr
    finally:
        _remove_remote(remote)


def test_doctor_and_serve_refuse_a_clashing_sandbox_range(server: Server, clashing_route: str,
                                                          tmp_path: Path) -> None:
    """DSEC_NET_CIDR over an existing route: doctor fails it with a free-range fix, and
    `dsec serve` refuses to start with the same words."""
    env = _env(server, DSEC_NET_CIDR=clashing_route)
    code, checks = _doctor(env)
    assert code == 1 and checks["net_cidr"]["status"] == "fail" and "DSEC_NET_CIDR=" in checks["net_cidr"]["fix"]
    env["DSEC_HOME"] = str(tmp_path / "home")
    r = subprocess.run([DSEC, "serve", "--port", "0"], env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "FAIL  net_cidr" in r.stderr and "refusing to start" in r.stderr


def test_first_hour_client_errors_name_the_next_command(server: Server, tmp_path: Path) -> None:
    """No server, wrong token, unknown image, a stock image not built yet: one line with
    the problem and one with the next command; exit 1, no traceback."""
    cases = [
        (["ps"], {"DSEC_URL": f"http://127.0.0.1:{_free_port()}"}, ["no DSec server answers", "dsec serve"]),
        (["ps"], {"DSEC_TOKEN": "not-a-token"}, ["unauthorized", "DSEC_TOKEN", "dsec tenant add"]),
        (["run", "nosuchimage", "--", "true"], {}, ["nosuchimage", "dsec image ls"]),
        (["run", "python", "--", "true"], {}, ["'python' is not built yet", "dsec image ensure-stock --only python"]),
    ]
    for args, extra, words in cases:
        r = server.cli(*args, env=_env(server, **extra), check=False)
        text = " ".join(r.stderr.split())  # rich wraps long lines
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        for w in words:
            assert w in text, (args, extra, text)


def test_serve_refuses_a_taken_port(tmp_path: Path) -> None:
    """Port in use: `dsec serve` refuses before starting anything, naming the port and
    `--port`; nothing is left running."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
        env["DSEC_HOME"] = str(tmp_path / "home")
        r = subprocess.run([DSEC, "serve", "--port", str(port)], env=env, capture_output=True, text=True,
                           timeout=120, check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "dsec serve --port" in r.stderr
    assert not (tmp_path / "home" / "server.json").exists()


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs: not writable even for root (permission bits would not stop root)."""
    d = tmp_path / "ro"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


def test_serve_and_doctor_refuse_a_read_only_home(read_only_dir: Path) -> None:
    """DSEC_HOME on a read-only filesystem: serve refuses with the doctor's words (path,
    reason, fix) instead of a traceback; doctor fails the home check the same way."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update(DSEC_HOME=str(read_only_dir / "home"), DSEC_URL=f"http://127.0.0.1:{_free_port()}")
    r = subprocess.run([DSEC, "serve", "--port", "0"], env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"DSEC_HOME {read_only_dir / 'home'} is not writable: Read-only file system" in r.stderr
    assert "point DSEC_HOME at a writable directory" in r.stderr
    r = subprocess.run([DSEC, "doctor", "--json"], env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert r.returncode == 1 and checks["home"]["status"] == "fail"


def test_overlay_check_on_a_healthy_and_a_broken_scratch(tmp_path: Path, read_only_dir: Path) -> None:
    """The overlay check really mounts: fine on a normal directory, a failure naming the
    directory (and the modprobe / local-filesystem fix) where no overlay can be made."""
    from dsec.cli.doctor import check_overlayfs

    assert check_overlayfs(tmp_path / "scratch").status == "ok"
    c = check_overlayfs(read_only_dir / "scratch")
    assert c.status == "fail" and str(read_only_dir / "scratch") in c.detail and "modprobe overlay" in (c.fix or "")


def test_hot_commands_against_a_server_stay_light(server: Server) -> None:
    """`dsec ps` and `dsec run busybox -- true` that succeed import neither the SDK stack
    (pydantic, httpx) nor rich: plain output keeps them at interpreter + typer + http.client."""
    probe = ("import json, sys\nargs = json.loads(sys.argv[1])\nsys.argv = ['dsec', *args]\n"
             "from dsec.cli.main import app\ntry:\n    app()\nexcept SystemExit as e:\n    code = e.code\n"
             "heavy = ('pydantic', 'httpx', 'rich', 'urllib3', 'dsec.sdk', 'dsec.api', 'numpy')\n"
             "print(json.dumps([code, sorted(m for m in sys.modules if m.split('.')[0] in heavy "
             "or m.startswith(heavy))]), file=sys.__stderr__)")
    for args in (["ps"], ["run", "busybox", "--", "true"]):
        r = subprocess.run([sys.executable, "-c", probe, json.dumps(args)], env=_env(server), capture_output=True,
                           text=True, timeout=120, check=False)
        code, loaded = json.loads(r.stderr.strip().splitlines()[-1])
        assert code in (0, None) and loaded == [], (args, code, loaded)


def test_busybox_wget_fails_cleanly_instead_of_crashing(server: Server) -> None:
    """The busybox image's wget is the static client: with a timeout (busybox-static's own
    wget segfaults there, exit 139) a refused connection is exit 1 with a message, and
    https:// points at the python image."""
    r = server.cli("run", "busybox", "--", "wget", "-q", "-T", "2", "-O-", "http://127.0.0.1:1/", check=False)
    assert r.returncode == 1 and "can't connect to remote host 127.0.0.1:1" in r.stderr, r.stderr
    r = server.cli("run", "busybox", "--", "wget", "-qO-", "https://127.0.0.1:1/", check=False)
    assert r.returncode == 1 and "use the python image" in r.stderr
