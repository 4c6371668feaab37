"""Builder: base image + steps -> image, one cached layer per copy/run step.

Cache key of step i = sha256(key of step i-1, canonical step JSON, and for copy steps
the diff_id of the files copied in); key 0 = the base image id. A hit (key in the
``build_cache`` table and its blob verified) reuses the layer without running
anything, so an unchanged spec rebuilds with no work, and changing only the last step
rebuilds only that layer. A failing step raises ``BuildFailed`` naming the step and its
output tail; nothing is registered and no image changes. A ``build:<id>`` lease keeps
the layers in use safe from GC while the build runs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import BuildFailed, InvalidArgument
from dsec.images.build.runner import BuildRunner
from dsec.images.build.spec import BuildSpec, Step
from dsec.images.fsutil import HashingWriter
from dsec.images.pack import pack_layer, write_tar
from dsec.images.store import ImageStore
from dsec.models.image import ImageInfo, LayerInfo


@dataclass
class BuildResult:
    image: ImageInfo
    cached: int
    built: int


class _Null:
    def write(self, data: bytes) -> int:
        return len(data)

    def flush(self) -> None:
        pass


def _copy_source(context: Path, src: str, what: str) -> tuple[Path, str | None]:
    p = (context / src).resolve()
    if not p.exists():
        raise InvalidArgument(f"{what}: copy source {src!r} does not exist (relative to {context})")
    return (p, None) if p.is_dir() else (p.parent, p.name)


class Builder:
    def __init__(self, store: ImageStore, runner: BuildRunner) -> None:
        self.store = store
        self.runner = runner

    def build(self, spec: BuildSpec, tag: str, context: Path = Path("."),
              log: Callable[[str], None] = lambda m: None) -> BuildResult:
        store = self.store
        base = store.resolve(spec.base)
        cfg = json.loads(store.content.read_bytes(base.id))
        c = cfg.setdefault("config", {})
        layers: list[LayerInfo] = list(base.layers)
        key = base.id
        lease = store.new_lease_key("build")
        store.lease(lease, [li.digest for li in layers] + [li.diff_id for li in layers])
        history = list(cfg.get("history") or [])
        cached = built = 0
        try:
            for i, step in enumerate(spec.steps, start=1):
                what = f"step {i}/{len(spec.steps)} ({step.kind})"
                extra = self._copy_digest(step, context, what) if step.kind == "copy" else ""
                key = hashlib.sha256(json.dumps([key, step.canonical(), extra], sort_keys=True).encode()).hexdigest()
                if step.kind in ("env", "workdir", "entrypoint", "cmd"):
                    self._apply_meta(c, step)
                    history.append({"created_by": f"dsec {step.kind} {json.dumps(step.canonical())}",
                                    "empty_layer": True})
                    continue
                li = self._cached(key)
                if li is not None:
                    cached += 1
                    log(f"{what}: cached {li.digest[:19]}")
                else:
                    t0 = time.monotonic()
                    li = self._copy(step, context) if step.kind == "copy" else \
                        self._run(step, spec, layers, c, what, len(base.layers), base.id)
                    with store.db.tx() as tx:
                        tx.execute("INSERT OR REPLACE INTO build_cache VALUES (?,?,?,?,?,?)",
                                   (key, li.digest, li.diff_id, li.size, li.media_type, time.time()))
                    built += 1
                    log(f"{what}: built {li.digest[:19]} in {time.monotonic() - t0:.2f}s")
                store.lease(lease, [li.digest, li.diff_id])
                layers.append(li)
                history.append({"created_by": f"dsec {step.kind} {json.dumps(step.canonical())}"})
            cfg["rootfs"] = {"type": "layers", "diff_ids": [li.diff_id for li in layers]}
            cfg["history"] = history
            config = json.dumps(cfg, separators=(",", ":"), sort_keys=True).encode()
            info = store.register(config, layers, [tag])
            return BuildResult(info, cached, built)
        finally:
            store.release(lease)

    def _cached(self, key: str) -> LayerInfo | None:
        rows = self.store.db.q("SELECT digest, diff_id, size, media_type FROM build_cache WHERE key=?", (key,))
        if not rows:
            return None
        d, diff, size, mt = rows[0]
        if not self.store.content.has(d):
            return None
        self.store.content.verify(d, f"cached build layer {d}")
        return LayerInfo(digest=d, diff_id=diff, size=size, media_type=mt)

    @staticmethod
    def _apply_meta(c: dict, step: Step) -> None:  # type: ignore[type-arg]
        if step.kind == "env":
            env = dict(e.split("=", 1) for e in c.get("Env") or [] if "=" in e)
            env.update(step.env or {})
            c["Env"] = [f"{k}={v}" for k, v in env.items()]
        elif step.kind == "workdir":
            c["WorkingDir"] = str(step.value)
        elif step.kind == "entrypoint":
            c["Entrypoint"] = [step.value] if isinstance(step.value, str) else step.value
        elif step.kind == "cmd":
            c["Cmd"] = [step.value] if isinstance(step.value, str) else step.value

    def _copy_digest(self, step: Step, context: Path, what: str) -> str:
        assert step.copy_ is not None
        root, only = _copy_source(context, step.copy_.src, what)
        hw = HashingWriter(_Null())  # type: ignore[arg-type]
        write_tar(root, hw, owner=tuple(step.copy_.owner), prefix=self._dest(step, only),  # type: ignore[arg-type]
                  include=(lambda r: r == only) if only else None)
        return hw.digest

    @staticmethod
    def _dest(step: Step, only: str | None) -> str:
        assert step.copy_ is not None
        dest = step.copy_.dest.strip("/")
        if only and step.copy_.dest.endswith("/"):
            return dest  # copy file INTO the directory
        if only:
            return dest.rsplit("/", 1)[0] if "/" in dest else ""
        return dest

    def _copy(self, step: Step, context: Path) -> LayerInfo:
        assert step.copy_ is not None
        root, only = _copy_source(context, step.copy_.src, "copy")
        s = self.store.settings
        if only and not step.copy_.dest.endswith("/") and step.copy_.dest.rsplit("/", 1)[-1] != only:
            # Renaming a single file: stage it under its destination name.
            with tempfile.TemporaryDirectory() as tmp:
                name = step.copy_.dest.rsplit("/", 1)[-1]
                shutil.copy2(root / only, Path(tmp) / name)
                return self._pack(Path(tmp), step, name, s)
        return self._pack(root, step, only, s)

    def _pack(self, root: Path, step: Step, only: str | None, s) -> LayerInfo:  # type: ignore[no-untyped-def]
        assert step.copy_ is not None
        with self.store.content.writer() as w:
            res = pack_layer(root, w, s.layer_compression, s.layer_zstd_level, owner=tuple(step.copy_.owner),
                             prefix=self._dest(step, only), include=(lambda r: r == only) if only else None)
            digest, size = w.commit(what="copy layer")
        return LayerInfo(digest=digest, diff_id=res.diff_id, size=size, media_type=res.media_type)

    def _run(self, step: Step, spec: BuildSpec, layers: list[LayerInfo], c: dict, what: str,  # type: ignore[type-arg]
             n_base: int, base_ref: str) -> LayerInfo:
        assert step.run is not None
        store = self.store
        lower = [store.ensure_layer(li) for li in layers]
        env = list(c.get("Env") or []) + [f"{k}={v}" for k, v in step.run.env.items()]
        network = spec.network if step.run.network is None else step.run.network
        scratch = Path(tempfile.mkdtemp(prefix="build-", dir=store.root))
        res = None
        try:
            res = self.runner.run(list(reversed(lower)), step.run.argv(), env=env, workdir=c.get("WorkingDir") or "/",
                                  network=network, timeout_s=store.settings.image_build_step_timeout_s,
                                  scratch=scratch, base_ref=base_ref, extra_lower_dirs=list(reversed(lower[n_base:])))
            if res.exit_code != 0:
                why = "timed out" if res.timed_out else f"exited with code {res.exit_code}"
                tail = res.output[-2000:]
                raise BuildFailed(f"{what} {step.run.argv()!r} {why}; output tail:\n{tail}",
                                  step=what, exit_code=res.exit_code, output=tail)
            from dsec.images.snapshot import Snapshotter
            return Snapshotter(store).commit(res.upper_dir)
        finally:
            if res is not None:
                res.release()
            shutil.rmtree(scratch, ignore_errors=True)
