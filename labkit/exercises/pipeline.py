"""Notebook 08's exercise: wire a two-step ensemble and load it live.

``08-ensemble``: the learner writes the ``config.pbtxt`` of a new ensemble, ``my_pipeline``, from
the repository's two steps (``minilm_tokenize``, then ``minilm_encode``), with an interface of its
own: its input is called ``text`` and its output ``vector``. So the learner must tell the two
sides of each map apart: an ``input_map``/``output_map`` key is the step's own tensor name,
its value a name inside the ensemble.

The check writes the text into the run's repository as ``my_pipeline/config.pbtxt`` (with its
version folder), loads it on the running server, reads the config Triton reports (platform
``ensemble``, the two steps in order, the input and output names), then embeds the notebook's
passage with it and with the single model ``minilm``: the vectors must agree within the 1e-5 the
notebook holds the lab's own ensemble to. When Triton refuses the config, the check quotes the
reason from the server's log (the load API only says "failed to poll from model repository").
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from labkit import pipeline
from labkit.errors import ConfigError, ServerError
from labkit.exercises.check import Check, Exercise, failed, passed, register
from labkit.repository import parse_config, write_config

if TYPE_CHECKING:
    from labkit.repository import Repository
    from labkit.server import TritonServer

KEY = "08-ensemble"
TITLE = "Wire a two-step ensemble"
NAME = "my_pipeline"
INPUT, OUTPUT = "text", "vector"
STEPS = ("minilm_tokenize", "minilm_encode")
SINGLE = "minilm"
#: The largest difference allowed between the ensemble's vector and the single model's (08's).
TOLERANCE = 1e-5
TODO = (
    f"write the config.pbtxt text of an ensemble named {NAME!r}: input {INPUT!r}, output "
    f"{OUTPUT!r}, two steps ({STEPS[0]} then {STEPS[1]}) wired with input_map and output_map."
)

#: The reference answer, as a learner writes it.
REFERENCE = f"""\
name: "{NAME}"
platform: "ensemble"
max_batch_size: 32
input {{ name: "{INPUT}" data_type: TYPE_STRING dims: [1] }}
output {{ name: "{OUTPUT}" data_type: TYPE_FP32 dims: [384] }}
ensemble_scheduling {{
  step {{
    model_name: "{STEPS[0]}"
    model_version: -1
    input_map {{ key: "text_input" value: "{INPUT}" }}
    output_map {{ key: "input_ids" value: "ids" }}
    output_map {{ key: "attention_mask" value: "mask" }}
  }}
  step {{
    model_name: "{STEPS[1]}"
    model_version: -1
    input_map {{ key: "input_ids" value: "ids" }}
    input_map {{ key: "attention_mask" value: "mask" }}
    output_map {{ key: "embedding" value: "{OUTPUT}" }}
  }}
}}
"""

MAP_HINT = (
    "in each input_map and output_map the key is the step's own tensor name (as the step's "
    "config names it: text_input, input_ids, attention_mask, embedding) and the value a name "
    f"inside the ensemble: the ensemble's {INPUT!r}, {OUTPUT!r}, or a name you choose that one "
    "step's output_map writes and the next step's input_map reads."
)


def load_refusal(log_tail: str, name: str = NAME) -> str | None:
    """Triton's reason for refusing ``name``, from its log ("Poll failed for model directory
    '<name>': <reason>"), the last one logged; None when the log gives none."""
    found = re.findall(
        rf"Poll failed for model directory '{re.escape(name)}': (.+?)\"?$", log_tail, re.M
    )
    return found[-1] if found else None


def judge_refused(reason: str) -> Check:
    """The outcome when Triton would not load the learner's ensemble, for Triton's ``reason``."""
    hint = MAP_HINT
    if "inconsistent data type" in reason:
        hint = (
            "a tensor is used where one of another type is expected: the tokenizer's ids and "
            f"mask are INT64, the encoder's embedding (your {OUTPUT!r}) FP32. Is every step "
            "there, and does each map name the right tensor? " + MAP_HINT
        )
    return failed(
        TITLE, f"Triton refused to load {NAME}: {reason}.", f"{NAME} loaded, READY.", hint
    )


def refusal_reason(error: str, log_tail: str) -> str:
    """Triton's reason for refusing the model: the load API's own message, or where that says
    only "failed to poll from model repository", the latest reason the server's log gives."""
    reason = (load_refusal(log_tail) if "failed to poll" in error else None) or error
    return re.sub(r"^Triton could not load model '[^']*': ", "", reason.strip()).rstrip(" .\n")


