"""A prompt UI for the notebooks: prompt, model picker, generation controls, Generate, output.

:class:`PromptUI` calls any ``generate(prompt, **params)`` callable. It may return the text (a
``str``, or an object with a ``.text`` such as :class:`labkit.client.Generation`), or yield text
pieces (a generator), which are appended to the output as they arrive, so a streaming client
plugs in unchanged (:func:`prompt_ui` streams from a decoupled model; the status line then
shows when the first text came and the pieces per second). ``params`` holds ``max_tokens`` and ``temperature`` always, ``top_p`` and
``top_k`` when moved off their neutral values, and ``model`` when there is a model picker.

Errors (server down, model not loaded, a parameter the model refuses) appear in the widget as a
one-line message, never a traceback; the traceback goes to the log at debug level.

>>> ui = prompt_ui(server)          # a TritonServer: models from its repository index
>>> ui                              # the last expression of a cell shows the widget
"""

from __future__ import annotations

import html
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ipywidgets as w

from labkit import client, streaming
from labkit.errors import LabkitError

log = logging.getLogger(__name__)

GenerateFn = Callable[..., Any]
READY = "READY"


class PromptUI:
    """The prompt widget. ``ui.widget`` is the box; ``ui`` itself displays as the box."""

    def __init__(
        self,
        generate: GenerateFn,
        *,
        server: Any = None,
        models: Sequence[str] | None = None,
        model: str | None = None,
        prompt: str = "",
        max_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_tokens_limit: int = 1024,
    ) -> None:
        self.generate = generate
        self.server = server
        self._states: dict[str, tuple[str, str]] = {}
        self.prompt = w.Textarea(
            value=prompt,
            placeholder="Type a prompt",
            description="Prompt",
            layout=w.Layout(width="100%", height="5em"),
        )
        self.model = w.Dropdown(description="Model", options=[(m, m) for m in models or []])
        self.refresh = w.Button(description="Refresh", tooltip="re-read the model repository")
        self.max_tokens = w.IntSlider(
            value=max_tokens, min=1, max=max_tokens_limit, description="Max tokens"
        )
        self.temperature = w.FloatSlider(
            value=temperature, min=0.0, max=2.0, step=0.05, description="Temperature"
        )
        self.top_p = w.FloatSlider(value=top_p, min=0.05, max=1.0, step=0.05, description="Top p")
        self.top_k = w.IntSlider(value=top_k, min=0, max=200, description="Top k")
        self.button = w.Button(description="Generate", button_style="primary")
        self.output = w.Textarea(
            value="",
            description="Output",
            disabled=True,
            layout=w.Layout(width="100%", height="10em"),
        )
        self.status = w.HTML(value="")
        self.button.on_click(self.on_generate)
        self.refresh.on_click(lambda _: self.refresh_models())
        has_picker = server is not None or bool(models)
        if server is not None:
            self.refresh_models()
        if model is not None:
            if model not in [value for _, value in self.model.options]:
                self.model.options = [*self.model.options, (model, model)]
            self.model.value = model
        rows = [self.prompt]
        if has_picker:
            rows.append(w.HBox([self.model, self.refresh] if server is not None else [self.model]))
        rows += [
            w.HBox([self.max_tokens, self.temperature]),
            w.HBox([self.top_p, self.top_k]),
            self.button,
            self.output,
            self.status,
        ]
        self.has_picker = has_picker
        self.widget = w.VBox(rows)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    # -- the model picker -----------------------------------------------------------------------
    def refresh_models(self) -> None:
        """Fill the picker from the server's repository index; a failure shows as a message."""
        try:
            index = self.server.model_index()
        except Exception as exc:  # noqa: BLE001 (shown in the widget)
            where = getattr(self.server, "http_url", "the server")
            self._error(f"cannot read the model repository from {where}: {_message(exc)}", exc)
            return
        self._states = {m["name"]: (m.get("state", ""), m.get("reason", "")) for m in index}
        chosen = self.model.value
        self.model.options = [(self._label(name), name) for name in sorted(self._states)]
        ready = [n for n, (state, _) in sorted(self._states.items()) if state == READY]
        if chosen in self._states:
            self.model.value = chosen
        elif ready:
            self.model.value = ready[0]
        self.status.value = "" if self._states else _html("no models in the repository", "warn")

    def _label(self, name: str) -> str:
        state = self._states.get(name, ("", ""))[0]
        return name if state == READY else f"{name} ({state.lower() or 'not loaded'})"

    # -- generating -----------------------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        """The keyword arguments the next Generate click passes to ``generate``."""
        params: dict[str, Any] = {
            "max_tokens": self.max_tokens.value,
            "temperature": self.temperature.value,
        }
        if self.top_p.value < 1.0:
            params["top_p"] = self.top_p.value
        if self.top_k.value > 0:
            params["top_k"] = self.top_k.value
        if self.has_picker:
            params["model"] = self.model.value
        return params

    def on_generate(self, _button: Any = None) -> None:
        """The Generate button: run ``generate`` and show its text, or its error as a message."""
        prompt = self.prompt.value
        if not prompt.strip():
            self.status.value = _html("type a prompt first", "warn")
            return
        params = self.params()
        if self.has_picker and not params.get("model"):
            self.status.value = _html("pick a model first (is one loaded?)", "warn")
            return
        self.button.disabled = True
        self.output.value = ""
        self.status.value = _html("generating...", "info")
        started, pieces, first = time.perf_counter(), 0, 0.0
        try:
            result = self.generate(prompt, **params)
            if isinstance(result, str) or hasattr(result, "text"):
                self.output.value = getattr(result, "text", result)
            elif isinstance(result, Iterable):
                for piece in result:
                    self.output.value += getattr(piece, "text", piece)
                    pieces += 1
                    if pieces == 1:
                        first = time.perf_counter() - started
                    self.status.value = _html(f"streaming... {pieces} pieces", "info")
            else:
                raise TypeError(f"generate returned {type(result).__name__}, not text")
        except Exception as exc:  # noqa: BLE001 (shown in the widget)
            self._error(self._explain(exc, params.get("model")), exc)
        else:
            took = time.perf_counter() - started
            streamed = ""
            if pieces:
                rate = f" ({(pieces - 1) / (took - first):.1f}/s)" if pieces > 1 else ""
                streamed = f"; first text after {first:.2f} s, {pieces} pieces{rate}"
            self.status.value = _html(f"done in {took:.2f} s{streamed}", "ok")
        finally:
            self.button.disabled = False

    def _explain(self, exc: BaseException, model: str | None) -> str:
        """The error's message, with the model's state when the server says it is not ready."""
        message = _message(exc)
        if self.server is None or not model:
            return message
        try:
            states = {m["name"]: m for m in self.server.model_index()}
        except Exception:  # noqa: BLE001 (the server is down: the message already says so)
            return message
        entry = states.get(model)
        if entry is None:
            return f"model {model!r} is not in the repository. {message}"
        if entry.get("state") != READY:
            reason = f": {entry['reason']}" if entry.get("reason") else ""
            return (
                f"model {model!r} is {entry.get('state') or 'not loaded'}{reason}; load it "
                f"with server.load_model({model!r}). {message}"
            )
        return message

    def _error(self, message: str, exc: BaseException) -> None:
        log.debug("prompt UI error", exc_info=exc)
        self.status.value = _html(message, "error")

    @property
    def error(self) -> str:
        """The message the widget shows now, as plain text (empty when there is none)."""
        return html.unescape(_strip_tags(self.status.value))


