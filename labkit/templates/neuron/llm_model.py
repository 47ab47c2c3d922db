"""Triton Python-backend model: a causal LM compiled for inf2/trn1 with optimum-neuron.

Same contract as the lab's GPU model: ``text_input`` (TYPE_STRING) in, ``text_output``
(TYPE_STRING, the generated continuation only) out, one response per request; an optional
``max_new_tokens`` (INT32) per request. Settings come from config.pbtxt's parameters, written by
``labkit.neuron_llm.generate_llm_model``: MODEL, COMPILED_MODEL, TP_DEGREE, BATCH_SIZE,
SEQUENCE_LENGTH, PRECISION, MAX_NEW_TOKENS, NEURON_CORE_START.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

PRECISIONS = ("bf16", "fp16", "fp32")
INTEGERS = ("TP_DEGREE", "BATCH_SIZE", "SEQUENCE_LENGTH", "MAX_NEW_TOKENS", "NEURON_CORE_START")
DEFAULTS = {
    "TP_DEGREE": "2",
    "BATCH_SIZE": "4",
    "SEQUENCE_LENGTH": "2048",
    "PRECISION": "bf16",
    "MAX_NEW_TOKENS": "128",
    "NEURON_CORE_START": "0",
    "COMPILED_MODEL": "",
}


def settings(params):
    """config.pbtxt parameters (name -> string) -> checked settings; errors name the fix."""
    values = {**DEFAULTS, **params}
    if not values.get("MODEL"):
        raise ValueError("parameter MODEL is missing: give a Hugging Face id or checkpoint folder")
    out = {"MODEL": values["MODEL"], "COMPILED_MODEL": values["COMPILED_MODEL"] or None}
    for key in INTEGERS:
        try:
            out[key] = int(values[key])
        except ValueError:
            raise ValueError(f"parameter {key} must be an integer, got {values[key]!r}") from None
        if out[key] < (0 if key == "NEURON_CORE_START" else 1):
            raise ValueError(f"parameter {key} is out of range: {out[key]}")
    if values["PRECISION"] not in PRECISIONS:
        raise ValueError(f"parameter PRECISION {values['PRECISION']!r} is not one of {PRECISIONS}")
    out["PRECISION"] = values["PRECISION"]
    if out["MAX_NEW_TOKENS"] >= out["SEQUENCE_LENGTH"]:
        raise ValueError("MAX_NEW_TOKENS must be below SEQUENCE_LENGTH (the prompt needs room)")
    first = out["NEURON_CORE_START"]
    last = first + out["TP_DEGREE"] - 1
    out["VISIBLE_CORES"] = str(first) if first == last else f"{first}-{last}"
    return out


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        try:
            self.settings = s = settings(params)
        except ValueError as exc:
            raise pb_utils.TritonModelException(str(exc)) from None
        os.environ["NEURON_RT_VISIBLE_CORES"] = s["VISIBLE_CORES"]
        from optimum.neuron import NeuronModelForCausalLM
        from transformers import AutoTokenizer

        compiled = s["COMPILED_MODEL"]
        if compiled and not os.path.isabs(compiled):
            compiled = os.path.join(args["model_repository"], compiled)
        if compiled:
            self.model = NeuronModelForCausalLM.from_pretrained(compiled)
        else:  # compile now (minutes); export once with labkit.neuron_llm.export_llm instead
            self.model = NeuronModelForCausalLM.from_pretrained(
                s["MODEL"],
                export=True,
                batch_size=s["BATCH_SIZE"],
                sequence_length=s["SEQUENCE_LENGTH"],
                num_cores=s["TP_DEGREE"],
                auto_cast_type=s["PRECISION"],
            )
        source = (
            compiled
            if compiled and os.path.exists(os.path.join(compiled, "tokenizer_config.json"))
            else s["MODEL"]
        )
        self.tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        pb_utils.Logger.log_info(
            f"{args['model_instance_name']}: {s['MODEL']} on NeuronCores {s['VISIBLE_CORES']}, "
            f"tp {s['TP_DEGREE']}, batch {s['BATCH_SIZE']}, seq {s['SEQUENCE_LENGTH']}, {s['PRECISION']}"
        )

    def prompts(self, request):
        raw = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)
        limit = pb_utils.get_input_tensor_by_name(request, "max_new_tokens")
        wanted = (
            int(limit.as_numpy().reshape(-1)[0])
            if limit is not None
            else self.settings["MAX_NEW_TOKENS"]
        )
        texts = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in raw]
        return texts, max(1, min(wanted, self.settings["MAX_NEW_TOKENS"]))

    def generate(self, texts, max_new_tokens):
        """Run ``texts`` in groups of the compiled batch size; returns the continuations."""
        import torch

        batch = self.settings["BATCH_SIZE"]
        room = self.settings["SEQUENCE_LENGTH"] - max_new_tokens
        answers = []
        for start in range(0, len(texts), batch):
            group = texts[start : start + batch]
            padded = group + [group[0]] * (batch - len(group))  # the compiled batch is fixed
            enc = self.tokenizer(
                padded, return_tensors="pt", padding=True, truncation=True, max_length=room
            )
            with torch.no_grad():
                out = self.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
            new = out[:, enc["input_ids"].shape[1] :]
            answers += self.tokenizer.batch_decode(new[: len(group)], skip_special_tokens=True)
        return answers

    def execute(self, requests):
        parsed = [self.prompts(r) for r in requests]
        # One generate() for all requests that share a token budget.
        results = [None] * len(requests)
        for budget in sorted({b for _, b in parsed}):
            owners = [i for i, (_, b) in enumerate(parsed) if b == budget]
            texts = [t for i in owners for t in parsed[i][0]]
            try:
                answers = iter(self.generate(texts, budget))
            except Exception as exc:  # noqa: BLE001 (the error goes to these requests' clients)
                for i in owners:
                    results[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
                continue
            for i in owners:
                mine = np.array(
                    [[next(answers).encode("utf-8")] for _ in parsed[i][0]], dtype=object
                )
                results[i] = pb_utils.InferenceResponse([pb_utils.Tensor("text_output", mine)])
        return results

    def finalize(self):
        self.model = None
