"""`dsec image push/pull` against the real CNCF distribution registry (Debian's
docker-registry) on a loopback port: digests unchanged, skopeo interop both ways, basic
and bearer-token auth, https with a private CA, chunked uploads, single-flight pulls."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from registry_env import PASSWORD, USER, Registry, TokenServer, run

from dsec.config import load_settings
from dsec.errors import ImageError, Unauthorized
from dsec.images import ImageStore
from dsec.images.registry_ops import Credentials, pull, push

pytestmark = pytest.mark.integration

DSEC = str(Path(__file__).resolve().parents[3] / ".venv/bin/dsec")


def fresh_store(tmp_path: Path, name: str = "other", **settings: object) -> ImageStore:
    home = tmp_path / name
    return ImageStore(home / "images", load_settings(home=home, **settings))


def test_push_pull_roundtrip_keeps_digests(store: ImageStore, registry: Registry, tmp_path: Path) -> None:
    """Push sends the stored blobs byte for byte (same layer and manifest digests, per
    skopeo inspect); pull into an empty store gives the same image id, verified blobs and
    an unpacked, usable layer."""
    src = store.resolve("busybox")
    mdigest = push(store, "busybox", f"{registry.host}/dsec/busybox:v1")
    assert mdigest == store.manifest_digest(src.id)
    info = json.loads(run(["skopeo", "inspect", "--tls-verify=false",
                           f"docker://{registry.host}/dsec/busybox:v1"]).stdout)
    assert info["Digest"] == mdigest
    assert info["Layers"] == [li.digest for li in src.layers]

    other = fresh_store(tmp_path)
    got = pull(other, f"{registry.host}/dsec/busybox:v1")
    assert got.id == src.id and [li.digest for li in got.layers] == [li.digest for li in src.layers]
    assert got.names == [f"{registry.host}/dsec/busybox:v1"]
    assert other.manifest_digest(got.id) == mdigest
    assert other.verify(got.names[0]) == {li.digest: None for li in got.layers}
    assert (other.layer_dirs(got.id)[0] / "bin/busybox").is_file()
    # by digest, under a local name; already-present blobs are re-verified, not re-fetched
    again = pull(other, f"{registry.host}/dsec/busybox@{mdigest}", name="bb:pinned")
    assert again.id == src.id and "bb:pinned" in other.resolve("bb:pinned").names


def test_skopeo_copies_what_we_push(store: ImageStore, registry: Registry, tmp_path: Path) -> None:
    """`skopeo copy docker://… oci:DIR` of our pushed image yields byte-identical blobs."""
    push(store, "busybox", f"{registry.host}/bb:v1")
    run(["skopeo", "copy", "--src-tls-verify=false", f"docker://{registry.host}/bb:v1", f"oci:{tmp_path}/sk:v1"])
    src = store.resolve("busybox")
    for d in [src.id] + [li.digest for li in src.layers]:
        assert (tmp_path / "sk/blobs/sha256" / d[7:]).read_bytes() == store.content.read_bytes(d)


@pytest.mark.parametrize("fmt", ["oci", "v2s2"])
def test_we_pull_what_skopeo_pushed(store: ImageStore, registry: Registry, tmp_path: Path, fmt: str) -> None:
    """An image skopeo pushed (OCI manifest with zstd layers, or Docker v2s2 with gzip
    layers) pulls, verifies and unpacks to the same diff_ids."""
    store.export("busybox", tmp_path / "oci", tag="gz", compression="gzip")
    args = ["--format", "v2s2"] if fmt == "v2s2" else []
    run(["skopeo", "copy", *args, "--dest-tls-verify=false", f"oci:{tmp_path}/oci:gz",
         f"docker://{registry.host}/from-skopeo:{fmt}"])
    other = fresh_store(tmp_path)
    got = pull(other, f"{registry.host}/from-skopeo:{fmt}")
    assert [li.diff_id for li in got.layers] == [li.diff_id for li in store.resolve("busybox").layers]
    want_mt = "application/vnd.docker.image.rootfs.diff.tar.gzip" if fmt == "v2s2" else \
        "application/vnd.oci.image.layer.v1.tar+gzip"
    assert got.layers[0].media_type == want_mt
    assert (other.layer_dirs(got.id)[0] / "bin/sh").is_symlink()
    # and it pushes back unchanged (docker media types are kept)
    assert push(other, got.names[0], f"{registry.host}/back:{fmt}") == other.manifest_digest(got.id)


def test_basic_auth(store: ImageStore, tmp_path: Path) -> None:
    """htpasswd registry: right credentials push and pull; a wrong password and no
    credentials are Unauthorized naming the registry (and never the password)."""
    reg = Registry(tmp_path, auth="htpasswd")
    try:
        ref = f"{reg.host}/auth/bb:v1"
        push(store, "busybox", ref, creds=Credentials(USER, PASSWORD))
        other = fresh_store(tmp_path)
        with pytest.raises(Unauthorized) as ei:
            pull(other, ref, creds=Credentials(USER, "wrong-password"))
        assert reg.host in ei.value.message and USER in ei.value.message and "wrong-password" not in ei.value.message
        with pytest.raises(Unauthorized, match="requires credentials"):
            pull(other, ref)
        assert other.list() == []
        assert pull(other, ref, creds=Credentials(USER, PASSWORD)).id == store.resolve("busybox").id
        # the CLI: password from stdin, credentials from the environment
        env = {"DSEC_HOME": str(tmp_path / "cli")}
        out = run([DSEC, "image", "pull", ref, "-u", USER, "--password-stdin"], env=env, stdin=PASSWORD + "\n")
        assert "pulled" in out.stdout
        bad = run([DSEC, "image", "pull", ref], check=False,
                  env={**env, "DSEC_REGISTRY_USERNAME": USER, "DSEC_REGISTRY_PASSWORD": "nope"})
        assert bad.returncode == 1 and "unauthorized" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        reg.stop()


def test_bearer_token_auth(store: ImageStore, tmp_path: Path) -> None:
    """Token-auth registry (WWW-Authenticate: Bearer realm/service/scope): the client gets
    a token from the realm with basic credentials and retries; bad credentials at the
    token server are Unauthorized naming it."""
    tokens = TokenServer(tmp_path)
    reg = Registry(tmp_path, auth="token", token=tokens)
    try:
        ref = f"{reg.host}/tok/bb:v1"
        push(store, "busybox", ref, creds=Credentials(USER, PASSWORD))
        assert tokens.issued >= 1
        other = fresh_store(tmp_path)
        with pytest.raises(Unauthorized) as ei:
            pull(other, ref, creds=Credentials(USER, "bad"))
        assert "token server" in ei.value.message and tokens.realm in ei.value.message
        got = pull(other, ref, creds=Credentials(USER, PASSWORD))
        assert got.id == store.resolve("busybox").id
        info = json.loads(run(["skopeo", "inspect", "--tls-verify=false", "--creds", f"{USER}:{PASSWORD}",
                               f"docker://{ref}"]).stdout)
        assert info["Layers"] == [li.digest for li in got.layers]
    finally:
        reg.stop()
        tokens.stop()


def test_https_with_private_ca(store: ImageStore, tmp_path: Path) -> None:
    """An https registry: trusted through registry_ca_file it works; without the CA the
    certificate error is reported (never silently retried over plain http)."""
    reg = Registry(tmp_path, tls=True)
    try:
        ref = f"{reg.host}/tls/bb:v1"
        with pytest.raises(ImageError, match="TLS certificate does not verify"):
            push(store, "busybox", ref)
        trusting = ImageStore(store.root, load_settings(home=store.root.parent, registry_ca_file=reg.cert))
        push(trusting, "busybox", ref)
        assert pull(fresh_store(tmp_path, registry_ca_file=reg.cert), ref).id == store.resolve("busybox").id
        assert pull(fresh_store(tmp_path, "insecure"), ref, insecure=True).id == store.resolve("busybox").id
    finally:
        reg.stop()


def test_chunked_upload(store: ImageStore, registry: Registry, tmp_path: Path) -> None:
    """registry_push_chunk_bytes > 0 pushes PATCH chunks (Content-Range) + a closing PUT;
    the registry stores the same blob digests."""
    chunky = ImageStore(store.root, load_settings(home=store.root.parent, registry_push_chunk_bytes=100_000))
    src = store.resolve("busybox")
    assert src.layers[0].size > 3 * 100_000  # several chunks
    push(chunky, "busybox", f"{registry.host}/chunked:v1")
    for li in src.layers:
        assert registry.blob_data(li.digest).read_bytes() == store.content.read_bytes(li.digest)
    assert pull(fresh_store(tmp_path), f"{registry.host}/chunked:v1").id == src.id


def test_concurrent_pulls_fetch_each_layer_once(store: ImageStore, registry: Registry, tmp_path: Path) -> None:
    """Four threads pulling the same image into one store: every pull succeeds and each
    layer blob is written once (single flight on blob-<digest>); the others only re-verify."""
    push(store, "busybox", f"{registry.host}/sf:v1")
    other = fresh_store(tmp_path)
    writes: list[str] = []
    orig = other.content._place

    def counting_place(tmp: Path, digest: str) -> None:
        writes.append(digest)
        orig(tmp, digest)

    other.content._place = counting_place  # type: ignore[method-assign]
    results: list[object] = []

    def one() -> None:
        try:
            results.append(pull(other, f"{registry.host}/sf:v1", unpack=False).id)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    src = store.resolve("busybox")
    assert results == [src.id] * 4
    layers = {li.digest for li in src.layers}
    assert sorted(d for d in writes if d in layers) == sorted(layers)  # each layer blob written once


def test_cli_push_pull_progress(store: ImageStore, registry: Registry, tmp_path: Path) -> None:
    """`dsec image push IMAGE REF` and `dsec image pull REF` print plain progress lines
    when not on a terminal and a one-line result."""
    env = {"DSEC_HOME": str(store.root.parent)}
    out = run([DSEC, "image", "push", "busybox", f"{registry.host}/cli/bb:v1"], env=env)
    assert "pushed busybox" in out.stdout and "100%" in out.stderr
    env2 = {"DSEC_HOME": str(tmp_path / "cli2")}
    out = run([DSEC, "image", "pull", f"{registry.host}/cli/bb:v1", "--name", "bb:from-reg"], env=env2)
    assert "pulled bb:from-reg" in out.stdout and "100%" in out.stderr
    ls = json.loads(run([DSEC, "image", "ls", "--json"], env=env2).stdout)
    assert ls[0]["names"] == ["bb:from-reg"] and ls[0]["id"] == store.resolve("busybox").id


def test_multi_layer_pull_unpacks_in_workers(store: ImageStore, registry: Registry, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A several-layer image above image_parallel_unpack_min_bytes is unpacked by worker
    processes after the pull (as an import is): every layer is sealed, verified and
    trusted by the pulling process, with the right contents."""
    from dsec.images.craft import CraftedImage, Entry, layer_tar, write_oci_layout

    layers = [layer_tar([Entry("work/a.txt", b"layer a\n")]), layer_tar([Entry("work/b.txt", b"layer b\n")]),
              layer_tar([Entry("etc/c.conf", b"c=1\n")])]
    write_oci_layout(tmp_path / "three", CraftedImage(layers=layers, tag="v1"))
    src = store.import_archive(tmp_path / "three", name="three:v1")
    push(store, "three:v1", f"{registry.host}/three:v1")
    import subprocess
    spawned: list[object] = []
    real_run = subprocess.run

    def counting_run(argv, *a, **kw):  # type: ignore[no-untyped-def]
        if "dsec.images.worker" in argv:
            spawned.append(argv)
        return real_run(argv, *a, **kw)

    monkeypatch.setattr(subprocess, "run", counting_run)
    other = fresh_store(tmp_path, image_parallel_unpack_min_bytes=0, image_unpack_workers=2)
    got = pull(other, f"{registry.host}/three:v1")
    assert got.id == src.id and other.misses == 3 and len(spawned) == 3
    assert all(other.layers.is_trusted(li.diff_id) for li in got.layers)  # no re-check in this process
    dirs = other.layer_dirs(got.id)
    assert (dirs[0] / "work/a.txt").read_text() == "layer a\n" and (dirs[2] / "etc/c.conf").read_text() == "c=1\n"
    assert other.verify(got.names[0], deep=True) == {li.digest: None for li in got.layers}


