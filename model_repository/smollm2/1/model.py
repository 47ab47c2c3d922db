"""Triton Python-backend model: text generation with a Hugging Face causal language model.

Triton imports this file as ``1.model`` (the version folder is a package), so its siblings come
in with ``from .``: ``protocol.py`` (config.pbtxt's parameters, requests, responses),
``loading.py`` (the weights), ``decoupled.py`` (a decoupled model's token-by-token responses),
``inflight.py`` and ``engine_settings.py`` (in-flight batching). They import only the standard
library, numpy, torch, transformers and ``triton_python_backend_utils``, so the folder also runs
in an NGC ``tritonserver`` container, where labkit is not installed.
"""

from __future__ import annotations

import functools
import gc
import json

import torch
import triton_python_backend_utils as pb_utils
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from .decoupled import FINAL, PieceStreamer, end_streams, read_decoupled
from .engine_settings import instance_count, thread_budget
from .loading import load
from .protocol import (
    Member,
    Options,
    Prompts,
    RequestReader,
    Settings,
    answer,
    completion,
    error_response,
    group_by_settings,
    read_options,
)


class TritonPythonModel:
    """What Triton calls: ``initialize`` once per instance, ``execute`` for each batch."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.name = config.get("name", args.get("model_name", "model"))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        options = read_options(config)
        loaded = load(options, args)
        self.tokenizer, self.model, self.device = loaded.tokenizer, loaded.model, loaded.device
        self.eos_ids = loaded.eos_ids
        self.decode_ids = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        # num_threads, else this instance's share of the cores (see thread_budget)
        threads = options.num_threads or thread_budget(
            instance_count(config), inflight=bool(options.inflight)
        )
        torch.set_num_threads(threads)
        self.reader = RequestReader(
            self.tokenizer, options.defaults, options.full_text, loaded.context
        )
        self.engine = self._start_engine(options) if options.inflight else None
        mode = "in-flight batching" if self.engine else "streaming" if self.decoupled else ""
        pb_utils.Logger.log_info(
            f"{self.name}: loaded {loaded.source} on {self.device} as {loaded.dtype}, context "
            f"{loaded.context}, {threads} torch thread(s), defaults {options.defaults}, "
            f"{mode or 'not streaming'}" + (f", {options.inflight}" if self.engine else "")
        )

    def execute(self, requests: list) -> list | None:
        if self.engine is not None:  # in-flight batching: the engine answers each request
            senders, groups = read_decoupled(requests, self.reader.read)
            for members in groups.values():
                for member in members:
                    self.engine.submit(senders[member.index], member.prompts)
            return None
        if self.decoupled:  # each request's responses go out through its own sender
            senders, groups = read_decoupled(requests, self.reader.read)
            for settings, members in groups.items():
                self._stream([senders[member.index] for member in members], members, settings)
            return None
        return self._answer_batch(requests)

    def _answer_batch(self, requests: list) -> list:
        """One response per request; each group of equal sampling settings is one ``generate``
        call (to the group's longest ``max_tokens``, each answer cut at its own)."""
        responses = [None] * len(requests)

        def refuse(index: int, message: str) -> None:
            responses[index] = error_response(message)

        for settings, members in group_by_settings(requests, self.reader.read, refuse).items():
            try:
                completions = self.generate_ids(token_ids(members), settings, row_limits(members))
            except Exception as exc:  # noqa: BLE001 (one bad batch must not stop the model)
                pb_utils.Logger.log_error(f"{self.name}: generate failed: {exc!r}")
                for member in members:
                    responses[member.index] = error_response(
                        f"generation failed: {exc}", pb_utils.TritonError.INTERNAL
                    )
                continue
            start = 0
            for member in members:
                stop = start + len(member.prompts.texts)
                responses[member.index] = answer(member.prompts, completions[start:stop])
                start = stop
        return responses

    def _stream(self, senders: list, members: list[Member], settings: Settings, model=None) -> None:
        """One ``generate`` for ``members``, each new token sent to its request as it comes."""
        prompts = [member.prompts for member in members]
        streamer = PieceStreamer(senders, prompts, self.completion, self.decode_ids, self.eos_ids)
        try:
            limits = row_limits(members)
            self.generate_ids(token_ids(members), settings, limits, streamer, model=model)
            streamer.finish()
        except Exception as exc:  # noqa: BLE001 (one bad batch must not stop the model)
            unfinished = [s.sender for s in streamer.streams if not s.finished]
            end_streams(unfinished, exc, self.name)

    @torch.inference_mode()
    def generate_ids(
        self,
        ids: list[list[int]],
        settings: Settings,
        limits: list[int] | None = None,
        streamer: BaseStreamer | None = None,
        model=None,
    ) -> list[str]:
        """Generate for all token sequences at once (left-padded: a prompt's greedy answer in a
        batch equals its answer alone), to ``settings.max_tokens``; return each one's new text,
        cut at its own limit in ``limits`` when given. A ``streamer`` gets each new token as it
        is made. ``model`` (default: this instance's) is the in-flight engine's side-lane twin."""
        batch = self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        config = GenerationConfig(
            max_new_tokens=settings.max_tokens,
            do_sample=settings.do_sample,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=sorted(self.eos_ids) or None,
            repetition_penalty=settings.repetition_penalty,
        )
        if settings.do_sample:
            config.temperature = settings.temperature
            config.top_k = settings.top_k or None
            config.top_p = settings.top_p
            if settings.seed is not None:
                torch.manual_seed(settings.seed)
        model = self.model if model is None else model
        output = model.generate(**batch, generation_config=config, streamer=streamer)
        width = batch["input_ids"].shape[1]
        texts = []
        for row, (seq, prompt) in enumerate(zip(output, ids, strict=True)):
            new = seq[width:].tolist()[: limits[row] if limits else None]
            for i, token in enumerate(new):
                if token in self.eos_ids:
                    new = new[:i]
                    break
            texts.append(self.completion(prompt, new))
        return texts

    def completion(self, prompt: list[int], new: list[int]) -> str:
        """The text ``new`` adds after ``prompt`` (:func:`protocol.completion`, this tokenizer)."""
        return completion(self.tokenizer, prompt, new)

    def finalize(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.stop()
        self.engine = None  # it holds this model (its side lane's run_alone): a cycle
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        # Triton's stub frees its shared memory before Python's last garbage collection; an
        # object that owns some (a response sender, a request's tensors) freed by that
        # collection crashes the stub (README, Known issues). Free such garbage now, and keep what is
        # still alive (this model, dropped next) out of that last collection.
        gc.collect()
        gc.freeze()

    # -- in-flight batching (inflight_batching: "true") -------------------------------------------
    def _start_engine(self, options: Options):
        # Imported here, only when the config asks for it: inflight.py needs transformers'
        # continuous-batching engine (transformers 5), which the other modes do without.
        from .inflight import InflightEngine

        engine = InflightEngine(
            self.model,
            self.tokenizer,
            limits=options.inflight,
            eos_ids=self.eos_ids,
            max_tokens=options.defaults.max_tokens,
            decode=self.completion,
            decode_ids=self.decode_ids,
            run_alone=self._answer_alone,
            name=self.name,
        )
        engine.start(self.tokenizer("Hello")["input_ids"])
        return engine

    def _answer_alone(self, sender, prompts: Prompts, model) -> None:
        """One request through ``generate`` on ``model``, streamed if it asked: the engine's
        side lane for requests that sample or set a repetition penalty (see ``inflight.py``)."""
        if prompts.stream:
            self._stream([sender], [Member(index=0, prompts=prompts)], prompts.settings, model)
            return
        try:
            completions = self.generate_ids(prompts.ids, prompts.settings, model=model)
        except Exception as exc:  # noqa: BLE001 (one bad request must not stop the model)
            end_streams([sender], exc, self.name)
            return
        sender.send(answer(prompts, completions), flags=FINAL)


def token_ids(members: list[Member]) -> list[list[int]]:
    """The token ids of every prompt of ``members``, in order: one ``generate`` batch."""
    return [seq for member in members for seq in member.prompts.ids]


def row_limits(members: list[Member]) -> list[int]:
    """Each prompt's own ``max_tokens``, in the order of :func:`token_ids`."""
    return [m.prompts.settings.max_tokens for m in members for _ in m.prompts.ids]
