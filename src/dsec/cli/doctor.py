"""``dsec doctor [--json]``: check this host and the server the way a new user needs,
and print for each problem the command that fixes it. ``dsec serve`` runs the host
checks at start (``serve_preflight``) and refuses with the same words.

Each check is a small function returning a ``Check``; decisions are pure functions of
what was observed (``decide_*``), so every verdict is unit-testable, and the gathering
takes its inputs as parameters (paths, PATH, limits) so faults can be injected safely.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import typer
from pydantic import BaseModel

from dsec.config import Settings, load_settings, parse_bytes

Status = Literal["ok", "warn", "fail", "skip"]
SUDO = "as root (`sudo` for a non-root user)"


class Check(BaseModel):
    """One verdict: ``fail`` blocks ``dsec serve``; ``warn`` does not."""

    name: str
    status: Status
    detail: str
    fix: str | None = None


class Report(BaseModel):
    ok: bool
    checks: list[Check]


# --- pure decisions ------------------------------------------------------------------------
def decide_root(euid: int) -> Check:
    if euid == 0:
        return Check(name="root", status="ok", detail="running as root")
    return Check(name="root", status="fail", detail=f"running as uid {euid}: sandboxes need root (mounts, "
                 "cgroups, namespaces)", fix="sudo .venv/bin/dsec doctor   (and `sudo .venv/bin/dsec serve`)")


def decide_cgroups(root: Path) -> Check:
    """cgroup v2 (unified, with cpu/memory/pids delegated) or v1 with cpu/memory/pids/freezer."""
    ctl = root / "cgroup.controllers"
    if ctl.is_file():
        have = set(ctl.read_text().split())
        missing = sorted({"cpu", "memory", "pids"} - have)
        if not missing:
            return Check(name="cgroups", status="ok", detail=f"cgroup v2 at {root} ({' '.join(sorted(have))})")
        return Check(name="cgroups", status="fail", detail=f"cgroup v2 at {root} lacks controllers {missing}",
                     fix=f"enable them {SUDO}: echo '+{' +'.join(missing)}' > {root}/cgroup.subtree_control")
    v1 = {c for c in ("cpu", "memory", "pids", "freezer") if (root / c).is_dir()}
    if v1 == {"cpu", "memory", "pids", "freezer"}:
        return Check(name="cgroups", status="ok", detail=f"cgroup v1 hierarchies at {root} (cpu, memory, pids, "
                     "freezer)")
    missing = sorted({"cpu", "memory", "pids", "freezer"} - v1)
    return Check(name="cgroups", status="fail", detail=f"no usable cgroups at {root} (missing {missing})",
                 fix=f"mount cgroup v2 {SUDO}: mount -t cgroup2 none {root}  (systemd hosts have it already)")


def decide_binary(name: str, path: str | None, version: str | None, error: str | None,
                  package: str, required: bool) -> Check:
    if path is None:
        return Check(name=name, status="fail" if required else "warn",
                     detail=f"{name} not found on PATH" + ("" if required else f" (only the {name} tier needs it)"),
                     fix=f"apt-get install -y {package}   {SUDO}; or run scripts/setup.sh")
    if error is not None:
        return Check(name=name, status="fail" if required else "warn", detail=f"{path} does not run: {error}",
                     fix=f"reinstall it: apt-get install --reinstall -y {package}   {SUDO}")
    return Check(name=name, status="ok", detail=f"{path}: {version}")


def decide_disk(path: Path, free: int, need: int) -> Check:
    gib = free / 2**30
    if free >= need:
        return Check(name="disk", status="ok", detail=f"{gib:.1f} GiB free under {path}")
    return Check(name="disk", status="warn", detail=f"only {gib:.1f} GiB free under {path} (want >= "
                 f"{need / 2**30:.1f} GiB for images and checkpoints)",
                 fix="free space (`dsec image gc`, `dsec episode gc`) or set DSEC_HOME to a larger disk")


def decide_nofile(soft: int, hard: int, need: int) -> Check:
    # `dsec serve` raises its soft limit to the hard one; the hard limit is what counts.
    if hard >= need:
        return Check(name="nofile", status="ok", detail=f"open files: soft {soft}, hard {hard} (serve raises "
                     f"soft to hard; want >= {need})")
    return Check(name="nofile", status="warn", detail=f"open-file hard limit {hard} < {need}: a busy server runs "
                 "out of file descriptors", fix=f"ulimit -Hn {need}; ulimit -n {need}   {SUDO}, in the shell that "
                 f"starts `dsec serve` (systemd: LimitNOFILE={need})")


def decide_home(home: Path, error: str | None) -> Check:
    if error is None:
        return Check(name="home", status="ok", detail=f"DSEC_HOME {home} is writable")
    return Check(name="home", status="fail", detail=f"DSEC_HOME {home} is not writable: {error}",
                 fix=f"mkdir -p {home}   {SUDO}, or point DSEC_HOME at a writable directory")


def decide_port(host: str, port: int, error: str | None, ours: bool) -> Check:
    if ours:
        return Check(name="port", status="ok", detail=f"{host}:{port} is served by the running DSec server")
    if error is None:
        return Check(name="port", status="ok", detail=f"{host}:{port} is free")
    return Check(name="port", status="fail", detail=f"cannot listen on {host}:{port}: {error}",
                 fix=f"stop what listens there (`ss -ltnp 'sport = :{port}'` shows it) or pick another port: "
                     "`dsec serve --port 7071` (or DSEC_PORT)")


def decide_cidr(cidr: str, clash: list[str] | None, error: str | None) -> Check:
    if error is not None:
        return Check(name="net_cidr", status="warn", detail=f"cannot read the routing table: {error}")
    if not clash:
        return Check(name="net_cidr", status="ok", detail=f"DSEC_NET_CIDR {cidr} overlaps no existing route")
    return Check(name="net_cidr", status="fail", detail=f"DSEC_NET_CIDR {cidr} overlaps existing routes: "
                 f"{', '.join(clash)}", fix="pick a free private range, e.g. `export DSEC_NET_CIDR=10.214.0.0/16`")


# --- observations (I/O) -----------------------------------------------------------------------
def _run(argv: list[str], timeout: float = 10) -> tuple[str | None, str | None]:
    """(first output line, None) or (None, error text)."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    if p.returncode != 0:
        return None, (p.stderr or p.stdout).strip()[-300:] or f"exit {p.returncode}"
    return (p.stdout.strip().splitlines() or [""])[0], None


