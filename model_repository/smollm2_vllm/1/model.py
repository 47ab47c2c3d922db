"""Triton Python-backend model: SmolLM2 on vLLM's V1 engine (``AsyncLLM``), decoupled.

The same contract as ``smollm2``: ``text_input``/``text_output``, the request parameters
(max_tokens, temperature, top_k, top_p, repetition_penalty, seed, return_full_text, stream), and
the same checks and error messages (``protocol.py``, linked from ``smollm2/1/``), and beside them
the contract of Triton's vLLM backend and of its OpenAI frontend (``contract.py``): the optional
inputs ``sampling_parameters`` (any vLLM SamplingParams field: stop strings, n, ...), ``stream``,
``exclude_input_in_output`` and ``return_*``, and the outputs they switch on (``finish_reason``,
token counts, logprobs). A request that says ``"stream": true`` gets one response per token
(``/generate_stream``, gRPC streaming), any other one final response (``/generate``). The engine
(``engine.py``) and its settings (``vllm_settings.py``: config.pbtxt parameters) are this
folder's own.

The model runs in ``.venv-vllm`` (vLLM, with numpy < 2 for the stub): labkit writes its path into
the run's copy of config.pbtxt as ``EXECUTION_ENV_PATH``; ``make install`` creates it.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from types import SimpleNamespace

import triton_python_backend_utils as pb_utils
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from .contract import ContractReader, failure
from .decoupled import FINAL
from .loading import context_length, end_of_sequence_ids, resolve_source
from .protocol import (
    ConfigError,
    RequestError,
    RequestReader,
    completion,
    error_response,
    read_options,
)
from .vllm_settings import (
    device_environment,
    engine_environment,
    instance_environment,
    read_adapters,
    read_engine_options,
)


class TritonPythonModel:
    """What Triton calls: ``initialize`` once, ``execute`` for each batch of requests."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.name = config.get("name", args.get("model_name", "model"))
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ConfigError(
                f"model {self.name!r}: the vLLM engine answers after execute has returned; add "
                "model_transaction_policy { decoupled: true } to config.pbtxt"
            )
        options = read_options(config)
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        try:
            engine_options = read_engine_options(params)
            adapters = read_adapters(engine_options, args["model_repository"])
        except ValueError as exc:
            raise ConfigError(f"model {self.name!r}: {exc}") from None
        try:
            pinned = instance_environment(
                engine_options, args, os.environ.get("CUDA_VISIBLE_DEVICES")
            )
        except ValueError as exc:
            raise ConfigError(f"model {self.name!r}: {exc}") from None
        os.environ.update(engine_environment(engine_options))
        os.environ.update(device_environment(params))
        os.environ.update(pinned)  # one engine per GPU instance, on its own GPU
        # vLLM reads some of its variables when it is imported (vllm.envs), so the engine module,
        # which imports vLLM, comes in only now that the environment holds them.
        from .engine import REFUSALS, SAMPLING_FIELDS, VllmEngine, sampling_params
        from .metrics import EngineMetrics

        weights, _ = resolve_source(options.huggingface_model, Path(args["model_repository"]))
        self.tokenizer = AutoTokenizer.from_pretrained(weights)
        # smollm2's own readings of the context and the end tokens, from the same files
        described = SimpleNamespace(
            config=AutoConfig.from_pretrained(weights),
            generation_config=GenerationConfig.from_pretrained(weights),
        )
        context = engine_options.max_model_len or context_length(described, self.tokenizer)
        self.reader = ContractReader(
            RequestReader(self.tokenizer, options.defaults, options.full_text, context),
            SAMPLING_FIELDS,
            sampling_params,
            context,
            REFUSALS,
            [adapter.name for adapter in adapters],
        )
        self.engine = VllmEngine(
            self.name,
            engine_options,
            weights,
            decode=functools.partial(completion, self.tokenizer),
            decode_ids=functools.partial(self.tokenizer.decode, skip_special_tokens=True),
            eos_ids=end_of_sequence_ids(described, self.tokenizer),
            metrics=EngineMetrics(self.name),
            adapters=adapters,
        )
        seconds = self.engine.start(self.tokenizer("Hello")["input_ids"])
        pb_utils.Logger.log_info(
            f"{self.name}: vLLM engine started in {seconds:.1f} s: {weights}, {engine_options}, "
            f"context {context}, defaults {options.defaults}, LoRA adapters "
            f"{[adapter.name for adapter in adapters] or 'none'}"
        )

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompts = self.reader.read(request)
            except RequestError as exc:
                sender.send(error_response(str(exc)), flags=FINAL)
                continue
            except Exception as exc:  # noqa: BLE001 (a fault of the model: this request's alone)
                said = failure(exc, ())
                pb_utils.Logger.log_error(f"{self.name}: {said.message}:\n{said.trace}")
                sender.send(
                    error_response(said.message, pb_utils.TritonError.INTERNAL), flags=FINAL
                )
                continue
            self.engine.submit(sender, prompts)
        return None

    def finalize(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.stop()
            self.engine = None