def prompt_ui(
    server: Any, model: str | None = None, *, stream: bool | None = None, **kwargs: Any
) -> PromptUI:
    """A :class:`PromptUI` on a running :class:`~labkit.server.TritonServer`: models from its
    repository index, text from ``/v2/models/<model>/generate``, or streamed piece by piece from
    ``/generate_stream`` for a streaming (decoupled) model such as ``smollm2_stream``.

    ``stream``: None streams exactly the models whose config is decoupled; True or False forces
    it (a non-decoupled model cannot stream: the server then says so in the widget).
    """
    decoupled: dict[str, bool] = {}  # model -> streams; a config that cannot be read is not kept

    def call(prompt: str, model: str, **params: Any):
        if stream is None and model not in decoupled:
            known = streaming.is_streaming(server.http_url, model)
            if known is not None:
                decoupled[model] = known
        if stream if stream is not None else decoupled.get(model, False):
            return streaming.stream(server.http_url, model, prompt, **params)
        return client.generate(server.http_url, model, prompt, **params)

    ui = PromptUI(call, server=server, model=model, **kwargs)
    ui.refresh.on_click(lambda _: decoupled.clear())  # a reload may change a model's config
    return ui


def stream_boxes(
    server: Any, model: str, prompts: Sequence[str], *, max_tokens: int = 24
) -> tuple[w.HBox, list[PromptUI]]:
    """One prompt box per prompt on ``model``, all generating at once, each streamed as it comes
    (the model is asked ``stream``, so an in-flight model streams too).

    Returns ``(box, uis)``: the boxes side by side, and each box (its ``output.value`` is its
    answer, ``error`` the message it shows, empty when it answered).
    """

    def generate(prompt: str, **params: Any):
        return streaming.stream(server.http_url, model, prompt, stream=True, **params)

    uis = [PromptUI(generate, prompt=p, max_tokens=max_tokens) for p in prompts]
    threads = [threading.Thread(target=ui.on_generate) for ui in uis]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return w.HBox([ui.widget for ui in uis]), uis


def _message(exc: BaseException) -> str:
    """A user-facing one-line message: labkit's own messages as they are, others with their type."""
    text = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
    first = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    if isinstance(exc, LabkitError):
        return first or type(exc).__name__
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


_COLOURS = {"error": "#b00020", "warn": "#8a6d00", "ok": "#1b5e20", "info": "#555"}


def _html(text: str, kind: str) -> str:
    return f"<span style='color:{_COLOURS[kind]}'>{html.escape(text)}</span>"


def _strip_tags(markup: str) -> str:

    return re.sub(r"<[^>]+>", "", markup)
