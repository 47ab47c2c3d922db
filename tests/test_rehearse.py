"""The rehearsal of a pod that ``labkit deploy k8s`` writes: the container read from the files
(the Deployment's, and what KServe's runtime makes of an InferenceService), the ``docker run``
the kubelet's rules give, and, in Docker on the lab's image built on the CPU stand-in, a pod that
becomes ready within its startup budget and answers, a killed stub that turns readiness off
and liveness that restarts the container, and a pod that never becomes ready saying why."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from docker_tier import lab_image

from labkit.cli import main
from labkit.cluster import ready_check
from labkit.deploy import DeploySettings, ngc_image, write_manifests
from labkit.deploy.k8s import memory_bytes
from labkit.deploy.rehearsal import (
    KSERVE_RUNTIME_ARGS,
    LABEL,
    Rehearsal,
    read_pod,
    rehearsal_table,
    rehearse,
    run_command,
)
from labkit.errors import ConfigError, MissingDependencyError, ServerError, ServerTimeoutError
from labkit.repository import add_model, prepare_repository

MODEL = "tiny-falcon"


def repository(folder: Path, *, weights: bool) -> Path:
    """A repository of the lab's smallest text model; ``weights``: built and linked in."""
    add_model(folder, MODEL)
    if weights:
        prepare_repository(folder)
    return folder


def manifests(folder: Path, repo: Path, **settings) -> Path:
    write_manifests(repo, folder, DeploySettings(**settings))
    return folder


# -- the container, read from the files (no Docker) ------------------------------------------
def test_the_deployments_container_is_read_with_its_probes_volumes_and_limits(tmp_path):
    repo = repository(tmp_path / "repo", weights=False)
    pod = read_pod(manifests(tmp_path / "k8s", repo, accelerator="gpu", memory="6Gi"))
    assert pod.kind == "Deployment" and pod.image == DeploySettings().image
    assert pod.command == ("tritonserver",) and pod.models == [MODEL]
    startup, readiness, liveness = (pod.probe(n) for n in ("startup", "readiness", "liveness"))
    assert (startup.path, startup.port) == ("/v2/health/ready", 8000)  # the port named "http"
    assert pod.startup_budget_s == startup.period_s * startup.failure_threshold
    assert readiness.command[:2] == ("python3", "/opt/labkit/ready_check.py")
    assert liveness.command[-1] == "--live" and "--live" not in readiness.command
    mounts = {m.path: m for m in pod.mounts}
    assert mounts["/models"].kind == "repository" and mounts["/models"].read_only
    check = mounts["/opt/labkit"]
    assert check.kind == "configmap" and check.mode == 0o444
    assert dict(check.files) == {"ready_check.py": Path(ready_check.__file__).read_text()}
    assert mounts["/dev/shm"].kind == "shm" and mounts["/dev/shm"].size_bytes == 2**30
    assert mounts["/cache"].kind == "tmpfs"
    assert pod.memory_bytes == memory_bytes("6Gi") and pod.grace_s == 40
    assert "HF_TOKEN" not in dict(pod.env) and dict(pod.env)["HF_HOME"] == "/cache/huggingface"
    notes = "\n".join(pod.notes)
    assert "HF_TOKEN: from Secret hf-token (optional)" in notes
    assert "nvidia.com/gpu: 1 requested" in notes
    assert "toleration nvidia.com/gpu" in notes


def test_the_kserve_container_runs_the_runtimes_args_then_the_predictors(tmp_path):
    repo = repository(tmp_path / "repo", weights=False)
    pod = read_pod(manifests(tmp_path / "kserve", repo, kserve=True))
    assert pod.kind == "InferenceService" and pod.command == ()
    assert pod.args[: len(KSERVE_RUNTIME_ARGS)] == KSERVE_RUNTIME_ARGS
    assert pod.args[len(KSERVE_RUNTIME_ARGS)] == "--model-control-mode=explicit"
    assert pod.models == [MODEL] and pod.ports == (("http1", 8080),)
    assert pod.probe("startup").port == 8080
    assert pod.repository_path == "/mnt/models"
    assert any("appends" in note for note in pod.notes)


