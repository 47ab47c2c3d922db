"""A decoupled model's responses: each request's text goes out as it is generated.

With ``model_transaction_policy { decoupled: true }`` a request gets one response per generated
token, holding the text that token added (empty while a multi-byte character is incomplete), then
a last response flagged final with the rest (usually empty): its pieces joined are exactly its
non-streaming answer (with ``return_full_text`` the prompt comes with the first piece). Each
piece is decoded from a few tokens only (``detokenize.py``); the final response's rest comes from
the whole answer's decode. Triton
serves such a model over ``/v2/models/<m>/generate_stream`` (server-sent events) and gRPC
streaming. When every client of a batch has gone, generation stops at the next token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import triton_python_backend_utils as pb_utils
from transformers.generation.streamers import BaseStreamer

from .detokenize import IncrementalText
from .protocol import (
    Member,
    Prompts,
    Settings,
    cancelled_response,
    error_response,
    group_by_settings,
    text_response,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class StreamCancelled(Exception):
    """Every request of a streamed batch was cancelled: generation stops early."""


class PieceStreamer(BaseStreamer):
    """Sends each request of a ``generate`` batch the text each new token adds, as it is made.

    ``senders[m]`` is the response sender of the request whose prompts are ``requests[m]``; their
    prompts are in the batch in that order. ``decode(prompt_ids, new_ids)`` is the function that
    makes the non-streaming answer, so the pieces add up to that answer; ``decode_ids(ids)`` is
    the tokenizer's decode, which each piece comes from (:class:`IncrementalText`).
    ``generate()`` calls :meth:`put` with each new token of every row; the caller calls
    :meth:`finish` once
    ``generate()`` has returned, so that a failed generate sends errors, not a last piece.
    """

    def __init__(
        self,
        senders: list,
        requests: list[Prompts],
        decode: Callable[[list[int], list[int]], str],
        decode_ids: Callable[[list[int]], str],
        eos_ids: set[int],
    ) -> None:
        self.streams = [
            RequestStream(sender, prompts, decode_ids)
            for sender, prompts in zip(senders, requests, strict=True)
        ]
        # (stream, row) in the batch's order; a row does not point back to its stream: a cycle
        # kept each sender alive until a garbage collection, and one still alive when the stub
        # ended crashed it (README, Known issues)
        self.rows = [(stream, row) for stream in self.streams for row in stream.rows]
        self.decode = decode
        self.eos_ids = eos_ids
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first passes the prompt batch
            self.prompt_seen = True
            return
        for stream in self.streams:
            if not (stream.cancelled or stream.finished) and stream.sender.is_cancelled():
                stream.cancel()
        if all(stream.cancelled for stream in self.streams):  # every client went away: stop
            raise StreamCancelled(f"{len(self.streams)} request(s) cancelled by their clients")
        pieces: dict[RequestStream, list[str]] = {}
        for (stream, row), token in zip(self.rows, value.reshape(-1).tolist(), strict=True):
            if row.done:
                continue
            if token in self.eos_ids:
                row.done = True
                continue
            row.new.append(token)
            piece = row.next_piece()
            pieces.setdefault(stream, [""] * len(stream.rows))[row.index] = piece
            # a request batched with longer ones stops at its own max_tokens
            row.done = len(row.new) >= stream.prompts.settings.max_tokens
        for stream, texts in pieces.items():
            stream.send(texts)
        for stream in self.streams:  # a request whose rows have all ended is told so now
            if not stream.finished and not stream.cancelled and all(r.done for r in stream.rows):
                self._finish(stream)

    def end(self) -> None:
        """Called by generate() when it is done; :meth:`finish` (the caller's) sends the end."""

    def finish(self) -> None:
        """Send every request its last response, flagged final."""
        for stream in self.streams:
            if stream.cancelled:
                try:
                    stream.sender.send(cancelled_response(), flags=FINAL)
                except Exception as exc:  # noqa: BLE001 (the request may be gone already)
                    pb_utils.Logger.log_info(f"cancelled request not told: {exc!r}")
                continue
            if not stream.finished:
                self._finish(stream)

    def _finish(self, stream: RequestStream) -> None:
        stream.send([rest_of(row, self.decode) for row in stream.rows], flags=FINAL)
        stream.finished = True


@dataclass(eq=False)  # compared (and hashed) by identity: a key of put()'s pieces
class RequestStream:
    """One request of a streamed batch: where its responses go and what was sent."""

    sender: object  # the request's response sender
    prompts: Prompts
    decode_ids: Callable[[list[int]], str]  # the tokenizer's decode, special tokens skipped
    rows: list[Row] = field(init=False)
    sent: bool = False  # a response went out already
    cancelled: bool = False  # its client went away
    finished: bool = False  # its final response went out

    def __post_init__(self) -> None:
        self.rows = [
            Row(i, ids, IncrementalText(ids, self.decode_ids))
            for i, ids in enumerate(self.prompts.ids)
        ]

    def cancel(self) -> None:
        self.cancelled = True
        for row in self.rows:
            row.done = True

    def send(self, pieces: list[str], flags: int = 0) -> None:
        """Send one piece per prompt; the first response starts with the prompt if asked."""
        if self.prompts.full_text and not self.sent:
            pieces = [p + piece for p, piece in zip(self.prompts.texts, pieces, strict=True)]
        self.sender.send(text_response(pieces, self.prompts.shape), flags=flags)
        self.sent = True


@dataclass(eq=False)
class Row:
    """One prompt of the ``generate`` batch: its tokens so far and the text already sent."""

    index: int  # the prompt's place in its request
    ids: list[int]  # the prompt's token ids
    text: IncrementalText  # decodes its new tokens a piece at a time
    new: list[int] = field(default_factory=list)  # the tokens generated for it
    emitted: str = ""  # the text sent for it
    done: bool = False  # ended (end-of-sequence token) or cancelled

    def next_piece(self) -> str:
        """The text its tokens since the last piece add, now counted as sent."""
        piece = self.text.piece(self.new)
        self.emitted += piece
        return piece


def read_decoupled(
    requests: list, read: Callable[[object], Prompts]
) -> tuple[list, dict[Settings, list[Member]]]:
    """Each request's response sender, and the valid requests grouped by settings; each other
    request is refused at once, in its final response."""
    senders = [request.get_response_sender() for request in requests]

    def refuse(index: int, message: str) -> None:
        senders[index].send(error_response(message), flags=FINAL)

    return senders, group_by_settings(requests, read, refuse)


def end_streams(senders: list, exc: Exception, name: str) -> None:
    """Tell each request of a failed (or cancelled) ``generate``, in its final response."""
    if isinstance(exc, StreamCancelled):
        pb_utils.Logger.log_info(f"{name}: {exc}; generation stopped")
        response = cancelled_response
    else:
        pb_utils.Logger.log_error(f"{name}: generate failed: {exc!r}")
        internal = pb_utils.TritonError.INTERNAL
        response = functools.partial(error_response, f"generation failed: {exc}", internal)
    for sender in senders:
        try:
            sender.send(response(), flags=FINAL)
        except Exception as lost:  # noqa: BLE001 (the request is gone, e.g. cancelled)
            pb_utils.Logger.log_warn(f"{name}: cannot send the error: {lost!r}")


def rest_of(row: Row, decode: Callable[[list[int], list[int]], str]) -> str:
    """What of a row's whole answer has not been sent yet: the text of its final response."""
    whole = decode(row.ids, row.new)
    if not whole.startswith(row.emitted):  # cannot happen with HF tokenizers
        pb_utils.Logger.log_warn(f"streamed text diverged from {whole!r}")
        return ""
    return whole[len(row.emitted) :]
