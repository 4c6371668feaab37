"""Build spec (YAML). Example::

    from: busybox:latest        # base image (NAME[:TAG] or id)
    network: false              # RUN steps get no network unless true (per step override)
    steps:
      - copy: {src: app/, dest: /work/app}        # host path relative to the spec file
      - run: "echo hello > /work/greeting"        # string -> /bin/sh -c; list -> argv
      - run: {cmd: ["pip", "install", "x"], network: true}
      - env: {PYTHONUNBUFFERED: "1"}
      - workdir: /work
      - entrypoint: ["/bin/sh", "-c"]
      - cmd: ["echo hi"]

copy/run steps produce one layer each; env/workdir/entrypoint/cmd only change the config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dsec.errors import InvalidArgument


class CopyStep(BaseModel):
    model_config = ConfigDict(extra="forbid")
    src: str
    dest: str
    owner: tuple[int, int] = (0, 0)


class RunStep(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cmd: str | list[str]
    network: bool | None = None
    env: dict[str, str] = Field(default_factory=dict)

    def argv(self) -> list[str]:
        return ["/bin/sh", "-c", self.cmd] if isinstance(self.cmd, str) else list(self.cmd)


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["copy", "run", "env", "workdir", "entrypoint", "cmd"]
    copy_: CopyStep | None = None
    run: RunStep | None = None
    env: dict[str, str] | None = None
    value: str | list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_key(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "kind" in data:
            return data
        if len(data) != 1:
            raise ValueError(f"each step must have exactly one of copy/run/env/workdir/entrypoint/cmd, got {sorted(data)}")
        (k, v), = data.items()
        if k == "copy":
            return {"kind": "copy", "copy_": v}
        if k == "run":
            return {"kind": "run", "run": v if isinstance(v, dict) else {"cmd": v}}
        if k == "env":
            return {"kind": "env", "env": {str(a): str(b) for a, b in (v or {}).items()}}
        if k in ("workdir", "entrypoint", "cmd"):
            return {"kind": k, "value": v}
        raise ValueError(f"unknown step type {k!r}; use copy, run, env, workdir, entrypoint or cmd")

    def canonical(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


class BuildSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    base: str = Field(alias="from")
    network: bool = False
    steps: list[Step] = Field(default_factory=list)


def load_spec(path: Path) -> BuildSpec:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise InvalidArgument(f"build spec {path}: cannot read ({exc})") from exc
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"build spec {path}: invalid YAML ({exc})") from exc
    return parse_spec(data, str(path))


def parse_spec(data: Any, what: str = "build spec") -> BuildSpec:
    try:
        return BuildSpec.model_validate(data)
    except ValidationError as exc:
        errs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise InvalidArgument(f"{what}: {errs}") from None