def judge_served(served: dict) -> Check | None:
    """The failed outcome when the config Triton reports for the learner's model is not the
    ensemble asked for; None when it is, and the answers may decide."""
    steps = [
        step.get("model_name") for step in served.get("ensemble_scheduling", {}).get("step", [])
    ]
    inputs = [tensor.get("name") for tensor in served.get("input", [])]
    outputs = [tensor.get("name") for tensor in served.get("output", [])]
    seen = (
        f"Triton serves {NAME} with platform {served.get('platform') or served.get('backend')!r}, "
        f"steps {steps}, inputs {inputs}, outputs {outputs}."
    )
    if served.get("platform") != "ensemble":
        return failed(
            TITLE,
            seen,
            'platform: "ensemble"',
            'an ensemble has no backend and no code: it says platform: "ensemble".',
        )
    if tuple(steps) != STEPS:
        return failed(
            TITLE,
            seen,
            f"two steps: {STEPS[0]}, then {STEPS[1]}.",
            "the tokenizer's ids and mask are the encoder's inputs: one step each, in that order.",
        )
    if inputs != [INPUT] or outputs != [OUTPUT]:
        return failed(
            TITLE,
            seen,
            f"one input {INPUT!r} and one output {OUTPUT!r}: the names the client uses.",
            "rename the ensemble's input and output, and use the new names as the VALUES of the "
            "first step's input_map and the last step's output_map (the keys stay the steps' own).",
        )
    return None


def judge_answers(max_abs_diff: float) -> Check:
    """The outcome from the largest difference between the two vectors of the passage."""
    apart = "0 (the same float32 numbers)" if max_abs_diff == 0 else f"{max_abs_diff:.1e}"
    seen = f"{NAME} and {SINGLE} embed the passage {apart} apart at most"
    if max_abs_diff <= TOLERANCE:
        return passed(
            TITLE,
            f"Triton loaded {NAME}, an ensemble of {STEPS[0]} then {STEPS[1]} with input "
            f"{INPUT!r} and output {OUTPUT!r}; {seen} (within 1e-5).",
        )
    return failed(
        TITLE,
        f"{seen}.",
        "at most 1e-5: the same tokenizer, weights and pooling.",
        "check that the encoder's input_ids gets the tokenizer's input_ids and its "
        "attention_mask the tokenizer's attention_mask, not the other way round.",
    )


def _write(repository: Repository, text: str) -> None:
    cfg = parse_config(text, source=f"{NAME}'s config")
    cfg.name = cfg.name or NAME
    if cfg.name != NAME:
        raise ValueError(f'the config says name: "{cfg.name}"; name it "{NAME}"')
    folder = repository.path / NAME
    (folder / "1").mkdir(parents=True, exist_ok=True)  # an ensemble's version folder is empty
    write_config(folder / "config.pbtxt", cfg)


def _embed(server: TritonServer, model: str, input_name: str, output_name: str, text: str):
    import numpy as np  # noqa: PLC0415 (only the check sends requests)
    import tritonclient.http as httpclient  # noqa: PLC0415

    tensor = httpclient.InferInput(input_name, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
    with server.client() as client:
        return client.infer(model, [tensor]).as_numpy(output_name)


def check(answer: Any, *, server: TritonServer, repository: Repository, **_: Any) -> Check:
    """Write the learner's config as ``my_pipeline``, load it live, read it back, compare."""
    if not isinstance(answer, str):
        return failed(
            TITLE,
            f"MY_ENSEMBLE is a {type(answer).__name__}.",
            "the config.pbtxt text, as a string (a triple-quoted one).",
            'write it between """ and """, as the config file itself.',
        )
    try:
        _write(repository, answer)
    except (ConfigError, ValueError) as exc:
        return failed(
            TITLE,
            f"the text is not a config Triton can read: {exc}",
            "a config.pbtxt in protobuf text format, as minilm_pipeline's above.",
            "compare its braces, quotes and field names with minilm_pipeline's config.",
        )
    try:
        server.load_model(NAME)
    except ServerError as exc:
        return judge_refused(refusal_reason(str(exc), server.log_tail(200)))
    with server.client() as client:
        served = client.get_model_config(NAME)
    wrong = judge_served(served)
    if wrong is not None:
        return wrong
    mine = _embed(server, NAME, INPUT, OUTPUT, pipeline.PASSAGE)
    single = _embed(server, SINGLE, "text_input", "embedding", pipeline.PASSAGE)
    return judge_answers(float(abs(mine - single).max()))


def solution(**_: Any) -> str:
    return REFERENCE


register(Exercise(KEY, TITLE, TODO, check, solution))