def test_the_ngc_images_install_script_still_names_the_models_it_loads(tmp_path):
    repo = repository(tmp_path / "repo", weights=False)
    pod = read_pod(manifests(tmp_path / "k8s", repo, image=ngc_image()))
    assert pod.command == ("/bin/sh", "-c") and "pip install" in pod.args[0]
    assert pod.models == [MODEL]


def test_the_docker_command_keeps_the_kubelets_rule_for_command_and_args(tmp_path):
    repo = repository(tmp_path / "repo", weights=False)
    plain = read_pod(manifests(tmp_path / "k8s", repo))
    kserve = read_pod(manifests(tmp_path / "kserve", repo, kserve=True))
    folders = {"/opt/labkit": "/x/check"}
    cmd = run_command(
        plain,
        name="p",
        image="img",
        host_ports={8000: 1, 8001: 2, 8002: 3},
        repository="/x/repo",
        config_dirs=folders,
    )
    assert cmd[:4] == ["docker", "run", "-d", "--name"]
    assert "127.0.0.1:1:8000" in cmd and "127.0.0.1:3:8002" in cmd
    assert "/x/repo:/models:ro" in cmd and "/x/check:/opt/labkit:ro" in cmd
    assert f"--shm-size={2**30}" in cmd and f"--memory={memory_bytes('8Gi')}" in cmd
    assert cmd[cmd.index("--tmpfs") + 1] == "/cache"
    # command replaces the image's entrypoint; args follow the image
    image_at = cmd.index("img")
    assert cmd[image_at - 2 : image_at] == ["--entrypoint", "tritonserver"]
    assert cmd[image_at + 1 :] == list(plain.args)
    cmd = run_command(
        kserve,
        name="k",
        image="img",
        host_ports={8080: 4},
        repository="/x/repo",
        config_dirs=folders,
    )
    assert "--entrypoint" not in cmd and "/x/repo:/mnt/models:ro" in cmd
    assert cmd[cmd.index("img") + 1 :] == list(kserve.args)


def test_a_folder_must_hold_one_pod_and_a_secret_it_needs_is_refused(tmp_path):
    repo = repository(tmp_path / "repo", weights=False)
    with pytest.raises(ConfigError, match="exactly one Deployment or InferenceService.*none"):
        read_pod(tmp_path / "repo")
    folder = manifests(tmp_path / "k8s", repo)
    path = folder / "deployment.yaml"
    resource = yaml.safe_load(path.read_text())
    env = resource["spec"]["template"]["spec"]["containers"][0]["env"]
    del env[1]["valueFrom"]["secretKeyRef"]["optional"]
    path.write_text(yaml.safe_dump(resource))
    with pytest.raises(ConfigError, match="HF_TOKEN comes from"):
        read_pod(folder)


def test_without_a_docker_command_the_error_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MissingDependencyError, match="docker command is not installed.*docker.io"):
        rehearse(tmp_path, tmp_path)


def test_the_side_by_side_table_has_a_column_per_pod(tmp_path):
    repo = repository(tmp_path / "repo", weights=False)
    pods = [
        Rehearsal(read_pod(manifests(tmp_path / name, repo, kserve=kserve)), "img")
        for name, kserve in (("k8s", False), ("kserve", True))
    ]
    table = rehearsal_table(pods)
    assert list(table.columns) == ["", "Deployment", "InferenceService"]
    assert table.set_index("").loc["passed"].tolist() == ["False", "False"]


