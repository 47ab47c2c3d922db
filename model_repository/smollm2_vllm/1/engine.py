"""vLLM's V1 ``AsyncLLM`` behind the lab's request contract: an asyncio loop in a thread of its own.

``execute`` hands each valid request to :meth:`VllmEngine.submit` and returns; a coroutine per
request feeds each of its prompts to the engine (as token ids, so the prompt is the tokens
``smollm2`` sees) and answers through the request's response sender: one response per token when
the request says ``"stream": true``, else one final response with the whole answer, which
``/generate`` needs. The loop never talks to Triton itself: its responses, and its questions
whether a client went away, go to an :class:`~.outbox.Outbox`, whose thread makes those round
trips. A request's client is asked when the engine hands it a step, at most every
:data:`ASK_S`, and by a watchdog when it had none for :data:`IDLE_ASK_S` (one still waiting for
the engine); a request whose client went away has its task cancelled, which aborts its sequences
in the engine. A request that finds ``max_num_seqs + max_queue_size`` prompts held already is
refused at once, ``busy: ...``. A request's sender is never used after its final response:
Triton 2.51's server crashed (SIGSEGV in ``TRITONBACKEND_ResponseFactoryIsCancelled``) when
``is_cancelled()`` was asked of a request that had just been answered.

A request is read and checked before it comes here (``contract.py``): its vLLM SamplingParams
are built, its answers are ``n`` per prompt. A request that sets a field which changes vLLM's
text (stop strings or stop tokens, ``ignore_eos``, ``skip_special_tokens: false``:
``contract.vllm_decodes``) is answered with vLLM's text; any other is decoded by the model as
``smollm2`` decodes it, and vLLM detokenizes only for its logprobs' ``decoded_token``. An unload lets the answers in flight finish for ``unload_drain_s``, then ends the rest
with an error that says so. A start past ``start_timeout_s`` ends every process it started.

When the engine dies (its core or worker process ended), every request fails with the reason, the
engine's processes are shut down, and the stub ends: a Triton 2.51 Python model has no readiness
of its own to report; a dead stub is what Triton and ``labkit.server.unhealthy`` see, and what
``labkit.server.recover`` reloads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import locale
import os
import signal
import threading
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import triton_python_backend_utils as pb_utils

from .contract import Answer, Request, failure, response
from .decoupled import FINAL
from .detokenize import IncrementalText
from .outbox import Outbox
from .protocol import busy_response, cancelled_response, error_response
from .vllm_settings import Adapter, EngineOptions, engine_arguments, queue_limit

if typing.TYPE_CHECKING:
    from .metrics import EngineMetrics

# The stub's embedded Python starts in the C locale: torch's inductor (imported by vLLM) then
# fails to read its own templates. Before vLLM is imported, take the environment's locale.
with contextlib.suppress(locale.Error):
    locale.setlocale(locale.LC_ALL, "")

try:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.exceptions import VLLMClientError
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError
except ImportError as exc:
    raise ImportError(
        f"this model needs vLLM, which the server's Python environment lacks ({exc}); it runs "
        "in .venv-vllm, which `make install` creates and labkit names in the model's "
        "config.pbtxt (parameter EXECUTION_ENV_PATH). Run `make install`, then load the model "
        "again"
    ) from None

CHECK_S = 0.05  # how often the watchdog runs: whether the engine lives, which clients to ask
ASK_S = 0.05  # a generating request's client is asked at most this often (on the engine's steps)
IDLE_ASK_S = 0.5  # a request without steps (waiting for the engine) is asked this often
LOG_EVERY_S = 10.0  # a watchdog pass that keeps failing is logged at most this often


#: What vLLM raises for a request's own values (each SamplingParams bound, a schema that does not
#: parse, an unknown LoRA adapter): a 400. Anything else is the server's fault (contract.failure).
REFUSALS = (VLLMClientError,)


@dataclass(frozen=True)
class Step:
    """What one engine step added to one answer (vLLM's delta output: only what is new, so an
    answer of n tokens costs O(n) to follow, not O(n²))."""

    answer: int  # the answer's place in the request: prompt x n + vLLM's completion index
    tokens: list[int]  # the tokens it added (several with stream_interval > 1)
    text: str  # the text they added (vLLM's; empty unless it detokenizes)
    finish_reason: str | None
    cumulative_logprob: float | None  # the answer's so far
    logprobs: list | None  # the added tokens' logprobs


@dataclass(eq=False)
class Job:
    """One request in the engine: its sender, and what each of its answers has reached and sent.

    A request of P prompts asking for n answers each has P x n answers, prompt by prompt."""

    sender: object
    request: Request
    ids: list[str]  # the engine's request id of each prompt
    answers: list[Answer] = field(default_factory=list)
    new: list[list[int]] = field(default_factory=list)  # each answer's tokens so far (to its EOS)
    ended: list[bool] = field(default_factory=list)  # each answer met its end-of-sequence token
    emitted: list[str] = field(default_factory=list)  # each answer's text sent so far
    texts: list[IncrementalText] = field(default_factory=list)  # each answer's pieces, decoded
    sent: bool = False  # a response went out already
    # Its final response is queued (loop thread): nothing more is queued for it, and the watchdog
    # no longer asks about its client.
    finished: bool = False
    # Its final response went out (the outbox's thread alone sets it): its sender is never
    # touched again (Triton 2.51 crashes in is_cancelled() of a request whose final response was
    # sent).
    closed: bool = False
    asked: float = 0.0  # when its client was last asked whether it went away (monotonic)
    cancelling: bool = False  # its task was cancelled (once: a second would cut its cleanup short)
    task: asyncio.Task | None = None


class VllmEngine:
    """The engine, its loop thread, and the requests it holds."""

    def __init__(
        self,
        name: str,
        options: EngineOptions,
        weights: str,
        decode: Callable[[list[int], list[int]], str],
        decode_ids: Callable[[list[int]], str],
        eos_ids: set[int],
        metrics: EngineMetrics,
        adapters: Sequence[Adapter] = (),
    ) -> None:
        self.name = name
        self.options = options
        self.weights = weights
        self.decode = decode  # (prompt ids, new ids) -> the answer's text, as smollm2 makes it
        self.decode_ids = decode_ids  # the tokenizer's decode: each streamed piece's text
        self.eos_ids = eos_ids
        self.metrics = metrics
        self.adapters = list(adapters)
        # vLLM's handle of each LoRA adapter, by the name requests give (ids start at 1)
        self.loras = {
            a.name: LoRARequest(a.name, number, a.path) for number, a in enumerate(adapters, 1)
        }
        self.limit = queue_limit(options)
        self.failure: str | None = None
        self.stats = dict.fromkeys(
            ("answered", "tokens", "cancelled", "busy", "failed", "watch_errors"), 0
        )
        self._jobs: set[Job] = set()
        self._held = 0  # prompts in the engine or waiting for it
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._stopping = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-loop", daemon=True
        )
        self.outbox = Outbox(name, self._gone)
        self.llm: AsyncLLM | None = None
        self.segments: list[str] = []  # the engine's shared memory, removed if it dies

    # -- start and stop ---------------------------------------------------------------------------
    def start(self, warmup_ids: list[int]) -> float:
        """Start the engine and answer one prompt; return the seconds it took."""
        started = time.monotonic()
        self.outbox.start()
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(warmup_ids), self._loop)
        timeout_s = self.options.start_timeout_s
        try:
            future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            # The loop's thread may still be inside vLLM's start (from_engine_args blocks it),
            # where stop() cannot reach the engine: its processes are ended first, which ends
            # that start too, then the rest is stopped.
            ended = end_children()
            self.stop(timeout_s=10.0)
            end_children()
            raise TimeoutError(
                f"model {self.name!r}: the vLLM engine did not start within start_timeout_s="
                f"{timeout_s} s; ended its {ended} process(es); raise start_timeout_s in "
                "config.pbtxt if the host is slow (a first compiled start takes minutes)"
            ) from None
        except BaseException:
            self.stop()
            end_children()
            raise
        self.segments = engine_segments()
        return time.monotonic() - started

    async def _start(self, warmup_ids: list[int]) -> None:
        args = AsyncEngineArgs(**engine_arguments(self.options, self.weights, self.adapters))
        self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[self.metrics.logger_factory()])
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        # The base model answers once, then each adapter: vLLM loads an adapter when a request
        # first names it, so a folder vLLM cannot load fails the model's load, not a request.
        for lora in [None, *self.loras.values()]:
            name = f"warmup-{lora.lora_name}" if lora else "warmup"
            prompt = {"prompt_token_ids": warmup_ids}
            async for _ in self.llm.generate(prompt, params, name, lora_request=lora):
                pass
        self._loop.create_task(self._watch())

    def stop(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, end the held ones, shut the engine and its processes down."""
        with self._lock:
            self._stopping = True
        if self._thread.is_alive():
            drain_s = self._drain()
            message = (
                f"model {self.name!r} was unloaded before this answer ended (the answers in "
                f"flight had unload_drain_s={drain_s:g} s to finish); retry once it is loaded "
                "again"
            )
            future = asyncio.run_coroutine_threadsafe(
                _called(self._end_all, lambda: busy_response(message)), self._loop
            )
            with contextlib.suppress(Exception):
                future.result(timeout=timeout_s)
            self.outbox.flush(timeout_s)  # the final responses go out before the engine stops
        if self.llm is not None:
            self.llm.shutdown(timeout=timeout_s)
            self.llm = None
        if self._thread.is_alive():
            # Every task ends here, in the loop's thread, while the stub can still free the
            # response senders their frames hold. Left to the interpreter's exit, collecting them
            # crashed the stub: "Segfault encountered" in ResponseSender's destructor, its shared
            # memory already gone, at every unload of a model that had served.
            future = asyncio.run_coroutine_threadsafe(_wind_down(), self._loop)
            with contextlib.suppress(Exception):
                future.result(timeout=timeout_s)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
        self.outbox.close(timeout_s)  # what the wind-down answered goes out; no sender is kept
        if self.metrics is not None:  # the last counts are written; its thread ends
            self.metrics.close()
        self._jobs.clear()
        gc.collect()
        self._log_stats("stopped")

    def _drain(self) -> float:
        """Let the answers in flight finish (new requests are refused already), for at most
        ``unload_drain_s``; return that bound. A dead engine has none to finish."""
        drain_s = float(self.options.unload_drain_s)
        deadline = time.monotonic() + drain_s
        while self.failure is None and time.monotonic() < deadline:
            if all(job.finished for job in self._held_jobs()):
                break
            time.sleep(CHECK_S)
        return drain_s

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, sender, request: Request) -> None:
        """Take one valid request: start it, or refuse it at once (stopped, busy, too big)."""
        count = request.answers  # sequences in the engine: n per prompt
        if count > self.limit:
            sender.send(
                error_response(
                    f"the request asks for {count} answers ({len(request.prompts.ids)} prompt(s) "
                    f"x n={request.n}); this model holds at most max_num_seqs + max_queue_size = "
                    f"{self.limit} sequences at once; send fewer prompts or a smaller n"
                ),
                flags=FINAL,
            )
            return
        with self._lock:
            refusal = self._refusal(count)
            if refusal is None:
                self._held += count
                number = next(self._numbers)
                prompts = request.prompts.ids
                job = Job(
                    sender, request, [f"{self.name}-{number}-{i}" for i in range(len(prompts))]
                )
                job.answers = [Answer() for _ in range(count)]
                job.new = [[] for _ in range(count)]
                job.ended = [False] * count
                job.emitted = [""] * count
                job.texts = [
                    IncrementalText(prompts[i // request.n], self.decode_ids) for i in range(count)
                ]
                self._jobs.add(job)
            else:
                self.stats["busy"] += 1
        if refusal is not None:
            sender.send(busy_response(refusal), flags=FINAL)
            return
        self._loop.call_soon_threadsafe(self._begin, job)

    def _refusal(self, count: int) -> str | None:
        """Why a request of ``count`` prompts cannot be held now (lock held), or None."""
        if self.failure is not None:
            return (
                f"the vLLM engine of {self.name!r} stopped ({self.failure}); the model must be "
                "reloaded (labkit.server.recover); retry after that"
            )
        if self._stopping:
            return f"model {self.name!r} is being unloaded; retry once it is loaded again"
        if self._held + count > self.limit:
            running = min(self._held, self.options.max_num_seqs)
            return (
                f"busy: {running} prompts are generating and {self._held - running} are waiting "
                f"(max_num_seqs={self.options.max_num_seqs}, max_queue_size="
                f"{self.options.max_queue_size}); retry later"
            )
        return None

    def _begin(self, job: Job) -> None:
        job.task = self._loop.create_task(self._serve(job))
        job.task.add_done_callback(lambda _: self._settled(job))

    def _settled(self, job: Job) -> None:
        """Every request's task ends here, even one cancelled before it ran: it is released, and
        answered if it was not (its client went away before it started)."""
        if not job.finished:
            self.stats["cancelled"] += 1
            self._finish(job, cancelled_response())
        self._release(job)

    def _cancel_job(self, job: Job) -> None:
        if job.task is not None and not job.cancelling and job.task is not asyncio.current_task():
            job.cancelling = True
            job.task.cancel()

    async def _serve(self, job: Job) -> None:
        updates: asyncio.Queue = asyncio.Queue()
        rows = [
            asyncio.create_task(self._row(job, i, ids, updates))
            for i, ids in enumerate(job.request.prompts.ids)
        ]
        try:
            running = len(rows)
            while running:
                step, error = await updates.get()
                if error is not None:
                    raise error
                if step is None:  # a prompt's answers have all ended
                    running -= 1
                    continue
                self._advance(job, step)
                self._ask(job, ASK_S)  # the engine's step: a moment to ask about the client
            self._answer(job)
            self.stats["answered"] += 1
        except asyncio.CancelledError:  # the watchdog saw the client go away, or a stop
            await self._cancelled(job, rows)
        except EngineDeadError as exc:
            self._crashed(exc)
        except Exception as exc:  # noqa: BLE001 (one bad request must not stop the model)
            said = failure(exc, REFUSALS)
            if said.client:  # vLLM refused the request's own values as it took it in
                self._finish(job, error_response(said.message))
                return
            self.stats["failed"] += 1
            pb_utils.Logger.log_error(f"{self.name}: {said.message}:\n{said.trace}")
            self._finish(job, error_response(said.message, pb_utils.TritonError.INTERNAL))
        finally:
            await _cancel(rows)

    async def _cancelled(self, job: Job, rows: list[asyncio.Task]) -> None:
        """A request whose client went away: its sequences are aborted in the engine."""
        await _cancel(rows)  # a cancelled generate() aborts its request in the engine
        if job.finished:  # ended by a stop or a dead engine, not by its client
            return
        self.stats["cancelled"] += 1
        self.metrics.aborted.increment(1)
        pb_utils.Logger.log_info(
            f"{self.name}: request {job.ids[0].rsplit('-', 1)[0]} cancelled by its client; "
            f"aborted its {len(job.ids)} sequence(s) in the engine"
        )
        self._finish(job, cancelled_response())

    async def _row(self, job: Job, index: int, ids: list[int], updates) -> None:
        """Feed one prompt's answers' steps (all n of them) to the request's task."""
        params, n = job.request.params, job.request.n
        lora = self.loras.get(job.request.lora_name)  # None: the base model
        prompt = {"prompt_token_ids": ids}
        try:
            async for out in self.llm.generate(prompt, params, job.ids[index], lora_request=lora):
                for o in out.outputs:  # with n > 1, vLLM reports one completion at a time
                    logprobs = None if o.logprobs is None else list(o.logprobs)
                    step = Step(
                        index * n + o.index,
                        list(o.token_ids),
                        o.text,
                        o.finish_reason,
                        o.cumulative_logprob,
                        logprobs,
                    )
                    updates.put_nowait((step, None))
                if out.finished:
                    updates.put_nowait((None, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (handed to the request's task, which answers it)
            updates.put_nowait((None, exc))

    def _advance(self, job: Job, step: Step) -> None:
        """Record what a step added to an answer; a streaming request gets the text it adds."""
        i = step.answer
        record = job.answers[i]
        record.tokens += len(step.tokens)
        record.finish_reason = step.finish_reason
        record.cumulative_logprob = step.cumulative_logprob
        if step.logprobs is not None:
            if record.logprobs is None:
                record.logprobs = []
            record.logprobs.extend(step.logprobs)
        new = job.new[i]
        if job.request.vllm_text:  # vLLM's text: it ends before a stop string
            record.text += step.text
            new.extend(step.tokens)
            grew, piece = bool(step.tokens), step.text
        else:
            added = [] if job.ended[i] else until_eos(step.tokens, self.eos_ids)
            job.ended[i] = job.ended[i] or len(added) < len(step.tokens)
            new.extend(added)
            self.stats["tokens"] += len(added)
            grew = bool(added)
            piece = job.texts[i].piece(new) if grew and job.request.prompts.stream else ""
        if not (grew and job.request.prompts.stream):
            return
        job.emitted[i] += piece
        pieces = [""] * len(job.answers)
        pieces[i] = piece
        self._send(job, pieces)

    def _answer(self, job: Job) -> None:
        request = job.request
        if request.vllm_text:
            whole = [record.text for record in job.answers]
            self.stats["tokens"] += sum(len(new) for new in job.new)
        else:
            prompts = request.prompts.ids
            whole = [self.decode(prompts[i // request.n], new) for i, new in enumerate(job.new)]
        if not request.prompts.stream:
            self._finish(job, self._response(job, whole))
            return
        rest = []
        for text, emitted in zip(whole, job.emitted, strict=True):
            rest.append(text[len(emitted) :] if text.startswith(emitted) else "")
        self._send(job, rest, flags=FINAL)

    def _response(self, job: Job, pieces: list[str]):
        """A response with ``pieces``; the first starts with the prompts if the request asked."""
        prompts = job.request.prompts
        if prompts.full_text and not job.sent:
            n = job.request.n
            pieces = [prompts.texts[i // n] + piece for i, piece in enumerate(pieces)]
        job.sent = True
        counts = [len(ids) for ids in prompts.ids]
        return response(job.request, pieces, job.answers, counts)

    def _send(self, job: Job, pieces: list[str], flags: int = 0) -> None:
        """One streamed response, queued for the outbox."""
        job.finished = bool(flags & FINAL)
        self.outbox.send(job, self._response(job, pieces), flags)

    def _finish(self, job: Job, response) -> None:
        """Queue ``job``'s final response, once."""
        if not job.finished:
            job.finished = True
            self.outbox.send(job, response, FINAL)

    def _ask(self, job: Job, every_s: float) -> None:
        """Queue the question whether ``job``'s client went away, unless asked within ``every_s``
        (loop thread: nothing is asked once its final response is queued)."""
        now = time.monotonic()
        if not (job.finished or job.cancelling) and now - job.asked >= every_s:
            job.asked = now
            self.outbox.ask(job)

    def _gone(self, job: Job) -> None:
        """The outbox found ``job``'s client gone: its task is cancelled, in the loop's thread."""
        with contextlib.suppress(RuntimeError):  # the loop closed: the stop ends the task
            self._loop.call_soon_threadsafe(self._cancel_job, job)

    def _held_jobs(self) -> list[Job]:
        with self._lock:  # execute's thread adds jobs while the loop's thread looks
            return list(self._jobs)

    def _release(self, job: Job) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.discard(job)
                self._held -= job.request.answers

    # -- the watchdog -----------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Notice a dead engine; ask about the clients of requests the engine has not stepped
        for :data:`IDLE_ASK_S` (the others are asked on their steps).

        A pass that fails is logged and the next one runs: one exception must not end
        cancellation and the engine's death watch for the rest of the model's life."""
        logged = -LOG_EVERY_S
        while True:
            await asyncio.sleep(CHECK_S)
            try:
                if self._watch_once():
                    return
            except Exception as exc:  # noqa: BLE001 (logged; the watch goes on)
                self.stats["watch_errors"] += 1
                if time.monotonic() - logged >= LOG_EVERY_S:  # a lasting fault: one line a while
                    logged = time.monotonic()
                    pb_utils.Logger.log_error(
                        f"{self.name}: a watchdog pass failed ({exc!r}); "
                        f"{self.stats['watch_errors']} so far; the watchdog goes on"
                    )

    def _watch_once(self) -> bool:
        """One pass of the watchdog; True once the engine is dead (the watch then ends)."""
        for job in self._held_jobs():
            if job.task is not None and not job.task.done():
                self._ask(job, IDLE_ASK_S)
        if self.llm is not None and self.llm.errored and self.failure is None:
            self._crashed(self.llm.dead_error)
            return True
        return False

    def _crashed(self, exc: BaseException) -> None:
        if self.failure is not None:
            return
        self.failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.failure += " (its engine core or worker process ended)"
        pb_utils.Logger.log_error(
            f"{self.name}: the vLLM engine stopped: {self.failure}; failing {len(self._jobs)} "
            "request(s) and ending this stub, so that the model is reported unhealthy and a "
            "reload (labkit.server.recover) restarts it"
        )
        message = f"generation failed: the vLLM engine stopped ({self.failure})"
        self._end_all(lambda: error_response(message, pb_utils.TritonError.INTERNAL))
        threading.Thread(target=self._end_stub, name="vllm-end", daemon=True).start()

    def _end_all(self, response: Callable[[], object]) -> None:
        """End every held request with ``response()`` (in the loop's thread)."""
        for job in self._held_jobs():
            if job.finished:  # answered; its task's end releases it
                continue
            self._cancel_job(job)
            self._finish(job, response())
            self._release(job)

    def _end_stub(self) -> None:
        """Shut the engine's remaining processes down, then end this stub process."""
        self.outbox.flush(5.0)  # the failed requests' responses go out first
        with contextlib.suppress(Exception):
            if self.llm is not None:
                self.llm.shutdown(timeout=10)
        end_children()
        for path in self.segments:  # a dead engine process cannot unlink what it made
            with contextlib.suppress(OSError):
                os.unlink(path)
        os._exit(70)

    def _log_stats(self, what: str) -> None:
        s = self.stats
        o = self.outbox.stats
        pb_utils.Logger.log_info(
            f"{self.name}: vLLM engine {what}: {s['answered']} answered, {s['tokens']} tokens, "
            f"{s['cancelled']} cancelled, {s['busy']} refused busy, {s['failed']} failed; "
            f"{o['sent']} responses sent, {o['asked']} clients asked, {o['faults']} send faults"
        )


# -- helpers --------------------------------------------------------------------------------------
#: The fields of vLLM's SamplingParams and their types: what a request may set, checked by name
#: and type before vLLM checks the values (contract.py).
SAMPLING_FIELDS = typing.get_type_hints(SamplingParams)


def sampling_params(fields: dict) -> SamplingParams:
    """vLLM's sampling parameters from a request's checked fields (temperature 0: greedy; top_k
    0: off, in vLLM too). Unless vLLM's text is the answer, the model decodes as smollm2 does
    (see model.py), and its greedy answers equal smollm2's. Each step's output holds
    what is new (DELTA): vLLM 0.32's stream_interval works only so (with cumulative outputs it
    sent every token anyway)."""
    return SamplingParams(**fields, output_kind=RequestOutputKind.DELTA)


def until_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i]
    return tokens


def end_children(timeout_s: float = 10.0) -> int:
    """End every process this stub started (vLLM's engine core, its workers) and return how
    many there were: SIGTERM, then SIGKILL after ``timeout_s``. The stub starts no other. Read
    from /proc (Linux), as the model may import only the server's environment and vLLM."""
    pids = _descendants(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(map(_running, pids)):
            time.sleep(0.1)
    return len(pids)


def engine_segments() -> list[str]:
    """The shared-memory files (Python's ``psm_`` segments) that the processes under this stub
    have mapped: vLLM's message queues between its engine core and its workers (160 and 240 MiB
    here). An engine whose worker dies never unlinks them."""
    found: set[str] = set()
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/dev/shm/psm_") and " " not in path:
                    found.add(path)
    return sorted(found)


def _descendants(root: int) -> list[int]:
    """The processes under ``root``, at any depth (from /proc's parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as stat:  # "pid (name) state ppid ..."
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has ended: only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


async def _wind_down() -> None:
    """Cancel every other task of the running loop, wait for them, close async generators."""
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


async def _called(function: Callable[..., object], *args) -> None:
    """``function(*args)`` as a coroutine: run in the loop's thread from another thread."""
    function(*args)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait for them (a cancelled ``generate`` aborts its request)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
