"""The upstream Inferentia QA matrix on the cpu target, served by one real Triton server.

add/sub model (OUTPUT__0 = a + b, OUTPUT__1 = a - b) x {dynamic batching (max_batch_size 1000,
preferred 8, delay 100 us), no batching with -1x4 dims} x {requests joined into one call, one call
per request} x {1 instance on cores 0:0, 3 instances on 0:7}. 8 cores / 3 instances leaves cores
6 and 7 idle: the generator warns loudly (naming them) and serves 0-1, 2-3, 4-5. ``qa_join`` is
the joined, batching variant with a queue delay long enough that eight requests released
together are certain to run as one call (upstream's 100 us makes a batch only by coincidence).

The inf1 / inf2 paths of the same model.py are served too, with a fake torch_neuron /
torch_neuronx that stands in for the Neuron SDK and device (which cannot run here): the fakes
record the NEURON_RT_VISIBLE_CORES, device ids and worker count that model.py gave them.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import JOIN_DELAY_MICROSECONDS, compiled_add_sub, sent_together
from labkit import profiling
from labkit.errors import ToolError
from labkit.neuron.gen import GenOptions, TensorSpec, generate_model

pytestmark = pytest.mark.integration

FAKE_DATA_PARALLEL = '''
import json, os

class DataParallel:
    """Stands in for the SDK's DataParallel: runs the module, records what model.py set."""

    def __init__(self, module, device_ids=None, dim=0, set_dynamic_batching=True):
        self.module, self.device_ids, self._workers = module, list(device_ids), None
        self._record()

    @property
    def num_workers(self):
        return self._workers

    @num_workers.setter
    def num_workers(self, value):
        self._workers = value
        self._record()

    def _record(self):
        record = {"sdk": SDK, "visible": os.environ.get("NEURON_RT_VISIBLE_CORES"),
                  "device_ids": self.device_ids, "num_workers": self._workers}
        path = os.path.join(RECORDS, f"{SDK}-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(record, f)

    def __call__(self, *args):
        return self.module(*args)
'''

REGISTER_TORCH_NEURON = (
    "\nimport torch, types\ntorch.neuron = types.SimpleNamespace(DataParallel=DataParallel)\n"
)


QA = {
    # name: (dynamic batching, joined into one call, instance count, core range)
    f"qa_{b}_{j}_{n}": (b == "dyn", j == "join", n, "0:0" if n == 1 else "0:7")
    for b in ("dyn", "nobatch")
    for j in ("join", "each")
    for n in (1, 3)
}
JOIN_BATCH = 8


def io_specs(batched: bool) -> dict:
    dims = "4" if batched else "-1x4"
    return {
        "inputs": [TensorSpec.parse(f"INPUT__{i},INT64,{dims}") for i in range(2)],
        "outputs": [TensorSpec.parse(f"OUTPUT__{i},INT64,{dims}") for i in range(2)],
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_module_server):
    root = tmp_path_factory.mktemp("neuron")
    artifact = compiled_add_sub(root / "cache")
    repo = root / "repo"
    warnings = {}
    for name, (batched, joined, count, cores) in QA.items():
        extra = {}
        if batched:
            extra = dict(
                enable_dynamic_batching=True,
                max_batch_size=1000,
                preferred_batch_size=[8],
                max_queue_delay_microseconds=100,
            )
        made = generate_model(
            GenOptions(
                repo / name,
                artifact.path,
                cores,
                target="cpu",
                triton_model_instance_count=count,
                disable_batch_requests_to_neuron=not joined,
                copy_compiled_model=True,
                **extra,
                **io_specs(batched),
            )
        )
        warnings[name] = made.warnings
    generate_model(
        GenOptions(
            repo / "qa_join",
            artifact.path,
            "0:0",
            target="cpu",
            copy_compiled_model=True,
            enable_dynamic_batching=True,
            max_batch_size=JOIN_BATCH,
            preferred_batch_size=[JOIN_BATCH],
            max_queue_delay_microseconds=JOIN_DELAY_MICROSECONDS,
            **io_specs(True),
        )
    )
    generate_model(
        GenOptions(
            repo / "fake_inf2",
            artifact.path,
            "0:3",
            target="inf2",
            triton_model_instance_count=2,
            threads_per_core=2,
            copy_compiled_model=True,
            **io_specs(False),
        )
    )
    generate_model(
        GenOptions(
            repo / "fake_inf1",
            artifact.path,
            "0:0",
            target="inf1",
            model_version=3,
            copy_compiled_model=True,
            **io_specs(False),
        )
    )
    records = root / "records"
    records.mkdir()
    # The Python backend puts the version folder on sys.path (PYTHONPATH does not reach the stub).
    for model_dir, sdk in (
        (repo / "fake_inf2" / "1", "torch_neuronx"),
        (repo / "fake_inf1" / "3", "torch_neuron"),
    ):
        extra = "" if sdk == "torch_neuronx" else REGISTER_TORCH_NEURON
        (model_dir / sdk).mkdir()
        head = f"SDK = {sdk!r}\nRECORDS = {str(records)!r}\n"
        (model_dir / sdk / "__init__.py").write_text(head + FAKE_DATA_PARALLEL + extra)
    server = start_module_server(repo)
    return {"server": server, "warnings": warnings, "records": records, "root": root}


def infer(client, model: str, a: np.ndarray, b: np.ndarray):
    inputs = []
    for i, value in enumerate((a, b)):
        tensor = httpclient.InferInput(f"INPUT__{i}", list(value.shape), "INT64")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    result = client.infer(model, inputs)
    return result.as_numpy("OUTPUT__0"), result.as_numpy("OUTPUT__1")


def concurrent_requests(server, model: str, count: int = 24):
    """``count`` requests at once, each with its own values and batch size 1 to 3."""
    rng = np.random.default_rng(abs(hash(model)) % 2**32)
    cases = [
        (rng.integers(-100, 100, (1 + i % 3, 4)), rng.integers(-100, 100, (1 + i % 3, 4)))
        for i in range(count)
    ]

    def one(case):
        with httpclient.InferenceServerClient(server.http_url) as client:
            return infer(client, model, case[0].astype(np.int64), case[1].astype(np.int64))

    with ThreadPoolExecutor(max_workers=count) as pool:
        return cases, list(pool.map(one, cases))


@pytest.mark.parametrize("model", sorted(QA))
def test_qa_matrix_every_request_gets_its_own_sum_and_difference(served, model):
    cases, results = concurrent_requests(served["server"], model)
    for (a, b), (total, diff) in zip(cases, results, strict=True):
        assert total.tolist() == (a + b).tolist()
        assert diff.tolist() == (a - b).tolist()


def test_dynamic_batching_joins_requests_into_one_call(served):
    server = served["server"]
    rng = np.random.default_rng(8)
    cases = [tuple(rng.integers(-100, 100, (2, 1, 4))) for _ in range(JOIN_BATCH)]

    def one(case):
        with httpclient.InferenceServerClient(server.http_url) as client:
            return infer(client, "qa_join", *case)

    results, counts = sent_together(server, "qa_join", one, cases)
    for (a, b), (total, diff) in zip(cases, results, strict=True):
        assert (total.tolist(), diff.tolist()) == ((a + b).tolist(), (a - b).tolist())
    assert counts["inference_count"] == JOIN_BATCH
    assert counts["execution_count"] == 1, f"not one call: {counts}"


def test_three_instances_on_eight_cores_get_two_each_and_the_idle_two_are_named(served):
    assert (
        "UNUSED NEURON CORES: 2 of the 8 cores in 0:7 (6, 7)"
        in served["warnings"]["qa_dyn_join_3"][0]
    )
    assert served["warnings"]["qa_dyn_join_1"] == []
    log = Path(served["server"].log_path).read_text()
    for index, cores in enumerate(("0-1", "2-3", "4-5")):
        assert (
            f"qa_dyn_join_3_0_{index}: target cpu, Neuron cores {cores} "
            f"(NEURON_RT_VISIBLE_CORES={cores}), 2 threads, one call per batch"
        ) in log
    assert (
        "qa_nobatch_each_1_0_0: target cpu, Neuron cores 0 (NEURON_RT_VISIBLE_CORES=0), 1 threads, one call per request"
        in log
    )


def test_inf2_model_py_sets_visible_cores_and_threads_per_instance_with_a_fake_sdk(served):
    a, b = np.array([[5, 6, 7, 8]]), np.array([[1, 1, 1, 1]])
    total, diff = infer(served["server"].client(), "fake_inf2", a, b)
    assert (total.tolist(), diff.tolist()) == ([[6, 7, 8, 9]], [[4, 5, 6, 7]])
    records = [json.loads(p.read_text()) for p in served["records"].glob("torch_neuronx-*.json")]
    assert sorted(r["visible"] for r in records) == ["0-1", "2-3"]
    # threads come from the instance's 2 cores x 2 per core, not the whole range's 4 cores x 2
    assert all(r["device_ids"] == [0, 1] and r["num_workers"] == 4 for r in records), records


def test_inf1_model_py_uses_torch_neuron_and_any_model_version_with_a_fake_sdk(served):
    client = served["server"].client()
    assert client.is_model_ready("fake_inf1", "3")
    total, _ = infer(client, "fake_inf1", np.array([[1, 2, 3, 4]]), np.array([[1, 1, 1, 1]]))
    assert total.tolist() == [[2, 3, 4, 5]]
    (record,) = [json.loads(p.read_text()) for p in served["records"].glob("torch_neuron-*.json")]
    assert (record["visible"], record["device_ids"], record["num_workers"]) == ("0", [0], 1)


def test_perf_analyzer_validates_outputs_as_the_upstream_qa_does(served, tmp_path):
    a = np.array([[1, 2, 3, 4], [0, 0, 0, 0], [-1, -2, -3, -4], [-4, -3, -2, -1]])
    b = np.array([[1, 1, 1, 1]] * 3 + [[-1, -1, -1, -1]])
    steps = [{"INPUT__0": a[i], "INPUT__1": b[i]} for i in range(4)]  # batch dim: -b
    good = [{"OUTPUT__0": a[i] + b[i], "OUTPUT__1": a[i] - b[i]} for i in range(4)]
    server = served["server"]
    validated = dict(
        measurement_mode="count_windows",
        measurement_request_count=50,
        stability_percentage=100,
        run_dir=tmp_path / "perf",
        progress=False,
    )
    data = profiling.write_perf_data(tmp_path / "good.json", steps, good)
    frame = profiling.perf_analyzer(
        server, "qa_dyn_join_3", input_data=data, concurrency="1:2", **validated
    )
    assert list(frame["concurrency"]) == [1, 2] and (frame["throughput"] > 0).all()
    bad = [dict(g) for g in good]
    bad[3] = {"OUTPUT__0": np.array([-5, -4, -3, -1]), "OUTPUT__1": a[3] - b[3]}  # upstream's typo
    data = profiling.write_perf_data(tmp_path / "bad.json", steps, bad)
    with pytest.raises(ToolError, match="(?i)output doesn't match expected"):
        profiling.perf_analyzer(
            server, "qa_dyn_join_3", input_data=data, concurrency=1, **validated
        )
