"""``dsec cluster up/down``: a local Ray cluster whose nodes are separate DSec nodes.

Every node is one ``ray start --block`` process (the head is node ``n0``) started with
the DSec node's own settings in its environment: DSEC_HOME (state, layer cache, stock
images), DSEC_RUN_DIR, DSEC_CGROUP_PARENT, DSEC_NET_CIDR and DSEC_NODE_ID, plus the
custom resource ``dsec_node_<id>`` its agent actor is pinned by. Ray's workers inherit
that environment, so the agent on a node reads that node's configuration exactly as on
a real machine where ``ray start`` runs with the machine's DSEC_* settings.

``--block`` keeps each ``ray start`` in the foreground, so the launcher knows the PID of
every process it started and ``down`` stops exactly those (SIGTERM: ``ray start
--block`` then stops the Ray processes it started), never another Ray on the box.
Everything is recorded in ``<dir>/cluster.json`` (temp + rename) before it is used.

Ports: the head's GCS port and every port Ray would otherwise default (dashboard
agent, metrics, runtime-env agent, client server, worker range) are picked free per
node, so two clusters (or a test cluster and a user's) coexist on one box.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from dsec import errors
from dsec.cluster.ray import node_resource
from dsec.durable import atomic_write

STATE_FILE = "cluster.json"
# Per-node private ranges: far from the single-node default (10.213.0.0/16).
CIDR_BASE = 220
# Node i listens on 127.0.0.(FIRST_IP + i): each node has its own address, all on
# loopback. Not 127.0.0.1: Ray rewrites that one to the machine's primary IP on join.
FIRST_IP = 2


class LocalNode(BaseModel):
    node_id: str
    ip: str = Field(..., description="Loopback address of this node (127.0.0.2 for the head, .3, ...)")
    home: str
    run_dir: str
    cgroup_parent: str
    net_cidr: str
    pid: int = Field(0, description="PID of this node's `ray start --block` (0: not started)")
    log: str = ""


class LocalCluster(BaseModel):
    address: str = Field(..., description="ray://HOST:PORT to give `dsec serve --cluster`")
    dir: str
    temp_dir: str
    checkpoints: str = Field("", description="The checkpoint store every node shares (give the API server "
                             "the same: DSEC_CHECKPOINT_ROOTS)")
    nodes: list[LocalNode] = Field(default_factory=list)
    created_at: float = 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_bin() -> str:
    exe = Path(sys.executable).parent / "ray"
    if exe.exists():
        return str(exe)
    found = shutil.which("ray")
    if found is None:
        raise errors.InvalidArgument("Ray is not installed: pip install 'dsec[ray]' (or 'ray>=2.9')")
    return found


def shared_env(c: LocalCluster) -> dict[str, str]:
    """What every process of the cluster shares, the API server included: the checkpoint
    store (capture on one node, restore on another)."""
    return {"DSEC_CHECKPOINT_ROOTS": json.dumps([c.checkpoints])} if c.checkpoints else {}


def node_env(node: LocalNode, base: dict[str, str] | None = None, shared: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(shared or {})
    env.update({"DSEC_HOME": node.home, "DSEC_RUN_DIR": node.run_dir, "DSEC_NODE_ID": node.node_id,
                "DSEC_CGROUP_PARENT": node.cgroup_parent, "DSEC_NET_CIDR": node.net_cidr,
                "RAY_USAGE_STATS_ENABLED": "0"})
    # Ray >= 2.5x turns token auth on for a `ray start --head` whenever ~/.ray/auth_token
    # exists (any bare `ray.init()` on the box writes one), but a driver joining by address
    # sends no token unless RAY_AUTH_MODE=token: the loopback cluster would refuse
    # `dsec serve --cluster`. Keep the mode explicit; a user's own setting wins.
    env.setdefault("RAY_AUTH_MODE", "disabled")
    return env


def _ports_args() -> list[str]:
    """Every port Ray would default, picked free (several nodes and clusters on one box)."""
    return ["--dashboard-agent-listen-port", str(_free_port()), "--dashboard-agent-grpc-port", str(_free_port()),
            "--metrics-export-port", str(_free_port()), "--runtime-env-agent-port", str(_free_port()),
            "--node-manager-port", str(_free_port()), "--object-manager-port", str(_free_port()),
            "--min-worker-port", "0", "--max-worker-port", "0"]


def plan(base_dir: Path, n: int, tag: str) -> list[LocalNode]:
    """The nodes of a cluster in ``base_dir`` (pure: names, dirs, cgroup parents, ranges)."""
    if not 1 <= n <= 30:
        raise errors.InvalidArgument(f"--nodes must be between 1 and 30, got {n}", field="nodes")
    out = []
    for i in range(n):
        nid = f"n{i}"
        out.append(LocalNode(node_id=nid, ip=f"127.0.0.{FIRST_IP + i}", home=str(base_dir / nid), run_dir=f"/tmp/dsec-{tag}-{nid}",
                             cgroup_parent=f"dsec-{tag}-{nid}", net_cidr=f"10.{CIDR_BASE + i}.0.0/16"))
    return out


def read_state(base_dir: Path) -> LocalCluster | None:
    try:
        return LocalCluster.model_validate_json((base_dir / STATE_FILE).read_text())
    except FileNotFoundError:
        return None


def _write_state(base_dir: Path, c: LocalCluster) -> None:
    atomic_write(base_dir / STATE_FILE, c.model_dump_json(indent=1).encode())


def _start_node(c: LocalCluster, node: LocalNode, head_port: int | None, images: list[str]) -> subprocess.Popen[bytes]:
    Path(node.home).mkdir(parents=True, exist_ok=True)
    Path(node.run_dir).mkdir(parents=True, exist_ok=True)
    args = [_ray_bin(), "start", "--block", "--disable-usage-stats", "--num-cpus", "0",
            "--object-store-memory", str(100 * 2**20), "--node-ip-address", node.ip,
            "--resources", json.dumps({node_resource(node.node_id): 1}), *_ports_args()]
    if head_port is not None:  # the head
        args += ["--head", "--port", str(head_port), "--temp-dir", c.temp_dir, "--include-dashboard", "false"]
    else:
        args += ["--address", c.address.removeprefix("ray://")]
    log = Path(node.home) / "ray-start.log"
    node.log = str(log)
    with open(log, "ab") as fh:
        # Own session: a Ctrl-C in the terminal that ran `cluster up` does not reach it.
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                             env=node_env(node, shared=shared_env(c)), start_new_session=True)
    p.dsec_log = str(log)  # type: ignore[attr-defined]
    return p


def _log_tail(p: subprocess.Popen[bytes]) -> str:
    """The last lines `ray start` wrote (its log is the process's stdout file)."""
    try:
        text = Path(f"/proc/self/fd/{p.stdout.fileno()}").read_text() if p.stdout else ""
    except OSError:
        text = ""
    path = getattr(p, "dsec_log", "")
    if not text and path:
        with contextlib.suppress(OSError):
            text = Path(path).read_text(errors="replace")
    return " | ".join(text.strip().splitlines()[-3:]) or "(no output)"


def _wait_nodes(address: str, want: set[str], timeout_s: float, procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """Until every node in ``want`` is alive in the cluster (checked with `ray` itself)."""
    import ray

    from dsec.cluster.ray import connect, dsec_nodes

    deadline = time.monotonic() + timeout_s
    host, _, port = address.removeprefix("ray://").rpartition(":")
    while True:  # the head's GCS takes 10-20 s on a busy 2-core box; ray.init would retry for a minute
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise errors.Timeout(f"the Ray head did not listen on {address} within {timeout_s:g}s") from None
            for nid, p in procs.items():
                if p.poll() is not None:
                    raise errors.SandboxFailure(f"node {nid}: `ray start` exited with {p.returncode}: {_log_tail(p)}")
            time.sleep(0.5)
    while True:
        for nid, p in procs.items():
            if p.poll() is not None:
                raise errors.SandboxFailure(f"node {nid}: `ray start` exited with {p.returncode}: {_log_tail(p)}")
        try:
            connect(address)
            alive = {nid for nid, n in dsec_nodes().items() if n.get("Alive")}
            if want <= alive:
                return
        except errors.InvalidArgument:
            if ray.is_initialized():
                ray.shutdown()
        if time.monotonic() > deadline:
            raise errors.Timeout(f"the local cluster did not come up within {timeout_s:g}s (nodes {sorted(want)})")
        time.sleep(0.5)


def ensure_images(node: LocalNode, images: list[str], log: Any = print) -> None:
    """Stock images into the node's own layer cache (each node is its own machine)."""
    if not images:
        return
    from dsec.config import load_settings
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock

    settings = load_settings(home=Path(node.home), run_dir=Path(node.run_dir))
    store = ImageStore(Path(node.home) / "images", settings)
    ensure_stock(store, only=images, log=lambda m: log(f"[{node.node_id}] {m}"))


def up(base_dir: Path, n: int, images: list[str] | None = None, timeout_s: float = 120.0,
       log: Any = print) -> LocalCluster:
    """Start the cluster (head + n-1 nodes on this box) and each node's agent actor."""
    base_dir = base_dir.resolve()
    old = read_state(base_dir)
    if old is not None and any(_alive(x.pid) for x in old.nodes):
        raise errors.Conflict(f"a local cluster already runs from {base_dir} (address {old.address}); "
                              "stop it with `dsec cluster down` first", address=old.address)
    base_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    tag = f"{port}"
    temp_dir = f"/tmp/dsec-ray-{tag}"  # short: Ray's socket paths must fit in sun_path
    c = LocalCluster(address=f"ray://127.0.0.{FIRST_IP}:{port}", dir=str(base_dir), temp_dir=temp_dir,
                     checkpoints=str(base_dir / "checkpoints"), nodes=plan(base_dir, n, tag), created_at=time.time())
    _write_state(base_dir, c)  # recorded before anything is started
    for node in c.nodes:
        ensure_images(node, images if images is not None else ["busybox"], log)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for i, node in enumerate(c.nodes):
            p = _start_node(c, node, port if i == 0 else None, images or [])
            procs[node.node_id] = p
            node.pid = p.pid
            _write_state(base_dir, c)
            # One node at a time: raylets starting together on a small box time out.
            _wait_nodes(c.address, {x.node_id for x in c.nodes[:i + 1]}, timeout_s, procs)
        from dsec.cluster.ray import ensure_agents
        _run(ensure_agents(timeout_s=timeout_s))
    except BaseException:
        log("start failed: stopping what was started")
        down(base_dir, log=lambda _m: None)
        raise
    return c


def add_node(base_dir: Path, images: list[str] | None = None, timeout_s: float = 120.0,
             log: Any = print) -> LocalNode:
    """One more DSec node joining the running local cluster (`ray start --address`), as
    another machine would; a `dsec serve --cluster` picks it up by itself."""
    base_dir = base_dir.resolve()
    c = read_state(base_dir)
    if c is None or not any(_alive(x.pid) for x in c.nodes):
        raise errors.InvalidArgument(f"no local cluster runs from {base_dir}; start one with `dsec cluster up`",
                                     field="dir")
    node = plan(base_dir, len(c.nodes) + 1, c.address.rpartition(":")[2])[-1]
    c.nodes.append(node)
    _write_state(base_dir, c)  # recorded before it starts: `down` stops it too
    ensure_images(node, images if images is not None else ["busybox"], log)
    p = _start_node(c, node, None, [])
    node.pid = p.pid
    _write_state(base_dir, c)
    _wait_nodes(c.address, {x.node_id for x in c.nodes}, timeout_s, {node.node_id: p})
    return node


def _run(coro: Any) -> Any:
    """Run ``coro`` to completion from sync code, also when called inside an event loop
    (then on a helper thread with its own loop)."""
    import asyncio
    import concurrent.futures

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    return True


def _group(pgid: int, temp_dir: str) -> list[int]:
    """Live processes of the process group ``pgid`` (a node's `ray start` session) that
    are Ray's: the leader, or anything naming the cluster's temp dir or Ray's binaries.
    Guards against PID reuse: a recycled group id holds none of those."""
    if pgid <= 0:
        return []
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rpartition(")")[2].split()
            if fields[0] == "Z" or int(fields[2]) != pgid:
                continue
            cmd = (d / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if int(d.name) == pgid or temp_dir.encode() in cmd or b"ray" in cmd:
            out.append(int(d.name))
    return out


def _destroy_sandboxes(c: LocalCluster, log: Any) -> int:
    """Destroy every sandbox the cluster's agents hold and stop the agents (best effort:
    whatever cannot be reached is cleaned by the node's own reconcile below)."""
    import asyncio

    async def run() -> int:
        from dsec.cluster.ray import RayNodeProxy, connect, dsec_nodes, get_agent

        connect(c.address)
        n = 0
        for nid in dsec_nodes():
            h = get_agent(nid)
            if h is None:
                continue
            proxy = RayNodeProxy(nid, h, 30)
            try:
                for info in await asyncio.wait_for(proxy.list(), 30):
                    with contextlib.suppress(errors.DSecError):
                        await asyncio.wait_for(proxy.destroy(info.id), 30)
                        n += 1
                await asyncio.wait_for(proxy.shutdown(), 30)
            except (errors.DSecError, TimeoutError) as e:
                log(f"[{nid}] could not clean through its agent: {e}")
        return n

    try:
        return _run(run())
    except Exception as e:  # noqa: BLE001 - a dead cluster is cleaned by reconcile below
        log(f"agents unreachable ({e}); cleaning nodes directly")
        return 0
    finally:
        import ray
        if ray.is_initialized():
            ray.shutdown()


def _reconcile_homes(c: LocalCluster) -> None:
    """After the agents are gone: a node's own reconcile cleans any sandbox left behind
    (kernel resources recorded under its home), run once per node in a child process
    with that node's environment (its cgroup parent is read at import)."""
    code = ("import asyncio\nfrom dsec.config import load_settings\nfrom dsec.node.manager import SandboxManager\n"
            "async def main():\n    m = SandboxManager(load_settings())\n    await m.start()\n"
            "    for sid in list(m.live):\n        await m.destroy(sid)\n    m.close()\nasyncio.run(main())\n")
    for node in c.nodes:
        if Path(node.home, "node").exists():
            subprocess.run([sys.executable, "-c", code], env=node_env(node), check=False, timeout=120,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _remove_cgroup_parent(parent: str) -> None:
    """The node's parent cgroup in every hierarchy (empty once its sandboxes are gone;
    rmdir refuses a cgroup that still has children or tasks, which is then left)."""
    from dsec.node.cgroups import CGROUP_ROOT

    for d in [CGROUP_ROOT / parent, *(h / parent for h in CGROUP_ROOT.iterdir() if h.is_dir())]:
        with contextlib.suppress(OSError):
            d.rmdir()


def down(base_dir: Path, keep_data: bool = False, log: Any = print) -> LocalCluster | None:
    """Destroy the cluster's sandboxes, stop the Ray processes it started (by PID), remove
    its dirs. Returns what was stopped (None: no cluster recorded there)."""
    base_dir = base_dir.resolve()
    c = read_state(base_dir)
    if c is None:
        return None
    if any(_alive(x.pid) for x in c.nodes):
        n = _destroy_sandboxes(c, log)
        if n:
            log(f"destroyed {n} sandboxes")
    for node in reversed(c.nodes):  # workers first, the head last
        if _alive(node.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGTERM)
    # `ray start --block` drains up to 30 s after SIGTERM; the sandboxes are gone already,
    # so a short grace, then SIGKILL to what is left of each node's own process group.
    deadline = time.monotonic() + 10
    for node in c.nodes:
        while _group(node.pid, c.temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in _group(node.pid, c.temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for node in c.nodes:
        end = time.monotonic() + 10
        while _group(node.pid, c.temp_dir) and time.monotonic() < end:
            time.sleep(0.1)
    _reconcile_homes(c)
    for node in c.nodes:
        shutil.rmtree(node.run_dir, ignore_errors=True)
        _remove_cgroup_parent(node.cgroup_parent)
    shutil.rmtree(c.temp_dir, ignore_errors=True)
    if keep_data:
        (base_dir / STATE_FILE).unlink(missing_ok=True)
    else:
        shutil.rmtree(base_dir, ignore_errors=True)
    return c
