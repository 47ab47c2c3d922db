"""N Triton replicas on one model repository, behind one HAProxy address, stopped as one.

>>> with Cluster("model_repository", replicas=2, load_models=["echo"]) as cluster:
...     client.infer(cluster.http_url, "echo", "hello")

Each replica is a :class:`~labkit.server.TritonServer` on its own loopback ports, with its own
readiness endpoint (:mod:`.health`); HAProxy (:mod:`.balancer`) sends each request to a replica
that is in the pool. A supervisor thread replaces a replica whose ``tritonserver`` died, on the
same ports (as a Deployment's ReplicaSet replaces a pod); a replica whose Python stub died leaves
the pool by its readiness and rejoins after :meth:`Cluster.recover`.

The cluster's ``http_url`` and ``grpc_url`` work wherever a server's do (labkit's clients,
perf_analyzer, AIPerf). It has no single ``metrics_url``: each replica has its own
(``cluster.replicas[i].server.metrics_url``), and HAProxy's own metrics are ``lb_metrics_url``.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from labkit import client
from labkit.cluster import ready_check
from labkit.cluster.balancer import (
    Checks,
    HAProxy,
    Target,
    render_config,
)
from labkit.cluster.health import ReadinessEndpoint
from labkit.errors import ConfigError, LabkitError, ServerError, ServerTimeoutError
from labkit.proc import Addresses, free_port, wait_until
from labkit.server import TritonServer, recover, stubs

log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[Cluster] = weakref.WeakSet()
FAULTS = ("server", "stub")
#: How many Triton servers share this host's cores, in each replica's environment. The model
#: code divides the host's cores by it (and by its instances) for its torch threads, so two
#: replicas on one host get the threads two instances in one server get; a model's explicit
#: ``num_threads`` parameter wins. Read by ``engine_settings.servers_on_host`` in the text model
#: and by the embedding and Neuron templates.
SERVERS_ON_HOST = "LABKIT_SERVERS_ON_HOST"


@dataclass
class Replica:
    """One replica: its current server (a new object after each replacement) and readiness.

    ``models``: the models its readiness checks (None: every model Triton lists as READY)."""

    index: int
    server: TritonServer
    models: list[str] | None = None
    readiness: ReadinessEndpoint | None = None
    generation: int = 0  # how many times it was replaced
    replacing: bool = False
    recovering: bool = False  # recover() runs: a stub is alive again before its model is
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        return f"r{self.index}"

    def probe(self) -> tuple[bool, str]:
        """(ready, reason): every model it serves ready, with every Python stub alive: the
        check a pod's readiness probe runs (:mod:`.ready_check`), unless it is being repaired."""
        server = self.server
        if self.replacing:
            return False, "being replaced"
        if self.recovering:
            return False, "recover() is restarting its models"
        if not server.running:
            return False, "tritonserver is not running"
        return ready_check.check(f"http://{server.http_url}", self.models, server_pid=server.pid)


