"""Memory estimates (parameters x bytes + headroom) and the plan that keeps, replaces or refuses."""

from __future__ import annotations

import logging
import math

import psutil
import pytest

from labkit import capacity, embedding, hardware, repository
from labkit.errors import ConfigError
from labkit.hardware import GIB, Memory

#: A local checkpoint's estimate must be within this of its independently counted weight bytes.
MARGIN = 0.01


@pytest.fixture(scope="module")
def smollm2_folder():
    return repository.build_weights("smollm2")  # cached after the first build (about 20 s)


def beyond_this_host(tmp_path, catalog_name: str) -> str:
    """A folder of ``catalog_name`` with enough instances that its float32 weights alone exceed
    this host's total memory: certain not to fit, whatever is free when the plan reads it."""
    weights = repository.CATALOG[catalog_name].parameters_b * 1e9 * 4
    instances = int(psutil.virtual_memory().total // weights) + 1
    repository.add_model(tmp_path, catalog_name, instance_count=instances)
    return catalog_name


@pytest.mark.slow
def test_smollm2_estimate_is_its_real_parameter_count_times_four_bytes(smollm2_folder):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32)
    loaded = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    in_memory = sum(p.numel() * p.element_size() for p in model.parameters())
    del model

    est = capacity.estimate("smollm2", device="cpu")
    assert est.source == f"checkpoint {smollm2_folder}"
    assert est.parameters == loaded
    assert (est.dtype, est.bytes_per_parameter) == ("float32", 4)
    assert est.weights_bytes == pytest.approx(in_memory, rel=MARGIN)
    file_bytes = (smollm2_folder / "model.safetensors").stat().st_size
    assert est.weights_bytes == pytest.approx(file_bytes, rel=MARGIN)
    assert est.parameters == pytest.approx(
        repository.CATALOG["smollm2"].parameters_b * 1e9, rel=MARGIN
    )
    expected = est.weights_bytes * 1.2 + capacity.RUNTIME_OVERHEAD_BYTES["cpu"]
    assert est.needed_bytes == int(expected)


@pytest.mark.slow
def test_gpu_estimate_loads_text_generators_in_float16(smollm2_folder):
    cpu = capacity.estimate("smollm2", device="cpu")
    gpu = capacity.estimate("smollm2", device="gpu")
    assert (gpu.dtype, gpu.bytes_per_parameter) == ("float16", 2)
    assert gpu.parameters == cpu.parameters
    assert gpu.weights_bytes * 2 == cpu.weights_bytes


def test_embedding_model_is_counted_from_its_package_files():
    from transformers import AutoModel

    est = capacity.estimate("minilm", device="gpu")
    model = AutoModel.from_pretrained(embedding.model_folder())
    assert est.kind == capacity.EMBEDDING
    assert est.parameters == sum(p.numel() for p in model.parameters())
    assert (est.dtype, est.bytes_per_parameter) == ("float32", 4)  # the template keeps float32


def test_instances_and_a_dtype_parameter_change_the_estimate(tmp_path):
    repository.add_model(tmp_path, "tiny-falcon", "twice", instance_count=2, dtype="bfloat16")
    repository.prepare_repository(tmp_path)
    est = capacity.estimate("twice", device="cpu", repository=tmp_path, runtime_bytes=1000)
    one = capacity.estimate("tiny-falcon", device="cpu", runtime_bytes=1000)
    assert est.parameters == one.parameters > 3_000_000
    assert (est.dtype, est.bytes_per_parameter, est.instances) == ("bfloat16", 2, 2)
    assert est.needed_bytes == int(2 * (est.parameters * 2 * 1.2 + 1000))


def test_hub_models_use_the_catalog_count():
    est = capacity.estimate("falcon7b", device="gpu")
    assert est.source == "catalog"
    assert est.parameters == 6_920_000_000
    assert est.needed_bytes / GIB == pytest.approx(6.92e9 * 2 * 1.2 / GIB + 1.0, rel=1e-3)


def test_pytorch_bin_checkpoints_count_shared_tensors_once(tmp_path):
    import torch

    shared = torch.zeros(2, 4)
    torch.save(
        {"embed": shared, "lm_head": shared, "other": torch.zeros(3, 4)},
        tmp_path / "pytorch_model.bin",
    )
    counted = capacity.count_checkpoint(tmp_path)
    assert (counted.parameters, counted.stored_dtype) == (8 + 12, "float32")


