"""``dsec bench ...``: benchmarks that compare against a baseline in the same run."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from dsec.cli.common import handle_errors

app = typer.Typer(help="Benchmarks (each reports ratios against a baseline run side by side).",
                  no_args_is_help=True)
console = Console(stderr=True)


def _emit(report: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str))
    console.print(f"[green]report written to {path}[/]")


@app.command()
def cli(rounds: int = typer.Option(20, help="rounds (each runs every command once, alternating order)"),
        out: Path = typer.Option(Path("reports"), help="report directory")) -> None:
    """`dsec --help`, `dsec ps`, `dsec run busybox -- true` vs `podman run --rm` (fresh server)."""
    from dsec.bench.cli import run
    with console.status("benchmarking the CLI") as status:
        report = run(rounds=rounds, progress=lambda m: status.update(m))
    _emit(report, out, "cli-bench")


@app.command()
def sandbox(rounds: int = typer.Option(10, help="create/destroy rounds per image"),
            execs: int = typer.Option(1000, help="exec round trips"),
            many: int = typer.Option(500, help="idle sandboxes held at once (0 to skip)"),
            out: Path = typer.Option(Path("reports"), help="report directory")) -> None:
    """Create-to-first-exec vs podman run, exec vs runc exec, destroy, N idle sandboxes."""
    from dsec.bench.sandbox import run
    with console.status("benchmarking sandboxes") as status:
        report = run(rounds=rounds, exec_n=execs, many=many, progress=lambda m: status.update(m))
    _emit(report, out, "sandbox-bench")


@app.command()
def images(out: Path = typer.Option(Path("reports"), help="report directory")) -> None:
    """Import vs podman load, overlay prepare, unchanged rebuild (needs the python image)."""
    from dsec.bench.images import run
    _emit(run(out), out, "images-bench")


@app.command("images-pull")
def images_pull(rounds: int = typer.Option(3, help="alternated rounds (best and median reported)"),
                cold_create: bool = typer.Option(True, help="also: cold create (pull) -> first exec on a server"),
                out: Path = typer.Option(Path("reports"), help="report directory")) -> None:
    """Pull of the python image from a local registry into an empty store vs skopeo copy;
    cold create -> first exec with the pull time apart."""
    from dsec.bench.images import run_pull
    _emit(run_pull(out, rounds=rounds, cold_create=cold_create), out, "images-pull-bench")


@app.command("images-cluster")
def images_cluster(nodes: int = typer.Option(5, help="DSec nodes of the local Ray cluster"),
                   rate: str = typer.Option("1gbit", help="tc tbf rate of the registry's link"),
                   rounds: int = typer.Option(1, help="rounds of (registry only, peers cut-through, peers "
                                                "store-and-forward), order alternated"),
                   image: str = typer.Option("python", help="stock image pushed and pulled"),
                   node_tmpfs: str = typer.Option("", help="put the nodes' homes on a tmpfs of this size (e.g. 4g): "
                                                  "on one box the nodes otherwise share one disk"),
                   prefetch: bool = typer.Option(False, help="also: create -> first exec on a third node after "
                                                 "the scheduler's prefetch path put the image there"),
                   out: Path = typer.Option(Path("reports"), help="report directory")) -> None:
    """N nodes start the same image at once from a registry in its own netns behind a
    tc-shaped veth: registry bytes and wall time with peers vs all from the registry;
    cold node create -> first exec with the pull apart (``--rounds 0``: only that)."""
    from dsec.bench.images_cluster import run
    _emit(run(out, nodes=nodes, rate=rate, rounds=rounds, image=image, node_tmpfs=node_tmpfs, prefetch=prefetch),
          out, "images-cluster-bench")


@app.command("exec-agent")
def exec_agent(calls: int = typer.Option(2000, help="round trips")) -> None:
    """The in-sandbox exec agent's round trip vs fork+exec of the same command."""
    from dsec.bench.exec_agent import run
    _emit(run(calls=calls), Path("reports"), "exec-agent-bench")


@app.command()
def net() -> None:
    """Network slot attach vs bare netns creation; throughput vs a plain veth (iperf3)."""
    from dsec.bench.net import run
    _emit(run(), Path("reports"), "net-bench")


@app.command("net-sandbox")
def net_sandbox() -> None:
    """Create-to-first-exec with a one-entry allow-list vs network=None, and egress
    throughput vs a plain veth, in real sandboxes of both tiers."""
    from dsec.bench.net_sandbox import run
    _emit(run(), Path("reports"), "net-sandbox-bench")


@app.command()
def pool(rounds: int = typer.Option(30, help="warm vs cold rounds"),
         burst: int = typer.Option(200, help="creates fired within one second"),
         out: Path = typer.Option(Path("reports"), help="report directory")) -> None:
    """On a real server: warm-pool hand-over to first exec vs a cold create (same build,
    pools off), and a burst of creates against the overcommit bound."""
    from dsec.bench.pool import run
    with console.status("benchmarking the scheduler on a real server") as status:
        report = run(rounds=rounds, burst=burst, progress=lambda m: status.update(m))
    _emit(report, out, "pool-bench")


