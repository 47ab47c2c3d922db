"""Replicas of one model repository behind a real load balancer, on this machine.

- :mod:`.balancer`: HAProxy: its configuration (health checks, retries), process, admin socket;
- :mod:`.health`: a readiness endpoint per replica, for HAProxy's health check;
- :mod:`.ready_check`: the check behind it, every served model ready and every Python stub alive,
  the same file a pod runs as its readiness probe (``labkit deploy k8s``);
- :mod:`.pool`: :class:`Cluster`: N :class:`~labkit.server.TritonServer` replicas behind HAProxy,
  a dead one replaced, everything stopped as one;
- :mod:`.failover`: steady load (:class:`labkit.load.Load`) through the balancer while a replica
  is killed, measured;
- :mod:`.scale`: one server, more instances in it, or the replicas: throughput on the same cores.
"""

from .balancer import REPLICA_HEADER, Checks, HAProxy, locate_haproxy, render_config
from .failover import FailoverResult, failover, failover_table, figure, what_probes_see
from .pool import FAULTS, SERVERS_ON_HOST, Cluster, Replica, start_cluster
from .scale import ScaleOut, compare_scale_out

__all__ = [
    "FAULTS",
    "REPLICA_HEADER",
    "SERVERS_ON_HOST",
    "Checks",
    "Cluster",
    "FailoverResult",
    "HAProxy",
    "Replica",
    "ScaleOut",
    "compare_scale_out",
    "failover",
    "failover_table",
    "figure",
    "locate_haproxy",
    "render_config",
    "start_cluster",
    "what_probes_see",
]
