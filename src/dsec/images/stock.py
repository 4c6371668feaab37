"""Stock images built offline on a fresh machine (no registry needed).

- ``busybox``: Debian's busybox-static (/bin/busybox + applet symlinks) plus minimal
  /etc/passwd, group, hosts and /tmp, /root, /work; one deterministic layer. Its
  ``/bin/wget`` is a small static HTTP client (``stock/wget.c``), not busybox's applet.
- ``cpp``: like python with g++ and bash only (SandboxFusion cpp).
- ``python``: a Debian rootfs made by mmdebstrap (variant minbase) from this machine's
  apt sources, with python3, pip, venv, git, gcc, libc6-dev, ca-certificates, bash.
  The rootfs tarball is cached under ``settings.image_stock_cache_dir`` keyed by the
  package list + suite + sources, so setup does not rebuild it. It is split into three
  layers (base OS / toolchain / python) by path, so a change to one part only re-ships it.

Each stock image carries a ``dev.dsec.stock.key`` label; ``ensure_stock`` rebuilds an
image only when that key (recipe + inputs) changed or its layers are not intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from dsec.errors import ImageError, NotFound
from dsec.images.fsutil import file_digest
from dsec.images.pack import pack_layer, write_tar
from dsec.images.store import ImageStore
from dsec.models.image import ImageInfo, LayerInfo

RECIPE_VERSION = "1"
STOCK_LABEL = "dev.dsec.stock.key"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PYTHON_PACKAGES = ["python3", "python3-pip", "python3-venv", "git", "gcc", "libc6-dev", "ca-certificates", "bash"]
# The cpp image (SandboxFusion's cpp language): the C++ toolchain and a shell, nothing else.
CPP_PACKAGES = ["g++", "libc6-dev", "bash"]
# Built on first use only (not by `dsec image ensure-stock` without --only): SandboxFusion's
# nodejs, go and java languages. Debian packages, so they build offline like python.
LAZY_STOCK: dict[str, list[str]] = {"nodejs": ["nodejs", "bash"], "go": ["golang-go", "bash"],
                                    "java": ["default-jdk-headless", "bash"]}
# Path prefixes of the python image's upper layers; everything else is the base layer.
PYTHON_LAYERS = [
    ("toolchain", ("usr/lib/gcc", "usr/libexec/gcc", "usr/include", "usr/lib/git-core", "usr/share/git-core",
                   "usr/share/perl", "usr/lib/x86_64-linux-gnu/perl", "usr/share/doc", "usr/share/man")),
    ("python", ("usr/lib/python3", "usr/share/python3", "usr/share/python-wheels", "usr/local/lib/python3",
                "usr/bin/python3", "usr/bin/pip", "usr/bin/pydoc")),
]
Log = Callable[[str], None]


def _config(diff_ids: list[str], key: str, cmd: list[str], history: list[str]) -> bytes:
    cfg = {"architecture": "amd64", "os": "linux",
           "config": {"Env": [PATH_ENV], "Cmd": cmd, "WorkingDir": "/work", "Labels": {STOCK_LABEL: key}},
           "rootfs": {"type": "layers", "diff_ids": diff_ids},
           "history": [{"created_by": h} for h in history]}
    return json.dumps(cfg, separators=(",", ":"), sort_keys=True).encode()


def _current(store: ImageStore, name: str, key: str) -> ImageInfo | None:
    try:
        info = store.resolve(name)
    except NotFound:
        return None
    cfg = json.loads(store.content.read_bytes(info.id))
    if (cfg.get("config") or {}).get("Labels", {}).get(STOCK_LABEL) != key:
        return None
    if any(not store.content.has(li.digest) for li in info.layers):
        return None
    return info


def _add_layer(store: ImageStore, build: Callable[[object], object]) -> LayerInfo:
    with store.content.writer() as w:
        res = build(w)
        digest, size = w.commit(what="stock layer")
    return LayerInfo(digest=digest, diff_id=res.diff_id, size=size, media_type=res.media_type)  # type: ignore[attr-defined]


# The busybox image's /bin/wget: Debian's busybox-static wget segfaults once a timeout is
# set (`wget -T 2`, on the host too) and has no TLS helper; this static HTTP client
# replaces that applet (docs: README "CLI", the allow-list example).
WGET_SOURCE = Path(__file__).parent / "stock" / "wget.c"
WGET_CFLAGS = ("-static", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-s")


def build_wget(dest: Path) -> None:
    """Compile the image's static wget (gcc + libc6-dev, as for dsec-init) to ``dest``."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise ImageError("the busybox stock image's wget needs gcc and libc6-dev (scripts/setup.sh installs them)")
    proc = subprocess.run([gcc, *WGET_CFLAGS, "-o", str(dest), str(WGET_SOURCE)], capture_output=True, text=True,
                          timeout=300, check=False)
    if proc.returncode != 0:
        raise ImageError(f"cannot build {WGET_SOURCE.name} for the busybox image: {proc.stderr.strip()[-2000:]}")
    os.chmod(dest, 0o755)