@app.command()
def failover(creates: int = typer.Option(200, help="creates in the burst (two clients)"),
             out: Path = typer.Option(Path("reports"), help="report directory")) -> None:
    """Kill -9 the scheduler leader mid-burst (redis, 1-node Ray cluster, two API servers):
    time without placements, takeover, exactly-once counts."""
    from dsec.bench.failover import run
    with console.status(f"{creates} creates, leader killed mid-burst"):
        report = run(creates)
    _emit(report, out, "failover-bench")


@app.command()
def scheduler(requests: int = typer.Option(20_000, help="placement requests")) -> None:
    """Placement decisions/s at 1,000 and 10,000 nodes, ours vs a Kubernetes-style baseline."""
    from dsec.bench.scheduler import run
    _emit(run(requests=requests), Path("reports"), "scheduler-bench")


@app.command()
def recovery(out: Path = typer.Option(Path("reports"), help="report directory"),
             reps: int = typer.Option(20, help="steps per size")) -> None:
    """Per-step checkpoint overhead and restore time (50-step, 20 MB episode)."""
    import asyncio

    from dsec.bench.recovery import run
    _emit(asyncio.run(run(out, reps=reps)), out, "recovery-bench")


@app.command()
def api(sandboxes: int = typer.Option(200, help="concurrent sandboxes (0: skip the load part)"),
        execs: int = typer.Option(50, help="execs per sandbox"),
        samples: int = typer.Option(300, help="paired overhead samples (0: skip the overhead part)")) -> None:
    """SDK-over-HTTP overhead and one asyncio client driving many sandboxes."""
    from dsec.bench.api import run
    _emit(run(sandboxes=sandboxes, execs=execs, samples=samples), Path("reports"), "api-bench")


@app.command()
def runcode(calls: int = typer.Option(512, help="/run_code calls (and bare python3 runs)"),
            concurrency: int = typer.Option(64, help="calls in flight (verl's default is 64)"),
            podman_calls: int = typer.Option(64, help="podman run --rm calls (0 to skip)"),
            resets: int = typer.Option(200, help="sb.reset() rounds for the median"),
            out: Path = typer.Option(Path("reports"), help="report directory")) -> None:
    """SandboxFusion /run_code at concurrency 64 vs bare python3 subprocesses and vs
    podman run --rm per call, in one run; plus the sb.reset() median."""
    from dsec.bench.runcode import run
    with console.status("benchmarking /run_code") as status:
        report = run(calls=calls, concurrency=concurrency, podman_calls=podman_calls, reset_rounds=resets,
                     progress=lambda m: status.update(m))
    _emit(report, out, "runcode-bench")


@app.command()
def speed(only: str = typer.Option("warm,sdk,gvisor,density,episodes,cold",
                                   help="comma-separated rows: warm, sdk, gvisor, density, episodes, cold"),
          rounds: int = typer.Option(20, help="warm/cold rounds"),
          samples: int = typer.Option(300, help="paired SDK overhead samples"),
          gvisor_n: int = typer.Option(200, help="exec round trips per tier"),
          idle: int = typer.Option(1000, help="idle sandboxes held at once"),
          episode_s: float = typer.Option(20.0, help="seconds of create -> exec -> destroy"),
          workers: int = typer.Option(8, help="concurrent episode workers"),
          out: Path = typer.Option(Path("reports"), help="report directory")) -> None:
    """Issue 15's table (warm hand-over, SDK overhead, gVisor exec, density, episodes/s,
    cold start), each row with its baseline from the same run."""
    from dsec.bench.speed import run
    with console.status("benchmarking speed and density") as status:
        report = run(tuple(x for x in only.split(",") if x), rounds, samples, gvisor_n, idle, episode_s, workers,
                     progress=lambda m: status.update(m))
    _emit(report, out, "speed-bench")
    print(report["table"])



@app.command()
@handle_errors
def cluster(nodes: int = typer.Option(100, help="simulated DSec nodes (fake node agents)"),
            placements: int = typer.Option(5000, help="creates placed through the scheduler driver"),
            concurrency: int = typer.Option(0, help="creates in flight (0: all at once)"),
            ray: bool = typer.Option(True, help="also run with the agents as Ray actors (else in-process only)"),
            real: bool = typer.Option(False, help="also: create->exec->destroy/s through `dsec serve --cluster` on "
                                                  "a 3-node `dsec cluster up` vs a single-node `dsec serve`"),
            real_seconds: float = typer.Option(20.0, help="--real: seconds of load per server"),
            workers: int = typer.Option(8, help="--real: concurrent SDK clients"),
            out: Path = typer.Option(Path("reports"), help="report directory")) -> None:
    """Placements/s through the real scheduler driver over N fake node agents as Ray actors
    vs the same agents in-process; with --real, 3-node vs 1-node sandbox throughput."""
    from dsec.bench.cluster import run, table
    with console.status("benchmarking the cluster control plane") as status:
        report = run(nodes=nodes, placements=placements, concurrency=concurrency or placements, use_ray=ray,
                     real=real, real_seconds=real_seconds, workers=workers, progress=lambda m: status.update(m))
    _emit(report, out, "cluster-bench")
    print(table(report))
