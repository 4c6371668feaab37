"""The container tier's seccomp profile as PID 1 installs it (dsec-init --seccomp): the
generated header carries exactly the profile's allow-list and argument rules, the OCI
config leaves seccomp to PID 1 only when asked, and a changed profile is a new binary."""

from __future__ import annotations

import re

from dsec.runtime import agent_build
from dsec.runtime.oci import RuntimeSpec, build_config
from dsec.runtime.seccomp import ALLOWED_SYSCALLS, DENIED_SYSCALLS, init_profile_header, seccomp_profile


def _spec(**kw: object) -> RuntimeSpec:
    return RuntimeSpec(sandbox_id="s1", rootfs="/r", agent_binary="/a", cpu=1, memory=1 << 28, pids=64,
                       nofile=1024, hostname="s1", **kw)  # type: ignore[arg-type]


def test_header_allows_exactly_the_profiles_names() -> None:
    """Every allowed name and nothing else (no denied name, no clone/clone3/personality,
    which only pass their argument rules) is in the allow array."""
    header = init_profile_header()
    allow = header.split("profile_allow[] = {", 1)[1].split("};", 1)[0]
    names = re.findall(r"#ifdef __NR_(\w+)\n    __NR_\1,\n#endif", allow)
    assert names == list(ALLOWED_SYSCALLS)
    assert not set(names) & (set(DENIED_SYSCALLS) | {"clone", "clone3", "personality"})


def test_header_argument_rules_match_the_oci_profile() -> None:
    """clone's namespace mask, personality's values and the errnos are the OCI profile's."""
    header = init_profile_header()
    rules = {r["names"][0]: r for r in seccomp_profile()["syscalls"] if r["names"][0] in ("clone", "clone3")}
    mask = rules["clone"]["args"][0]["value"]
    assert f"#define PROFILE_CLONE_NS_FLAGS {mask:#x}u" in header
    assert f"#define PROFILE_CLONE3_ERRNO {rules['clone3']['errnoRet']}" in header
    assert f"#define PROFILE_DEFAULT_ERRNO {seccomp_profile()['defaultErrnoRet']} " in header
    values = [r["args"][0]["value"] for r in seccomp_profile()["syscalls"] if r["names"] == ["personality"]]
    assert "profile_personality[] = {" + ", ".join(f"{v:#x}u" for v in values) + "};" in header


def test_config_leaves_seccomp_to_pid1_only_when_asked() -> None:
    """With init_seccomp runc gets no profile and PID 1 is told to install it; without, the
    OCI profile is there and PID 1 installs nothing (the two never both or neither)."""
    ours = build_config(_spec(init_seccomp=True))
    assert "seccomp" not in ours["linux"] and ours["process"]["args"] == ["/.dsec/init", "--seccomp"]
    runcs = build_config(_spec(init_seccomp=False))
    assert runcs["linux"]["seccomp"] == seccomp_profile() and runcs["process"]["args"] == ["/.dsec/init"]


def test_binary_name_follows_the_profile(monkeypatch) -> None:
    """A changed allow-list builds a new dsec-init (its name hashes the generated header)."""
    before = agent_build.binary_name(agent_build._build_inputs()[0])
    import dsec.runtime.seccomp as sc
    monkeypatch.setattr(sc, "ALLOWED_SYSCALLS", sc.ALLOWED_SYSCALLS[:-1])
    assert agent_build.binary_name(agent_build._build_inputs()[0]) != before
