"""The in-flight engine's settings: its limits (config.pbtxt parameters) and what they make.

Standard library only: labkit loads this file too (``labkit.repository.textgen``), so that its
benchmark builds the engine that the served model builds, from the same config.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields


# Defaults measured in-process on 2 cores (SmolLM2-135M, float32, answers of 4..64 tokens, seed
# 0): 16 running requests gave 98 output tokens/s to 16 clients where 8 gave 48; pages of 16
# tokens with 64 tokens a step and pages of 32 with 256 were within the noise (75 and 82 tokens/s
# at 8 clients); 256 blocks of 16 tokens hold 16 requests of 256 tokens each (188 MB of float32 KV
# for SmolLM2); a queue of 64 let 64 streams wait (the soak: 0 refused), each for at most about
# four answers' time.
@dataclass(frozen=True)
class Limits:
    """The engine's limits: config.pbtxt parameters of the same names (strings there)."""

    max_running_requests: int = 16  # prompts generating at once (one slot each)
    kv_page_size: int = 16  # tokens per page of the paged KV cache
    kv_blocks: int = 256  # pages per layer: the cache holds kv_page_size * kv_blocks tokens
    max_batch_tokens: int = 64  # tokens one step may process (decodes plus prefill chunks)
    max_queue_size: int = 64  # requests waiting for a slot; one more is refused: busy

    @property
    def kv_tokens(self) -> int:
        return self.kv_page_size * self.kv_blocks

    def blocks(self, tokens: int) -> int:
        """The KV blocks a prompt of ``tokens`` tokens (answer included) occupies at most."""
        return -(-tokens // self.kv_page_size)


# The least value of each limit; transformers' paged cache needs pages of 4 tokens or more.
MINIMUM = {"kv_page_size": 4, "max_queue_size": 0}


def read_limits(params: Mapping[str, str]) -> Limits:
    """The limits that config.pbtxt's parameters set, defaults for the others.

    Raises ``ValueError`` naming the parameter (the model reports it as a config error).
    """
    values = {}
    for limit in fields(Limits):
        text = params.get(limit.name, str(limit.default))
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"parameter {limit.name!r} must be an integer, got {text!r}") from None
        least = MINIMUM.get(limit.name, 1)
        if value < least:
            why = " (transformers' paged cache)" if limit.name == "kv_page_size" else ""
            raise ValueError(f"parameter {limit.name!r} must be >= {least}{why}, got {value}")
        values[limit.name] = value
    return Limits(**values)


def engine_settings(limits: Limits) -> dict:
    """The arguments of transformers' ``ContinuousBatchingConfig`` for ``limits``."""
    return {
        "page_size": limits.kv_page_size,
        "num_blocks": limits.kv_blocks,
        "max_batch_tokens": limits.max_batch_tokens,
        "max_requests_per_batch": limits.max_running_requests,
        "allow_block_sharing": False,  # every prompt's blocks are its own: reservations add up
        "auto_switch_to_flash": False,  # keep the model's attention: generate() runs on it too
        "safety_margin": 0.0,  # admission already keeps the cache from running out
    }


#: How many Triton servers share this host's cores. labkit's ``Cluster`` sets it to its replica
#: count in every replica's environment, so that two replicas on one host take the cores two
#: instances in one server would take; unset: one server.
SERVERS_VARIABLE = "LABKIT_SERVERS_ON_HOST"


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 2


def servers_on_host() -> int:
    """``LABKIT_SERVERS_ON_HOST`` (at least 1; unset or not a number: 1)."""
    try:
        return max(1, int(os.environ.get(SERVERS_VARIABLE, "1")))
    except ValueError:
        return 1


def instance_count(config: Mapping) -> int:
    """How many instances of a model Triton runs for its config (Triton's JSON form): the sum of
    ``instance_group[].count``, once per listed GPU for a ``KIND_GPU`` group; at least 1."""
    total = 0
    for group in config.get("instance_group", []):
        count = int(group.get("count", 1))
        gpus = group.get("gpus", [])
        total += count * (len(gpus) if group.get("kind") == "KIND_GPU" and gpus else 1)
    return max(1, total)


def thread_budget(instances: int = 1, servers: int | None = None, *, inflight: bool = False) -> int:
    """torch threads for one instance of a served model: the cores divided among the instances
    that share them, at least 1; for the in-flight engine, the cores less one.

    The cores are this process's; they are shared by ``instances`` instances of the model in each
    of ``servers`` servers (default: :func:`servers_on_host`). A model's ``num_threads``
    parameter overrides the budget.

    Measured by ``labkit bench threads`` on 2 cores (2026-12-06, load average 1.2 to 4.1, three
    rounds, dynamic batching on, perf_analyzer on the same cores; the table is in
    docs/benchmarks.md), 2 threads an instance against 1, round by round:

    - one instance alone: x1.12 to x1.71 (medians) for tiny-falcon, SmolLM2, MiniLM and its
      encoder step, at 1 and at 8 clients (SmolLM2 at 8: x1.68): it takes every core;
    - two instances in one server, or two replicas: at 8 clients x0.03 to x0.65 in every round,
      four spinning torch threads on two cores: each takes its share. At 1 client, one copy busy
      at a time, the share gives up SmolLM2's x1.44 to x1.50 (the others: x0.94 to x1.08);
    - the in-flight engine runs its own scheduling thread and a dispatcher beside torch's:
      :func:`serving_threads` (the cores less one) stays its budget.
    """
    servers = servers_on_host() if servers is None else max(1, servers)
    cores = serving_threads() if inflight else usable_cores()
    return max(1, cores // (max(1, instances) * servers))


def serving_threads() -> int:
    """torch threads for a served model on a CPU: one less than the cores this process may use.

    The engine's thread, the dispatcher's and Triton's HTTP/gRPC threads need a core besides
    torch's workers, and so does a benchmark client on the same host. Measured on 2 cores with
    AIPerf on the same host (SmolLM2, 8 streams, answers of 4..64 tokens): torch's default of 2
    threads gave 8 output tokens/s (its spinning workers starve the others), 1 thread 51-55.
    """
    return max(1, usable_cores() - 1)