def check_binary(name: str, binary: str, package: str, required: bool, path_env: str | None = None) -> Check:
    found = shutil.which(binary, path=path_env if path_env is not None else os.environ.get("PATH"))
    if found is None:
        return decide_binary(name, None, None, None, package, required)
    out, error = _run([found, "--version"])
    return decide_binary(name, found, out, error, package, required)


def check_overlayfs(scratch: Path) -> Check:
    """A real overlay mount (and unmount) in a scratch dir: what every sandbox root needs."""
    fix = f"modprobe overlay   {SUDO}"
    try:
        fs = Path("/proc/filesystems").read_text()
    except OSError as e:
        return Check(name="overlayfs", status="fail", detail=f"cannot read /proc/filesystems: {e}", fix=fix)
    if "overlay" not in fs.split():
        _run(["modprobe", "overlay"])
        if "overlay" not in Path("/proc/filesystems").read_text().split():
            return Check(name="overlayfs", status="fail", detail="the kernel has no overlay filesystem", fix=fix)
    if os.geteuid() != 0:
        return Check(name="overlayfs", status="skip", detail="overlay is in the kernel (mount test needs root)")
    from dsec.node import syscalls

    try:
        scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".doctor-ovl-", dir=scratch) as tmp:
            d = Path(tmp)
            for sub in ("lower", "upper", "work", "merged"):
                (d / sub).mkdir()
            syscalls.mount_overlay(str(d / "merged"), [str(d / "lower")], str(d / "upper"), str(d / "work"))
            try:
                (d / "merged" / "probe").write_text("ok")
            finally:
                syscalls.umount(str(d / "merged"))
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        return Check(name="overlayfs", status="fail", detail=f"an overlay mount under {scratch} failed: {e}",
                     fix=f"{fix}; DSEC_HOME must be on a local filesystem (ext4/xfs), not overlay-on-overlay")
    return Check(name="overlayfs", status="ok", detail=f"overlay mounts work under {scratch}")


def check_nftables() -> Check:
    fix = f"apt-get install -y nftables libnftables1   {SUDO}"
    try:
        from dsec.net.nft import Nft
    except OSError as e:
        return Check(name="nftables", status="warn", detail=f"libnftables cannot be loaded ({e}): egress "
                     "allow-lists will not work (sandboxes without network still do)", fix=fix)
    if os.geteuid() != 0:
        return Check(name="nftables", status="skip", detail="libnftables present (listing rules needs root)")
    try:
        nft = Nft()
        try:
            nft.list_json("list tables")
        finally:
            nft.close()
    except Exception as e:  # noqa: BLE001
        return Check(name="nftables", status="warn", detail=f"nftables does not answer: {e}", fix=fix)
    return Check(name="nftables", status="ok", detail="nftables answers (egress allow-lists available)")


