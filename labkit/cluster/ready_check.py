"""Is this Triton server ready to answer every model it serves? One check, two places.

The same file runs in two places, so what the lab's balancer sees is what a pod's probe sees:

- :mod:`labkit.cluster` calls :func:`check` for each replica, behind HAProxy's health check;
- a Kubernetes pod runs it as an exec probe (``python3 ready_check.py``, mounted from a
  ConfigMap that ``labkit deploy k8s`` writes), with nothing but the image's ``python3``: it
  imports only the standard library.

A replica is ready when, for every model it serves:

1. Triton's ``/v2/models/<model>/ready`` is 200. Not the server-wide ``/v2/health/ready``: that one
   also answers 400 while *another* model loads or unloads (checked on Triton 2.51: notebook 07
   loads two twins of its model on one replica, and that replica left the pool twice), and it
   stays 200 after a Python stub died;
2. every Python-backend instance of it has its ``triton_python_backend_stub`` process alive
   (read from ``/proc``). Triton 2.51 keeps the model READY after its stub died, ``/ready``
   included, and refuses every request to it (``500 Stub process '<model>_0' is not healthy``).
   From NGC 26.01 on (python_backend PR #423), ``/v2/models/<model>/ready`` itself answers not
   ready when a stub has died; the stub count sees it on both.

``--live`` checks only that the server answers ``/v2/health/live`` and that every stub is alive:
a pod's liveness probe, since nothing restarts a dead stub on these versions (the container must).

The models are the ones named (``--model``, repeatable), else every model the repository index
lists as READY. Exit status 0 when ready, 1 when not, with the reason on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request

#: The name of the Python backend's stub executable (its process runs one model instance).
STUB = "triton_python_backend_stub"


def _get(url: str, timeout_s: float, data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def instance_count(config: dict) -> int:
    """How many instances Triton runs for a served config (its JSON form): the sum of
    ``instance_group[].count``, once per listed GPU for a ``KIND_GPU`` group; at least 1.
    (The rule of the text model's ``engine_settings.instance_count``; this file cannot import
    it in a pod.)"""
    total = 0
    for group in config.get("instance_group", []):
        count = int(group.get("count", 1))
        gpus = group.get("gpus", [])
        total += count * (len(gpus) if group.get("kind") == "KIND_GPU" and gpus else 1)
    return max(1, total)


def live_stubs(server_pid: int | None = None, proc: str = "/proc") -> dict[str, int]:
    """Model name -> how many of its Python stub processes are alive (not zombies): the children
    of ``server_pid``, or every stub on the host (one server per pod) when it is None."""
    found: dict[str, int] = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"{proc}/{entry}/stat") as f:
                # "pid (comm) state ppid ...": the comm may hold spaces, so split after its ')'
                state, ppid = f.read().rpartition(")")[2].split()[:2]
        except OSError:  # the process ended while this looked
            continue
        if state == "Z" or not args[0].endswith(STUB.encode()) or len(args) < 2:
            continue
        if server_pid is not None and int(ppid) != server_pid:
            continue
        # its second argument is the model's file: <repository>/<model>/<version>/model.py
        model = os.path.basename(os.path.dirname(os.path.dirname(args[1].decode())))
        found[model] = found.get(model, 0) + 1
    return found


def served_models(url: str, timeout_s: float = 2.0) -> list[str]:
    """The models the repository index lists as READY."""
    status, body = _get(f"{url}/v2/repository/index", timeout_s, data=b"{}")
    if status != 200:
        raise OSError(f"the repository index answered {status}")
    return sorted({row["name"] for row in json.loads(body) if row.get("state") == "READY"})


def check(
    url: str = "http://127.0.0.1:8000",
    models: list[str] | None = None,
    *,
    server_pid: int | None = None,
    live: bool = False,
    proc: str = "/proc",
    timeout_s: float = 2.0,
) -> tuple[bool, str]:
    """(ready, reason) of the server at ``url``: see the module's docstring. ``live``: only that
    it answers and every stub is alive."""
    url = url.rstrip("/")
    try:
        if live:
            status, _ = _get(f"{url}/v2/health/live", timeout_s)
            if status != 200:
                return False, f"/v2/health/live answered {status}"
        names = list(models) if models else served_models(url, timeout_s)
        stubs = live_stubs(server_pid, proc)
        broken = []
        for name in names:
            quoted = urllib.parse.quote(name, safe="")
            if not live:
                status, _ = _get(f"{url}/v2/models/{quoted}/ready", timeout_s)
                if status != 200:
                    broken.append(f"{name}: /v2/models/{name}/ready answered {status}")
                    continue
            status, body = _get(f"{url}/v2/models/{quoted}/config", timeout_s)
            if status != 200:
                broken.append(f"{name}: its config answered {status}")
                continue
            config = json.loads(body)
            if config.get("backend") != "python":
                continue
            expected, running = instance_count(config), stubs.get(name, 0)
            if running < expected:
                broken.append(f"{name}: {running} of {expected} Python stubs alive")
    except (OSError, ValueError) as exc:  # refused, timed out, or not JSON
        return False, f"cannot ask {url}: {exc}"
    if broken:
        return False, "; ".join(broken)
    return True, "live" if live else "ready"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="Triton's HTTP address")
    parser.add_argument(
        "--model", action="append", help="a model to check (default: every READY one)"
    )
    parser.add_argument("--server-pid", type=int, help="count only this process's stubs")
    parser.add_argument("--live", action="store_true", help="liveness: answers, stubs alive")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="per request")
    args = parser.parse_args(argv)
    ready, reason = check(
        args.url, args.model, server_pid=args.server_pid, live=args.live, timeout_s=args.timeout_s
    )
    sys.stdout.write(reason + "\n")  # what the kubelet keeps as the probe's answer
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