def test_push_mounts_blobs_from_the_repo_they_came_from(store: ImageStore, registry: Registry, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An image pulled from repo A of a registry, pushed to repo B of the same registry:
    its blobs are cross-repository mounted (POST ?mount=&from=A, 201), no byte is
    uploaded, and B reads back with the same digests."""
    from dsec.images.registry import RegistryClient

    push(store, "busybox", f"{registry.host}/team/a:v1")
    other = fresh_store(tmp_path)
    pull(other, f"{registry.host}/team/a:v1", unpack=False)
    calls: list[tuple[str, str, int]] = []
    real = RegistryClient.request

    def spy(self, method, url, scope, **kw):  # type: ignore[no-untyped-def]
        r = real(self, method, url, scope, **kw)
        calls.append((method, str(url), r.status_code))
        return r

    monkeypatch.setattr(RegistryClient, "request", spy)
    digest = push(other, f"{registry.host}/team/a:v1", f"{registry.host}/team/b:v1")
    mounts = [c for c in calls if c[0] == "POST" and "mount=" in c[1]]
    assert len(mounts) == 2 and all(c[2] == 201 and "from=team/a" in c[1] for c in mounts)  # config + layer
    assert not [c for c in calls if c[0] in ("PUT", "PATCH") and "/blobs/uploads/" in c[1]]
    info = json.loads(run(["skopeo", "inspect", "--tls-verify=false", f"docker://{registry.host}/team/b:v1"]).stdout)
    assert info["Digest"] == digest and info["Layers"] == [li.digest for li in store.resolve("busybox").layers]
