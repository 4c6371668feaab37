"""One settings object for the whole project.

Every tunable has a default here with a one-line doc; code elsewhere never carries a
magic number. Values come from ``DSEC_*`` environment variables, then an optional TOML
file (``DSEC_CONFIG``), then these defaults. Seed figures are defaults, never constants.
"""

from __future__ import annotations

import math

import os
import tomllib
from functools import lru_cache
from pathlib import Path

from typing import Annotated

from pydantic import BeforeValidator, Field
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _default_home() -> Path:
    return Path(os.environ.get("DSEC_HOME", "/var/lib/dsec"))


def _address_list(value: object) -> object:
    """An env/TOML string is a JSON list or comma-separated: '10.0.0.1:3128,10.0.0.2:53'."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            import json
            return json.loads(text)
        return [x.strip() for x in text.split(",") if x.strip()]
    return value


AddressList = Annotated[list[str], NoDecode, BeforeValidator(_address_list)]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DSEC_", extra="ignore")

    # --- locations -----------------------------------------------------------------
    home: Path = Field(default_factory=_default_home, description="Data dir: state, images, sandboxes")
    run_dir: Path | None = Field(None, description="Runtime dir for sockets/runc state (default HOME/run)")
    config: Path | None = Field(None, description="Optional TOML file with settings")

    # --- client --------------------------------------------------------------------
    url: str | None = Field(None, description="API server URL for SDK/CLI")
    token: str | None = Field(None, description="Tenant API token for SDK/CLI")
    client_retries: int = Field(4, description="SDK retries on transient failures / 429")
    client_backoff_s: float = Field(0.2, description="SDK initial retry backoff (doubles, capped)")
    client_backoff_max_s: float = Field(5.0, description="SDK retry backoff cap")
    client_timeout_s: float = Field(120.0, description="SDK per-request timeout")

    # --- server --------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="API bind host")
    port: int = Field(7070, description="API bind port")
    max_upload_bytes: int = Field(256 * 1024 * 1024, description="Largest file/tar upload accepted")
    max_exec_output_bytes: int = Field(16 * 1024 * 1024, description="Exec output kept per stream")
    audit_retention_s: float = Field(7 * 24 * 3600, description="Audit log kept after sandbox death")

    # --- service layer: API server, SDK, CLI (owner: service engineer) ----------------
    client_max_connections: int = Field(2048, description="SDK HTTP connection pool size per Client")
    client_max_keepalive: int = Field(1024, description="SDK idle keep-alive connections kept per Client")
    api_retry_after_s: float = Field(1.0, description="Retry-After sent with 429 when no better hint")
    api_audit_flush_s: float = Field(0.2, description="Audit records are batched and flushed this often")
    api_prune_interval_s: float = Field(60.0, description="How often dead sandboxes' audit is pruned")
    api_shutdown_grace_s: float = Field(10.0, description="Graceful shutdown: wait this long for requests")
    api_audit_max_chars: int = Field(4096, description="Longest string kept per audit field (argv, paths)")
    api_max_inflight_creates: int = Field(1024, description="Creates in flight before 429 Overloaded")
    api_scheduler: bool = Field(True, description="Creates go through the control-plane scheduler driver")
    api_image_check_ttl_s: float = Field(30.0, description="A create's image was found this recently: skip the "
                                         "lookup (a thread hop; an image removed since is still refused by the node)")
    api_create_wait_s: float = Field(30.0, description="A create not placed within this is withdrawn: 429 + Retry-After")
    api_keepalive_s: float = Field(75.0, description="Server keep-alive idle timeout (> client_keepalive_s)")
    client_keepalive_s: float = Field(30.0, description="SDK closes idle pooled connections after this (< server's)")
    api_loop_lag_probe_s: float = Field(0.25, description="Event-loop lag is sampled this often (metric)")
    # --- API event-loop priority (owner: service/API) ---
    api_loop_nice: int = Field(-10, ge=-20, le=19, description="Nice of the API event-loop thread (children "
                               "reset to 0); keeps the API responsive under sandbox load. 0 = leave as is")
    api_exec_slots: int = Field(32, ge=1, description="Execs started at once; more wait (bounded by "
                                "api_exec_slot_hold_s) so a burst cannot flood one loop iteration")
    api_exec_slot_hold_s: float = Field(0.05, gt=0, description="An exec frees its slot after this long even "
                                        "if still running: long commands never block others")
    demo_episodes: int = Field(16, description="Concurrent agent episodes run by `dsec demo`")
    demo_image: str = Field("python", description="Image used by `dsec demo` episodes")
    doctor_min_free_disk: str = Field("5G", description="`dsec doctor`/serve warn below this free space under HOME")
    doctor_min_nofile: int = Field(16384, description="`dsec doctor`/serve warn below this open-file hard limit")
    # --- API hardening: bodies, files, connections (issue 18 #2 #3 #5 #11 #12) ---
    api_max_json_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Largest JSON request body (413 past "
                                    "it; checked after auth, before reading); raw uploads use max_upload_bytes")
    api_uploads_per_tenant: int = Field(4, ge=1, description="File/tar uploads one tenant may stream at once "
                                        "(429 past it)")
    api_file_ops_per_tenant: int = Field(8, ge=1, description="Blocking file operations one tenant may have in "
                                         "flight on the file I/O threads (more wait, then 429)")
    api_file_threads: int = Field(32, ge=1, description="File I/O threads, apart from the pool that state, "
                                  "create and kill calls use")
    api_file_slot_wait_s: float = Field(5.0, gt=0, description="A file operation waits this long for one of "
                                        "its tenant's slots, then answers 429")
    api_file_op_timeout_s: float = Field(60.0, gt=0, description="Deadline of one blocking file step (open, "
                                         "1 MiB read/write, list page); 504 past it")
    api_list_max_entries: int = Field(1000, ge=1, description="Most entries one files/list page returns "
                                      "(a larger `limit` is clamped); the rest via the cursor")
    api_header_timeout_s: float = Field(10.0, gt=0, description="A request's headers must be complete this long "
                                        "after its first byte (or after connect); else the connection is closed")
    api_max_pending_per_client: int = Field(64, ge=1, description="Connections one client address may hold "
                                            "with a half-sent request header; more are closed at once")
    api_pending_grace_s: float = Field(1.0, gt=0, description="A connection that sent no complete header this "
                                       "long after connect counts toward api_max_pending_per_client")

    # --- sandbox defaults (SPEC §1) ----------------------------------------------
    default_cpu: float = Field(1.0, description="CPU cap (cgroup limit) per sandbox")
    default_memory: str = Field("2G", description="Memory per sandbox")
    default_disk: str = Field("10G", description="Writable-layer quota per sandbox")
    default_timeout_s: float = Field(1800.0, description="Wall timeout/TTL per sandbox")
    default_pids: int = Field(1024, description="Max processes per sandbox")
    sandbox_max_pids: int | None = Field(None, ge=8, description="Largest `pids` one sandbox may ask for; above "
                                         "is 422 (default: host pid_max / 4; never above host pid_max)")
    default_nofile: int = Field(4096, description="RLIMIT_NOFILE in sandboxes (<= host hard limit)")
    default_isolation: str = Field("container", description="container (runc) or gvisor (runsc)")
    runc_path: str = Field("runc", description="runc binary")
    runtime_nice: int = Field(-10, ge=-20, le=19, description="Container tier: nice of `runc run` on a cold "
                              "create, so it outranks sandbox load (dsec-init resets PID 1 to 0 before any sandbox "
                              "code runs); 0 = as the node")
    init_seccomp: bool = Field(True, description="Container tier: PID 1 (dsec-init) installs the sandbox seccomp "
                                                 "profile, built with it, instead of runc compiling it on each "
                                                 "create (about 10 ms of CPU); false: runc's OCI profile")
    runsc_path: str = Field("runsc", description="runsc binary")
    runsc_platform: str = Field("ptrace", description="gVisor platform (ptrace works everywhere)")
    runsc_debug_dir: Path | None = Field(None, description="Write gVisor debug logs here (troubleshooting)")
    exec_default_timeout_s: float = Field(60.0, description="Exec timeout when none given")

    # --- node capacity -------------------------------------------------------------
    node_cpu: float | None = Field(None, description="Schedulable CPUs (default: os.cpu_count())")
    node_memory: str | None = Field(None, description="Schedulable memory (default: MemTotal)")
    node_disk: str | None = Field(None, description="Schedulable disk quota (default: free space of HOME x disk_overprovision)")
    disk_overprovision: float = Field(10.0, description="Writable layers are tmpfs, filled on write and charged to "
                                                        "the sandbox's memory: quotas are thin-provisioned by this")
    node_max_sandboxes: int = Field(2000, description="Hard cap of live sandboxes per node")
    node_reset_workers: int = Field(16, ge=1, description="Threads running in-place resets and recycles per node "
                                    "(they mostly wait on RCU grace periods and the GIL, not on CPU; with 4, "
                                    "recycling capped short episodes at ~50/s)")
    node_id: str | None = Field(None, description="This node's id in a cluster (default: the API bind host)")
    cgroup_parent: str = Field("dsec", description="Parent cgroup of this node's sandboxes (one per node on a shared box)")
    cluster: str | None = Field(None, description="Ray cluster to drive (ray://HEAD:PORT or HEAD:PORT); None: this machine only")
    cluster_agent_timeout_s: float = Field(60.0, description="Longest wait for a node agent actor to start or answer a control call")
    cluster_membership_interval_s: float = Field(5.0, description="How often `dsec serve --cluster` looks for DSec nodes that joined")
    cluster_layer_sync_interval_s: float = Field(60.0, gt=0, description="How often `dsec serve --cluster` reads every node's layer index so the scheduler's layer coverage drops what a node removed (cluster GC) and adds what it got")
    cluster_heartbeat_interval_s: float = Field(1.0, gt=0, description="How often `dsec serve --cluster` probes every node agent's health (heartbeat)")
    cluster_heartbeat_timeout_s: float = Field(2.0, gt=0, description="Longest wait for one heartbeat answer; a slower answer counts as missed")
    cluster_node_lost_after_s: float = Field(5.0, gt=0, description="A node with no good heartbeat for this long (or whose Ray node died) is lost: its sandboxes answer 410")
    cluster_restore_lost: bool = Field(True, description="Restore a lost node's checkpointed sandboxes on other nodes (latest checkpoint, same sandbox id)")
    cluster_data_direct: bool = Field(True, description="Node agents also serve node calls on a direct token-authenticated TCP endpoint (no Ray hop per exec/file call); off: every call goes through Ray")
    cluster_data_max_frame_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024, description="Largest frame on the direct data path; larger calls go through Ray")
    cluster_data_read_timeout_s: float = Field(10.0, gt=0, description="Direct data path: a frame (or the handshake) must arrive in full within this once begun")
    cluster_demand_min_age_s: float = Field(1.0, ge=0, description="A create queued this long counts as pending demand the cluster cannot place (GET /v1/scheduler pending_demand, metrics)")

    # --- images (SPEC §2) ------------------------------------------------------------
    image_cache_max_images: int = Field(20, description="Most recent images whose layers are kept")
    image_cache_max_bytes: str = Field("50G", description="Byte budget of the unpacked-layer cache")
    image_gc_unused_s: float = Field(24 * 3600, description="GC layers unreferenced and unused this long")
    image_base_layer_min_copies: int = Field(3, description="Cluster-wide copies kept of base layers")
    image_max_concurrent_pulls: int = Field(4, description="Concurrent layer pulls per node")
    layer_compression: str = Field("zstd", description="zstd (default) or gzip for layers we write")
    layer_zstd_level: int = Field(3, description="zstd level for layers we write")

    # --- image store / builder (owner: images; docs/images.md) ------------------------
    image_stock_cache_dir: Path = Field(Path("/var/cache/dsec"), description="Cache of stock rootfs tarballs (mmdebstrap)")
    image_stock_suite: str = Field("bookworm", description="Debian suite of the stock python image")
    image_build_step_timeout_s: float = Field(1800.0, description="Wall timeout of one RUN build step")
    image_build_output_max_bytes: int = Field(1024 * 1024, description="RUN step output kept (tail) per step")
    layer_import_compress: bool = Field(False, description="Store uncompressed imported layers zstd-compressed (CPU for disk)")
    layer_import_threads: int = Field(2, description="zstd worker threads when layer_import_compress is on")
    layer_unpack_syncfs: bool = Field(False, description="syncfs before sealing an unpacked layer (see docs/images.md)")
    image_unpack_workers: int = Field(2, description="Worker processes unpacking an image's layers on import")
    image_parallel_unpack_min_bytes: int = Field(64 * 1024 * 1024, description="Use unpack workers above this image size")
    # --- OCI registry client (owner: images; docs/images.md "Registry") -----------------
    image_registry: str = Field("", description="Default registry HOST[:PORT] for refs that name none")
    registry_username: str | None = Field(None, description="Registry user (basic auth, also at a token server)")
    registry_password: str | None = Field(None, description="Password/token of registry_username (never logged)")
    registry_ca_file: Path | None = Field(None, description="Extra CA bundle (PEM) trusted for https registries")
    registry_timeout_s: float = Field(60.0, gt=0, description="Connect/read timeout of one registry HTTP call")
    registry_push_chunk_bytes: int = Field(0, ge=0, description="Push blobs as PATCH chunks this big (0: one PUT)")
    image_pull_on_create: bool = Field(True, description="Creates pull a missing image found in image_registry")
    registry_insecure: bool = Field(False, description="Pulls on create may use plain http / unverified TLS to image_registry (a registry on a private network)")
    node_max_concurrent_pulls: int = Field(4, ge=1, description="Blob transfers (registry or peer) one node runs at once, across all its pulls")
    # --- peer-to-peer layers on a cluster (owner: images; docs/images.md "Across machines") ----
    p2p_enabled: bool = Field(True, description="Cluster nodes serve their verified blobs to peers and fetch from peers before the registry")
    p2p_host: str = Field("", description="Address the node's peer blob endpoint binds (empty: the node's Ray address)")
    p2p_port: int = Field(0, ge=0, lt=65536, description="Port of the node's peer blob endpoint (0: a free one, published in the cluster directory)")
    p2p_serve_max: int = Field(2, ge=1, description="Blobs a node serves to peers at once (more get 503 and try another holder): the fan-out tree's degree")
    p2p_tree_wait_s: float = Field(5.0, gt=0, description="In a burst, how long a node waits for a holder that serves fewer than p2p_serve_max peers of a blob before asking a busier one")
    p2p_wait_s: float = Field(300.0, gt=0, description="Longest a node waits for peers/another node's registry fetch of a layer before fetching it from the registry itself")
    p2p_claim_stale_s: float = Field(15.0, gt=0, description="A node's registry-fetch claim on a layer with no progress for this long is taken over")
    p2p_announce_interval_s: float = Field(10.0, gt=0, description="How often a node re-publishes which blobs it holds (also after every pull)")
    p2p_cut_through: bool = Field(True, description="A node serves a blob to peers while it is still receiving it (each receiver verifies the digest before use)")
    image_gc_cluster_interval_s: float = Field(600.0, gt=0, description="How often a cluster node runs the cluster-wide layer GC decision for its own layers")
    image_prefetch_enabled: bool = Field(True, description="The cluster's scheduler leader prefetches popular images (in image_registry) onto the nodes it will likely use next")
    image_prefetch_interval_s: float = Field(15.0, gt=0, description="How often the leader runs a prefetch pass")
    image_prefetch_window_s: float = Field(600.0, gt=0, description="Creates per image are counted over this window (popularity); keep it below image_gc_unused_s")
    image_prefetch_min_creates: int = Field(2, ge=1, description="Creates within the window that make an image popular")
    image_prefetch_top_images: int = Field(3, ge=0, description="Most popular images prefetched per pass")
    image_prefetch_nodes: int = Field(2, ge=0, description="Nodes per popular image that should hold it: the first ones the scheduler's score ranks for its last shape")
    image_prefetch_max_inflight: int = Field(2, ge=1, description="Prefetches in flight across the cluster (one per node at most)")
    image_prefetch_retry_s: float = Field(600.0, gt=0, description="A (node, image) prefetched or tried is not prefetched again for this long")

    # --- scheduler (SPEC §3) ---------------------------------------------------------
    queue_capacity: int = Field(10000, description="Max queued create requests (bounded)")
    queue_high_watermark: float = Field(0.80, description="Backpressure on above this depth fraction")
    queue_low_watermark: float = Field(0.60, description="Backpressure off below this depth fraction")
    image_miss_threshold: float = Field(0.30, description="Refuse nodes missing more than this of an image")
    overcommit_window_s: float = Field(30.0, description="Sliding usage window per node")
    overcommit_predict_window_s: float = Field(600.0, description="Mean window for predicted load")
    overcommit_predict_factor: float = Field(1.5, description="Predicted load = mean x this")
    overcommit_threshold: float = Field(0.85, description="Admit nothing above this predicted load")
    overcommit_ratio: float = Field(1.3, description="Max admitted / capacity while below threshold")
    node_sync_interval_s: float = Field(5.0, description="How often the scheduler re-lists its nodes' sandboxes")
    warm_fast_path_max_queue: int = Field(64, description="Warm hand-over skips the batch window while the queue is this short")
    cpu_request_ratio: float = Field(0.25, description="CPU reserved per sandbox = its CPU cap x this")
    memory_request_ratio: float = Field(1.0, gt=0, le=1, description="Memory reserved per sandbox = its memory "
                                        "limit x this (idle-heavy RL loads lower it with the CPU one)")
    disk_request_ratio: float = Field(0.01, gt=0, le=1, description="Disk reserved per sandbox = its disk quota x "
                                      "this: a quota caps a tmpfs charged to the sandbox's memory, not disk")
    warm_pool_factor: float = Field(1.2, description="Pool target = peak concurrency x this")
    warm_pool_window_s: float = Field(600.0, description="Window for observed peak concurrency")
    warm_pool_max_idle_s: float = Field(1800.0, description="Idle pool members expire after this")
    warm_pool_max_per_node: int = Field(64, description="Max warm sandboxes per node")
    batch_window_s: float = Field(0.050, description="Requests within this window are placed together")
    node_parallel_creates: int = Field(8, description="Parallel creations per node")
    retry_max_attempts: int = Field(3, description="Create attempts across nodes")
    retry_backoff_s: float = Field(0.05, description="Initial create retry backoff")
    retry_backoff_max_s: float = Field(2.0, description="Create retry backoff cap")
    heartbeat_interval_s: float = Field(10.0, description="Lease heartbeat interval")
    heartbeat_misses: int = Field(3, description="Missed heartbeats before the reaper cleans")
    reaper_interval_s: float = Field(1.0, description="How often the reaper runs")
    rightsize_max_factor: float = Field(2.0, description="Max raise of a task type's requests")
    sparrow_probes: int = Field(2, description="Nodes probed per task when nodes are many")
    sparrow_min_nodes: int = Field(200, description="Use sampling above this many nodes")

    # --- control plane (scheduler issue 5; owner: control/sim) -------------------------
    priority_aging_s: float = Field(30.0, description="Queued this long, a request moves up one priority class")
    tenant_max_sandboxes: int = Field(100000, description="Default per-tenant quota: concurrent sandboxes")
    tenant_max_cpu: float = Field(1e9, description="Default per-tenant quota: CPUs in use")
    tenant_max_memory: str = Field("1024T", description="Default per-tenant quota: memory in use")
    tenant_max_queued: int = Field(10000, description="Max queued requests per tenant")
    backpressure_parallel_boost: float = Field(2.0, description="Per-node parallel creates x this under backpressure")
    retry_after_min_s: float = Field(0.5, description="Smallest Retry-After sent under backpressure")
    retry_after_max_s: float = Field(30.0, description="Largest Retry-After sent under backpressure")
    place_w_locality: float = Field(1.0, description="Score weight of image layer coverage (bytes)")
    place_w_load: float = Field(0.5, description="Score weight of allocated fraction (lower is better)")
    place_w_predicted: float = Field(0.5, description="Score weight of predicted usage (lower is better)")
    place_spread: float = Field(0.02, description="Score penalty per sandbox already placed on a node this batch")
    locality_candidates: int = Field(16, description="Nodes holding the image sampled as candidates (large clusters)")
    warm_pool_refill_s: float = Field(5.0, description="Demand bucket = time to rebuild a pool member")
    warm_pool_trim_factor: float = Field(1.5, description="Destroy surplus members only beyond target x this")
    warm_pool_plan_interval_s: float = Field(30.0, description="Full pool plan (expiry, shrink) period")
    warm_pool_max_per_tenant: int = Field(512, description="Max warm sandboxes one tenant's demand may ask for")
    warm_pool_max_total: int = Field(100000, description="Max warm sandboxes cluster-wide")
    warm_pool_recycle: bool = Field(True, description="A killed container sandbox of a pool shape the pool wants is "
                                    "reset under a new id and returned to the pool instead of torn down")
    retry_budget_ratio: float = Field(0.2, description="Retries allowed as a fraction of first attempts")
    idempotency_ttl_s: float = Field(24 * 3600, description="How long finished request ids are remembered")
    rightsize_min_samples: int = Field(5, description="Usage samples of a task type before right-sizing")
    rightsize_headroom: float = Field(1.2, description="Right-sized request = observed p95 x this")
    rightsize_min_fraction: float = Field(0.25, description="Never lower a request below this fraction")
    preemption_enabled: bool = Field(True, description="High priority may preempt lower priority sandboxes")

    # --- networking (SPEC §1) -------------------------------------------------------
    net_enabled: bool = Field(True, description="Offer egress allow-lists (starts on first use)")
    net_cidr: str = Field("10.213.0.0/16", description="Private range for sandbox addresses")
    net_slot_pool: int = Field(16, description="Pre-built network slots kept ready")
    net_egress_rate: str = Field("100mbit", description="Per-sandbox egress bandwidth limit")
    net_max_connections: int = Field(256, description="Per-sandbox concurrent connection limit")
    net_denied_log_max: int = Field(1000, description="Denied-attempt audit records kept per sandbox")
    # --- networking: added by the net engineer (dsec.net) ---------------------------
    net_egress_burst: str = Field("256k", description="Egress shaper (TBF) bucket size per sandbox")
    net_egress_latency_ms: float = Field(50.0, description="Max queueing delay in the egress shaper")
    net_denied_log_rate: int = Field(20, description="Denied packets logged per second per sandbox")
    net_nflog_group: int | None = Field(None, description="NFLOG group for denied attempts (default: per runtime dir)")
    net_enable_forwarding: bool = Field(True, description="Set net.ipv4.ip_forward=1 at start (needed for egress)")
    net_denied_audit_distinct: int = Field(50, description="Denied destinations itemized per audit log; "
                                                            "more are only counted")
    net_denied_audit_poll_s: float = Field(2.0, description="How often denied attempts are copied into audit logs")
    net_host_allow: AddressList = Field(default_factory=list, description="Operator only: host/node IP:PORT (or "
                                      "IP:LO-HI) sandboxes may name in allow-lists; other host addresses never open")
    net_node_addresses: AddressList = Field(default_factory=list, description="Extra node addresses (IPs/CIDRs, e.g. "
                                          "cluster peers) treated like the host's own: closed unless net_host_allow")

    # --- checkpoints (SPEC §4) ------------------------------------------------------
    checkpoint_roots: list[Path] = Field(default_factory=list, description="Replica roots (default HOME/blobs)")
    checkpoint_keep: int = Field(5, description="Checkpoint units kept per episode")
    checkpoint_full_every: int = Field(20, description="Full checkpoint every N incremental ones")
    # --- checkpoints: recovery engine (owner: state recovery) ---------------------------
    checkpoint_cache_dir: Path | None = Field(None, description="Unpacked checkpoint layers (default HOME/ckpt-layers)")
    checkpoint_layer_gc_grace_s: float = Field(60.0, ge=0, description="An unpacked checkpoint layer no mounted "
                                               "sandbox uses is deleted once this old (made or last reused)")
    checkpoint_max_bytes: int = Field(1 << 30, ge=1 << 20, description="Most file bytes (apparent size) one "
                                      "checkpoint may hold, below the sandbox's disk quota: bounds server memory")
    checkpoint_gc_grace_s: float = Field(3600.0, description="Unreferenced checkpoint blobs older than this are collected")
    checkpoint_zstd_level: int = Field(3, description="zstd level of checkpoint layers and trajectory segments")
    checkpoint_max_context_bytes: int = Field(64 * 1024 * 1024, description="Largest agent context accepted per save")
    checkpoint_inline_max_bytes: int = Field(16 * 1024, description="Checkpoint parts up to this size live inside the unit metadata")
    checkpoint_inline_budget_bytes: int = Field(256 * 1024, description="Max inline bytes per unit; larger go to blobs")
    # --- checkpoints: journal, background squash, fencing (owner: state recovery) ------
    checkpoint_journal: bool = Field(True, description="Keep a local per-episode trajectory journal, appended off the exec path")
    checkpoint_journal_dir: Path | None = Field(None, description="Trajectory journals (default HOME/journals)")
    checkpoint_squash_background: bool = Field(True, description="Squash the layer chain into a full layer off the step path")
    checkpoint_max_chain: int = Field(60, description="Chain length at which a squash runs inline (background one lagging)")

    # --- in-sandbox exec agent (owner: exec agent; docs/exec-agent.md) -----------------
    agent_connect_timeout_s: float = Field(5.0, description="Max wait to connect to a sandbox's exec agent")
    agent_grace_s: float = Field(10.0, description="Wait past an exec's timeout before the agent is declared lost")
    agent_listen_backlog: int = Field(4096, description="listen() backlog of each sandbox's agent socket")
    agent_keepalive_max_idle: int = Field(4, ge=0, description="Idle exec-agent connections kept per sandbox "
                                          "for the next exec (0 = one connection per exec)")
    agent_keepalive_idle_s: float = Field(20.0, gt=0, description="An idle kept-alive agent connection older "
                                          "than this is closed, not reused (the agent ends it at 60 s)")

    # --- gVisor exec (added by the sandbox security suite; dsec.node.agent) ------------
    gvisor_exec_drain_s: float = Field(0.05, description="After a gVisor exec's command exits, wait this long "
                                       "for output still in its pipes (background jobs may hold them open)")

    # --- SandboxFusion-compatible /run_code (issue 14; dsec.api.compat.fusion) ---------------
    fusion_images: dict[str, str] = Field({"python": "python", "bash": "python", "cpp": "cpp", "nodejs": "nodejs",
                                           "go": "go", "java": "java"},
                                          description="SandboxFusion language -> DSec image that runs it "
                                          "(nodejs/go/java images are built on their first call)")
    fusion_pool_max: int = Field(64, ge=1, description="Most sandboxes one (tenant, image, memory) run_code pool "
                                 "holds; calls beyond wait for a free one")
    fusion_cpu: float = Field(1.0, gt=0, description="CPU cap of each run_code sandbox")
    fusion_memory_mb: int = Field(1024, ge=16, description="Memory of a run_code sandbox when the request "
                                  "gives no memory_limit_MB (or -1)")
    fusion_pids: int = Field(256, ge=16, description="Process cap of each run_code sandbox (fork bombs stop here)")
    fusion_max_request_bytes: int = Field(16 << 20, ge=1024, description="Largest /run_code request body "
                                          "(code, stdin and files); larger is a SandboxError naming it")
    fusion_max_output_bytes: int = Field(1 << 20, ge=1024, description="stdout/stderr kept per stream per "
                                         "run_code step (floods are cut here and flagged)")
    fusion_max_timeout_s: float = Field(300.0, gt=0, description="Largest compile_timeout / run_timeout honoured")
    fusion_sandbox_ttl_s: float = Field(3600.0, gt=60, description="A pooled run_code sandbox is replaced after "
                                        "this long (its TTL is a bit longer)")
    fusion_anonymous_tenant: str | None = Field(None, description="Tenant that un-keyed /run_code and /v1/ping "
                                                "calls run as; None (default): no anonymous access")

    # --- run-level accounting and live clones (issue 16; dsec.accounting) --------------
    usage_enabled: bool = Field(True, description="Account sandboxes' CPU, memory, execs, bytes written, lifetime")
    usage_sample_interval_s: float = Field(1.0, gt=0, description="How often a live sandbox's cgroup counters "
                                           "are sampled while they move (memory GiB-seconds integrate over "
                                           "samples; idle ones back off, usage_idle_sample_max_s)")
    usage_idle_sample_max_s: float = Field(30.0, gt=0, description="A sandbox whose counters did not move since "
                                           "its last sample is read at doubling intervals up to this (an exec or "
                                           "any change brings it back to usage_sample_interval_s): idle sandboxes "
                                           "cost almost nothing per interval")
    usage_flush_interval_s: float = Field(5.0, gt=0, description="Live sandboxes' totals are written to the "
                                          "state database this often (and at every death)")
    usage_retention_s: float = Field(90 * 24 * 3600, gt=0, description="Usage of dead sandboxes is kept this long")
    usage_prometheus_labels: AddressList = Field(["run"], description="Operator only: sandbox label keys "
                                                 "exported as Prometheus labels of dsec_usage_* ('tenant' = the "
                                                 "tenant name); comma-separated")
    usage_prometheus_max_values: int = Field(100, ge=1, description="Distinct values per exported label key; "
                                             "later values share the series '_other' (bounded cardinality)")
    usage_query_max_sandboxes: int = Field(1000, ge=1, description="Most per-sandbox rows one usage query lists")
    clone_max: int = Field(64, ge=1, description="Most clones one sb.clone(n) call may make")
    group_max: int = Field(256, ge=1, description="Most sandboxes one create_group call may ask for")
    group_wait_s: float = Field(30.0, gt=0, description="Default deadline to admit a whole group (then 429)")
    group_poll_s: float = Field(0.05, gt=0, description="How often a group at the head of the queue re-checks room")

    # --- state / cluster --------------------------------------------------------------
    state_url: str = Field("", description="Shared state store: redis://HOST:PORT/DB (several API servers "
                           "on one Redis) or sqlite:///PATH; empty = HOME/state.db (`dsec serve --state`)")
    state_timeout_s: float = Field(2.0, gt=0, description="Redis state: connect/read timeout of one call "
                                   "(past it the request answers 503 + Retry-After)")
    scheduler_lease_ttl_s: float = Field(3.0, gt=0, description="Scheduler leader lease: a leader silent this "
                                         "long is replaced (failover takes at most this plus one renew interval)")
    scheduler_lease_renew_s: float = Field(0.5, gt=0, description="How often the leader renews its lease and "
                                           "the other servers try to take it")
    api_advertise_url: str = Field("", description="URL the other API servers reach this one at (a follower "
                                   "hands placements to the leader there); empty = the address it listens on")
    blob_backend: str = Field("local", description="local (default) or s3")
    s3_endpoint: str | None = Field(None, description="S3-compatible endpoint URL")
    s3_bucket: str = Field("dsec", description="S3 bucket for blobs")

    @property
    def state_backend(self) -> str:
        """sqlite | redis, from ``state_url`` (read by `dsec doctor`)."""
        return "redis" if self.state_url.startswith(("redis://", "rediss://", "unix://")) else "sqlite"

    @property
    def redis_url(self) -> str:
        return self.state_url

    @property
    def runtime_dir(self) -> Path:
        return self.run_dir or (self.home / "run")


def _toml_overrides() -> dict[str, object]:
    path = os.environ.get("DSEC_CONFIG")
    if not path:
        return {}
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    return {k: v for k, v in data.items() if not isinstance(v, dict)}


def load_settings(**overrides: object) -> Settings:
    """Build settings: explicit overrides > DSEC_* env > TOML file > defaults."""
    base = _toml_overrides()
    env_set = {f for f in Settings.model_fields if f"DSEC_{f.upper()}" in os.environ}
    merged = {k: v for k, v in base.items() if k not in env_set}
    merged.update(overrides)
    return Settings(**merged)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return load_settings()


_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_bytes(value: str | int) -> int:
    """Parse '512M', '8G', '1.5g', '1024' or 8589934592 into bytes."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    text = str(value).strip().lower().removesuffix("ib").removesuffix("b") if str(value).strip() else ""
    if not text:
        raise ValueError(f"invalid size {value!r}: expected e.g. '512M' or '8G'")
    unit = text[-1] if text[-1] in _UNITS else ""
    number = text[: -1] if unit else text
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"invalid size {value!r}: expected e.g. '512M' or '8G'") from None
    if amount < 0:
        raise ValueError(f"size must be >= 0, got {value!r}")
    if not math.isfinite(amount * _UNITS[unit]):  # 'nan', 'inf', or 1e400G
        raise ValueError(f"invalid size {value!r}: not a finite number of bytes")
    return int(amount * _UNITS[unit])
