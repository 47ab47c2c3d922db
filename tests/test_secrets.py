"""Secrets and exposure: a planted hub token shows up in no artefact, no message and no repr;
names cannot climb out of a repository; model code treats request content as plain data.

Loopback binding is tested where the server is: tests/test_server.py
(``test_serves_on_loopback_and_stop_leaves_no_process``: every listening socket is 127.0.0.1) and
tests/test_doctor.py (``test_a_triton_bound_to_all_interfaces_is_a_warning``).
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from labkit import client, embedding, proc, repository
from labkit.cli import main
from labkit.errors import ConfigError, InferenceError, ServerError, ToolError
from labkit.repository import Repository
from labkit.server import TritonServer, reload

ROOT = Path(__file__).resolve().parent.parent
TOKEN = f"hf_labkitPlanted{uuid.uuid4().hex}"  # a fresh value: found only if something leaked it
TOKEN_VARIABLES = ("HF_TOKEN", "PRIVATE_REPO_TOKEN")
TEMPLATES = sorted((ROOT / "labkit" / "templates").rglob("*.py")) + sorted(
    (ROOT / "model_repository").glob("*/*/*.py")
)
EVALUATING = re.compile(
    r"(?<![\w.])(eval|exec|compile|__import__)\s*\(|literal_eval|\bpickle\b|\bmarshal\b"
    r"|\bdill\b|\bshelve\b|\bos\.system\b|\bsubprocess\b|\btorch\.load\(|\byaml\.load\("
)
PAYLOAD = "__import__('os').system('touch {marker}')"


def files_holding(root: Path, needle: str) -> list[str]:
    """Every file under ``root`` (links not followed) whose bytes contain ``needle``."""
    found = []
    for folder, _dirs, files in os.walk(root, followlinks=False):
        for name in files:
            path = Path(folder) / name
            if path.is_symlink():
                continue
            if needle.encode() in path.read_bytes():
                found.append(str(path.relative_to(root)))
    return found


@pytest.fixture
def planted(monkeypatch):
    for name in TOKEN_VARIABLES:
        monkeypatch.setenv(name, TOKEN)
    return TOKEN


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    """``tf0`` (tiny Falcon), ``minilm`` and ``llama7b`` (gated hub model, loaded by a test),
    with the planted token in the server's environment."""
    root = tmp_path_factory.mktemp("secrets")
    repo = root / "repo"
    repo.mkdir()
    repository.add_model(repo, "tiny-falcon", name="tf0", max_tokens=4)
    repository.add_model(repo, "llama7b")
    repository.prepare_repository(repo)
    embedding.add_embedding_model(repo, "minilm", max_batch_size=4)
    leaky = repo / "leaky"
    (leaky / "1").mkdir(parents=True)
    (leaky / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "x" data_type: TYPE_STRING dims: [-1] }]\n'
        'output [{ name: "y" data_type: TYPE_STRING dims: [-1] }]\n'
    )
    (leaky / "1" / "model.py").write_text(
        "import os\n\nclass TritonPythonModel:\n    def initialize(self, args):\n"
        "        raise RuntimeError('the hub refused token ' + os.environ['HF_TOKEN'])\n"
    )
    return start_module_server(
        repo, load_models=["tf0", "minilm"], env={name: TOKEN for name in TOKEN_VARIABLES}
    )


