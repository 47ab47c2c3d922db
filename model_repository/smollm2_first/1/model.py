"""Your first Triton model: a Hugging Face language model served by Triton's Python backend.

Triton calls three methods, and this file reads top to bottom in their order: ``initialize``
loads the tokenizer and the model once, ``execute`` answers the requests that arrive (tokenize,
generate, respond), ``finalize`` lets the model go when Triton unloads it. ``config.pbtxt``
names the weights in its ``huggingface_model`` parameter: a folder beside it (``weights``) or a
Hugging Face Hub id such as ``tiiuae/falcon-7b``. The lab's full model (``smollm2``) is built on
the same three methods and adds batching, streaming and in-flight batching.
"""

import json
import os
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModelForCausalLM, AutoTokenizer


class TritonPythonModel:
    def initialize(self, args):
        """Load the tokenizer and the model that config.pbtxt names, once per model instance."""
        config = json.loads(args["model_config"])
        settings = {key: value["string_value"] for key, value in config["parameters"].items()}
        self.max_tokens = int(settings.get("max_tokens", "16"))  # when a request names none
        self.max_tokens_limit = int(settings.get("max_tokens_limit", "512"))  # the most it may
        source = settings["huggingface_model"]
        if (Path(args["model_repository"]) / source).is_dir():  # a folder beside config.pbtxt
            source = str(Path(args["model_repository"]) / source)
        token = os.environ.get("HF_TOKEN") or os.environ.get("PRIVATE_REPO_TOKEN")
        if settings.get("gated") == "true" and not token:
            raise RuntimeError(
                f"{source} is gated on the Hugging Face Hub and no token is set: accept its "
                "license on huggingface.co, then set HF_TOKEN in the server's environment"
            )
        on_gpu = args["model_instance_kind"] == "GPU" and torch.cuda.is_available()
        self.device = f"cuda:{args['model_instance_device_id']}" if on_gpu else "cpu"
        dtype = torch.float16 if on_gpu else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(source, token=token)
        self.model = AutoModelForCausalLM.from_pretrained(source, token=token, dtype=dtype)
        self.model.to(self.device).eval()
        self.context = self.model.config.max_position_embeddings  # prompt + answer, in tokens
        pb_utils.Logger.log_info(f"{config['name']}: loaded {source} on {self.device}")

    def execute(self, requests):
        """One response per request, holding one answer per prompt of that request."""
        responses = []
        for request in requests:
            prompts = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            try:
                max_tokens = self.max_tokens_of(request)
                answers = [self.generate(prompt_text(p), max_tokens) for p in prompts.flat]
            except Exception as error:  # noqa: BLE001 (this request fails alone; the others go on)
                bad = isinstance(error, ValueError)  # a bad request: HTTP 400; else a fault: 500
                message = str(error) if bad else f"{type(error).__name__}: {error}"
                code = pb_utils.TritonError.INVALID_ARG if bad else pb_utils.TritonError.INTERNAL
                refusal = pb_utils.TritonError(message, code)
                responses.append(pb_utils.InferenceResponse(error=refusal))
                continue
            output = np.array(answers, dtype=np.object_).reshape(prompts.shape)
            tensor = pb_utils.Tensor("text_output", output)
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses

    @torch.inference_mode()
    def generate(self, prompt, max_tokens):
        """The prompt and up to ``max_tokens`` new tokens after it, each the likeliest (greedy)."""
        inputs = self.tokenizer(prompt, return_tensors="pt").to(self.device)  # tokenize
        tokens = inputs["input_ids"].shape[-1] + max_tokens  # the prompt and its answer
        if tokens > self.context:
            raise ValueError(
                f"the prompt and max_tokens {max_tokens} are {tokens} tokens, over the model's "
                f"context of {self.context}; shorten the prompt or lower max_tokens"
            )
        output = self.model.generate(
            **inputs,
            max_new_tokens=max_tokens,  # new tokens only: the prompt does not count
            do_sample=False,
            pad_token_id=self.tokenizer.eos_token_id,
        )
        text = self.tokenizer.decode(output[0], skip_special_tokens=True)
        head = self.tokenizer.decode(inputs["input_ids"][0], skip_special_tokens=True)
        return prompt + text[len(head) :]  # the prompt as it was sent, then the new text

    def max_tokens_of(self, request):
        """The request's ``max_tokens``, else config.pbtxt's, at most its ``max_tokens_limit``.
        This model answers greedily: it takes ``temperature`` 0 and refuses any other parameter."""
        asked = json.loads(request.parameters() or "{}")
        if asked.pop("temperature", 0) != 0:
            raise ValueError("this model answers greedily: temperature must be 0 (smollm2 samples)")
        unknown = sorted(set(asked) - {"max_tokens"})
        if unknown:
            raise ValueError(f"unknown parameter(s) {unknown}: this model reads only max_tokens")
        max_tokens = asked.get("max_tokens", self.max_tokens)
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens must be a whole number of at least 1, got {max_tokens!r}")
        if max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"max_tokens {max_tokens} is over this model's max_tokens_limit of "
                f"{self.max_tokens_limit} (config.pbtxt)"
            )
        return max_tokens

    def finalize(self):
        """Let the model's memory go: Triton is unloading it."""
        self.model = None


def prompt_text(item):
    """One prompt of ``text_input`` as text; an empty one is a bad request."""
    prompt = item.decode("utf-8") if isinstance(item, bytes) else str(item)
    if not prompt.strip():
        raise ValueError("a prompt of text_input is empty or only spaces; send some text")
    return prompt