def ensure_busybox(store: ImageStore, log: Log = print) -> ImageInfo:
    bb = Path(shutil.which("busybox") or "/bin/busybox")
    if not bb.exists():
        raise ImageError("busybox stock image needs /bin/busybox (apt-get install busybox-static)")
    bb_digest, _ = file_digest(bb)
    wget_digest = hashlib.sha256(WGET_SOURCE.read_bytes() + " ".join(WGET_CFLAGS).encode()).hexdigest()
    key = hashlib.sha256(f"busybox:{RECIPE_VERSION}:{bb_digest}:{wget_digest}".encode()).hexdigest()[:32]
    info = _current(store, "busybox:latest", key)
    if info is not None:
        return info
    log("building stock image busybox:latest")
    with tempfile.TemporaryDirectory(prefix="dsec-busybox-") as tmp:
        root = Path(tmp)
        for d, mode in [("bin", 0o755), ("sbin", 0o755), ("usr/bin", 0o755), ("usr/sbin", 0o755), ("etc", 0o755),
                        ("tmp", 0o1777), ("root", 0o700), ("work", 0o755), ("proc", 0o555), ("sys", 0o555),
                        ("dev", 0o755), ("var/tmp", 0o1777)]:
            (root / d).mkdir(parents=True, exist_ok=True)
            os.chmod(root / d, mode)
        shutil.copyfile(bb, root / "bin/busybox")
        os.chmod(root / "bin/busybox", 0o755)
        out = subprocess.run([str(bb), "--list-full"], capture_output=True, text=True, check=True).stdout
        for applet in sorted(set(out.split())):
            p = root / applet
            if applet == "bin/busybox" or p.exists():
                continue
            p.parent.mkdir(parents=True, exist_ok=True)
            os.symlink("/bin/busybox", p)
        for applet in ("bin/wget", "usr/bin/wget"):
            (root / applet).unlink(missing_ok=True)
        build_wget(root / "bin/wget")
        (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
        (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
        (root / "etc/hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost\n")
        for f in ("etc/passwd", "etc/group", "etc/hosts"):
            os.chmod(root / f, 0o644)
        s = store.settings
        layer = _add_layer(store, lambda w: pack_layer(root, w, s.layer_compression, s.layer_zstd_level,  # type: ignore[arg-type]
                                                        owner=(0, 0)))
    cfg = _config([layer.diff_id], key, ["/bin/sh"], ["busybox-static rootfs"])
    return store.register(cfg, [layer], ["busybox:latest"])


def _sources_file() -> Path:
    for p in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]:
        if p.is_file() and "debian" in p.read_text():
            return p
    raise ImageError("no Debian apt sources configured on this machine (/etc/apt/sources.list.d/*.sources)")


def python_rootfs(store: ImageStore, log: Log = print, name: str = "python",
                  packages: list[str] | None = None) -> tuple[Path, str]:
    """Cached mmdebstrap tarball of the python (or another Debian) image (built once per package list)."""
    s = store.settings
    sources = _sources_file()
    packages = packages or PYTHON_PACKAGES
    key = hashlib.sha256(json.dumps([RECIPE_VERSION, s.image_stock_suite, packages,
                                     sources.read_text()]).encode()).hexdigest()[:24]
    cache = s.image_stock_cache_dir / f"{name}-{key}.tar"
    if cache.exists():
        return cache, key
    if shutil.which("mmdebstrap") is None:
        raise ImageError("python stock image needs mmdebstrap (apt-get install mmdebstrap)")
    cache.parent.mkdir(parents=True, exist_ok=True)
    part = cache.with_name(cache.name + f".part-{os.getpid()}")
    log(f"mmdebstrap {s.image_stock_suite} (minbase + {', '.join(packages)}) -> {cache}")
    cmd = ["mmdebstrap", "--variant=minbase", "--include=" + ",".join(packages), "--format=tar",
           "--skip=output/dev", "--quiet", s.image_stock_suite, str(part), str(sources)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        part.unlink(missing_ok=True)
        raise ImageError(f"mmdebstrap failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    with open(part, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(part, cache)
    return cache, key


def _route(name: str) -> int:
    for i, (_, prefixes) in enumerate(PYTHON_LAYERS, start=1):
        if any(name == p or name.startswith(p) for p in prefixes):
            return i
    return 0


def _norm(name: str) -> str:
    n = os.path.normpath(name).lstrip("/")
    return "" if n == "." else n


def split_tarball(tarball: Path, sinks: list[object]) -> None:
    """Stream a rootfs tarball into len(sinks) layer tars, routing entries by path.

    Directories go to the base layer and, as needed, to the layer of their contents
    (same metadata, so the overlay view is unchanged); hard links follow their target.
    """
    tars = [tarfile.open(fileobj=s, mode="w|", format=tarfile.PAX_FORMAT)  # type: ignore[call-overload]  # noqa: SIM115
            for s in sinks]
    dirs: dict[str, tarfile.TarInfo] = {}
    written: list[set[str]] = [set() for _ in sinks]
    where: dict[str, int] = {}
    with tarfile.open(tarball, "r|") as src:
        for ti in src:
            name = _norm(ti.name)
            if not name or ti.ischr() or ti.isblk():
                continue
            ti.name = name
            ti.uname = ti.gname = ""
            if ti.isdir():
                dirs[name] = ti
            idx = where.get(_norm(ti.linkname), 0) if ti.islnk() else _route(name)
            if ti.islnk():
                ti.linkname = _norm(ti.linkname)
            where[name] = idx
            parts = name.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in written[idx] and d in dirs:
                    tars[idx].addfile(dirs[d])
                    written[idx].add(d)
            if ti.isdir():
                if name in written[idx]:
                    continue
                written[idx].add(name)
            tars[idx].addfile(ti, src.extractfile(ti) if ti.isreg() else None)
    for t in tars:
        t.close()


def ensure_python(store: ImageStore, log: Log = print, name: str = "python",
                  packages: list[str] | None = None) -> ImageInfo:
    s = store.settings
    packages = packages or PYTHON_PACKAGES
    try:
        sources = _sources_file().read_text()
    except ImageError:
        sources = ""
    key = hashlib.sha256(json.dumps([RECIPE_VERSION, s.image_stock_suite, packages, sources,
                                     s.layer_compression]).encode()).hexdigest()[:32]
    info = _current(store, f"{name}:latest", key)
    if info is not None:
        return info
    tarball, _ = python_rootfs(store, log, name, packages)
    log(f"packing {name}:latest layers from {tarball}")
    from dsec.images.fsutil import HashingWriter
    from dsec.images.media import COMPRESSION_MT, compressing_writer

    n = 1 + len(PYTHON_LAYERS)
    writers = [store.content.writer() for _ in range(n)]
    ws = [cm.__enter__() for cm in writers]
    try:
        comps = [compressing_writer(w, s.layer_compression, s.layer_zstd_level) for w in ws]  # type: ignore[arg-type]
        inners = [HashingWriter(c) for c in comps]  # type: ignore[arg-type]
        split_tarball(tarball, inners)
        layers = []
        for w, c, inner in zip(ws, comps, inners):
            c.close()
            digest, size = w.commit(what="python stock layer")
            layers.append(LayerInfo(digest=digest, diff_id=inner.digest, size=size,
                                    media_type=COMPRESSION_MT[s.layer_compression]))
    finally:
        for cm in writers:
            cm.__exit__(None, None, None)
    cfg = _config([li.diff_id for li in layers], key, ["/bin/bash"],
                  ["mmdebstrap minbase"] + [f"split: {name}" for name, _ in PYTHON_LAYERS])
    info = store.register(cfg, layers, [f"{name}:latest"])
    for li in layers:
        store.ensure_layer(li)
    return info


def ensure_cpp(store: ImageStore, log: Log = print) -> ImageInfo:
    """Debian minbase + g++ and bash (the SandboxFusion cpp language), built like python."""
    return ensure_python(store, log, name="cpp", packages=CPP_PACKAGES)


STOCK = {"busybox": ensure_busybox, "python": ensure_python, "cpp": ensure_cpp}


def ensure_stock(store: ImageStore, only: list[str] | None = None, log: Log = print) -> dict[str, ImageInfo]:
    names = only or list(STOCK)
    unknown = [n for n in names if n not in STOCK and n not in LAZY_STOCK]
    if unknown:
        raise NotFound(f"unknown stock image(s) {unknown}; available: {', '.join([*STOCK, *LAZY_STOCK])}")
    out = {}
    for n in names:
        info = STOCK[n](store, log) if n in STOCK else ensure_python(store, log, name=n, packages=LAZY_STOCK[n])
        for li in info.layers:
            store.ensure_layer(li)
        out[n] = info
    return out


__all__ = ["ensure_busybox", "ensure_python", "ensure_stock", "write_tar"]
