"""Pure registry-client decisions: reference parsing, the plain-http policy, the
WWW-Authenticate parser and the platform choice in an image index."""

from __future__ import annotations

import pytest

from dsec.errors import ImageError, InvalidArgument
from dsec.images.registry import Reference, parse_challenge, parse_reference, pick_platform, schemes_to_try

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize("text,want", [
    ("localhost:5000/python:3", Reference("localhost:5000", "python", "3", None)),
    ("127.0.0.1:5000/a/b/c", Reference("127.0.0.1:5000", "a/b/c", "latest", None)),
    ("reg.example.com/lib/py@" + D, Reference("reg.example.com", "lib/py", None, D)),
    ("[::1]:5000/x:v1", Reference("[::1]:5000", "x", "v1", None)),
    ("localhost/x", Reference("localhost", "x", "latest", None)),
])
def test_parse_reference(text: str, want: Reference) -> None:
    """HOST[:PORT]/REPO[:TAG|@DIGEST] splits into its parts; the tag defaults to latest."""
    assert parse_reference(text) == want


def test_default_registry_and_bad_refs() -> None:
    """A ref without a host uses image_registry, or is refused naming the fix; bad
    repository names, tags and digests are refused naming the part."""
    assert parse_reference("python:3", "r.local:5000") == Reference("r.local:5000", "python", "3", None)
    assert parse_reference("library/python", "r.local:5000").repository == "library/python"
    with pytest.raises(InvalidArgument, match="names no registry"):
        parse_reference("python:3")
    with pytest.raises(InvalidArgument, match="repository"):
        parse_reference("r.local/Upper:1")
    with pytest.raises(InvalidArgument, match="tag"):
        parse_reference("r.local/x:bad!tag")
    with pytest.raises(InvalidArgument, match="digest"):
        parse_reference("r.local/x@sha256:abc")
    with pytest.raises(InvalidArgument):
        parse_reference("r.local/x y")


def test_plain_http_only_for_loopback_or_insecure() -> None:
    """https is always tried first; http only for loopback hosts or with --insecure."""
    assert schemes_to_try("127.0.0.1:5000", False) == ["https", "http"]
    assert schemes_to_try("localhost:5000", False) == ["https", "http"]
    assert schemes_to_try("[::1]:5000", False) == ["https", "http"]
    assert schemes_to_try("registry.example.com", False) == ["https"]
    assert schemes_to_try("10.0.0.5:5000", False) == ["https"]
    assert schemes_to_try("10.0.0.5:5000", True) == ["https", "http"]


def test_parse_challenge() -> None:
    """Bearer and Basic challenges with quoted values (commas inside quotes kept)."""
    kind, p = parse_challenge('Bearer realm="https://auth.example/token",service="reg",'
                              'scope="repository:a/b:pull,push"')
    assert kind == "bearer" and p == {"realm": "https://auth.example/token", "service": "reg",
                                      "scope": "repository:a/b:pull,push"}
    assert parse_challenge('Basic realm="x"') == ("basic", {"realm": "x"})


def test_pick_platform() -> None:
    """linux/amd64 is chosen from an index; an index without it is refused."""
    idx = {"manifests": [{"digest": "a", "platform": {"architecture": "arm64", "os": "linux"}},
                         {"digest": "b", "platform": {"architecture": "amd64", "os": "linux"}}]}
    assert pick_platform(idx, "x")["digest"] == "b"
    with pytest.raises(ImageError, match="linux/amd64"):
        pick_platform({"manifests": idx["manifests"][:1]}, "x")


def test_pull_source_only_from_the_configured_registry() -> None:
    """Pull-on-create contacts only image_registry: bare names resolve there, a ref naming
    that registry is accepted, any other host (e.g. a loopback service) or an image id
    is never pulled; with the setting off or no registry configured nothing is."""
    from dsec.images.registry_ops import pull_source

    reg = "127.0.0.1:5000"
    assert pull_source("team/py:3", reg, True) == "127.0.0.1:5000/team/py:3"
    assert pull_source("python", reg, True) == "127.0.0.1:5000/python:latest"
    assert pull_source("127.0.0.1:5000/x:v1", reg, True) == "127.0.0.1:5000/x:v1"
    assert pull_source("127.0.0.1:6379/x:v1", reg, True) is None
    assert pull_source("evil.example.com/x:v1", reg, True) is None
    assert pull_source("sha256:" + "ab" * 32, reg, True) is None
    assert pull_source("python", "", True) is None
    assert pull_source("python", reg, False) is None
    assert pull_source("Bad Name", reg, True) is None
