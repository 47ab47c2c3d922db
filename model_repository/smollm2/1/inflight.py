"""In-flight batching: requests join and leave a running batch at every generation step.

This is what vLLM and TensorRT-LLM call in-flight (iteration-level, continuous) batching. With the
config parameter ``inflight_batching: "true"`` (and ``model_transaction_policy { decoupled:
true }``), ``execute`` reads each request with the shared ``RequestReader`` and hands it to
:class:`InflightEngine`, then returns at once. The engine is transformers' continuous-batching
manager (``model.init_continuous_batching``: a paged KV cache and a FIFO scheduler that run in
their own thread) and one dispatcher thread of this module, which:

- admits waiting requests as soon as slots and KV blocks are free (the log says when a request
  has to wait, and what the engine holds then). Each prompt reserves the blocks of ``prompt +
  max_tokens`` tokens when it is admitted, so the cache never runs out in the middle of an
  answer (transformers' engine then stops for good: it cannot offload here);
- sends each request's responses through its own response sender: one per token when the
  request says ``"stream": true`` (the same pieces as the decoupled model's, see
  ``decoupled.py``, each decoded from a few tokens: ``detokenize.py``), else one final response
  with the whole answer, decoded once, which ``/generate`` needs;
- frees the slot of a request whose client went away (closed HTTP connection, cancelled gRPC
  stream) at the next step;
- runs a request that samples or sets a repetition penalty whole, with ``generate``, in a side
  lane: a thread of its own, one such request at a time, while the engine's streams go on
  (transformers' engine decides sampling once for all its requests). The two share the cores and
  the weights: ``generate`` runs on the model itself, or, for an eager-attention model, whose
  attention the engine replaces with its paged one, on a twin that holds the same weight
  tensors. Such a request gets exactly the answer of the other schedulers, ``seed`` included;
- ends the stub process when the engine's thread dies, after failing every request with the
  reason. A Triton 2.51 Python model has no readiness of its own to report; a dead stub is what
  Triton (``Stub process ... is not healthy``) and ``labkit.server.unhealthy`` see, and what
  ``labkit.server.recover`` reloads.

The limits are config.pbtxt parameters (``engine_settings.Limits``; defaults measured on a 2-core
CPU with SmolLM2-135M in float32). A request that can never fit them is refused (HTTP 400); one that
finds ``max_queue_size`` requests already waiting is refused at once with UNAVAILABLE and a
"busy: ...; retry later" message (Triton 2.51's ``/generate`` answers every model error with HTTP
400; gRPC keeps the code), never left waiting without bound.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import transformers
import triton_python_backend_utils as pb_utils
from transformers import GenerationConfig

from .decoupled import FINAL, RequestStream, Row, rest_of
from .engine_settings import Limits, engine_settings
from .protocol import (
    Prompts,
    Settings,
    answer,
    busy_response,
    cancelled_response,
    error_response,
)

try:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
except ImportError:  # transformers before 5.x
    raise ImportError(
        "inflight_batching needs transformers' continuous-batching engine "
        f"(ContinuousBatchingConfig, transformers 5.x); this server has transformers "
        f"{transformers.__version__}; upgrade it or serve without inflight_batching"
    ) from None

WARMUP_ID = "labkit-warmup"
CANCEL_CHECK_S = 0.05  # how often the clients of running and waiting requests are asked
STATS_EVERY_S = 60.0  # how often a busy engine logs what it did


def runs_whole(settings: Settings) -> bool:
    """Whether a request needs ``generate`` (the engine decodes greedily, without penalty)."""
    return settings.do_sample or settings.repetition_penalty != 1.0


def side_model(model):
    """The model ``generate`` runs on while the engine runs: the model itself, unless the engine
    will switch its attention (eager becomes "paged|eager", which ``generate`` cannot run); then a
    twin that shares every parameter and buffer tensor (no weight is copied) and keeps its own
    config. Call it before the engine is made: the twin must not copy the engine."""
    if model.config._attn_implementation != "eager":
        return model
    tensors = itertools.chain(model.parameters(), model.buffers())
    return copy.deepcopy(model, memo={id(tensor): tensor for tensor in tensors})


def until_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i]
    return list(tokens)


@dataclass(eq=False)
class Job:
    """One Triton request in the engine's care: its response sender and prompts, and its slots."""

    stream: RequestStream
    blocks: list[int]  # KV blocks each prompt reserves
    whole: bool  # served by generate() between engine steps
    rids: list[str] = field(default_factory=list)  # the engine's ids of its prompts, once admitted

    @property
    def prompts(self) -> Prompts:
        return self.stream.prompts


