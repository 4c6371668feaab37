"""Simulation report: markdown table + JSON + matplotlib PNG plots in one directory."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dsec.durable import atomic_write  # noqa: E402

ROWS = [
    ("queue_wait_p50_s", "queue wait p50 (s)", "{:.3f}"),
    ("queue_wait_p99_s", "queue wait p99 (s)", "{:.3f}"),
    ("start_latency_p50_s", "start latency p50 (s)", "{:.3f}"),
    ("start_latency_p99_s", "start latency p99 (s)", "{:.3f}"),
    ("decisions_per_s", "placement decisions/s (wall)", "{:,.0f}"),
    ("decisions_per_cpu_s", "placement decisions/CPU-s", "{:,.0f}"),
    ("layer_hit_rate", "layer hit rate", "{:.1%}"),
    ("byte_hit_rate", "byte hit rate", "{:.1%}"),
    ("bytes_pulled", "bytes pulled (GiB)", "gib"),
    ("warm_pool_hit_rate", "warm-pool hit rate", "{:.1%}"),
    ("utilisation_alloc_mean", "utilisation (allocated CPU)", "{:.1%}"),
    ("utilisation_used_mean", "utilisation (used CPU)", "{:.1%}"),
    ("overload_incidents", "overload incidents", "{:d}"),
    ("preemptions", "preemptions", "{:d}"),
    ("rejected_429", "429s (client retried)", "{:d}"),
    ("failed_requests", "failed requests", "{:d}"),
    ("requests_placed", "requests placed", "{:,d}"),
    ("creates", "sandbox creations (incl. pool)", "{:,d}"),
    ("node_failures", "node failures", "{:d}"),
    ("sandboxes_lost_to_node_failures", "sandboxes lost (resubmitted)", "{:d}"),
    ("wall_s", "simulation wall time (s)", "{:.1f}"),
    ("cpu_s", "simulation CPU time (s)", "{:.1f}"),
]


NODE_CHOICE = {
    "ours": "DSec's placement: layer coverage in bytes + load + predicted load with a per-batch "
            "spread penalty, nodes missing > 30 % of the image refused while a better one exists, "
            "candidates = holders of the image's top and largest layers + 2 random probes",
    "random": "a uniformly random feasible node",
    "least-loaded": "the feasible node with the lowest allocated CPU fraction (scans every node)",
    "k8s": "kube-scheduler defaults: filter, then score percentageOfNodesToScore of the feasible "
           "nodes by NodeResourcesFit/LeastAllocated + ImageLocality (equal weights)",
}


def describe_policy(spec: str) -> str:
    name, plain = (spec[:-6], True) if spec.endswith(":plain") else (spec, False)
    how = NODE_CHOICE.get(name, name)
    if plain:
        return (f"{how}; stand-alone as in a Kubernetes cluster: admits by requests up to node "
                "capacity (no overcommit, no usage rule), no warm pools, preemption of lower priority "
                "when full")
    return (f"{how}; within DSec's scheduler: the same tenant queues, overcommit rule (1.3x while "
            "predicted use < 85 %), warm pools (members placed by this policy too) and preemption "
            "as every other row")


def _fmt(fmt: str, v: object) -> str:
    if fmt == "gib":
        return f"{float(v) / 1024**3:,.1f}"  # type: ignore[arg-type]
    return fmt.format(v)


def render_markdown(meta: dict, results: list[dict]) -> str:
    names = [r["policy"] for r in results]
    lines = [f"# DSec scheduler simulation (seed {meta['seed']})", "",
             f"{meta['hours']} h simulated, rate scale {meta['rate_scale']} "
             f"({meta['arrivals_expected']:,.0f} creations expected), {meta['nodes']} nodes of "
             f"{meta['node_cpu']:.0f} CPU, {meta['images']} images (Zipf s={meta['zipf_s']}).", "",
             "| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key, label, fmt in ROWS:
        lines.append(f"| {label} | " + " | ".join(_fmt(fmt, r.get(key, 0)) for r in results) + " |")
    lines += ["", ("Queue wait = the client's first submit -> placement decision (a request refused "
                   "with 429 waits until its resubmission is placed); start latency = first submit -> "
                   "sandbox ready (pull + start, or warm hand-over)."), ""]
    lines += [f"- `{n}`: {describe_policy(n)}" for n in names]
    lines += ["",
              "![comparison](comparison.png)", "", "![timeline](timeline.png)", ""]
    return "\n".join(lines)


def plot(out: Path, results: list[dict]) -> None:
    names = [r["policy"] for r in results]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    panels = [("queue_wait_p99_s", "queue wait p99 (s)"), ("start_latency_p99_s", "start latency p99 (s)"),
              ("bytes_pulled", "bytes pulled (GiB)"), ("layer_hit_rate", "layer hit rate"),
              ("warm_pool_hit_rate", "warm-pool hit rate"), ("decisions_per_s", "decisions/s (wall)")]
    for ax, (key, title) in zip(axes.flat, panels):
        vals = [r[key] / (1024**3 if key == "bytes_pulled" else 1) for r in results]
        ax.bar(names, vals, color=["tab:green" if n.startswith("ours") else "tab:gray" for n in names])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(out / "comparison.png", dpi=90)
    plt.close(fig)
    fig, axes = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    for r in results:
        ts = [p["t"] / 3600 for p in r["series"]]
        axes[0].plot(ts, [p["alloc"] for p in r["series"]], label=r["policy"])
        axes[1].plot(ts, [p["queue"] for p in r["series"]], label=r["policy"])
        axes[2].plot(ts, [p["pulled"] / 1024**3 for p in r["series"]], label=r["policy"])
    axes[0].set_ylabel("allocated CPU fraction")
    axes[1].set_ylabel("queue depth")
    axes[2].set_ylabel("GiB pulled (cumulative)")
    axes[2].set_xlabel("hours")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=90)
    plt.close(fig)


def write_report(out: Path, meta: dict, results: list[dict]) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md"}
    atomic_write(paths["json"], json.dumps({"meta": meta, "results": results}, indent=1,
                                            sort_keys=True).encode())
    atomic_write(paths["md"], render_markdown(meta, results).encode())
    plot(out, results)
    paths["comparison"] = out / "comparison.png"
    paths["timeline"] = out / "timeline.png"
    return paths