# -- in Docker ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    """The repository, the lab's image on the stand-in, and the plain pod rehearsed with a stub
    killed (shared: one rehearsal answers three tests)."""
    image = lab_image()
    root = tmp_path_factory.mktemp("rehearse")
    repo = repository(root / "repo", weights=True)
    plain = rehearse(
        manifests(root / "k8s", repo), repo, image=image, kill_stub=True, timeout_s=300
    )
    return {"repo": repo, "root": root, "image": image, "plain": plain}


def leftovers() -> str:
    return subprocess.run(
        ["docker", "ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.docker
def test_the_plain_pod_becomes_ready_within_its_budget_and_answers(pods):
    plain = pods["plain"]
    assert plain.ready and plain.time_to_ready_s <= plain.pod.startup_budget_s, plain.table()
    assert plain.model == MODEL and plain.answer.strip(), plain
    assert plain.image == pods["image"] and "in place of" in plain.image_note
    table = plain.table()
    assert table.loc[table["probe"] == "startup", "passed"].iloc[-1]
    first_ready = table.index[table["kubelet"] == "ready"][0]
    assert table.loc[:first_ready].query("probe == 'liveness'").empty  # after the start only
    assert leftovers() == ""


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.docker
def test_a_killed_stub_turns_readiness_off_and_liveness_restarts_the_container(pods):
    plain = pods["plain"]
    kill, readiness, liveness = (
        plain.stub_kill,
        plain.pod.probe("readiness"),
        plain.pod.probe("liveness"),
    )
    assert kill is not None and kill.model == MODEL, plain
    # out of the Service within its threshold of failed checks (a tick of slack for the first)
    bound = readiness.period_s * (readiness.failure_threshold + 1) + readiness.timeout_s
    assert kill.readiness_off_after_s is not None and kill.readiness_off_after_s <= bound, plain
    assert f"{MODEL}: 0 of 1" in kill.readiness_output  # its stubs alive of expected
    assert kill.liveness_failures == liveness.failure_threshold and kill.restarts == 1, plain
    assert kill.restarted_after_s <= liveness.period_s * (liveness.failure_threshold + 1)
    assert kill.ready_again_after_s > kill.restarted_after_s, plain
    # the same seeded model, greedy: the restarted container answers as the first did
    assert kill.answer_after == plain.answer
    assert plain.passed
    events = plain.table()["kubelet"].tolist()
    assert events.index("not ready") < events.index("restarted") < len(events) - 1
    assert events[-1] == "ready"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.docker
def test_labkit_rehearse_runs_the_kserve_pod_to_ready_and_an_answer(pods, capsys):
    folder = manifests(pods["root"] / "kserve", pods["repo"], kserve=True)
    args = ["rehearse", "--manifests", str(folder), "--model-repository", str(pods["repo"])]
    assert main([*args, "--image", pods["image"], "--timeout-s", "300"]) == 0
    out = capsys.readouterr().out
    assert "pod: inferenceservice.yaml: InferenceService/triton" in out
    assert "passed: True" in out and "model asked: tiny-falcon" in out
    assert "--model-store=/mnt/models" in out
    assert leftovers() == ""


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.docker
def test_a_pod_that_never_becomes_ready_says_why_and_shows_its_log(pods, tmp_path):
    folder = manifests(tmp_path / "k8s", pods["repo"])
    with pytest.raises(ServerTimeoutError, match=r"(?s)not ready after 2 s.*last probe.*log lines"):
        rehearse(folder, pods["repo"], image=pods["image"], timeout_s=2)
    # a model that cannot load (its weights' config is not JSON): the server exits
    broken = repository(tmp_path / "broken", weights=False)
    (broken / MODEL / "weights").mkdir()
    (broken / MODEL / "weights" / "config.json").write_text("{ not json")
    folder = manifests(tmp_path / "broken-k8s", broken)
    with pytest.raises(ServerError, match=r"(?s)exited with status \d+.*tiny-falcon"):
        rehearse(folder, broken, image=pods["image"], timeout_s=120)
    assert leftovers() == ""
