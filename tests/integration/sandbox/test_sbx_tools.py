"""Real agent tools work inside sandboxes (over-blocking seccomp profiles are known to
break agents): bash, python3 with threads + multiprocessing + asyncio, gcc building a
pthreads program, git, and pip installing a local wheel into a venv. Stock python image."""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile

import pytest
from sbx_helpers import make, sh

pytestmark = pytest.mark.integration

PY_PROGRAM = r'''
import asyncio, multiprocessing as mp, os, threading, concurrent.futures as cf

def square(x):
    return x * x

async def serve_and_call():
    async def handle(reader, writer):
        writer.write((await reader.readline()).upper())
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"ping\n")
    line = await reader.readline()
    proc = await asyncio.create_subprocess_exec("echo", "sub", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    server.close()
    return line.decode().strip(), out.decode().strip()

counter = 0
lock = threading.Lock()
def bump():
    global counter
    for _ in range(1000):
        with lock:
            counter += 1

def main():
    threads = [threading.Thread(target=bump) for _ in range(8)]
    [t.start() for t in threads]; [t.join() for t in threads]
    with cf.ThreadPoolExecutor(4) as ex:
        tp = sum(ex.map(square, range(10)))
    results = {}
    for method in ("fork", "spawn", "forkserver"):
        with mp.get_context(method).Pool(2) as pool:
            results[method] = sum(pool.map(square, range(10)))
    q = mp.Queue(); p = mp.Process(target=q.put, args=("queued",)); p.start(); p.join()
    print(counter, tp, results["fork"], results["spawn"], results["forkserver"], q.get(),
          *asyncio.run(serve_and_call()))

if __name__ == "__main__":
    main()
'''

C_PROGRAM = r'''
#include <pthread.h>
#include <stdio.h>
static long total; static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void *work(void *arg) { for (int i = 0; i < 100000; i++) { pthread_mutex_lock(&mu); total++; pthread_mutex_unlock(&mu); } return arg; }
int main(void) { pthread_t t[4]; for (int i = 0; i < 4; i++) pthread_create(&t[i], 0, work, 0);
  for (int i = 0; i < 4; i++) pthread_join(t[i], 0); printf("%ld\n", total); return 0; }
'''


def _wheel() -> tuple[str, bytes]:
    """A minimal pure-python wheel, built by hand (no network, no build backend)."""
    name, ver = "dsec_probe_pkg", "0.1"
    dist = f"{name}-{ver}.dist-info"
    files = {
        f"{name}/__init__.py": b"ANSWER = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: dsec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return f"{name}-{ver}-py3-none-any.whl", buf.getvalue()


@pytest.fixture
async def pybox(node, tier, python_image):
    info = await make(node, tier, image=python_image, cpu=1, memory="1G", disk="512M")
    return info.id


async def test_bash(node, pybox):
    """bash arrays, arithmetic, [[ ]], pipefail and process substitution (/dev/fd) work."""
    script = ("set -euo pipefail; a=(x y z); echo ${#a[@]} $((2**10)); "
              "[[ abc == a* ]] && echo glob; diff <(echo q) <(echo q) && echo same")
    r = await sh(node, pybox, ["bash", "-c", script])
    assert (r.exit_code, r.stdout) == (0, "3 1024\nglob\nsame\n"), r


async def test_python_threads_multiprocessing_asyncio(node, pybox):
    """python3: threads with locks, a thread pool, multiprocessing pools under fork, spawn
    and forkserver (semaphores in /dev/shm), a Queue, and asyncio (TCP on loopback and a
    subprocess)."""
    await node.write_file(pybox, "/work/prog.py", PY_PROGRAM.encode())
    r = await sh(node, pybox, ["python3", "/work/prog.py"], timeout=60)
    assert (r.exit_code, r.stdout) == (0, "8000 285 285 285 285 queued PING sub\n"), r


async def test_gcc_builds_and_runs_pthreads(node, pybox):
    """gcc compiles and links a pthreads program that then runs with 4 threads."""
    await node.write_file(pybox, "/work/t.c", C_PROGRAM.encode())
    r = await sh(node, pybox, "gcc -O2 -pthread /work/t.c -o /work/t && /work/t", timeout=120)
    assert (r.exit_code, r.stdout) == (0, "400000\n"), r


async def test_git_init_commit(node, pybox):
    """git init, add, commit and log work (HOME is set for git's config lookup)."""
    r = await sh(node, pybox, "git init -q /work/repo && cd /work/repo && git config user.email a@b.c && "
                              "git config user.name agent && echo hi > f && git add f && git commit -qm first && "
                              "git log --format=%s", timeout=60)
    assert (r.exit_code, r.stdout) == (0, "first\n"), r


async def test_pip_installs_a_local_wheel(node, pybox):
    """A wheel uploaded through the file API installs with `pip install --no-index` into
    a fresh venv and imports."""
    name, data = _wheel()
    await node.write_file(pybox, f"/work/{name}", data)
    r = await sh(node, pybox, f"python3 -m venv /work/venv && /work/venv/bin/pip install -q --no-index /work/{name}"
                              " && /work/venv/bin/python -c 'import dsec_probe_pkg as p; print(p.ANSWER)'", timeout=180)
    assert (r.exit_code, r.stdout.strip().splitlines()[-1]) == (0, "42"), r