def check_cidr(settings: Settings) -> Check:
    if not settings.net_enabled:
        return Check(name="net_cidr", status="skip", detail="networking off (DSEC_NET_ENABLED=0)")
    try:
        from dsec.net.links import routes_overlapping

        return decide_cidr(settings.net_cidr, routes_overlapping(settings.net_cidr, "dsec"), None)
    except Exception as e:  # noqa: BLE001
        return decide_cidr(settings.net_cidr, None, str(e))


def _existing_parent(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_disk(settings: Settings) -> Check:
    where = _existing_parent(settings.home)
    return decide_disk(where, shutil.disk_usage(where).free, parse_bytes(settings.doctor_min_free_disk))


def check_nofile(settings: Settings) -> Check:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    return decide_nofile(soft if soft != inf else 2**31, hard if hard != inf else 2**31, settings.doctor_min_nofile)


def check_home(home: Path) -> Check:
    try:
        home.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=home, prefix=".doctor-"):
            pass
    except OSError as e:
        return decide_home(home, e.strerror or str(e))
    return decide_home(home, None)


def check_port(host: str, port: int, ours: bool = False) -> Check:
    if port == 0 or ours:
        return decide_port(host, port, None, ours)
    try:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is not "taken"
            s.bind((host, port))
    except OSError as e:
        return decide_port(host, port, e.strerror or str(e), False)
    return decide_port(host, port, None, False)


def check_stock_images(settings: Settings) -> Check:
    from dsec.images.stock import STOCK

    fix = f"dsec image ensure-stock   {SUDO} (scripts/setup.sh does it)"
    db = settings.home / "images"
    if not db.exists():
        return Check(name="stock_images", status="warn", detail=f"no image store under {settings.home} yet", fix=fix)
    from dsec.errors import DSecError
    from dsec.images import ImageStore

    try:
        store = ImageStore(db, settings)
        missing = []
        for name in STOCK:
            try:
                store.resolve(f"{name}:latest")
            except DSecError:
                missing.append(name)
    except (DSecError, OSError) as e:
        return Check(name="stock_images", status="warn", detail=f"cannot open the image store: {e}", fix=fix)
    if missing:
        return Check(name="stock_images", status="warn", detail=f"stock images not built yet: {', '.join(missing)}",
                     fix=f"dsec image ensure-stock {' '.join('--only ' + m for m in missing)}   {SUDO}")
    return Check(name="stock_images", status="ok", detail=f"stock images present: {', '.join(STOCK)}")


def check_server() -> tuple[Check, Check]:
    """(server reachable, token valid) through the CLI's own client path."""
    from dsec.cli.common import SERVE_HINT
    from dsec.cli.wire import ServerUnreachable, Wire, resolve_target
    from dsec.errors import DSecError, Unauthorized

    t = resolve_target()
    try:
        with Wire(t) as w:
            w.call("GET", "/health")
            reach = Check(name="server", status="ok", detail=f"DSec server answers at {t.url}")
            try:
                w.call("GET", "/v1/sandboxes")
            except Unauthorized as e:
                return reach, Check(name="token", status="fail", detail=f"the token from {t.token_source} is "
                                    f"refused by {t.url}: {e.message}",
                                    fix=f"unset DSEC_TOKEN (the local server's token is {t.home}/token), or "
                                        "ask the server's admin for one (`dsec tenant add NAME` prints it)")
            return reach, Check(name="token", status="ok", detail=f"token from {t.token_source} accepted")
    except ServerUnreachable as e:
        return (Check(name="server", status="fail", detail=e.message, fix=SERVE_HINT),
                Check(name="token", status="skip", detail="no server to ask"))
    except DSecError as e:
        return (Check(name="server", status="fail", detail=f"{t.url} answered oddly: {e.message}",
                      fix="check DSEC_URL points at a DSec server"),
                Check(name="token", status="skip", detail="no server to ask"))


def _tcp(name: str, url: str, fix: str) -> Check:
    from urllib.parse import urlsplit

    u = urlsplit(url if "://" in url else f"tcp://{url}")
    host, port = u.hostname or "127.0.0.1", u.port
    if port is None:
        return Check(name=name, status="warn", detail=f"{url}: no port to probe")
    try:
        with socket.create_connection((host, port), timeout=3):
            return Check(name=name, status="ok", detail=f"{host}:{port} reachable")
    except OSError as e:
        return Check(name=name, status="fail", detail=f"{name} at {host}:{port} unreachable: {e.strerror or e}",
                     fix=fix)


