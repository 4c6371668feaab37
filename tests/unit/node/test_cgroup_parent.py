"""The cgroup parent is a per-node setting (Settings.cgroup_parent), not a value read from
DSEC_CGROUP_PARENT when dsec.node.manager is imported: two nodes in one process, or a
node built with overrides (the Ray actor's ``load_settings(**overrides)``), each create,
freeze, probe and tear down under their own parent."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_two_nodes_in_one_process_use_their_own_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever this process's DSEC_CGROUP_PARENT, each agent's manager, its episode host's
    freezer path and its usage ledger parent are the ones its settings name."""
    from dsec.checkpoints.nodehost import NodeEpisodeHost
    from dsec.config import load_settings
    from dsec.node.agent import LocalNodeAgent

    monkeypatch.setenv("DSEC_CGROUP_PARENT", "dsec-from-env")
    a = LocalNodeAgent(load_settings(home=tmp_path / "a", cgroup_parent="dsec-ta", net_enabled=False))
    b = LocalNodeAgent(load_settings(home=tmp_path / "b", cgroup_parent="dsec-tb", net_enabled=False))
    assert (a.manager.cgroup_parent, b.manager.cgroup_parent) == ("dsec-ta", "dsec-tb")
    assert NodeEpisodeHost(a)._freezer_dir("sb-1").parts[-2:] == ("dsec-ta", "sb-1")
    assert NodeEpisodeHost(b)._freezer_dir("sb-1").parts[-2:] == ("dsec-tb", "sb-1")
    env_node = LocalNodeAgent(load_settings(home=tmp_path / "c", net_enabled=False))
    assert env_node.manager.cgroup_parent == "dsec-from-env"  # the environment, read when settings load


def test_teardown_uses_the_parent_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The teardown helper (thaw, kill and remove the sandbox's cgroups) works under the
    parent it is given (the sandbox record's), not a process-wide one."""
    from types import SimpleNamespace

    from dsec.config import load_settings
    from dsec.node import manager as mgr

    seen: list[tuple[str, str, str]] = []
    monkeypatch.setattr(mgr.cgroups, "thaw", lambda parent, sid: seen.append(("thaw", parent, sid)))
    monkeypatch.setattr(mgr.cgroups, "kill_and_remove", lambda parent, sid: seen.append(("remove", parent, sid)))
    m = mgr.SandboxManager(load_settings(home=tmp_path, cgroup_parent="dsec-tc", net_enabled=False))
    rt = SimpleNamespace(remove_state=lambda sid: None, state_root=tmp_path / "rt")
    mgr._release_kernel_resources(m.paths("sb-x"), rt, None, "container", "dsec-rec")  # type: ignore[arg-type]
    assert seen == [("thaw", "dsec-rec", "sb-x"), ("remove", "dsec-rec", "sb-x")]
