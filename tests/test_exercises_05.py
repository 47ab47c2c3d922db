"""Notebook 05's exercise, ``05-split-cores``: the generator's flags that split a host's
NeuronCores across two instances. The judging of the folder made for inf2 runs without a server;
the whole check, with the split loaded on a real Triton (the cpu target standing in for the
NeuronCores, as in the notebook), runs against one."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import compiled_add_sub
from labkit import exercises
from labkit.hardware import NeuronHardware
from labkit.neuron.compiler import CompiledModel
from labkit.server import index

KEY = "05-split-cores"
RIGHT = "--neuron_core_range 0:1 --triton_model_instance_count 2"


def stand_in(path: Path) -> CompiledModel:
    """A cpu-target compiled add_sub as the notebook's ``built.compiled["add_sub"]`` describes it;
    the folder made for inf2 only names the Neuron artifact, so no file is needed for judging."""
    return CompiledModel(path, "cpu", "add_sub", True, ((1, 4), (1, 4)), ("int64", "int64"))


def judged(flags, tmp_path, **context):
    context.setdefault("instance_type", "inf2.xlarge")
    return exercises.run(
        KEY, flags, compiled=stand_in(tmp_path / "add_sub.pt"), run_dir=tmp_path, **context
    )


def test_one_core_each_on_an_inf2_xlarge_passes_and_the_folder_says_so(tmp_path):
    outcome = judged(RIGHT, tmp_path)
    assert outcome.passed, outcome
    assert "NeuronCores 0 and 1" in outcome.seen
    config = (tmp_path / "exercise" / "inf2" / "add_sub_split" / "config.pbtxt").read_text()
    assert "count: 2" in config and 'string_value: "1"' in config


def test_the_untouched_cell_is_not_done_yet(tmp_path):
    assert judged(..., tmp_path).status == exercises.NOT_DONE


def test_one_instance_fails(tmp_path):
    outcome = judged("--neuron_core_range 0:1", tmp_path)
    assert outcome.status == exercises.FAILED
    assert outcome.seen.startswith("1 instance(s) on NeuronCores 0-1")


def test_cores_the_host_does_not_have_fail(tmp_path):
    outcome = judged("--neuron_core_range 0:3 --triton_model_instance_count 2", tmp_path)
    assert outcome.status == exercises.FAILED
    assert "2, 3 do not exist on inf2.xlarge" in outcome.seen


def test_more_instances_than_cores_is_refused_by_the_generator(tmp_path):
    outcome = judged("--neuron_core_range 0:0 --triton_model_instance_count 2", tmp_path)
    assert outcome.status == exercises.FAILED
    assert "generator refused" in outcome.seen and "out of the 1 in 0:0" in outcome.seen


def test_a_range_the_count_does_not_divide_fails_naming_the_idle_core(tmp_path):
    outcome = judged(
        "--neuron_core_range 0:10 --triton_model_instance_count 2",
        tmp_path,
        instance_type="inf2.24xlarge",
    )
    assert outcome.status == exercises.FAILED
    assert "UNUSED NEURON CORES" in outcome.seen and "(10)" in outcome.seen


def test_a_neuron_host_is_judged_on_the_cores_its_device_reports():
    host = NeuronHardware("inf2", 6, 12, "neuron-ls", "inf2.24xlarge")
    solution = exercises.EXERCISES[KEY].solution(instance_type="inf2.xlarge", neuron_hardware=host)
    assert solution == "--neuron_core_range 0:11 --triton_model_instance_count 2"


@pytest.mark.integration
@pytest.mark.slow  # compiles add_sub, starts a server and loads two torch stubs: ~35 s on 2 busy cores
def test_the_split_is_served_and_each_instance_sets_its_own_cores(tmp_path, start_server):
    compiled = compiled_add_sub(tmp_path / "cache")
    repo = tmp_path / "repo"
    repo.mkdir()
    server = start_server(repo)
    context = dict(server=server, compiled=compiled, run_dir=tmp_path / "run",
                   instance_type="inf2.xlarge")  # fmt: skip
    outcome = exercises.run(KEY, ..., solutions=True, **context)
    assert outcome.passed, outcome
    assert "NEURON_RT_VISIBLE_CORES=0 (add_sub_split_0_0) and 1 (add_sub_split_0_1)" in outcome.seen
    # the check unloaded its model and removed its folder: the server is as it was
    assert "add_sub_split" not in set(index(server)["name"])
    assert not (repo / "add_sub_split").exists()
    wrong = exercises.run(KEY, "--neuron_core_range 0:1", **context)
    assert wrong.status == exercises.FAILED and "1 instance(s)" in wrong.seen