def check_services(settings: Settings) -> list[Check]:
    """Ray / Redis / registry / S3: only those configured."""
    out = []
    if settings.state_backend == "redis":
        out.append(_tcp("redis", settings.redis_url, "start Redis (`redis-server --daemonize yes`) or fix "
                                                     "DSEC_STATE_URL"))
    if settings.blob_backend == "s3" and settings.s3_endpoint:
        out.append(_tcp("s3", settings.s3_endpoint, "start the S3 endpoint or fix DSEC_S3_ENDPOINT"))
    # The Ray cluster (DSEC_CLUSTER: ray://HEAD:PORT or HEAD:PORT) and an image registry,
    # when this build has those settings and they are set.
    for field, name, fix in (("cluster", "ray", "start the head (`ray start --head`) or fix DSEC_CLUSTER"),
                             ("registry_url", "registry", "start the registry or fix DSEC_REGISTRY_URL")):
        val = getattr(settings, field, None)
        if isinstance(val, str) and val and val != "auto":
            out.append(_tcp(name, val.replace("ray://", "tcp://", 1), fix))
    return out


# --- the two users: `dsec doctor` and `dsec serve` -----------------------------------------
def host_checks(settings: Settings, host: str, port: int, server_is_ours: bool = False,
                cgroup_root: Path = Path("/sys/fs/cgroup")) -> list[Check]:
    """What `dsec serve` needs of this machine (also the first part of `dsec doctor`)."""
    checks = [decide_root(os.geteuid()), check_home(settings.home)]
    checks.append(decide_cgroups(cgroup_root))
    checks.append(check_overlayfs(settings.home if checks[1].status == "ok" else Path(tempfile.gettempdir())))
    checks.append(check_binary("runc", settings.runc_path, "runc", required=True))
    checks.append(check_binary("runsc", settings.runsc_path, "runsc", required=False))
    checks += [check_nftables(), check_cidr(settings), check_disk(settings), check_nofile(settings),
               check_port(host, port, server_is_ours), check_stock_images(settings)]
    return checks


def run_doctor(settings: Settings | None = None) -> Report:
    settings = settings or load_settings()
    server, token = check_server()
    from dsec.cli.wire import resolve_target

    url = resolve_target().url
    ours = server.status == "ok" and f"{settings.host}:{settings.port}" in url
    checks = host_checks(settings, settings.host, settings.port, server_is_ours=ours)
    if server.status == "ok" and not ours:  # a server runs elsewhere: the local port does not matter now
        checks = [Check(name="port", status="skip", detail=f"a DSec server already answers at {url}; "
                        f"{settings.host}:{settings.port} only matters to start another")
                  if c.name == "port" else c for c in checks]
    checks += [server, token, *check_services(settings)]
    return Report(ok=all(c.status != "fail" for c in checks), checks=checks)


def render(checks: list[Check], only_problems: bool = False) -> str:
    marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}
    lines = []
    for c in checks:
        if only_problems and c.status not in ("fail", "warn"):
            continue
        lines.append(f"{marks[c.status]}  {c.name:<13} {c.detail}")
        if c.fix and c.status in ("fail", "warn"):
            lines.append(f"      {'':<13} fix: {c.fix}")
    return "\n".join(lines)


def serve_preflight(settings: Settings, host: str, port: int, echo: Callable[[str], Any] = print) -> None:
    """`dsec serve`'s start: the host checks; any failure -> the doctor's words and exit 1."""
    checks = host_checks(settings, host, port)
    failed = [c for c in checks if c.status == "fail"]
    warned = [c for c in checks if c.status == "warn"]
    if warned:
        echo(render(warned))
    if failed:
        echo(render(failed))
        echo(f"dsec serve: refusing to start ({len(failed)} check(s) failed); `dsec doctor` shows every check")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    @app.command()
    def doctor(as_json: bool = typer.Option(False, "--json", help="Machine-readable report")) -> None:
        """Check this host and the server; print what is wrong and the command that fixes it."""
        report = run_doctor()
        if as_json:
            print(report.model_dump_json(indent=2))
        else:
            print(render(report.checks))
            bad = [c for c in report.checks if c.status == "fail"]
            warn = sum(c.status == "warn" for c in report.checks)
            print(f"\n{len(bad)} problem(s) found" if bad else
                  f"\nall checks passed{f' ({warn} warning(s))' if warn else ''}")
        raise typer.Exit(0 if report.ok else 1)
