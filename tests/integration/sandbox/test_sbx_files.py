"""The host-side file API (read/write/list/remove/upload_tar/download_tar) acts inside the
sandbox only, whatever the sandbox planted: absolute symlinks to /, symlinks to host
paths, `..` chains, symlinked parent dirs, and hostile tar entries. A canary file on the
host must be neither read nor modified, and no file may appear outside the sandbox."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest
from sbx_helpers import make, sh

from dsec.errors import InvalidArgument, NotFound

pytestmark = pytest.mark.integration


def _tar(entries: list[tuple[str, str, bytes | str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for kind, name, data in entries:
            ti = tarfile.TarInfo(name)
            if kind == "sym":
                ti.type, ti.linkname = tarfile.SYMTYPE, str(data)
                tf.addfile(ti)
            else:
                assert isinstance(data, bytes)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def host_canary(tmp_path: Path):
    """A canary directory on the host, named by an absolute path the sandbox can plant."""
    d = Path(f"/tmp/dsec-canary-{os.urandom(4).hex()}")
    d.mkdir()
    f = d / "canary.txt"
    f.write_text("host-canary " + os.urandom(8).hex())
    yield d, f
    for p in sorted(d.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
    d.rmdir()


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(d.rglob("*"))}


async def test_file_api_cannot_escape_through_planted_links(node, tier, host_canary):
    """Symlinks and `..` planted from inside resolve inside the sandbox for every file
    API call; the host canary is never read, written, listed, archived or deleted."""
    cdir, cfile = host_canary
    before = _snapshot(cdir)
    host_passwd = Path("/etc/passwd").read_bytes()
    info = await make(node, tier)
    sid = info.id
    r = await sh(node, sid, f"cd /work && ln -s / root && ln -s /etc/passwd pw && ln -s {cdir} cdir && "
                            f"ln -s {cfile} cfile && ln -s ../../../../../../../../{cdir.relative_to('/')} up && "
                            "mkdir -p d && ln -s ../../../../.. d/upup && echo planted")
    assert r.stdout == "planted\n", r
    sandbox_passwd = await node.read_file(sid, "/etc/passwd")
    assert sandbox_passwd != host_passwd

    # reads: links resolve against the sandbox root
    assert await node.read_file(sid, "/work/pw") == sandbox_passwd
    assert await node.read_file(sid, "/work/root/etc/passwd") == sandbox_passwd
    assert await node.read_file(sid, "/work/d/upup/etc/passwd") == sandbox_passwd
    assert await node.read_file(sid, "/../../../etc/passwd") == sandbox_passwd
    for path in ("/work/cfile", f"/work/cdir/{cfile.name}", f"/work/up/{cfile.name}",
                 f"/work/root{cfile}", f"/work/d/upup{cfile}", f"/../../..{cfile}"):
        with pytest.raises(NotFound):
            await node.read_file(sid, path)

    # lists: the planted root link lists the sandbox root, not the host's
    names = {e.name for e in await node.list_files(sid, "/work/root")}
    assert names == {e.name for e in await node.list_files(sid, "/")}
    assert "work" in names and ".dsec" in names
    with pytest.raises(NotFound):
        await node.list_files(sid, "/work/cdir")

    # writes: land inside the sandbox, never on the host canary
    with pytest.raises(NotFound):  # the link's target dir does not exist in the sandbox
        await node.write_file(sid, "/work/cfile", b"pwned-1")
    await node.write_file(sid, f"/work/root{cfile}", b"pwned-1")
    await node.write_file(sid, "/work/cfile", b"pwned-2")
    await node.write_file(sid, f"/work/d/upup/tmp/x-{cfile.name}", b"pwned-3")
    r = await sh(node, sid, f"cat {cfile}; echo; cat /tmp/x-{cfile.name}")
    assert r.stdout == "pwned-2\npwned-3", r  # cfile link now points at the file written inside

    # tar: links are archived as links; uploads through planted links stay inside
    data = await node.download_tar(sid, "/work")
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        members = {m.name: m for m in tf}
        assert members["cfile"].issym() and members["root"].issym()
        for m in members.values():
            if m.isreg():
                assert b"host-canary" not in tf.extractfile(m).read()
    await node.upload_tar(sid, "/work", _tar([("file", f"cdir/{cfile.name}", b"pwned-4"),
                                              ("file", f"root{cdir}/new.txt", b"pwned-5"),
                                              ("file", f"/abs{cdir}/new2.txt", b"pwned-6"),
                                              ("sym", "evil", str(cdir)),
                                              ("file", "evil/new3.txt", b"pwned-7")]))
    for bad in ([("file", f"../../..{cdir}/new.txt", b"x")], [("file", f"ok/../../../..{cdir}/n", b"x")]):
        with pytest.raises(InvalidArgument):
            await node.upload_tar(sid, "/work", _tar(bad))
    r = await sh(node, sid, f"cat {cdir}/{cfile.name} {cdir}/new.txt {cdir}/new3.txt")
    assert r.stdout == "pwned-4pwned-5pwned-7", r

    # removes: deleting through a link to the host dir deletes the sandbox's copy only
    await node.remove_file(sid, "/work/root" + str(cdir), recursive=True)
    await node.remove_file(sid, "/work/cfile")

    assert _snapshot(cdir) == before, "the host canary dir changed"
    assert not Path(f"/tmp/x-{cfile.name}").exists() and not Path("/abs").exists()