class Cluster(Addresses):
    """``replicas`` Triton servers on ``model_repository`` behind HAProxy on ``host``.

    ``http_port``/``grpc_port``: the balancer's addresses (0: free ports); ``checks``: how it
    checks replicas and retries requests; ``replace_dead``: start a new server when one dies;
    ``server_options`` go to every :class:`~labkit.server.TritonServer` (``extra_args``,
    ``env``, ``tritonserver``...). Logs go to ``run_dir`` (a temporary folder when None).

    The replicas share this host's cores: each one's environment has ``LABKIT_SERVERS_ON_HOST``
    set to ``replicas`` (:data:`SERVERS_ON_HOST`; an ``env`` in ``server_options`` may set it
    otherwise), so each model instance takes its share of the cores for its torch threads, as
    it would among that many instances of one server. A model's ``num_threads`` wins.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike,
        replicas: int = 2,
        *,
        load_models: str | list[str] = "*",
        host: str = "127.0.0.1",
        http_port: int = 0,
        grpc_port: int = 0,
        stats_port: int = 0,
        run_dir: str | os.PathLike | None = None,
        checks: Checks | None = None,
        replace_dead: bool = True,
        startup_timeout_s: float | None = None,
        haproxy: str | os.PathLike | None = None,
        server_options: dict | None = None,
    ) -> None:
        if replicas < 1:
            raise ConfigError(f"replicas={replicas} must be >= 1")
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise ServerError(
                f"model repository {str(self.model_repository)!r} does not exist; pass a folder "
                "of models (see model_repository/ in the lab)"
            )
        self.size = replicas
        self.load_models = load_models
        self.host = host
        self.checks = checks or Checks()
        self.replace_dead = replace_dead
        self.startup_timeout_s = startup_timeout_s
        self.server_options = dict(server_options or {})
        self.run_dir = (
            Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="labkit-cluster-"))
        )
        self._requested = {"http": http_port, "grpc": grpc_port, "stats": stats_port}
        self.ports = dict(self._requested)
        self._haproxy_path = haproxy
        self.balancer: HAProxy | None = None
        self.replicas: list[Replica] = []
        self._events: list[tuple[float, str, str]] = []
        self._stopping = threading.Event()
        self._batched: dict[str, bool] = {}  # model -> its requests carry a batch dimension
        self._in_pool: dict[str, bool] = {}  # HAProxy's view at the supervisor's last look
        self._supervisor: threading.Thread | None = None
        self._pool_watcher: PoolWatch | None = None
        self._socket_dir: str | None = None
        self.started_at: float | None = None

    # -- addresses (the balancer's http_url and grpc_url come from Addresses) ---------------
    @property
    def metrics_url(self) -> None:
        """None: each replica has its own metrics (``replicas[i].server.metrics_url``)."""
        return None

    @property
    def lb_metrics_url(self) -> str:
        """HAProxy's own Prometheus metrics (per-server requests, states, check results)."""
        return f"http://{self.client_host}:{self.ports['stats']}/metrics"

    @property
    def stats_url(self) -> str:
        """HAProxy's statistics page (one row per replica, refreshed every second)."""
        return f"http://{self.client_host}:{self.ports['stats']}/stats"

    @property
    def running(self) -> bool:
        return self.balancer is not None and self.balancer.running

    def __repr__(self) -> str:
        return f"Cluster(replicas={self.size}, http={self.http_url!r}, running={self.running})"

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Cluster:
        """Start every replica (one after the other), their readiness endpoints and HAProxy;
        return once every replica is in the pool. On any failure everything started is stopped."""
        if self.running:
            return self
        self._stopping.clear()
        self.started_at = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _LIVE.add(self)
        try:
            named = [self.load_models] if isinstance(self.load_models, str) else self.load_models
            models = None if "*" in named else list(named)
            self.replicas = [Replica(i, self._new_server(i), models) for i in range(self.size)]
            for replica in self.replicas:
                replica.server.start()
            for replica in self.replicas:
                replica.readiness = ReadinessEndpoint(replica.probe, self.host, name=replica.name)
                self._event(replica.name, f"ready on http {replica.server.http_url}")
            self._start_balancer()
            self.wait_ready()
            self._in_pool = {replica.name: True for replica in self.replicas}
        except BaseException:
            self.stop()
            raise
        self._supervisor = threading.Thread(
            target=self._supervise, name="labkit-cluster-supervisor", daemon=True
        )
        self._supervisor.start()
        # Its own thread: the supervisor is busy for seconds while it starts a replacement.
        self._pool_watcher = PoolWatch(self, 0.05, on_change=self._pool_changed).start()
        return self

    def _new_server(
        self, index: int, ports: dict[str, int] | None = None, generation: int = 0
    ) -> TritonServer:
        suffix = f"-{generation}" if generation else ""
        ports = ports or {"http": 0, "grpc": 0, "metrics": 0}
        options = dict(self.server_options)
        options["env"] = {SERVERS_ON_HOST: str(self.size), **(options.get("env") or {})}
        return TritonServer(
            self.model_repository,
            mode="local",
            host=self.host,
            http_port=ports["http"],
            grpc_port=ports["grpc"],
            metrics_port=ports["metrics"],
            load_models=self.load_models,
            startup_timeout_s=self.startup_timeout_s,
            log_path=self.run_dir / f"tritonserver-r{index}{suffix}.log",
            **options,
        )

    def _start_balancer(self) -> None:
        for kind, port in self._requested.items():
            self.ports[kind] = port or free_port(self.client_host)
        self._socket_dir = tempfile.mkdtemp(prefix="labkit-lb-")  # a unix socket path is short
        socket_path = Path(self._socket_dir) / "admin.sock"
        targets = [
            Target(r.name, r.server.ports["http"], r.server.ports["grpc"], r.readiness.port)
            for r in self.replicas
        ]
        config = render_config(
            targets,
            http_port=self.ports["http"],
            grpc_port=self.ports["grpc"],
            stats_port=self.ports["stats"],
            socket_path=socket_path,
            checks=self.checks,
            host=self.host,
        )
        self.balancer = HAProxy(
            config, self.run_dir, socket_path=socket_path, haproxy=self._haproxy_path
        )
        self.balancer.start()
        self._event("lb", f"haproxy on http {self.http_url}, grpc {self.grpc_url}")

    def wait_ready(self, timeout_s: float = 30.0, count: int | None = None) -> None:
        """Wait until ``count`` replicas (default: all) are UP in HAProxy, each checked: a server
        HAProxy has not checked yet also reads UP ("UP 1/2", "Initializing")."""
        count = self.size if count is None else count
        if not wait_until(lambda: len(self.checked_up()) >= count, timeout_s, 0.05):
            raise ServerTimeoutError(
                f"{len(self.in_pool())} of {count} replicas were in the pool after "
                f"{timeout_s:g} s:\n{self.pool().to_string()}"
            )

    def in_pool(self) -> list[str]:
        """The replicas HAProxy sends requests to now."""
        if not self.running:
            return []
        # "UP 1/2" is a replica going down that still takes requests; "DOWN 1/2" one coming back.
        view = self.balancer.servers().items()
        return [name for name, row in view if row["status"].split()[0] == "UP"]

    def checked_up(self) -> list[str]:
        """The replicas HAProxy has checked and found ready, with no failed check since."""
        if not self.running:
            return []
        return [name for name, row in self.balancer.servers().items() if row["status"] == "UP"]

    def pool(self) -> pd.DataFrame:
        """One row per replica: its address, process, readiness, and HAProxy's view of it:
        ``in_flight`` requests now and ``requests``, the HTTP requests HAProxy has sent it since
        the cluster started (every client's, metadata and statistics requests included; its
        health checks are not requests). :meth:`spread` counts the requests of one burst."""
        view = self.balancer.servers() if self.running else {}
        rows = []
        for replica in self.replicas:
            ready, reason = replica.probe()
            lb = view.get(replica.name, {})
            rows.append(
                {
                    "replica": replica.name,
                    "http_url": replica.server.http_url,
                    "pid": replica.server.pid,
                    "generation": replica.generation,
                    "ready": ready,
                    "readiness": reason,
                    "lb_status": lb.get("status", ""),
                    "lb_check": lb.get("check_desc", ""),
                    "in_flight": int(lb.get("scur") or 0),
                    "requests": int(lb.get("stot") or 0),
                }
            )
        return pd.DataFrame(rows)

    def pool_table(self) -> pd.DataFrame:
        """:meth:`pool` in words, for a notebook."""
        return self.pool().rename(columns=_POOL_WORDS)

    def events(self) -> pd.DataFrame:
        """What happened to the cluster, seconds since its start, in the order it was recorded:
        kills, exits, replacements, recoveries, and each replica leaving (``out of the pool``)
        and rejoining (``in the pool``) HAProxy's pool as the supervisor saw it. A replica's
        repair (``replacement ready``, ``recovered``) is recorded before it may pass its
        readiness check again, so it always comes before its ``in the pool``."""
        start = self.started_at or 0.0
        rows = [
            {"t_s": round(t - start, 3), "who": who, "event": what} for t, who, what in self._events
        ]
        return pd.DataFrame(rows, columns=["t_s", "who", "event"])

    def event_table(self) -> pd.DataFrame:
        """:meth:`events` in words, for a notebook."""
        events = self.events()
        return pd.DataFrame(
            {
                "seconds since the cluster started": events["t_s"],
                "who": events["who"].replace({"lb": "balancer"}),
                "what happened": events["event"],
            }
        )

    def infer(self, model: str, prompt: str, **parameters: object) -> str:
        """One prompt through the balancer, as any client of the cluster sends it; the answer.

        The balancer carries only the inference request: whether the model batches is asked of
        a replica directly, once per model."""
        return client.infer(
            self.http_url, model, prompt, batched=self._batches(model), **parameters
        )[0]

    def _batches(self, model: str) -> bool:
        if model not in self._batched:
            self._batched[model] = client.model_batches(self.replicas[0].server.http_url, model)
        return self._batched[model]

    def spread(self, model: str, prompt: str, requests: int = 6, **parameters: object):
        """Send ``requests`` prompts through the balancer one after the other; one row per
        replica, in words: the requests HAProxy sent it during this burst (its counters before and after,
        so another client's requests meanwhile would count too)."""
        if requests < 1:
            raise ConfigError(f"requests={requests} must be >= 1")
        self._batches(model)  # asked of a replica before the count starts
        before = {name: int(row.get("stot") or 0) for name, row in self.balancer.servers().items()}
        for _ in range(requests):
            self.infer(model, prompt, **parameters)
        rows = [
            {
                "replica": name,
                "HAProxy's state": row.get("status", ""),
                "requests sent to it": int(row.get("stot") or 0) - before.get(name, 0),
            }
            for name, row in self.balancer.servers().items()
        ]
        return pd.DataFrame(rows, columns=["replica", "HAProxy's state", "requests sent to it"])

    def when(self, who: str, what: str, after: float = 0.0) -> float | None:
        """The first ``time.monotonic()`` after ``after`` that ``who`` had event ``what``."""
        return next(
            (t for t, w, e in list(self._events) if w == who and e == what and t > after), None
        )

    def _event(self, who: str, what: str) -> float:
        now = time.monotonic()
        self._events.append((now, who, what))
        log.info("cluster %s: %s", who, what)
        return now

    # -- faults and repair -----------------------------------------------------------------
    def replica(self, which: int | str) -> Replica:
        """A replica by index (0) or name ("r0")."""
        index = int(which[1:]) if isinstance(which, str) and which.startswith("r") else which
        try:
            return self.replicas[int(index)]
        except (IndexError, ValueError):
            raise ConfigError(
                f"no replica {which!r}; this cluster has {', '.join(r.name for r in self.replicas)}"
            ) from None

    def kill(self, which: int | str = 0, fault: str = "server", model: str | None = None) -> float:
        """SIGKILL a replica's ``tritonserver`` (``fault="server"``; its stubs are orphaned as in a
        real crash) or one Python stub of ``model`` (``fault="stub"``). Returns the time of the
        kill (``time.monotonic()``)."""
        replica = self.replica(which)
        server = replica.server
        if fault not in FAULTS:
            raise ConfigError(f"fault={fault!r}; use one of {', '.join(FAULTS)}")
        if not server.running:
            raise ServerError(f"replica {replica.name} is not running; nothing to kill")
        if fault == "server":
            pid = server.pid
        else:
            alive = stubs(server)
            name = model or next(iter(alive), None)
            if not alive.get(name):
                raise ServerError(
                    f"replica {replica.name} has no Python stub of {name!r}; stubs: {alive}"
                )
            pid = alive[name][0]
        os.kill(pid, signal.SIGKILL)
        return self._event(
            replica.name, f"killed {'tritonserver' if fault == 'server' else 'stub'} {pid}"
        )

    def recover(self, which: int | str = 0) -> list[str]:
        """Restart the models of a replica whose stub died; it rejoins the pool once they are
        loaded. (While Triton loads the new instance its stub is alive but the model still runs
        on the dead one, so the replica stays out until this returns.)"""
        replica = self.replica(which)
        replica.recovering = True
        try:
            names = recover(replica.server)
            self._event(replica.name, "recovered")  # before its readiness may pass again
            log.info("cluster %s: recover() restarted %s", replica.name, names)
        finally:
            replica.recovering = False
        return names

    def _supervise(self) -> None:
        while not self._stopping.wait(0.1):
            for replica in self.replicas:
                server = replica.server
                if replica.replacing or server.pid is None or server.running:
                    continue
                self._event(replica.name, "tritonserver exited")
                if not self.replace_dead:
                    server.stop()  # its stubs and shared memory; the replica stays out
                    continue
                replica.replacing = True
                self._replace(replica)  # in this thread, which outlives the new server

    def _pool_changed(self, name: str, status: str) -> None:
        """Record a replica leaving or rejoining HAProxy's pool ("UP 1/2": going down, still in;
        a change between two states out of it, DOWN to MAINT, is no event)."""
        up = status == "UP"
        if self._in_pool.get(name, True) != up:
            self._in_pool[name] = up
            self._event(name, "in the pool" if up else "out of the pool")

    def _replace(self, replica: Replica) -> None:
        """Stop what is left of a dead replica (stubs, shared memory) and start a new server on
        the same ports, so the balancer's configuration stays as it is."""
        with replica.lock:
            old = replica.server
            old.stop()
            if self._stopping.is_set():
                return
            replica.generation += 1
            server = self._new_server(replica.index, dict(old.ports), replica.generation)
            replica.server = server
            self._event(replica.name, "replacement starting")
            try:
                server.start()
                if not self._stopping.is_set():
                    self._event(replica.name, "replacement ready")  # before it may rejoin
            except LabkitError as exc:
                self._event(replica.name, f"replacement failed: {exc}")
                return
            finally:
                replica.replacing = False
            if self._stopping.is_set():
                server.stop()

    def stop(self, *, parallel: bool = True) -> None:
        """Stop HAProxy, the readiness endpoints and every replica (process groups, stubs,
        shared memory). Safe to call twice, or never started; also run at interpreter exit."""
        self._stopping.set()
        if self._pool_watcher is not None:
            self._pool_watcher.stop(timeout_s=1)
            self._pool_watcher = None
        if self._supervisor is not None:
            # A supervisor that is starting a replacement stays in that start until it fails:
            # the server it started is stopped below, with the others.
            self._supervisor.join(timeout=1)
            self._supervisor = None
        if self.balancer is not None:
            self.balancer.stop()
        for replica in self.replicas:
            if replica.readiness is not None:
                replica.readiness.close()
                replica.readiness = None
        # Each stop() reads its server's shared-memory regions while the server still runs, then
        # waits for a graceful exit: up to --exit-timeout-secs (10 s) for a server whose model was
        # recovered after a stub died. So the replicas stop in parallel threads, except at
        # interpreter exit, where they stop one after the other.
        if parallel and len(self.replicas) > 1:
            threads = [threading.Thread(target=r.server.stop, daemon=True) for r in self.replicas]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        for replica in self.replicas:  # one left by a thread, or a replacement that was starting
            replica.server.stop()
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        _LIVE.discard(self)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:
        try:
            self.stop(parallel=False)
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


