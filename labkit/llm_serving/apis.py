"""One request, two APIs: the official ``openai`` client against vLLM's own server, and Triton's
``/generate`` endpoint against vLLM in Triton, with the outputs beside the text that LLM clients
read: why the answer ended (``finish_reason``) and how many tokens the prompt and the answer took.

Most LLM applications are written against the OpenAI API. vLLM's own server speaks it; Triton
speaks its own (KServe v2 and ``/generate``), and its OpenAI-compatible frontend puts the OpenAI
API in front of it (``labkit serve --openai``, in docker mode). The served model
(``model_repository/smollm2_vllm``) takes the tensors that frontend sends: ``sampling_parameters``
(a JSON string), ``exclude_input_in_output`` and ``return_finish_reason``,
``return_num_input_tokens``, ``return_num_output_tokens``. So the same greedy request, sent both
ways, gets the same text, the same finish reason and the same token counts.

:func:`ask_both` sends :data:`REQUEST` each way and never raises: a way that fails keeps its error
text, so the measurements made before it are not lost; :func:`problems` says in words what
failed or differs; :func:`apis_frame` is the table notebook 06 shows.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import pandas as pd

from labkit import client
from labkit.errors import InferenceError

#: Each way (its key in :data:`~labkit.llm_serving.charts.WAY_NAMES`), as the table names it: the
#: way's own name, then how it is asked. (This module sits below ``charts``, which imports
#: ``rounds``, which imports this module; a test keeps the names the same.)
APIS = {
    "vllm-standalone": "vLLM's own server, with the openai client (/v1/completions)",
    "vllm": "vLLM in Triton, with Triton's /v2/models/<model>/generate",
}
#: The table's columns: answer key -> header a learner reads.
COLUMNS = {
    "answer": "answer",
    "finish_reason": "finish reason",
    "prompt_tokens": "prompt tokens",
    "answer_tokens": "answer tokens",
}
#: vLLM's server was started without ``--api-key``: it takes any key, and the client needs one.
API_KEY = "EMPTY"


@dataclass(frozen=True)
class Request:
    """A greedy completion of ``prompt`` that ends at a ``stop`` string or after ``max_tokens``."""

    prompt: str = "I am going"
    stop: tuple[str, ...] = (".",)
    max_tokens: int = 24


#: The request notebook 06 sends each way: its greedy answer reaches "." within 24 tokens.
REQUEST = Request()


def openai_arguments(request: Request, model: str) -> dict:
    """The keyword arguments of the ``openai`` client's ``completions.create`` for ``request``
    (``temperature=0``: greedy, as the Triton model's config)."""
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stop": list(request.stop),
    }


def generate_body(request: Request) -> dict:
    """The fields of Triton's ``/generate`` JSON beside ``text_input``: each names one of the
    model's inputs (``sampling_parameters`` is a JSON string of vLLM's fields)."""
    sampling = {"max_tokens": request.max_tokens, "temperature": 0, "stop": list(request.stop)}
    return {
        "sampling_parameters": json.dumps(sampling),
        "exclude_input_in_output": True,  # the answer alone, as the OpenAI API returns it
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }


def ask_openai(url: str, model: str, request: Request = REQUEST, *, timeout_s: float = 120.0):
    """``request`` through the ``openai`` client to the OpenAI server at ``url`` (``host:port``):
    ``{"answer", "finish_reason", "prompt_tokens", "answer_tokens"}``. Raises the client's error."""
    import openai  # noqa: PLC0415 (the client and pydantic load only when a comparison asks)

    api = openai.OpenAI(
        base_url=f"http://{client.server_address(url)}/v1",
        api_key=API_KEY,
        timeout=timeout_s,
        max_retries=0,  # one request: a failure is reported, not retried
    )
    with api:
        completion = api.completions.create(**openai_arguments(request, model))
    choice = completion.choices[0]
    usage = completion.usage
    return {
        "answer": choice.text,
        "finish_reason": choice.finish_reason,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "answer_tokens": usage.completion_tokens if usage else None,
    }


def ask_triton(url: str, model: str, request: Request = REQUEST, *, timeout_s: float = 120.0):
    """``request`` to Triton's ``/v2/models/<model>/generate`` at ``url``: the same keys as
    :func:`ask_openai`. Raises :class:`~labkit.errors.InferenceError` with the server's reason, or
    when the model's answer lacks an output the request asked for."""
    raw = client.generate(
        url, model, request.prompt, timeout_s=timeout_s, **generate_body(request)
    ).raw
    missing = [
        k for k in ("finish_reason", "num_input_tokens", "num_output_tokens") if k not in raw
    ]
    if missing:
        raise InferenceError(
            f"model {model!r} answered without {', '.join(missing)}: it does not speak the "
            f"contract of Triton's LLM clients (its outputs: {', '.join(sorted(raw))})"
        )
    return {
        "answer": raw["text_output"],
        "finish_reason": raw["finish_reason"],
        "prompt_tokens": raw["num_input_tokens"],
        "answer_tokens": raw["num_output_tokens"],
    }


@dataclass
class Answer:
    """What one way answered (``error`` set instead when it failed), and its round trip."""

    way: str  # a key of APIS
    answer: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    answer_tokens: int | None = None
    seconds: float | None = None
    error: str | None = None


def ask_both(
    standalone_url: str | None,
    standalone_model: str,
    triton_url: str | None,
    triton_model: str,
    request: Request = REQUEST,
    *,
    timeout_s: float = 120.0,
) -> list[dict]:
    """``request`` to vLLM's own server with the ``openai`` client, then to the model in Triton
    with ``/generate``; a way whose URL is None is left out. One :class:`Answer` each, as a dict
    (a run's JSON keeps it). Never raises: a failed request keeps its error's text."""
    ways = [
        ("vllm-standalone", ask_openai, standalone_url, standalone_model),
        ("vllm", ask_triton, triton_url, triton_model),
    ]
    answers = []
    for way, ask, url, model in ways:
        if url is None:
            continue
        answer = Answer(way)
        started = time.perf_counter()
        try:
            for key, value in ask(url, model, request, timeout_s=timeout_s).items():
                setattr(answer, key, value)
        except Exception as exc:  # noqa: BLE001 (any failure is the way's result: the rounds measured before it stay)
            answer.error = f"{type(exc).__name__} from {url}: {exc}"
        answer.seconds = round(time.perf_counter() - started, 3)
        answers.append(asdict(answer))
    return answers


def problems(answers: list[dict]) -> list[str]:
    """What stops the ways' answers from agreeing, in words: each failed request, then each output
    (text, finish reason, token counts) on which the ways that answered differ. Empty when every
    way answered alike."""
    found = [f"{APIS[a['way']]} failed: {a['error']}" for a in answers if a.get("error")]
    answered = [a for a in answers if not a.get("error")]
    for key, header in COLUMNS.items():
        values = {a["way"]: a.get(key) for a in answered}
        if len(set(map(repr, values.values()))) > 1:
            found.append(
                f"the {header} differ: "
                + "; ".join(f"{v!r} from {APIS[w]}" for w, v in values.items())
            )
    return found


def apis_frame(answers: list[dict]) -> pd.DataFrame:
    """One row per way (how it was asked), its answer (or its error), the finish reason, the
    prompt's and the answer's tokens."""
    rows = []
    for a in answers:
        row = {"way": APIS[a["way"]]}
        row.update({header: a.get(key) for key, header in COLUMNS.items()})
        if a.get("error"):
            row["answer"] = f"failed: {a['error']}"
        rows.append(row)
    return pd.DataFrame(rows, columns=["way", *COLUMNS.values()])
