"""The benchmark's own figure, shipped as data: what ``labkit bench inflight`` measured at its full
shape (8 streaming clients, 32 requests of 4..64 new tokens, the server on one core and AIPerf on
the other), with where and when it was measured.

Notebook 06 states it beside its own figures: the notebook measures on whatever else the host is
doing, and a learner should see the benchmark's lead with its provenance, not only this run's.
To refresh it, run the benchmark and turn its ``inflight.json`` into a record::

    labkit bench inflight --scheduler inflight,vllm --workload mixed --clients stream \\
        --concurrency 8 --no-precision --run-dir runs/bench-inflight
    python -c "from labkit.llm_serving import benchmark as b; \\
        print(b.record_of('runs/bench-inflight/inflight.json', date='YYYY-MM-DD', commit='...'))"

and paste the printed dictionary over :data:`MEASURED`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import ConfigError

#: ``labkit bench inflight``, measured on this project's 2-core CPU host (see the module's doc),
#: with vLLM compiled as shipped (its graphs cached by ``make install``). The host was quiet (load
#: average 1.5 at the start, 1.4 at the end, 285 s in all); the servers are measured one after
#: the other. With vLLM eager (2026-12-04, load average rising to 7.5) the same shape measured
#: in-flight 39.6 and vLLM in Triton 78.4 output tokens/s (1.98x).
MEASURED = {
    "date": "2026-12-06",
    "commit": "86b88c6",
    "command": "labkit bench inflight --scheduler inflight,vllm --workload mixed --concurrency 8 "
    "--clients stream --no-precision",
    "clients": 8,
    "requests": 32,
    "tokens": [4, 64],
    "cores": "server on core 0, AIPerf on core 1",
    "load_average": [1.51, 2.17, 2.5],
    "output_tokens_per_s": {"inflight": 49.808, "vllm": 102.04, "vllm-standalone": 93.41},
    "itl_p50_ms": {"inflight": 138.043, "vllm": 69.319, "vllm-standalone": 74.284},
}


@dataclass(frozen=True)
class Benchmark:
    """One measurement of ``labkit bench inflight``, with its provenance."""

    date: str
    commit: str
    command: str
    clients: int
    requests: int
    tokens: tuple[int, int]
    cores: str
    load_average: tuple[float, ...]  # 1, 5 and 15 minutes, at the measurement's start
    output_tokens_per_s: dict[str, float]
    itl_p50_ms: dict[str, float]

    @property
    def vllm_lead(self) -> float:
        """vLLM in Triton's output tokens/s over the in-flight model's."""
        return self.output_tokens_per_s["vllm"] / self.output_tokens_per_s["inflight"]

    def shape(self) -> str:
        """``8 clients, 32 requests of 4 to 64 tokens, server on core 0, AIPerf on core 1``"""
        low, high = self.tokens
        return f"{self.clients} clients, {self.requests} requests of {low} to {high} tokens, {self.cores}"


def measured() -> Benchmark:
    """The shipped measurement (:data:`MEASURED`)."""
    return of(MEASURED)


def of(record: dict) -> Benchmark:
    """A :class:`Benchmark` from a record such as :data:`MEASURED`."""
    try:
        return Benchmark(
            **{
                **record,
                "tokens": tuple(record["tokens"]),
                "load_average": tuple(record["load_average"]),
            }
        )
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"a benchmark record needs every field of Benchmark: {exc}") from None


def record_of(path: str | os.PathLike, *, date: str, commit: str) -> dict:
    """A record for :data:`MEASURED` from a ``labkit bench inflight`` run's ``inflight.json``
    (its streaming rows on the mixed workload at its highest concurrency)."""
    study = json.loads(Path(path).read_text(encoding="utf-8"))
    rows = [r for r in study["rows"] if r["workload"] == "mixed" and r["streaming"]]
    if not rows:
        raise ConfigError(f"{path} holds no streaming row on the mixed workload")
    top = max(r["concurrency"] for r in rows)
    rows = {r["scheduler"]: r for r in rows if r["concurrency"] == top}
    if not {"inflight", "vllm"} <= set(rows):
        raise ConfigError(f"{path} measured {sorted(rows)}; the record needs inflight and vllm")
    s, host = study["settings"], study["host"]
    pinned = host.get("server_cores")
    return {
        "date": date,
        "commit": commit,
        "command": "labkit bench inflight --scheduler "
        + ",".join(s["schedulers"])
        + " --workload "
        + ",".join(s["workloads"])
        + " --concurrency "
        + ",".join(str(c) for c in s["concurrency"])
        + {(True,): " --clients stream", (False,): " --clients whole"}.get(
            tuple(s["streaming"]), ""
        )
        + ("" if s.get("precision", True) else " --no-precision"),
        "clients": top,
        "requests": max(s["requests"], 2 * top),
        "tokens": [s["mixed_low"], s["mixed_high"]],
        "cores": f"server on core {pinned}, AIPerf on core {host['client_cores']}"
        if pinned
        else "not pinned",
        "load_average": host["load_average_start"],
        "output_tokens_per_s": {w: r["output_tokens_per_s"] for w, r in rows.items()},
        "itl_p50_ms": {w: r["itl_p50_ms"] for w, r in rows.items()},
    }
