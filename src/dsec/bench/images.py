"""Image benchmark: ours vs a baseline in the same run, reported as ratios.

1. import + unpack of the python stock image as a ``docker save`` archive (made by
   ``skopeo copy`` from our export) into a fresh store, vs ``podman load`` of the SAME
   archive into a fresh podman storage root (overlay driver). Alternated, best of N.
2. overlay prepare (Snapshotter.prepare) median on the cached image (target < 2 ms),
   plus the first prepare in a fresh store object (pays the per-process verification).
3. unchanged rebuild of a 3-step spec (copy, run, run) on python (target < 1 s),
   against the first (cold) build of the same spec.

Run: ``python -m dsec.bench.images [REPORT_DIR]`` (root; needs the python stock image,
which ``dsec image ensure-stock`` builds).

Registry pull (``run_pull``; ``dsec bench images-pull`` or ``python -m dsec.bench.images
pull [REPORT_DIR]``): python image pushed to a local docker-registry, then pulled into an
empty store vs ``skopeo copy docker://... oci:...`` of the same image, alternated, best of 3;
then a real ``dsec serve`` without the image: cold create (pulls from the registry) ->
first exec, the pull time apart, and a warm create -> first exec.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from dsec.config import get_settings, load_settings
from dsec.images import ImageStore, Snapshotter
from dsec.images.build import Builder, UnshareRunner, load_spec
from dsec.images.stock import ensure_stock


def _store(home: Path) -> ImageStore:
    return ImageStore(home / "images", load_settings(home=home))


def _docker_archive(src: ImageStore, work: Path) -> Path:
    src.export("python", work / "oci", tag="bench", compression="gzip")
    out = work / "python-docker.tar"
    subprocess.run(["skopeo", "copy", f"oci:{work}/oci:bench", f"docker-archive:{out}:python:bench"],
                   check=True, capture_output=True)
    shutil.rmtree(work / "oci")
    return out


def _ours(archive: Path, work: Path) -> float:
    home = Path(tempfile.mkdtemp(dir=work, prefix="ours-"))
    os.sync()  # start both sides with no dirty pages of the other side pending
    t0 = time.perf_counter()
    _store(home).import_archive(archive)
    return time.perf_counter() - t0  # home removed with `work` at the end (no deletes between runs)


def _podman(archive: Path, work: Path) -> float:
    root = Path(tempfile.mkdtemp(dir=work, prefix="podman-"))
    runroot = Path(tempfile.mkdtemp(prefix="dpb-", dir="/tmp"))  # podman wants runroot < 50 chars
    os.sync()
    base = ["podman", "--root", str(root / "root"), "--runroot", str(runroot), "--storage-driver", "overlay",
            "--events-backend", "none"]
    t0 = time.perf_counter()
    proc = subprocess.run(base + ["load", "-q", "-i", str(archive)], capture_output=True, text=True, check=False)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"podman load failed ({proc.returncode}): {proc.stderr[-2000:]}")
    _PODMAN_CLEANUP.append((base, root, runroot))  # deleted at the end: deletes (ext4 discard)
    return dt                                      # between runs slowed whichever side ran next


_PODMAN_CLEANUP: list[tuple[list[str], Path, Path]] = []


def _cleanup_podman() -> None:
    while _PODMAN_CLEANUP:
        base, root, runroot = _PODMAN_CLEANUP.pop()
        subprocess.run(base + ["system", "reset", "-f"], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(runroot, ignore_errors=True)


def _prepare(home: Path, n: int) -> dict:
    first_store = _store(home)
    snap = Snapshotter(first_store)
    t0 = time.perf_counter()
    snap.prepare("bench-first", "python:bench", home / "scratch" / "first")
    first_ms = (time.perf_counter() - t0) * 1000
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        snap.prepare(f"bench-{i}", "python:bench", home / "scratch" / str(i))
        times.append((time.perf_counter() - t0) * 1000)
    for i in range(n):
        snap.release(f"bench-{i}")
    snap.release("bench-first")
    times.sort()
    # Baseline on the same disk: the two mkdirs (upper, work) any prepare must do.
    base = []
    for i in range(n):
        d = home / "scratch" / f"b{i}"
        t0 = time.perf_counter()
        os.makedirs(d / "upper")
        os.mkdir(d / "work")
        base.append((time.perf_counter() - t0) * 1000)
    return {"n": n, "median_ms": statistics.median(times), "p95_ms": times[int(n * 0.95) - 1],
            "first_in_process_ms": first_ms, "baseline_mkdirs_median_ms": statistics.median(base),
            "ratio_vs_mkdir_baseline": statistics.median(times) / statistics.median(base)}


def _rebuild(home: Path, work: Path) -> dict:
    ctx = work / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app" / "main.py").write_text("print('hello from the bench')\n")
    (ctx / "spec.yaml").write_text(yaml.safe_dump({"from": "python:bench", "steps": [
        {"copy": {"src": "app/", "dest": "/work/app"}},
        {"run": "python3 -m venv /opt/venv"},
        {"run": "python3 /work/app/main.py > /work/out.txt"},
    ]}))
    store = _store(home)
    b = Builder(store, UnshareRunner(store.settings))
    t0 = time.perf_counter()
    r1 = b.build(load_spec(ctx / "spec.yaml"), "bench-app:1", ctx)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    r2 = b.build(load_spec(ctx / "spec.yaml"), "bench-app:1", ctx)
    warm = time.perf_counter() - t0
    assert r2.built == 0 and r2.image.id == r1.image.id
    return {"cold_build_s": cold, "unchanged_rebuild_s": warm, "steps": 3, "rebuilt_steps": r2.built,
            "ratio_rebuild_vs_cold": warm / cold}


def run(report_dir: Path | str = "bench-reports", rounds: int = 3, prepares: int = 500) -> dict:
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    s = get_settings()
    src = ImageStore(s.home / "images", s)
    ensure_stock(src, ["python"], log=lambda m: print(m, file=sys.stderr))
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-images-", dir=s.home))
    try:
        archive = _docker_archive(src, work)
        ours, podman = [], []
        for r in range(rounds):  # alternate who goes first so disk/page-cache state favours neither
            first, second = (_ours, _podman) if r % 2 == 0 else (_podman, _ours)
            for fn in (first, second):
                os.sync()
                time.sleep(2)  # let the previous side's deletes/discards settle
                (ours if fn is _ours else podman).append(fn(archive, work))
        home = work / "main"
        _store(home).import_archive(archive)
        result = {
            "archive_bytes": archive.stat().st_size,
            "import": {"ours_s": min(ours), "podman_load_s": min(podman), "ours_all": ours, "podman_all": podman,
                       "ratio_ours_vs_podman": min(ours) / min(podman),
                       "ratio_median": statistics.median(ours) / statistics.median(podman),
                       "load_avg_1m": os.getloadavg()[0]},
            "prepare": _prepare(home, prepares),
            "rebuild": _rebuild(home, work),
        }
    finally:
        _cleanup_podman()
        shutil.rmtree(work, ignore_errors=True)
    (report_dir / "images.json").write_text(json.dumps(result, indent=2))
    return result


# --- registry pull (issue 12) --------------------------------------------------------------

class _LocalRegistry:
    """The CNCF distribution registry (Debian ``docker-registry``) on a free loopback
    port with its own storage under ``work``; stopped by PID."""

    def __init__(self, work: Path) -> None:
        import socket

        import httpx

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.host = f"127.0.0.1:{port}"
        cfg = {"version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
               "storage": {"filesystem": {"rootdirectory": str(work / "registry")}},
               "http": {"addr": self.host, "secret": os.urandom(8).hex()}}
        (work / "registry.yml").write_text(yaml.safe_dump(cfg))
        self._log = open(work / "registry.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(["docker-registry", "serve", str(work / "registry.yml")],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            try:
                httpx.get(f"http://{self.host}/v2/", timeout=1)
                return
            except httpx.TransportError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("docker-registry did not start: "
                                       + (work / "registry.log").read_text()[-1000:]) from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._log.close()


def _pull_ours(ref: str, work: Path, unpack: bool) -> tuple[float, float]:
    from dsec.images.registry_ops import pull

    home = Path(tempfile.mkdtemp(dir=work, prefix="pull-"))
    st = _store(home)  # an empty DSEC image store
    os.sync()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    pull(st, ref, unpack=unpack)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)  # nothing else runs in this process meanwhile
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def _pull_skopeo(ref: str, work: Path) -> tuple[float, float]:
    dest = Path(tempfile.mkdtemp(dir=work, prefix="skopeo-"))
    os.sync()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", f"docker://{ref}", f"oci:{dest}:bench"],
                   check=True, capture_output=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def _cold_create(reg: _LocalRegistry, work: Path) -> dict:
    """A real ``dsec serve`` whose store lacks the image, ``image_registry`` = the local
    registry: create (which pulls) -> first exec, then a warm create -> first exec."""
    import httpx

    from dsec.api.launch import reap_home, start_serve

    home = work / "cold-node"
    srv = start_serve(home, {"DSEC_IMAGE_REGISTRY": reg.host}, log_level="info")
    out: dict = {}
    try:
        with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {srv.token}"}, timeout=600) as c:
            for phase in ("cold", "warm"):
                t0 = time.perf_counter()
                r = c.post("/v1/sandboxes", json={"image": "bench/python:latest"})
                r.raise_for_status()
                t1 = time.perf_counter()
                e = c.post(f"/v1/sandboxes/{r.json()['id']}/exec", json={"cmd": ["python3", "-c", "print(1)"]})
                e.raise_for_status()
                t2 = time.perf_counter()
                out[phase] = {"create_s": t1 - t0, "first_exec_s": t2 - t1, "create_to_first_exec_s": t2 - t0}
                c.delete(f"/v1/sandboxes/{r.json()['id']}")
        log = srv.log.read_text(errors="replace")
        pulled = [ln for ln in log.splitlines() if "pulled " in ln and "bench/python" in ln]
        out["pull_s"] = float(pulled[-1].rsplit(" in ", 1)[1].rstrip("s")) if pulled else None
        out["pull_share_of_cold_create"] = (out["pull_s"] / out["cold"]["create_s"]) if pulled else None
    finally:
        srv.stop()
        reap_home(home, load_settings(home=home))
    return out


def run_pull(report_dir: Path | str = "bench-reports", rounds: int = 3, cold_create: bool = True) -> dict:
    """Pull of the python image from a local registry into an empty DSEC store vs
    ``skopeo copy docker://... oci:...`` of the same image, alternated, best of N.
    Also: our push time, and pull + unpack (ready for a sandbox) as a separate figure."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    s = get_settings()
    src = ImageStore(s.home / "images", s)
    ensure_stock(src, ["python"], log=lambda m: print(m, file=sys.stderr))
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-pull-", dir=s.home))
    reg = _LocalRegistry(work)
    try:
        from dsec.images.registry_ops import push

        ref = f"{reg.host}/bench/python:latest"
        t0 = time.perf_counter()
        push(src, "python", ref)
        push_s = time.perf_counter() - t0
        _pull_ours(ref, work, False)  # warm-up: imports, TLS context (a node agent is long-lived)
        ours, skopeo, ours_cpu, skopeo_cpu, unpacked = [], [], [], [], []
        for r in range(rounds):  # alternate who goes first
            order = [("ours", lambda: _pull_ours(ref, work, False)), ("skopeo", lambda: _pull_skopeo(ref, work))]
            for name, fn in (order if r % 2 == 0 else order[::-1]):
                time.sleep(1)
                wall, cpu = fn()
                (ours if name == "ours" else skopeo).append(wall)
                (ours_cpu if name == "ours" else skopeo_cpu).append(cpu)
        for _ in range(max(1, rounds // 2)):
            unpacked.append(_pull_ours(ref, work, True)[0])
        info = src.resolve("python")
        result = {
            "image_bytes": info.size, "layers": len(info.layers), "registry": "docker-registry (CNCF distribution)",
            "push_s": push_s,
            "pull": {"ours_s": min(ours), "skopeo_copy_s": min(skopeo), "ours_all": ours, "skopeo_all": skopeo,
                     "ratio_ours_vs_skopeo": min(ours) / min(skopeo),
                     "ratio_median": statistics.median(ours) / statistics.median(skopeo),
                     "ours_MiB_s": info.size / min(ours) / 2**20,
                     "ours_cpu_s_median": statistics.median(ours_cpu),
                     "skopeo_cpu_s_median": statistics.median(skopeo_cpu),
                     "ratio_cpu_median": statistics.median(ours_cpu) / statistics.median(skopeo_cpu)},
            "pull_and_unpack_s": min(unpacked),
            "cold_create": _cold_create(reg, work) if cold_create else None,
            "concurrency": s.image_max_concurrent_pulls,
            "load_avg_1m": os.getloadavg()[0],
            "notes": "ours: blobs fsynced + digest-verified before rename, image registered (no unpack); "
                     "skopeo: copy into an OCI layout dir (no fsync). pull_and_unpack_s: ours until every "
                     "layer is unpacked and sealed (ready for a sandbox).",
        }
    finally:
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)
    (report_dir / "images-pull.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) > 1 and sys.argv[1] == "pull":
        print(json.dumps(run_pull(sys.argv[2] if len(sys.argv) > 2 else "bench-reports"), indent=2))
    else:
        print(json.dumps(run(sys.argv[1] if len(sys.argv) > 1 else "bench-reports"), indent=2))
