"""Live changes on a real Triton server: index, load, unload, edit + reload, failing models.

One server for the module, serving small numpy-only Python models written into a temporary
repository (they load in about a second), so every test sees real Triton behaviour quickly.
Every test finds ``double`` (x2) and ``triple`` (x3) as first written (:func:`as_found`).
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from labkit.cli import main as labkit_main
from labkit.errors import ConfigError, ServerError
from labkit.repository import Repository
from labkit.server import TritonServer, index, reload, served_config

pytestmark = pytest.mark.integration

SCALER = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.scale = float(params["scale"]["string_value"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            y = pb_utils.Tensor("y", (x * self.scale).astype(np.float32))
            responses.append(pb_utils.InferenceResponse([y]))
        return responses
"""

BROKEN = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("weights are missing: broken on purpose")

    def execute(self, requests):
        return []
"""


def scaler_config(name: str, scale: str) -> str:
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        'input { name: "x" data_type: TYPE_FP32 dims: [-1] }\n'
        'output { name: "y" data_type: TYPE_FP32 dims: [-1] }\n'
        "instance_group { count: 1 kind: KIND_CPU }\n"
        f'parameters {{ key: "scale" value {{ string_value: "{scale}" }} }}\n'
    )


def write_model(repo_path, name: str, code: str, config: str) -> None:
    (repo_path / name / "1").mkdir(parents=True)
    (repo_path / name / "1" / "model.py").write_text(code)
    (repo_path / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    repo = tmp_path_factory.mktemp("live") / "repo"
    write_model(repo, "double", SCALER, scaler_config("double", "2"))
    write_model(repo, "triple", SCALER, scaler_config("triple", "3"))
    return start_module_server(repo)


@pytest.fixture(autouse=True)
def as_found(server):
    """Each test leaves the server as it found it, pass or fail: a config it changed is put back
    and reloaded, a model it unloaded is loaded again. No test depends on another's effects."""
    repo = Repository(server.model_repository)
    configs = {m: repo.config_path(m).read_bytes() for m in ("double", "triple")}
    yield
    states = index(server).set_index("name")["state"]
    for model, text in configs.items():
        path = repo.config_path(model)
        if path.read_bytes() != text or states.get(model) != "READY":
            path.write_bytes(text)
            reload(server, model)


def infer(server: TritonServer, model: str, x: np.ndarray) -> np.ndarray:
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x.astype(np.float32))
    with server.client() as client:
        return client.infer(model, [tensor]).as_numpy("y")


def test_index_shows_two_models_ready_at_once(server):
    frame = index(server)
    ready = frame[frame.state == "READY"]
    assert {"double", "triple"} <= set(ready.name)
    assert list(frame.columns) == ["name", "version", "state", "reason"]
    assert infer(server, "double", np.array([1, 2])).tolist() == [2, 4]
    assert infer(server, "triple", np.array([1, 2])).tolist() == [3, 6]


def test_edit_and_reload_change_the_served_config_and_behaviour_without_a_restart(server):
    repo = Repository(server.model_repository)
    pid = server.pid
    x = np.array([1.0, 2.0, 3.0])
    assert infer(server, "triple", x).tolist() == [3, 6, 9]
    assert served_config(server, "triple")["max_batch_size"] == 0
    with pytest.raises(InferenceServerException, match=r"unexpected shape for input 'x'.*\[2,3\]"):
        infer(server, "triple", np.ones((2, 3)))  # no batch dimension yet: [2, 3] is refused

    diff = repo.edit(
        "triple", max_batch_size=4, preferred_batch_size=[2, 4], parameters={"scale": "5"}
    )
    assert "+max_batch_size: 4" in diff
    assert reload(server, "triple") == ""  # the edit was already written; reload only loads

    served = served_config(server, "triple")
    assert served["max_batch_size"] == 4
    assert served["dynamic_batching"]["preferred_batch_size"] == [2, 4]
    assert served["parameters"]["scale"]["string_value"] == "5"
    assert infer(server, "triple", x[None, :]).tolist() == [[5, 10, 15]]
    assert infer(server, "triple", np.ones((2, 3))).tolist() == [[5] * 3] * 2
    assert server.pid == pid and server.is_ready()
    assert infer(server, "double", x).tolist() == [2, 4, 6]  # the other model never stopped


