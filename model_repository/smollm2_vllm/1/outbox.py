"""What the engine says to Triton, said from a thread of its own: every response sent, and every
"did this client go away?" asked.

In Triton's Python backend each ``send`` and each ``is_cancelled`` is a round trip to the server
process. Made on vLLM's event-loop thread, every one of them kept vLLM's output handler waiting:
a streamed token cost the loop one round trip, and the watchdog added one per held request every
50 ms. Here the loop only queues them; this thread makes them, in the order queued, so a
request's responses keep their order and its final response is its last.

A request's sender is never used after its final response went out (Triton 2.51's server
crashed in ``is_cancelled()`` of a request that had just been answered): the thread marks it
closed when it sends that response, and skips whatever was queued for it afterwards.

Standard library and Triton only; ``engine.py`` gives it the requests (its ``Job`` objects: a
``sender``, a ``closed`` flag this thread alone sets).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import triton_python_backend_utils as pb_utils

from .decoupled import FINAL

LOG_EVERY_S = 10.0  # a fault that repeats is logged at most this often


class Outbox:
    """A queue of sends and questions for Triton, and the thread that works through it.

    ``gone(job)`` is called (from this thread) for a request whose client went away: its
    ``is_cancelled()`` said so, or a response to it could not be sent."""

    def __init__(self, name: str, gone: Callable[[object], None]) -> None:
        self.name = name
        self.gone = gone
        self.stats = {"sent": 0, "asked": 0, "faults": 0}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="vllm-outbox", daemon=True)
        self._logged = -LOG_EVERY_S

    def start(self) -> None:
        self._thread.start()

    def send(self, job, response, flags: int = 0) -> None:
        """Queue one response to ``job``'s client (its last when ``flags`` has FINAL)."""
        self._queue.put(("send", job, response, flags))

    def ask(self, job) -> None:
        """Queue the question whether ``job``'s client went away."""
        self._queue.put(("ask", job, None, 0))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued before this call is done; False past ``timeout_s``."""
        if not self._thread.is_alive():
            return self._queue.empty()
        done = threading.Event()
        self._queue.put(("mark", done, None, 0))
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued, then end the thread (the senders it held are let go)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            what, job, response, flags = item
            if what == "mark":
                job.set()
                continue
            try:
                self._do(what, job, response, flags)
            except Exception as exc:  # noqa: BLE001 (one request's fault must not stop the rest)
                self._fault(what, job, flags, exc)
            del item, job, response  # no sender outlives its turn here

    def _do(self, what: str, job, response, flags: int) -> None:
        if job.closed:  # its final response went out: its sender is never touched again
            return
        if what == "ask":
            self.stats["asked"] += 1
            if job.sender.is_cancelled():
                self.gone(job)
            return
        if flags & FINAL:
            job.closed = True
        self.stats["sent"] += 1
        job.sender.send(response, flags=flags)

    def _fault(self, what: str, job, flags: int, exc: Exception) -> None:
        """A send or a question that failed. A streamed response that could not be sent: the
        client is taken as gone (a final one has nobody left to tell; a failed question is asked
        again later). Logged, at most every :data:`LOG_EVERY_S`."""
        self.stats["faults"] += 1
        if what == "send" and not flags & FINAL:
            self.gone(job)
        if time.monotonic() - self._logged >= LOG_EVERY_S:
            self._logged = time.monotonic()
            pb_utils.Logger.log_info(
                f"{self.name}: a {'response' if what == 'send' else 'cancellation check'} "
                f"failed ({exc!r}), {self.stats['faults']} so far; the outbox goes on"
            )