class InflightEngine:
    """transformers' continuous-batching manager, fed by ``execute`` and drained by a dispatcher.

    ``decode(prompt_ids, new_ids)`` is the model's completion function (the non-streaming answer);
    ``decode_ids(ids)`` the tokenizer's decode, which streamed pieces come from;
    ``run_alone(sender, prompts, model)`` answers one request with ``generate`` on ``model`` and
    sends its final response (the side lane); ``on_crash()`` is called once the engine has died
    and its requests were failed.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        limits: Limits,
        eos_ids: set[int],
        max_tokens: int,
        decode: Callable[[list[int], list[int]], str],
        decode_ids: Callable[[list[int]], str],
        run_alone: Callable[[object, Prompts, object], None],
        name: str,
        on_crash: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.limits = limits
        self.eos_ids = eos_ids
        self.decode = decode
        self.decode_ids = decode_ids
        self.run_alone = run_alone
        self.name = name
        self.on_crash = on_crash or end_stub
        self.failure: str | None = None  # why the engine stopped, once it has
        self.stats = dict.fromkeys(
            ("answered", "tokens", "waited", "cancelled", "busy", "failed"), 0
        )
        self._lock = threading.Lock()
        self._waiting: deque[Job] = deque()  # valid requests, first come first served
        self._side: deque[Job] = deque()  # requests for the side lane (generate), in turn
        self._side_wakes = threading.Condition(self._lock)
        self._side_busy = False  # the side lane is answering one
        self._active: dict[str, tuple[Job, Row]] = {}  # engine request id -> its prompt
        self._running = 0  # prompts in the engine
        self._reserved = 0  # KV blocks they reserved
        self._serial = 0
        self._stopping = threading.Event()
        self.side_model = side_model(model)
        self.manager = model.init_continuous_batching(
            generation_config=GenerationConfig(
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=sorted(eos_ids) or -1,
                pad_token_id=tokenizer.pad_token_id,
            ),
            continuous_batching_config=ContinuousBatchingConfig(**engine_settings(limits)),
        )
        self._thread = threading.Thread(target=self._run, name=f"{name}-inflight", daemon=True)
        self._side_thread = threading.Thread(
            target=self._run_side, name=f"{name}-side", daemon=True
        )

    # -- life cycle -------------------------------------------------------------------------------
    def start(self, warmup_ids: list[int], timeout_s: float = 300.0) -> None:
        """Start the engine, run one short request through it, then start the dispatcher."""
        self.manager.start()
        self.manager.add_request(warmup_ids, request_id=WARMUP_ID, max_new_tokens=2)
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.manager.get_result(timeout=1.0)
            if result is not None and result.request_id == WARMUP_ID and result.is_finished():
                break
            if not self.manager.is_running() or time.monotonic() > deadline:
                self.manager.stop(block=False, hard_stop=True)
                raise RuntimeError(
                    f"{self.name}: the in-flight engine did not answer its warm-up request "
                    f"({self._fatal() or f'nothing within {timeout_s:g} s'})"
                )
        if result.error:
            kind = getattr(self.model.config, "model_type", "this model")
            raise RuntimeError(
                f"{self.name}: the in-flight engine (transformers' continuous batching) cannot "
                f"run {kind}: {result.error}; serve it without inflight_batching"
            )
        cache = getattr(self.manager.batch_processor, "cache", None)
        if cache is not None and getattr(cache, "num_blocks", self.limits.kv_blocks) < (
            self.limits.kv_blocks
        ):
            raise RuntimeError(
                f"{self.name}: the engine made {cache.num_blocks} KV blocks, fewer than "
                f"kv_blocks={self.limits.kv_blocks}; lower kv_blocks"
            )
        self._thread.start()
        self._side_thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the dispatcher and the engine; requests still here get an UNAVAILABLE answer."""
        self._stopping.set()
        with self._lock:
            self._side_wakes.notify_all()
        for thread in (self._thread, self._side_thread):
            if thread.is_alive():
                thread.join(timeout_s)
        message = f"model {self.name!r} is being unloaded; retry once it is loaded again"
        self._send_all(self._take_all(), lambda: busy_response(message))
        with contextlib.suppress(Exception):  # a dead engine has nothing to stop
            self.manager.stop(block=True, timeout=timeout_s, hard_stop=True)
        self._log_stats("stopped")

    # -- what execute calls -----------------------------------------------------------------------
    def submit(self, sender, prompts: Prompts) -> None:
        """Take one valid request: admit it, queue it, or refuse it at once (too big, busy)."""
        stream = RequestStream(sender, prompts, self.decode_ids)
        problem = self._never_fits(prompts)
        if problem:
            sender.send(error_response(problem), flags=FINAL)
            return
        job = Job(
            stream,
            [self.limits.blocks(len(ids) + prompts.settings.max_tokens) for ids in prompts.ids],
            runs_whole(prompts.settings),
        )
        with self._lock:
            refusal = self._refusal(job)
            if refusal is None:
                if job.whole:
                    waits = self._side_busy or bool(self._side)
                    self._side.append(job)
                    self._side_wakes.notify()
                else:
                    self._waiting.append(job)
                    self._admit()
                    waits = not job.rids
                self.stats["waited"] += waits
                room = self._room()
            else:
                self.stats["busy"] += 1
        if refusal is not None:
            sender.send(busy_response(refusal), flags=FINAL)
        elif waits:
            pb_utils.Logger.log_info(f"{self.name}: a request waits for room ({room})")

    def _room(self) -> str:
        """What the engine holds now (lock held), for the log: slots, KV blocks, the queue."""
        limits = self.limits
        return (
            f"{self._running}/{limits.max_running_requests} slots and {self._reserved}/"
            f"{limits.kv_blocks} KV blocks taken, {len(self._waiting)} requests waiting, "
            f"{len(self._side) + self._side_busy} in the side lane"
        )

    def _never_fits(self, prompts: Prompts) -> str | None:
        limits, count = self.limits, len(prompts.ids)
        if count > limits.max_running_requests:
            return (
                f"the request holds {count} prompts; the in-flight engine runs at most "
                f"max_running_requests={limits.max_running_requests} at once; send fewer per "
                "request"
            )
        needed = sum(limits.blocks(len(ids) + prompts.settings.max_tokens) for ids in prompts.ids)
        if needed > limits.kv_blocks:
            longest = max(len(ids) for ids in prompts.ids)
            return (
                f"prompt(s) of up to {longest} tokens with max_tokens="
                f"{prompts.settings.max_tokens} need {needed} KV blocks of "
                f"{limits.kv_page_size} tokens; the in-flight engine has kv_blocks="
                f"{limits.kv_blocks} ({limits.kv_tokens} tokens); shorten the prompt or lower "
                "max_tokens"
            )
        return None

    def _refusal(self, job: Job) -> str | None:
        """Why ``job`` cannot wait here now (called with the lock held), or None."""
        if self.failure is not None:
            return (
                f"the in-flight engine of {self.name!r} stopped ({self.failure}); the model "
                "must be reloaded (labkit.server.recover); retry after that"
            )
        if self._stopping.is_set():
            return f"model {self.name!r} is being unloaded; retry once it is loaded again"
        waiting = len(self._waiting) + len(self._side)
        if waiting >= self.limits.max_queue_size and not self._fits_now(job):
            return (
                f"busy: {self._running + self._side_busy} prompts are generating and {waiting} "
                f"requests are waiting (max_queue_size={self.limits.max_queue_size}); retry later"
            )
        return None

    def _fits_now(self, job: Job) -> bool:
        """Whether ``job`` would start at once (nothing waits before it, and there is room)."""
        if job.whole:
            return not self._side and not self._side_busy
        return not self._waiting and self._running < self.limits.max_running_requests

    def _admit(self) -> None:
        """Move waiting requests into the engine, first come first served (lock held)."""
        while self._waiting and not self.failure:
            job = self._waiting[0]
            count, blocks = len(job.blocks), sum(job.blocks)
            if (
                self._running + count > self.limits.max_running_requests
                or self._reserved + blocks > self.limits.kv_blocks
            ):
                return
            self._waiting.popleft()
            self._running += count
            self._reserved += blocks
            for row in job.stream.rows:
                self._serial += 1
                rid = f"{self._serial}"
                job.rids.append(rid)
                self._active[rid] = (job, row)
                self.manager.add_request(
                    row.ids,
                    request_id=rid,
                    max_new_tokens=job.prompts.settings.max_tokens,
                    streaming=True,
                )

    # -- the dispatcher thread --------------------------------------------------------------------
    def _run(self) -> None:
        checked = last_stats = time.monotonic()
        try:
            while not self._stopping.is_set():
                outbox: list[Callable[[], None]] = []
                results = self._results(timeout_s=CANCEL_CHECK_S)
                with self._lock:
                    for result in results:
                        self._deliver(result, outbox)
                    self._admit()
                self._send(outbox)
                now = time.monotonic()
                if now - checked >= CANCEL_CHECK_S:
                    self._drop_cancelled()
                    checked = now
                if now - last_stats >= STATS_EVERY_S and self._active:
                    self._log_stats("running")
                    last_stats = now
                if not self.manager.is_running() and not self._stopping.is_set():
                    raise RuntimeError(self._fatal() or "the engine's thread ended")
        except Exception as exc:  # noqa: BLE001 (whatever stopped the engine, its requests are told)
            self._crashed(exc)

    def _results(self, timeout_s: float) -> list:
        """The outputs the engine produced: wait up to ``timeout_s`` for one, then take the rest."""
        first = self.manager.get_result(timeout=timeout_s)
        results = [] if first is None else [first]
        while first is not None:
            first = self.manager.get_result(timeout=0)
            if first is not None:
                results.append(first)
        return results

    def _deliver(self, result, outbox: list) -> None:
        """Route one engine output to its request (lock held); sends go to ``outbox``."""
        entry = self._active.get(result.request_id)
        if entry is None:
            return  # the warm-up request, or one already cancelled
        job, row = entry
        if result.error is not None:
            self._end(
                job,
                outbox,
                error_response(f"generation failed: {result.error}", pb_utils.TritonError.INTERNAL),
            )
            self.stats["failed"] += 1
            return
        new = until_eos(result.generated_tokens, self.eos_ids)
        grew = len(new) > len(row.new)
        self.stats["tokens"] += len(new) - len(row.new)
        row.new = new
        if grew and job.prompts.stream:
            piece = row.next_piece()
            pieces = [""] * len(job.stream.rows)
            pieces[row.index] = piece
            outbox.append(functools.partial(job.stream.send, pieces))
        if result.is_finished():
            row.done = True
            self._release(result.request_id)
            if all(r.done for r in job.stream.rows):
                outbox.append(functools.partial(self._answer, job))
                self.stats["answered"] += 1

    def _answer(self, job: Job) -> None:
        """The final response of a finished request: the rest of each piece, or the whole answer."""
        rows = job.stream.rows
        if job.prompts.stream:
            job.stream.send([rest_of(row, self.decode) for row in rows], flags=FINAL)
        else:
            completions = [self.decode(row.ids, row.new) for row in rows]
            job.stream.sender.send(answer(job.prompts, completions), flags=FINAL)

    def _release(self, rid: str) -> None:
        job, row = self._active.pop(rid)
        self._running -= 1
        self._reserved -= job.blocks[row.index]

    def _end(self, job: Job, outbox: list, response) -> None:
        """Take ``job`` out of the engine and the queue (lock held); its last response is queued."""
        for rid in job.rids:
            if rid in self._active:
                self.manager.cancel_request(rid)
                self._release(rid)
        for waiting in (self._waiting, self._side):
            with contextlib.suppress(ValueError):
                waiting.remove(job)
        job.stream.cancel()
        outbox.append(functools.partial(_send_final, job.stream.sender, response))

    def _drop_cancelled(self) -> None:
        """End every request whose client has gone; their slots go to the next in line."""
        with self._lock:
            jobs = list({id(job): job for job, _ in self._active.values()}.values())
            jobs += list(self._waiting) + list(self._side)
        gone = [job for job in jobs if job.stream.sender.is_cancelled()]
        if not gone:
            return
        outbox: list[Callable[[], None]] = []
        with self._lock:
            for job in gone:
                self._end(job, outbox, cancelled_response())
                self.stats["cancelled"] += 1
            self._admit()
            room = self._room()
        self._send(outbox)
        pb_utils.Logger.log_info(
            f"{self.name}: {len(gone)} request(s) cancelled by their clients; their slots are "
            f"free ({room})"
        )

    # -- the side lane -----------------------------------------------------------------------------
    def _run_side(self) -> None:
        """Answer each request that samples, one at a time, with generate(), beside the engine."""
        while True:
            with self._lock:
                while not self._side and not self._stopping.is_set():
                    self._side_wakes.wait()
                if self._stopping.is_set():
                    return
                job = self._side.popleft()
                self._side_busy = True
            try:
                if job.stream.sender.is_cancelled():
                    _send_final(job.stream.sender, cancelled_response())
                    outcome = "cancelled"
                else:
                    self.run_alone(job.stream.sender, job.prompts, self.side_model)
                    outcome = "answered"
            except Exception as exc:  # noqa: BLE001 (one request's fault must not end the lane)
                pb_utils.Logger.log_error(f"{self.name}: side-lane request failed: {exc!r}")
                outcome = "failed"
            with self._lock:
                self._side_busy = False
                self.stats[outcome] += 1

    # -- when the engine dies ---------------------------------------------------------------------
    def _crashed(self, exc: BaseException) -> None:
        self.failure = self._fatal() or f"{type(exc).__name__}: {exc}"
        jobs = self._take_all()
        pb_utils.Logger.log_error(
            f"{self.name}: the in-flight engine stopped: {self.failure}; failing {len(jobs)} "
            "request(s) and ending this stub, so that the model is reported unhealthy and a "
            "reload (labkit.server.recover) restarts it"
        )
        message = f"generation failed: the in-flight engine stopped ({self.failure})"
        self._send_all(jobs, lambda: error_response(message, pb_utils.TritonError.INTERNAL))
        with contextlib.suppress(Exception):
            self.manager.stop(block=False, hard_stop=True)
        self.on_crash()

    def _fatal(self) -> str | None:
        error = getattr(
            getattr(self.manager, "background_thread_status", None), "fatal_error", None
        )
        return f"{type(error).__name__}: {error}" if error is not None else None

    def _take_all(self) -> list[Job]:
        with self._lock:
            jobs = list({id(job): job for job, _ in self._active.values()}.values())
            jobs += list(self._waiting) + list(self._side)
            self._active.clear()
            self._waiting.clear()
            self._side.clear()
            self._running = self._reserved = 0
        return jobs

    @staticmethod
    def _send_all(jobs: list[Job], response: Callable[[], object]) -> None:
        for job in jobs:
            job.stream.cancel()
            _send_final(job.stream.sender, response())

    @staticmethod
    def _send(outbox: list[Callable[[], None]]) -> None:
        for send in outbox:
            try:
                send()
            except Exception as exc:  # noqa: BLE001 (a client that went away; the next check drops it)
                pb_utils.Logger.log_warn(f"in-flight response not sent: {exc!r}")

    def _log_stats(self, what: str) -> None:
        steps = getattr(self.manager, "current_batch", 0)
        s = self.stats
        pb_utils.Logger.log_info(
            f"{self.name}: in-flight engine {what}: {steps} steps, {s['tokens']} tokens, "
            f"{s['answered']} answered, {s['waited']} waited, {s['cancelled']} cancelled, "
            f"{s['busy']} refused busy, "
            f"{s['failed']} failed; {self._running} prompts running, {len(self._waiting)} waiting"
        )


def _send_final(sender, response) -> None:
    try:
        sender.send(response, flags=FINAL)
    except Exception as exc:  # noqa: BLE001 (the request is gone, e.g. cancelled)
        pb_utils.Logger.log_info(f"final response not sent: {exc!r}")


def end_stub() -> None:
    """End this stub process, so that Triton and labkit see the model as unhealthy."""
    time.sleep(0.5)  # the failed requests' responses are on their way out
    os._exit(70)
