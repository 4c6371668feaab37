"""Issue 18, files API: special files, sparse files, uploads, listings (real server, real
sandboxes, runc and gVisor). Each test names the finding it guards; memory figures are
the `dsec serve` process's own peak RSS (VmHWM, reset through /proc/PID/clear_refs)."""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2e_server import Server, running_server
from sec_helpers import open_request, peak_rss_growth, read_status

from dsec.errors import InvalidArgument, PayloadTooLarge
from dsec.sdk import Client, Sandbox

pytestmark = pytest.mark.integration

TIERS = ["container", pytest.param("gvisor", marks=pytest.mark.gvisor)]
LIMIT = 600 << 20  # max_upload_bytes of this module's server: a 512 MiB file fits, 1 GiB does not


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "sec-files", {"DSEC_MAX_UPLOAD_BYTES": str(LIMIT),
                                                        "DSEC_API_CREATE_WAIT_S": "20"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: Server) -> Iterator[Client]:
    with Client(srv.url, srv.token, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def other_token(client: Client) -> Iterator[str]:
    token = client.add_tenant("sec-files-other").token
    yield token
    client.remove_tenant("sec-files-other")


def _auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _tar(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        ti = tarfile.TarInfo(name)
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("isolation", TIERS)
def test_fifo_writes_are_refused_and_never_block_the_server(srv: Server, client: Client, other_token: str,
                                                            isolation: str) -> None:
    """#2: PUT (file or tar) onto fifos the sandbox made answers 422 naming the fifo at
    once; before, each request blocked a shared worker thread in open() and, with a few
    at a time, every tenant's file, create and kill calls hung. (gVisor: the fifos live
    in gVisor's kernel, not on the host; the same calls must still never block.)"""
    with Sandbox.create(image="busybox", isolation=isolation, client=client) as sb:
        r = sb.exec("mkdir -p /tmp/q && for i in 0 1 2 3 4 5 6 7 8 9 10 11; do mkfifo /tmp/q/f$i; done; ls /tmp/q | wc -l")
        assert r.exit_code == 0 and r.stdout.strip() == "12", r

        def put(i: int) -> httpx.Response:
            with httpx.Client(base_url=srv.url, headers=_auth(srv.token), timeout=20) as h:
                if i % 3 == 2:
                    return h.put(f"/v1/sandboxes/{sb.id}/tar", params={"path": "/tmp/q"}, content=_tar(f"f{i}", b"x"))
                return h.put(f"/v1/sandboxes/{sb.id}/files", params={"path": f"/tmp/q/f{i}"}, content=b"x")

        with ThreadPoolExecutor(12) as ex:
            futs = [ex.submit(put, i) for i in range(12)]
            t0 = time.monotonic()
            # Meanwhile another tenant creates, writes, reads and kills as usual.
            with Client(srv.url, other_token, timeout=30, retries=0) as oc, \
                    Sandbox.create(image="busybox", client=oc) as osb:
                osb.files.write("/tmp/ok", b"fine")
                assert osb.files.read("/tmp/ok") == b"fine"
            other_s = time.monotonic() - t0
            answers = [f.result() for f in futs]
        assert other_s < 20
        if isolation == "gvisor":
            # gVisor keeps a sandbox's fifos in its own kernel: the host sees no fifo there,
            # so the writes land as files; what matters is that nothing blocked.
            assert {a.status_code for a in answers} <= {204, 422}, [a.text for a in answers]
        else:
            assert [a.status_code for a in answers] == [422] * 12, [a.text for a in answers]
            assert all("fifo" in a.json()["message"] for a in answers)
            with pytest.raises(InvalidArgument, match="fifo"):
                sb.files.read("/tmp/q/f0")
        assert sb.exec("echo still-alive").stdout == "still-alive\n"


def test_uploads_per_tenant_are_capped(srv: Server, client: Client, other_token: str) -> None:
    """#5 / #2: a tenant's stalled uploads hold at most api_uploads_per_tenant (4) slots;
    the next upload waits api_file_slot_wait_s for one and is then 429 (it used to be
    read in full), while other tenants upload as usual meanwhile."""
    with Sandbox.create(image="busybox", client=client) as sb:
        hdr = {**_auth(srv.token), "content-length": str(1 << 20)}
        stalled = [open_request(srv.url, "PUT", f"/v1/sandboxes/{sb.id}/files?path=/tmp/s{i}", hdr, b"x" * 4096)
                   for i in range(4)]
        try:
            time.sleep(1.0)  # each of them now holds an upload slot, waiting for the rest of its body
            fifth = open_request(srv.url, "PUT", f"/v1/sandboxes/{sb.id}/files?path=/tmp/s5", hdr, b"x" * 4096)
            t0 = time.monotonic()
            assert read_status(fifth, 15) == 429  # after api_file_slot_wait_s (5 s) without a free slot
            assert time.monotonic() - t0 < 10
            fifth.close()
            with Client(srv.url, other_token, timeout=30) as oc, Sandbox.create(image="busybox", client=oc) as osb:
                osb.files.write("/tmp/big", b"y" * 300_000)
                assert osb.exec("wc -c < /tmp/big").stdout.strip() == "300000"
        finally:
            for s in stalled:
                s.close()
        time.sleep(0.5)
        sb.files.write("/tmp/after", b"slots are back")  # closed uploads gave their slots back
        assert sb.files.read("/tmp/after") == b"slots are back"


def test_e2b_uploads_share_the_tenant_upload_slots(srv: Server) -> None:
    """#5 via the E2B front end: its file upload buffers the body (up to max_upload_bytes),
    so it takes one of the tenant's api_uploads_per_tenant (4) slots like a native upload;
    a fifth stalled upload is 429 instead of one more buffer (it had no cap at all)."""
    with httpx.Client(base_url=srv.url, headers={"x-api-key": srv.token}, timeout=60) as c:
        r = c.post("/e2b/sandboxes", json={"templateID": "busybox", "timeout": 300})
        assert r.status_code == 201, r.text
        sid, access = r.json()["sandboxID"], r.json()["envdAccessToken"]
        try:
            hdr = {"e2b-sandbox-id": sid, "x-access-token": access, "content-type": "application/octet-stream",
                   "content-length": str(1 << 20)}
            stalled = [open_request(srv.url, "POST", f"/e2b/envd/files?path=/tmp/e{i}", hdr, b"x" * 4096)
                       for i in range(4)]
            try:
                time.sleep(1.0)  # each holds a slot, waiting for the rest of its body
                fifth = open_request(srv.url, "POST", "/e2b/envd/files?path=/tmp/e5", hdr, b"x" * 4096)
                assert read_status(fifth, 15) == 429  # after api_file_slot_wait_s without a free slot
                fifth.close()
            finally:
                for s in stalled:
                    s.close()
        finally:
            c.delete(f"/e2b/sandboxes/{sid}")


def test_upload_to_a_foreign_sandbox_is_refused_before_its_body(srv: Server, client: Client,
                                                                other_token: str) -> None:
    """#5: an upload to a sandbox the tenant does not own is 404 from its headers alone
    (the body used to be buffered, up to max_upload_bytes, before the ownership check)."""
    with Sandbox.create(image="busybox", client=client) as sb:
        for route in ("files", "tar"):
            s = open_request(srv.url, "PUT", f"/v1/sandboxes/{sb.id}/{route}?path=/tmp/x",
                             {**_auth(other_token), "content-length": str(64 << 20)}, b"x" * 1000)
            assert read_status(s, 5) == 404
            s.close()


@pytest.mark.parametrize("isolation", TIERS)
def test_sparse_file_over_the_limit_is_refused_before_reading(srv: Server, client: Client, isolation: str) -> None:
    """#3: a 1 GiB sparse file in a 64 MiB-disk sandbox is refused (413, apparent size)
    by file read and tar download before a byte is read: the server's peak RSS does not
    move (the tar route used to buffer the whole GiB before its size check)."""
    with Sandbox.create(image="busybox", disk="64M", isolation=isolation, client=client) as sb:
        r = sb.exec("mkdir -p /tmp/sp && truncate -s 1G /tmp/sp/big && ls -l /tmp/sp/big")
        assert r.exit_code == 0 and "1073741824" in r.stdout, r
        t0 = time.monotonic()
        with peak_rss_growth(srv.proc.pid) as peak:
            with pytest.raises(PayloadTooLarge, match="apparent"):
                sb.files.download_tar("/tmp/sp")
            with pytest.raises(PayloadTooLarge, match="apparent"):
                sb.files.read("/tmp/sp/big")
        assert time.monotonic() - t0 < 5
        print(f"peak RSS growth: {peak.growth_mib:.1f} MiB")
        assert peak.growth_mib < 32, f"server peak RSS grew {peak.growth_mib:.0f} MiB"


class _Pipe(io.RawIOBase):
    """A readable file over an iterator of byte chunks (tarfile's stream mode reads it)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._buf = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        while not self._buf:
            self._buf = next(self._chunks, b"")
            if not self._buf:
                return 0
        n = min(len(b), len(self._buf))
        b[:n], self._buf = self._buf[:n], self._buf[n:]
        return n


@pytest.mark.parametrize("isolation", TIERS)
def test_sparse_file_under_the_limit_streams_in_bounded_memory(srv: Server, client: Client, isolation: str) -> None:
    """#3: a 512 MiB sparse file (under the limit) is served by file read and by tar
    download in pieces: complete, byte-exact at its end, and the server's peak RSS grows
    by far less than the file (both routes used to hold it whole)."""
    size = (512 << 20) + 5
    with Sandbox.create(image="busybox", disk="64M", isolation=isolation, client=client) as sb:
        r = sb.exec("mkdir -p /tmp/sp2 && truncate -s 512M /tmp/sp2/big && echo tail >> /tmp/sp2/big")
        assert r.exit_code == 0, r
        with peak_rss_growth(srv.proc.pid) as peak, \
                httpx.Client(base_url=srv.url, headers=_auth(srv.token), timeout=120) as h:
            with h.stream("GET", f"/v1/sandboxes/{sb.id}/files", params={"path": "/tmp/sp2/big"}) as resp:
                assert resp.status_code == 200
                got, last = 0, b""
                for chunk in resp.iter_bytes(1 << 20):
                    got += len(chunk)
                    last = (last + chunk)[-16:]
            assert got == size and last.endswith(b"tail\n")
            with h.stream("GET", f"/v1/sandboxes/{sb.id}/tar", params={"path": "/tmp/sp2"}) as resp:
                assert resp.status_code == 200
                with tarfile.open(fileobj=io.BufferedReader(_Pipe(resp.iter_bytes(1 << 20))), mode="r|") as tf:
                    m = tf.next()
                    assert m is not None and m.name == "big" and m.size == size
                    src = tf.extractfile(m)
                    assert src is not None
                    n, last = 0, b""
                    while chunk := src.read(1 << 20):
                        n += len(chunk)
                        last = (last + chunk)[-16:]
                    assert n == size and last.endswith(b"tail\n")
        print(f"peak RSS growth: {peak.growth_mib:.1f} MiB")
        assert peak.growth_mib < 100, f"server peak RSS grew {peak.growth_mib:.0f} MiB for a 512 MiB file"


@pytest.mark.parametrize("isolation", TIERS)
def test_uploads_stream_in_bounded_memory(srv: Server, client: Client, isolation: str) -> None:
    """#5: a 192 MiB file upload and a 192 MiB tar upload reach the sandbox intact while
    the server's peak RSS grows by far less than the body (both used to be buffered
    whole, then joined: twice the body)."""
    size = 192 << 20
    block = bytes(range(256)) * 4096  # 1 MiB, not all zeros
    with Sandbox.create(image="busybox", memory="1G", isolation=isolation, client=client) as sb, \
            httpx.Client(base_url=srv.url, headers=_auth(srv.token), timeout=120) as h:
        def body() -> Iterator[bytes]:
            for _ in range(size // len(block)):
                yield block

        with peak_rss_growth(srv.proc.pid) as peak:
            r = h.put(f"/v1/sandboxes/{sb.id}/files", params={"path": "/tmp/up/big"}, content=body())
            assert r.status_code == 204, r.text
        print(f"peak RSS growth (file upload): {peak.growth_mib:.1f} MiB")
        assert peak.growth_mib < 64, f"server peak RSS grew {peak.growth_mib:.0f} MiB for a 192 MiB upload"
        assert sb.exec("wc -c < /tmp/up/big").stdout.strip() == str(size)
        sb.exec("rm /tmp/up/big")

        def tar_body() -> Iterator[bytes]:
            info = tarfile.TarInfo("t/big")
            info.size = size
            yield info.tobuf(tarfile.PAX_FORMAT)
            yield from body()
            yield bytes(2 * tarfile.BLOCKSIZE)

        with peak_rss_growth(srv.proc.pid) as peak:
            r = h.put(f"/v1/sandboxes/{sb.id}/tar", params={"path": "/tmp/up"}, content=tar_body())
            assert r.status_code == 204, r.text
        print(f"peak RSS growth (tar upload): {peak.growth_mib:.1f} MiB")
        assert peak.growth_mib < 64, f"server peak RSS grew {peak.growth_mib:.0f} MiB for a 192 MiB tar"
        assert sb.exec("wc -c < /tmp/up/t/big").stdout.strip() == str(size)


def test_listing_is_paged_and_bounded(srv: Server, client: Client) -> None:
    """#11: files/list returns at most api_list_max_entries (1000) entries per page with
    an X-Next-Cursor header, `limit`/`cursor` page through in name order, a bad cursor
    is 422, the SDK's sb.files.list follows the pages, and one page of a 50k-entry
    directory costs the server little memory (the whole listing was one reply)."""
    with Sandbox.create(image="busybox", client=client) as sb:
        r = sb.exec("mkdir -p /tmp/d && cd /tmp/d && i=0; while [ $i -lt 50000 ]; do : > f$i; i=$((i+1)); done",
                    timeout=300)
        assert r.exit_code == 0, r
        with httpx.Client(base_url=srv.url, headers=_auth(srv.token), timeout=120) as h:
            url = f"/v1/sandboxes/{sb.id}/files/list"
            with peak_rss_growth(srv.proc.pid) as peak:
                first = h.get(url, params={"path": "/tmp/d"})
            assert first.status_code == 200 and len(first.json()) == 1000
            print(f"peak RSS growth: {peak.growth_mib:.1f} MiB")
            assert peak.growth_mib < 32, f"server peak RSS grew {peak.growth_mib:.0f} MiB for one page"
            names = [e["name"] for e in first.json()]
            assert names == sorted(names)
            cursor = first.headers["x-next-cursor"]
            second = h.get(url, params={"path": "/tmp/d", "cursor": cursor, "limit": 7})
            assert [e["name"] for e in second.json()] == sorted(f"f{i}" for i in range(50000))[1000:1007]
            assert h.get(url, params={"path": "/tmp/d", "limit": 50_000}).json().__len__() == 1000  # clamped
            bad = h.get(url, params={"path": "/tmp/d", "cursor": "%%%"})
            assert bad.status_code == 422 and "cursor" in bad.json()["message"]
        sb.exec("cd /tmp/d && i=2500; while [ $i -lt 50000 ]; do rm f$i; i=$((i+1)); done", timeout=300)
        listed = sb.files.list("/tmp/d")  # 2500 entries: three pages, followed by the SDK
        assert sorted(e.name for e in listed) == sorted(f"f{i}" for i in range(2500))


@pytest.mark.parametrize("isolation", TIERS)
def test_listing_during_a_rename_race_never_fails_with_500(srv: Server, client: Client, isolation: str) -> None:
    """#13: while the sandbox renames entries back and forth, files/list answers 200 (an
    entry that vanished between reading the directory and its stat is left out) or a
    4xx, never 500."""
    with Sandbox.create(image="busybox", isolation=isolation, client=client) as sb:
        sb.exec("mkdir -p /tmp/r && cd /tmp/r && i=0; while [ $i -lt 300 ]; do : > a$i; i=$((i+1)); done")
        sb.exec("cd /tmp/r && (while true; do for f in a*; do mv $f b${f#a}; done; "
                "for f in b*; do mv $f a${f#b}; done; done) >/dev/null 2>&1 &")
        time.sleep(0.5)
        statuses: dict[int, int] = {}
        with httpx.Client(base_url=srv.url, headers=_auth(srv.token), timeout=30) as h:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                r = h.get(f"/v1/sandboxes/{sb.id}/files/list", params={"path": "/tmp/r"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code < 500, r.text
        assert statuses.get(200, 0) > 10, statuses