def test_safetensors_headers_are_read_and_index_buffers_are_not_counted(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    tensors = {"w": np.zeros((3, 4), np.float16), "b": np.zeros(4, np.float16)}
    save_file(tensors | {"position_ids": np.zeros((1, 8), np.int64)}, tmp_path / "a.safetensors")
    save_file({"head": np.zeros((2, 2), np.float32)}, tmp_path / "b.safetensors", {"format": "np"})
    assert capacity.safetensors_header(tmp_path / "b.safetensors") == {
        "head": {"dtype": "F32", "shape": [2, 2]}
    }  # the metadata is not a tensor
    counted = capacity.count_checkpoint(tmp_path)
    assert (counted.parameters, counted.stored_dtype, counted.files) == (12 + 4 + 4, "float16", 2)
    (tmp_path / "c.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match=r"c\.safetensors: not a safetensors file"):
        capacity.count_checkpoint(tmp_path)


def test_a_folder_without_weights_is_named(tmp_path):
    with pytest.raises(ConfigError, match="holds no .*safetensors"):
        capacity.count_checkpoint(tmp_path)


def test_an_unknown_model_is_named():
    with pytest.raises(ConfigError, match="'no-such-model'.*neither a model of"):
        capacity.estimate("no-such-model")


def test_small_models_fit_on_the_host_as_read():
    plan = capacity.plan(["smollm2", "tiny-falcon", "minilm"], device="cpu")
    assert plan.models == ["smollm2", "tiny-falcon", "minilm"]
    assert list(plan.table["decision"]) == ["fits"] * 3
    assert plan.of_kind(capacity.TEXTGEN) == ["smollm2", "tiny-falcon"]
    assert plan.of_kind(capacity.EMBEDDING) == ["minilm"]
    assert plan.messages == []


def test_a_model_that_does_not_fit_is_replaced_by_the_fallback_with_a_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="labkit.capacity")
    big = beyond_this_host(tmp_path, "falcon7b")
    plan = capacity.plan([big, "smollm2"], device="cpu", repository=tmp_path)
    assert plan.models == ["opt125m", "smollm2"]
    est = capacity.estimate(big, device="cpu", repository=tmp_path)
    [message] = plan.messages
    host = plan.memory  # the one reading the plan made of this host
    left = f"{host.available_bytes / GIB:.2f} GiB is left"
    for part in (big, f"~{est.needed_bytes / GIB:.2f} GiB", left, "opt125m", str(host)):
        assert part in message
    assert host.total_bytes == psutil.virtual_memory().total
    assert message in caplog.text
    table = plan.table
    assert table.loc[big, "decision"] == "replaced by opt125m"
    assert table.loc["opt125m", "serve as"] == "opt125m"


def test_a_model_that_does_not_fit_is_refused_without_a_fallback(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="labkit.capacity")
    big = beyond_this_host(tmp_path, "persimmon8b")
    embedding.add_embedding_model(tmp_path, "minilm")
    plan = capacity.plan([big, "minilm"], device="cpu", repository=tmp_path, fallback=None)
    assert plan.models == ["minilm"]
    assert plan.table.loc[big, "decision"] == "refused"
    assert "persimmon8b needs ~" in caplog.text and "not loading it" in caplog.text


def test_models_fill_memory_in_order_and_the_fallback_is_used_once(tmp_path):
    falcon, persimmon = (
        beyond_this_host(tmp_path, "falcon7b"),
        beyond_this_host(tmp_path, "persimmon8b"),
    )
    plan = capacity.plan(["smollm2", falcon, persimmon], device="cpu", repository=tmp_path)
    assert plan.models == ["smollm2", "opt125m"]
    table = plan.table
    assert list(table["decision"]) == [
        "fits",
        "replaced by opt125m",
        "fallback for falcon7b",
        "refused",
    ]
    assert "opt125m is already planned" in plan.messages[-1]
    # what each model found free: the host as read, less what the models before it took
    free = plan.memory.available_bytes
    smollm2 = capacity.estimate("smollm2", device="cpu", repository=tmp_path).needed_bytes
    opt = capacity.estimate("opt125m", device="cpu", repository=tmp_path).needed_bytes
    after = [free, free - smollm2, free - smollm2, free - smollm2 - opt]
    assert list(table["free before (GiB)"]) == [round(b / GIB, 2) for b in after]
    # the message says why less is left than the host has free: the models planned before it
    assert (
        f", less {(smollm2 + opt) / GIB:.2f} GiB for the models planned before it"
        in (plan.messages[-1])
    )


def test_strict_plan_refuses_with_the_model_its_estimate_and_the_host(tmp_path):
    big = beyond_this_host(tmp_path, "persimmon8b")
    total = psutil.virtual_memory().total / GIB
    with pytest.raises(
        ConfigError, match=rf"persimmon8b needs ~\d+\.\d\d GiB.*free of {total:.1f} GiB"
    ):
        capacity.plan([big], device="cpu", repository=tmp_path, strict=True)


def test_a_cpu_only_model_on_a_fake_gpu_is_charged_to_host_memory(monkeypatch):
    # Fake: no GPU here, so the GPU's memory is given; the host's is read as the plan reads it.
    readings = []

    def host_memory_as_read():
        readings.append(hardware.host_memory())
        return readings[-1]

    monkeypatch.setattr(capacity, "host_memory", host_memory_as_read)
    gpu = Memory("gpu", 80 * GIB, 2 * GIB, "GPU 0: a fake test GPU")
    plan = capacity.plan(["minilm", "smollm2"], memory=gpu)  # minilm's config says KIND_CPU
    table = plan.table
    assert table.loc["minilm", "device"] == "cpu" and table.loc["smollm2", "device"] == "gpu"
    assert table.loc["smollm2", "dtype"] == "float16"
    [host] = readings
    assert table.loc["minilm", "free before (GiB)"] == round(host.available_bytes / GIB, 2)
    assert table.loc["smollm2", "free before (GiB)"] == 2.0
    assert plan.models == ["minilm", "smollm2"]


def test_a_model_listed_twice_or_a_string_is_an_error():
    with pytest.raises(ConfigError, match="listed twice"):
        capacity.plan(["minilm", "minilm"], device="cpu")
    with pytest.raises(ConfigError, match="one string"):
        capacity.plan("minilm", device="cpu")
    empty = capacity.plan([], device="cpu")
    assert empty.models == [] and empty.table.empty


def test_the_real_host_is_measured_with_psutil_and_planned_against():
    host = hardware.host_memory()
    assert host.device == "cpu" and host.total_bytes == psutil.virtual_memory().total
    assert 0 < host.available_bytes <= host.total_bytes
    plan = capacity.plan(["tiny-falcon"], device="cpu")
    assert (plan.memory.device, plan.memory.total_bytes) == ("cpu", host.total_bytes)
    free = plan.memory.available_bytes
    assert plan.table.loc["tiny-falcon", "free before (GiB)"] == round(free / GIB, 2)
    assert plan.models == ["tiny-falcon"]  # ~0.5 GiB: fits on any host that runs these tests


def test_nvidia_smi_output_is_parsed_from_a_fake_two_gpu_listing():
    # The fallback where NVML cannot be loaded (tests/test_hardware.py reads NVML). Fake: no GPU
    # here; two lines in nvidia-smi's query format stand in for a two-GPU host.
    text = "0, NVIDIA H200, 143771, 143000\n1, NVIDIA H200, 143771, 100000\n"
    gpus = hardware.parse_nvidia_smi(text)
    assert [g.description for g in gpus] == ["GPU 0: NVIDIA H200", "GPU 1: NVIDIA H200"]
    assert gpus[1].available_bytes == 100000 * 2**20 and gpus[0].total_bytes == 143771 * 2**20
    with pytest.raises(ConfigError, match="unexpected nvidia-smi line"):
        hardware.parse_nvidia_smi("garbage")


def test_without_a_gpu_auto_means_cpu_and_gpu_is_refused():
    if hardware.gpus():
        pytest.skip("this host has a GPU; test_gpu_memory_is_read_from_the_driver covers it")
    assert hardware.resolve_device("auto") == "cpu"
    with pytest.raises(ConfigError, match="the NVIDIA driver reports no GPU here"):
        hardware.device_memory("gpu")
    with pytest.raises(ConfigError, match="'tpu' is not one of"):
        hardware.resolve_device("tpu")


@pytest.mark.gpu
def test_gpu_memory_is_read_from_the_driver(tmp_path):
    gpus = hardware.gpu_memory()
    if not gpus:
        pytest.skip("no NVIDIA GPU here")
    memory = hardware.device_memory("auto")
    assert memory.device == "gpu" and memory.total_bytes > 1 * GIB
    assert memory.description in {g.description for g in gpus}  # the GPU with the least free
    # float16 weights alone beyond the GPU's total memory: certain not to fit
    instances = int(memory.total_bytes // (6.92e9 * 2)) + 1
    repository.add_model(tmp_path, "falcon7b", instance_count=instances)
    plan = capacity.plan(["tiny-falcon", "falcon7b"], device="gpu", repository=tmp_path)
    assert plan.memory.device == "gpu"
    assert plan.models == ["tiny-falcon", "opt125m"]
    assert math.isclose(plan.table.loc["falcon7b", "weights (GiB)"], 6.92e9 * 2 / GIB, rel_tol=1e-3)


@pytest.mark.integration
def test_served_smollm2_holds_its_weights_and_stays_within_its_estimate(tmp_path, start_server):
    from labkit import client, lab

    device = hardware.resolve_device("auto")  # a GPU host serves the text generators on its GPU
    plan = capacity.plan(["smollm2", "tiny-falcon"], device=device)
    repo = lab.prepare_run_repository(tmp_path, models=plan.models)
    server = start_server(repo, load_models=plan.models)
    for model in plan.models:  # weights are memory-mapped: answering makes them resident
        assert client.infer(server.http_url, model, ["Where is the nearest"], max_tokens=2)
    compared = plan.compare(server)
    assert list(compared.index) == ["smollm2", "tiny-falcon"]
    assert list(compared["processes"]) == [1, 1]
    column = "gpu (GiB)" if device == "gpu" else "resident (GiB)"
    assert (compared["measured (GiB)"] == compared[column]).all()
    weights = capacity.estimate("smollm2", device=device).weights_bytes / GIB
    assert compared.loc["smollm2", "measured (GiB)"] > weights, compared.to_string()
    assert compared["within estimate"].all(), compared.to_string()
