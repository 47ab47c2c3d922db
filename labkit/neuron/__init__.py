"""AWS Inferentia and Trainium (the hardware itself is found by :func:`labkit.hardware.detect_neuron`).

- :mod:`.compiler`: trace a model for inf1 / inf2 / trn1 or the ``cpu`` target, with a cache;
- :mod:`.gen`: generate a Triton model folder, as python_backend's ``gen_triton_model.py`` does;
- :mod:`.vllm`: the LLM on vLLM with AWS's vLLM Neuron plugin (config, engine arguments, setup);
- :mod:`.walkthrough`: notebook 05's flow (compile, generate, serve, compare, profile).
"""

from labkit.hardware import NeuronHardware, detect_neuron

from .compiler import TARGETS, CompiledModel, cache_key, compile, load  # noqa: A004 (labkit.neuron.compile is the verb users expect)
from .gen import GeneratedModel, GenOptions, TensorSpec, generate_model

__all__ = [
    "TARGETS",
    "CompiledModel",
    "GenOptions",
    "GeneratedModel",
    "NeuronHardware",
    "TensorSpec",
    "cache_key",
    "compile",
    "detect_neuron",
    "generate_model",
    "load",
]