#: :meth:`Cluster.pool`'s columns as a learner reads them.
_POOL_WORDS = {
    "http_url": "HTTP address",
    "pid": "process",
    "generation": "times replaced",
    "readiness": "its check says",
    "lb_status": "HAProxy's state",
    "lb_check": "HAProxy's last check",
    "in_flight": "requests in flight",
    "requests": "requests sent to it",
}


class PoolWatch:
    """Polls HAProxy's view of a cluster's pool every ``interval_s``, in a thread of its own, and
    keeps each change of a replica's state (``changes``: when, replica, the status's first word:
    ``UP``, ``DOWN``, ``MAINT``; "DOWN 1/2" while going down is DOWN) and HAProxy's count of the
    requests it sent each replica (``stot``) at each look out of the pool. ``on_change(replica,
    status)`` is called at each change, the first look at each replica included.

    The cluster watches its own pool with one (its events "in the pool" / "out of the pool");
    :func:`labkit.cluster.failover.failover` watches with another, closer (every 20 ms).
    """

    def __init__(
        self,
        cluster: Cluster,
        interval_s: float = 0.02,
        on_change: Callable[[str, str], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.on_change = on_change
        self.changes: list[tuple[float, str, str]] = []
        # per replica, each out-of-the-pool spell: HAProxy's request count at its first and at
        # its last look out of the pool (both read with the state, from the same snapshot)
        self.out_spells: dict[str, list[list[int]]] = {}
        self._state: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="labkit-pool-watch", daemon=True)

    def start(self) -> PoolWatch:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                view = self.cluster.balancer.servers()
            except (OSError, AttributeError):  # HAProxy stopping: the cluster is stopping too
                continue
            now = time.monotonic()
            for name, row in view.items():
                status = row["status"].split()[0]
                sent = int(row.get("stot") or 0)
                changed = self._state.get(name) != status
                if changed:
                    self._state[name] = status
                    self.changes.append((now, name, status))
                    if self.on_change is not None:
                        self.on_change(name, status)
                if status != "UP":
                    spells = self.out_spells.setdefault(name, [])
                    if changed or not spells:
                        spells.append([sent, sent])
                    spells[-1][1] = sent

    def sent_while_out(self, replica: str) -> int:
        """Requests HAProxy sent ``replica`` while it was out of the pool, by HAProxy's own
        count: between the first and the last look that saw it out, over every spell."""
        return sum(last - first for first, last in self.out_spells.get(replica, []))

    def first(self, replica: str, status_is_up: bool, after: float) -> float | None:
        """The first time after ``after`` that ``replica`` became UP (or anything but UP)."""
        for t, name, status in list(self.changes):
            if name == replica and t >= after and (status == "UP") == status_is_up:
                return t
        return None

    def __enter__(self) -> PoolWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_cluster(
    run_dir: str | os.PathLike,
    repository: str | os.PathLike,
    models: list[str] | str = "*",
    replicas: int = 2,
    **options: object,
) -> Cluster:
    """A notebook's cluster: ``replicas`` servers on ``repository`` behind HAProxy on free
    loopback ports, logs in ``run_dir``; ``options`` go to :class:`Cluster`."""
    return Cluster(repository, replicas, load_models=models, run_dir=run_dir, **options).start()


@atexit.register
def _stop_all() -> None:
    for cluster in list(_LIVE):
        cluster.stop(parallel=False)  # no new threads while the interpreter shuts down