@pytest.mark.integration
@pytest.mark.notebook
def test_a_planted_token_appears_in_no_file_of_a_notebook_run(planted, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    code = main(["run", "01", "--out", str(out), "-p", "MODEL", "tiny-falcon"])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    executed = (out / "01_deploy_transformer.ipynb").read_text()
    assert "docker" in executed and "-e HF_TOKEN" in executed  # the token is passed by name
    assert (out / "01_deploy_transformer" / "tritonserver.log").is_file()
    assert (out / "01_deploy_transformer" / "model_repository" / "tiny-falcon").is_dir()
    assert files_holding(out, planted) == []
    assert planted not in printed.out + printed.err + caplog.text


@pytest.mark.integration
def test_server_repr_commands_and_logs_hold_no_token(planted, tmp_path, caplog):
    repo = tmp_path / "repo"
    repo.mkdir()
    server = TritonServer(repo, mode="docker", image="example/triton:1", env={"HF_TOKEN": planted})
    caplog.set_level("DEBUG")
    shown = " ".join(server.docker_command("name")) + repr(server)
    assert planted not in shown and "-e HF_TOKEN" in shown
    args = [sys.executable, "-c", "import sys; sys.exit(sys.argv[1])", f"--token={planted}"]
    with pytest.raises(ToolError, match="exited with status 1") as info:
        proc.run(args, timeout_s=30)
    assert planted not in str(info.value) and "--token=***" in str(info.value)
    assert planted not in caplog.text


def test_servers_bind_loopback_unless_asked(tmp_path):
    quiet = TritonServer(tmp_path, http_port=0).server_args(tmp_path)
    public = TritonServer(tmp_path, host="0.0.0.0").server_args(tmp_path)
    for kind in ("http", "grpc", "metrics"):
        assert f"--{kind}-address=127.0.0.1" in quiet
        assert f"--{kind}-address=0.0.0.0" in public


def log_text(server: TritonServer) -> str:
    """The server's log file as written (``log_tail`` redacts tokens: it could not show one)."""
    return Path(server.log_path).read_text(errors="replace")


@pytest.mark.integration
def test_a_failed_gated_load_names_the_problem_without_the_token(server, planted):
    with pytest.raises(ServerError, match="could not load model 'llama7b'") as info:
        server.load_model("llama7b")
    assert "meta-llama/Llama-2-7b-hf" in str(info.value) and planted not in str(info.value)
    with pytest.raises(ServerError, match=r"the hub refused token \*\*\*") as info:
        reload(server, "leaky")
    assert planted not in str(info.value)
    assert planted not in log_text(server) and planted not in repr(server)
    assert client.generate(server.http_url, "tf0", "Hi", max_tokens=2).text.startswith("Hi")


@pytest.mark.integration
def test_the_server_log_holds_no_token(server):
    # what the server logged up to now, in any order of tests: its start with the token in its
    # environment at least (the tests that provoke loads and refusals check the log too)
    assert TOKEN not in log_text(server)


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", "x/../../y", "/abs"])
def test_adding_a_catalog_model_under_a_climbing_name_is_refused(tmp_path, name):
    repo = tmp_path / "repo"
    repo.mkdir()
    with pytest.raises(ConfigError, match="invalid model name"):
        repository.add_model(repo, "tiny-falcon", name=name)
    with pytest.raises(ConfigError, match="invalid model name"):
        embedding.add_embedding_model(repo, name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]
    assert list(repo.iterdir()) == []


@pytest.mark.integration
@pytest.mark.parametrize("name", ["../tf0", "tf0/../tf0", "/etc"])
def test_live_model_operations_refuse_a_climbing_name(server, name):
    with pytest.raises(ConfigError, match="invalid model name"):
        server.load_model(name)
    with pytest.raises(ConfigError, match="invalid model name"):
        server.unload_model(name)
    with pytest.raises(ConfigError, match="invalid model name"):
        reload(server, name, repository=Repository(server.model_repository))


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: str(p.relative_to(ROOT)))
def test_model_code_never_evaluates_or_unpickles(path):
    hits = [
        f"{number}: {line.strip()}"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if EVALUATING.search(line.split("#", 1)[0])
    ]
    assert hits == []


@pytest.mark.integration
def test_code_sent_as_text_and_parameters_stays_plain_text(server, tmp_path):
    marker = tmp_path / "pwned"
    payload = PAYLOAD.format(marker=marker)
    answer = client.generate(server.http_url, "tf0", payload, max_tokens=2)
    assert answer.text.startswith(payload)  # the prompt itself, given back as text
    for name in ("max_tokens", "temperature", "seed"):
        with pytest.raises(InferenceError, match=re.escape(f"got {payload!r}")) as info:
            client.generate(server.http_url, "tf0", "Hi", **{name: payload})
        assert info.value.status == 400
    with pytest.raises(InferenceError, match="unknown parameter"):
        client.generate(server.http_url, "tf0", "Hi", **{payload: 1})
    vector = embedding.served_embed(server, [payload])
    assert vector.shape == (1, 384) and np.isfinite(vector).all()
    np.testing.assert_allclose(vector, embedding.embed([payload]), atol=1e-5, rtol=0)
    assert not marker.exists()
    assert TOKEN not in log_text(server)