def test_reload_with_a_config_writes_it_and_loads_it(server):
    repo = Repository(server.model_repository)
    cfg = repo.config("double")
    cfg.parameters["scale"].string_value = "-1"
    diff = reload(server, "double", cfg)
    assert '-    string_value: "2"\n+    string_value: "-1"' in diff
    assert infer(server, "double", np.array([4.0])).tolist() == [-4]
    cfg.parameters["scale"].string_value = "2"
    reload(server, "double", cfg)
    assert infer(server, "double", np.array([4.0])).tolist() == [8]


def test_an_invalid_edit_writes_nothing_and_the_server_keeps_serving(server):
    repo = Repository(server.model_repository)
    path = repo.config_path("double")
    before, served_before = path.read_bytes(), served_config(server, "double")
    with pytest.raises(ConfigError, match="dynamic_batching needs max_batch_size > 0"):
        repo.edit("double", preferred_batch_size=[8])
    cfg = repo.config("double")
    cfg.max_batch_size = 2
    cfg.dynamic_batching.preferred_batch_size.append(8)
    with pytest.raises(ConfigError, match="preferred_batch_size 8 is outside 1..max_batch_size"):
        reload(server, "double", cfg)
    assert path.read_bytes() == before
    assert served_config(server, "double") == served_before
    assert infer(server, "double", np.array([1.0])).tolist() == [2]


def test_a_config_triton_refuses_is_rolled_back_and_the_old_model_keeps_serving(server):
    repo = Repository(server.model_repository)
    path = repo.config_path("double")
    before = path.read_bytes()
    cfg = repo.config("double")
    cfg.backend = "no_such_backend"
    with pytest.raises(ServerError, match="unable to find backend library for backend 'no_such"):
        reload(server, "double", cfg)
    assert path.read_bytes() == before
    assert infer(server, "double", np.array([1.0])).tolist() == [2]


def test_a_failing_model_leaves_the_others_serving_and_its_error_carries_the_reason(server):
    repo_path = server.model_repository
    write_model(repo_path, "broken", BROKEN, scaler_config("broken", "1"))
    try:
        with pytest.raises(ServerError, match="weights are missing: broken on purpose"):
            reload(server, "broken")
        frame = index(server).set_index("name")
        assert frame.loc["broken", "state"] == "UNAVAILABLE"
        assert "broken on purpose" in frame.loc["broken", "reason"]
        assert frame.loc["double", "state"] == "READY"
        assert infer(server, "double", np.array([1.0])).tolist() == [2]
    finally:
        Repository(repo_path).remove("broken")


def test_unload_and_load_again(server):
    server.unload_model("double")
    frame = index(server).set_index("name")
    assert frame.loc["double", "state"] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException, match="unknown model: 'double'"):
        infer(server, "double", np.array([1.0]))
    reload(server, "double")
    assert index(server).set_index("name").loc["double", "state"] == "READY"
    assert infer(server, "double", np.array([1.0])).tolist() == [2]


def test_cli_edit_with_reload_changes_the_running_model(server, capsys):
    repo = str(server.model_repository)

    def edit_scale(value: str) -> int:
        return labkit_main(
            [
                "models",
                "edit",
                "double",
                "--model-repository",
                repo,
                "--param",
                f"scale={value}",
                "--reload",
                server.http_url,
            ]
        )

    try:
        assert edit_scale("7") == 0
        assert f"reloaded double on {server.http_url}" in capsys.readouterr().out
        assert infer(server, "double", np.array([1.0])).tolist() == [7]
        assert (
            labkit_main(["models", "list", "--model-repository", repo, "--url", server.http_url])
            == 0
        )
        listing = capsys.readouterr().out
        assert "double" in listing and "READY" in listing
    finally:
        edit_scale("2")
    assert infer(server, "double", np.array([1.0])).tolist() == [2]
