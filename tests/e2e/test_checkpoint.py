"""Plain-sandbox checkpoints over HTTP against a real ``dsec serve`` (runc, overlayfs)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from e2e_server import Server, ensure_images, reap_home, start_server

from dsec.errors import Conflict, DSecError, NotFound
from dsec.sdk import AsyncClient, AsyncSandbox, Client, Sandbox

pytestmark = pytest.mark.integration

# One line per path of the root filesystem (not other mounts): type, mode, content hash
# or link target. /etc/hosts, /etc/hostname, /etc/resolv.conf are per-sandbox runtime files.
FINGERPRINT = r"""cd / && find . -xdev | sort | while read -r p; do
  case "$p" in ./etc/hosts|./etc/hostname|./etc/resolv.conf) continue;; esac
  if [ -L "$p" ]; then echo "L $p $(readlink "$p")"
  elif [ -f "$p" ]; then echo "F $p $(stat -c %a "$p") $(sha256sum < "$p" | cut -c1-64)"
  else echo "D $p $(stat -c %a "$p")"; fi
done"""

SETUP = r"""set -e
mkdir -p /work/deep/er && echo 'print(1)' > /work/a.py && chmod 700 /work/a.py
head -c 200000 /dev/urandom > /work/deep/er/blob.bin
ln -s /work/a.py /work/link && echo changed >> /etc/group
rm /bin/ls /etc/passwd && rmdir /home 2>/dev/null || true"""


def fingerprint(sb: Sandbox) -> list[str]:
    r = sb.exec(FINGERPRINT, timeout=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout.splitlines()


def test_checkpoint_restore_byte_for_byte(server: Server) -> None:
    """A restored sandbox has the same image, resources, env and filesystem (written,
    changed and deleted image files); a second checkpoint of it stacks on its base; a
    checkpoint of the same sandbox again is incremental and still exact."""
    with Client(server.url, server.token) as c:
        with Sandbox.create(image="busybox", cpu=0.5, memory="96M", env={"FOO": "bar baz"},
                            labels={"run": "ckpt"}, client=c) as sb:
            assert sb.exec(SETUP).exit_code == 0
            sb.files.write("/work/bin.dat", bytes(range(256)) * 64)
            before = fingerprint(sb)
            assert not any(line.startswith("F ./bin/ls ") for line in before)
            cp = sb.checkpoint()
            assert cp.id.startswith("ck-") and cp.sandbox_id == sb.id and cp.size > 0

            with Sandbox.restore(cp.id, client=c) as sb2:
                assert sb2.id != sb.id
                i1, i2 = sb.get_info(), sb2.get_info()
                assert (i2.image, i2.image_id, i2.cpu, i2.memory, i2.labels) == \
                       (i1.image, i1.image_id, i1.cpu, i1.memory, i1.labels)
                assert sb2.exec("echo $FOO").stdout == "bar baz\n"
                assert fingerprint(sb2) == before
                assert sb2.files.read("/work/bin.dat") == bytes(range(256)) * 64
                # The restored sandbox's own checkpoint stacks on the one it came from.
                assert sb2.exec("rm /work/a.py && echo two > /work/two").exit_code == 0
                after2 = fingerprint(sb2)
                cp2 = sb2.checkpoint()
                assert cp2.parent == cp.id
                with Sandbox.restore(cp2.id, client=c, labels={"run": "ckpt3"}) as sb3:
                    assert fingerprint(sb3) == after2 and sb3.info.labels == {"run": "ckpt3"}

            # Same sandbox again: incremental on top of the first checkpoint.
            assert sb.exec("rm -r /work/deep && echo again > /work/again").exit_code == 0
            again = fingerprint(sb)
            cp4 = sb.checkpoint()
            assert cp4.fs_digest != cp.fs_digest
            with Sandbox.restore(cp4.id, client=c) as sb4:
                assert fingerprint(sb4) == again
        ids = {x.id for x in c.checkpoints()}
        assert {cp.id, cp2.id, cp4.id} <= ids
        assert [x.id for x in c.checkpoints(sb.id)] == [cp.id, cp4.id]
        c.delete_checkpoint(cp4.id)
        with pytest.raises(NotFound, match=cp4.id):
            Sandbox.restore(cp4.id, client=c)


def test_checkpoint_errors_and_tenancy(server: Server) -> None:
    """Unknown checkpoint is 404 naming it; another tenant's checkpoint or sandbox is
    404; a killed sandbox cannot be checkpointed (409)."""
    with Client(server.url, server.token) as c:
        with pytest.raises(NotFound, match="ck-0123456789abcdef01234567"):
            Sandbox.restore("ck-0123456789abcdef01234567", client=c)
        with pytest.raises(NotFound, match="not-a-checkpoint"):
            Sandbox.restore("not-a-checkpoint", client=c)
        other = c.add_tenant("ckpt-other")
        sb = Sandbox.create(image="busybox", client=c)
        try:
            cp = sb.checkpoint()
            with Client(server.url, other.token) as oc:
                with pytest.raises(NotFound, match=cp.id):
                    Sandbox.restore(cp.id, client=oc)
                with pytest.raises(NotFound):
                    oc.checkpoint(sb.id)
                assert oc.checkpoints() == []
        finally:
            sb.kill()
        with pytest.raises(Conflict, match="destroyed|stopp"):
            c.checkpoint(sb.id)
        c.remove_tenant("ckpt-other")


def test_corrupt_checkpoint_is_refused(server: Server) -> None:
    """A checkpoint whose layer no longer matches its digest is refused (digest named) and
    no sandbox is created from it."""
    import json

    with Client(server.url, server.token) as c:
        with Sandbox.create(image="busybox", client=c) as sb:
            sb.exec("head -c 100000 /dev/urandom > /data.bin")
            cp = sb.checkpoint()
        unit = next((server.home / "checkpoints" / "episodes").glob(f"sbckpt.*.{cp.id[3:]}/units/*.json"))
        digest = json.loads(unit.read_text())["fs_chain"][0]["digest"]
        blob = server.home / "checkpoints" / "cas" / "sha256" / digest.removeprefix("sha256:")
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        before = {s.id for s in c.list()}
        with pytest.raises(DSecError, match=digest.removeprefix("sha256:")[:12]):
            Sandbox.restore(cp.id, client=c)
        assert {s.id for s in c.list()} == before


def test_async_restore(server: Server) -> None:
    """AsyncSandbox.checkpoint / AsyncSandbox.restore over the asyncio client."""
    async def main() -> None:
        async with AsyncClient(server.url, server.token) as c:
            async with await AsyncSandbox.create(image="busybox", client=c) as sb:
                await sb.files.write("/x", b"async")
                cp = await sb.checkpoint()
            async with await AsyncSandbox.restore(cp.id, client=c) as sb2:
                assert await sb2.files.read("/x") == b"async"
    asyncio.run(main())


def test_restored_sandbox_checkpoints_after_restart(tmp_path: Path) -> None:
    """A restored sandbox adopted by a restarted server still checkpoints on top of the
    checkpoint it came from (its base is recorded durably, not only in memory): a restore
    of that new checkpoint has the base's files and the new ones."""
    ensure_images(tmp_path, ["busybox"])
    srv = start_server(tmp_path)
    try:
        with Client(srv.url, srv.token) as c:
            with Sandbox.create(image="busybox", client=c) as sb:
                sb.exec("echo base > /base.txt && rm /bin/ls")
                cp = sb.checkpoint()
            sb2 = Sandbox.restore(cp.id, client=c)
        assert srv.stop(signal.SIGTERM) == 0
        srv = start_server(tmp_path)
        with Client(srv.url, srv.token) as c:
            sb2 = Sandbox.connect(sb2.id, client=c)
            sb2.exec("echo new > /new.txt")
            cp2 = sb2.checkpoint()
            assert cp2.parent == cp.id
            sb2.kill()
            with Sandbox.restore(cp2.id, client=c) as sb3:
                r = sb3.exec("cat /base.txt /new.txt; test -e /bin/ls && echo ls-back")
                assert r.stdout == "base\nnew\n"
    finally:
        if srv.proc.poll() is not None:
            srv = start_server(tmp_path)
        srv.kill_all()
        srv.stop()
        reap_home(tmp_path)


@pytest.mark.gvisor
def test_gvisor_checkpoint_restore(server: Server) -> None:
    """A gVisor sandbox checkpoints and restores into a gVisor sandbox with its files, a
    deleted image file still deleted, and its env."""
    with Client(server.url, server.token) as c:
        with Sandbox.create(image="busybox", isolation="gvisor", env={"A": "1"}, client=c) as sb:
            assert sb.exec("echo hi > /w.txt && rm /bin/ls").exit_code == 0
            cp = sb.checkpoint()
        with Sandbox.restore(cp.id, client=c) as sb2:
            assert sb2.info.isolation == "gvisor"
            r = sb2.exec("cat /w.txt; test -e /bin/ls || echo gone; echo $A")
            assert r.stdout == "hi\ngone\n1\n"
