"""Memory and disk requests below their limits (issue 15 density): ``memory_request_ratio``
and ``disk_request_ratio`` shrink what the scheduler reserves, never the sandbox's own
limits, and a refusal names the resource that ran out."""

from __future__ import annotations

from dsec.config import Settings, parse_bytes
from dsec.control.convert import share_request, spec_to_request
from dsec.control.overcommit import fits, refusal_reason, shortfalls
from dsec.control.types import Node
from dsec.models import SandboxSpec

G = 2**30
M = 2**20
TRIAL = SandboxSpec(image="busybox", cpu=0.1, memory="16M")  # default disk (10G)


def _settings(**kw: object) -> Settings:
    return Settings(**kw)  # type: ignore[arg-type]


def test_default_memory_is_reserved_in_full_and_limits_are_kept():
    req = spec_to_request(SandboxSpec(image="b", cpu=1, memory="2G", disk="10G"), "t", "r", _settings())
    assert req.memory == 2 * G and req.memory_limit == 0  # ratio 1.0: unchanged
    assert req.disk == share_request(10 * G, 0.01) and req.disk_limit == 10 * G


def test_memory_ratio_reserves_a_fraction_and_the_shape_keeps_the_limit():
    req = spec_to_request(SandboxSpec(image="b", cpu=1, memory="2G", disk="1G"), "t", "r",
                          _settings(memory_request_ratio=0.1, disk_request_ratio=0.5))
    assert (req.memory, req.memory_limit) == (round(0.1 * 2048) * M, 2 * G)
    assert (req.disk, req.disk_limit) == (512 * M, G)
    # pool members are built from the shape: the limits must survive in it
    assert req.shape[7:] == (2 * G, G)


def test_share_request_has_a_floor_and_whole_mib():
    assert share_request(16 * M, 0.01) == M
    assert share_request(1000 * M, 0.1) == 100 * M
    assert share_request(123, 1.0) == 123


def _fill(node: Node, s: Settings, n: int) -> int:
    """Requests of the trial shape admitted one after another until the first refusal."""
    req = spec_to_request(TRIAL, "t", "r", s)
    placed = 0
    while placed < n and fits(node, req, s.overcommit_ratio, s.overcommit_threshold):
        node.used_cpu += req.cpu
        node.used_memory += req.memory
        node.used_disk += req.disk
        node.count += 1
        placed += 1
    return placed


def _node() -> Node:  # this machine: 2 CPUs, 25 GB, 62 GB free disk thin-provisioned x10
    return Node("n1", cpu=2.0, memory=25 * G, disk=620 * G)


def test_a_thousand_idle_sandboxes_fit_with_the_issue_ratios():
    """The issue's trial: with cpu 0.01 and memory 0.1 ratios and the default disk, 1,000
    idle busybox sandboxes are admitted; with disk reserved in full only 62 were."""
    s = _settings(cpu_request_ratio=0.01, memory_request_ratio=0.1)
    assert _fill(_node(), s, 1000) == 1000
    assert _fill(_node(), _settings(cpu_request_ratio=0.01, memory_request_ratio=0.1, disk_request_ratio=1.0),
                 1000) == 62


def test_refusal_names_the_resource_that_ran_out():
    s = _settings(disk_request_ratio=1.0)
    node = _node()
    node.used_disk = 615 * G
    req = spec_to_request(TRIAL, "t", "r", s)
    short = shortfalls(node, req, s.overcommit_ratio, s.overcommit_threshold)
    assert len(short) == 1 and short[0].startswith("disk (10.00G asked, 5.00G of 620.00G")
    assert "DSEC_DISK_REQUEST_RATIO" in short[0]
    node.used_memory = int(node.memory * s.overcommit_ratio)
    why = refusal_reason(req, [node], s.overcommit_ratio, s.overcommit_threshold)
    assert why.startswith("out of memory (") and "; disk (" in why
    other = _node()
    why = refusal_reason(req, [node, other], s.overcommit_ratio, s.overcommit_threshold)
    assert "had room" in why  # the second node fits: nothing to blame


def test_parse_of_default_disk_matches_the_trial():
    assert parse_bytes(Settings().default_disk) == 10 * G
