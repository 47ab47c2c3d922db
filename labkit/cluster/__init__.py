"""Replicas of one model repository behind a real load balancer, on this machine.

- :mod:`.balancer`: HAProxy: its configuration (health checks, retries), process, admin socket;
- :mod:`.health`: a readiness endpoint per replica that also sees a dead Python stub;
- :mod:`.pool`: :class:`Cluster`: N :class:`~labkit.server.TritonServer` replicas behind HAProxy,
  a dead one replaced, everything stopped as one;
- :mod:`.failover`: steady load (:class:`labkit.load.Load`) through the balancer while a replica
  is killed, measured.
"""

from .balancer import REPLICA_HEADER, Checks, HAProxy, locate_haproxy, render_config
from .failover import FailoverResult, failover, figure
from .pool import FAULTS, Cluster, Replica, start_cluster

__all__ = [
    "FAULTS",
    "REPLICA_HEADER",
    "Checks",
    "Cluster",
    "FailoverResult",
    "HAProxy",
    "Replica",
    "failover",
    "figure",
    "locate_haproxy",
    "render_config",
    "start_cluster",
]
