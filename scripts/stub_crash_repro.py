"""Reproduce a Python-backend stub's segfault on its way out, and count them.

A stub crashed when its model ended (unload, or the server's stop) while Python still held,
in a reference cycle, an object that owns shared memory: a decoupled request's response sender
after ``is_cancelled()`` (its cancel flag lives in the stub's shared memory). The stub frees its
shared memory before it finalizes the interpreter, whose last garbage collection then frees the
sender and touches the unmapped memory (``segfault at ...0c8 ... error 4 in libc.so.6``).

Each round starts a server with tiny Falcon as a decoupled model (the lab's ``textgen``
template, as ``smollm2_stream``), streams ``--streams`` answers, ends the model (``--end``:
``unload``, ``stop``, or ``kill-server``: SIGKILL to tritonserver alone, reaped at once, which
leaves its stubs without their server: Triton's own crash, upstream server#7875) and counts the
kernel log's segfaults of that server's own stubs (by pid: other servers on the host are not
counted). Needs a readable kernel log (root). Measured on the 2-core host: before the
fix, 3 of 3 rounds crashed (``stop``, 4 streams) and 2 of 2 (``unload``, 1 stream); after it,
0 of 3 each; ``kill-server`` crashed 1 round of 2 (``segfault at ...220 ... error 6``).

    .venv/bin/python scripts/stub_crash_repro.py --rounds 5 --streams 4 --end stop
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the crash watch's kernel-log reader

import crashwatch  # noqa: E402

from labkit import repository, streaming  # noqa: E402
from labkit.server import TritonServer  # noqa: E402

MODEL = "tf_stream"


def one_round(folder: Path, streams: int, end: str, kernel: crashwatch.KernelLog) -> list[str]:
    """The kernel log's crash lines of this round's stubs."""
    server = TritonServer(
        folder, http_port=0, grpc_port=0, metrics_port=0, log_path=folder / "server.log"
    ).start()
    try:
        server.load_model(MODEL)
        for n in range(streams):
            pieces = list(streaming.stream(server.grpc_url, MODEL, f"Prompt {n}", "grpc"))
            assert pieces, "no piece streamed"
        stubs = {p.pid for p in psutil.Process(server.pid).children(recursive=True)}
        if end == "unload":
            server.unload_model(MODEL)
        elif end == "kill-server":  # tritonserver alone, SIGKILLed: its stubs outlive it
            os.kill(server.pid, signal.SIGKILL)
            os.waitpid(server.pid, 0)  # reaped, as a launcher that waits for it does
            time.sleep(3.0)  # a stub checks every 300 ms whether its server still lives
    finally:
        server.stop()
    time.sleep(1.0)  # the kernel logs a crash a moment after the process's end
    return [line for _, pid, line in crashwatch.parse(kernel.new()) if pid in stubs]


def say(*lines: str) -> None:
    print(*lines, sep="\n  ", flush=True)  # noqa: T201 (a script reports on stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--end", choices=["stop", "unload", "kill-server"], default="stop")
    args = parser.parse_args()
    kernel = crashwatch.KernelLog()
    crashes = 0
    with tempfile.TemporaryDirectory(prefix="stub-crash-") as tmp:
        folder = Path(tmp) / "repository"
        repository.add_model(folder, "tiny-falcon", name=MODEL, max_tokens=12, decoupled=True)
        repository.prepare_repository(folder)
        for n in range(args.rounds):
            lines = one_round(folder, args.streams, args.end, kernel)
            crashes += len(lines)
            say(f"round {n + 1}: {len(lines)} stub segfault(s)", *lines)
    say(f"{crashes} segfault(s) in {args.rounds} round(s), {args.end} after {args.streams} streams")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
