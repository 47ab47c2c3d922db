"""``labkit deploy k8s``: the manifests it writes pass kubernetes-validate (strict, Kubernetes
1.37's bundled schemas) and check-jsonschema (the InferenceService schema in labkit/deploy/schemas),
both offline; the validators themselves reject a wrong field; no secret value is ever written.
They deploy the chosen models, or those the image can run (``smollm2_vllm`` is left out, with
where it goes instead), each pipeline whole, loaded explicitly, with the packages those models
import; the copy into the claim holds exactly those models, links resolved.
No cluster is contacted: nothing here was applied anywhere."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import yaml

from labkit.cli import main
from labkit.deploy import (
    DeploySettings,
    copy_repository,
    deployed_models,
    kserve_schema,
    manifests,
    ngc_image,
    python_requirements,
    validate_manifests,
    write_manifests,
)
from labkit.deploy.k8s import DEFAULT_CACHE_BYTES, load_args
from labkit.errors import ConfigError
from labkit.repository import Repository
from labkit.settings import triton_image

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY = ROOT / "model_repository"
#: A model for the tests that build manifests from settings alone (no repository).
ONE = ("minilm",)


def load(folder: Path, name: str) -> dict:
    return yaml.safe_load((folder / name).read_text())


@pytest.mark.integration
@pytest.mark.parametrize("accelerator", ["cpu", "gpu", "neuron"])
def test_plain_manifests_pass_kubernetes_validate(tmp_path, accelerator):
    write_manifests(REPOSITORY, tmp_path, DeploySettings(accelerator=accelerator))
    report = validate_manifests(tmp_path)
    assert set(report["kind"]) == {
        "ConfigMap",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PersistentVolumeClaim",
    }
    assert report["passed"].all(), report.to_string()
    assert report["validator"].str.startswith("kubernetes-validate --strict").all()


@pytest.mark.integration
def test_the_kserve_manifests_pass_both_validators_from_the_command_line(tmp_path, capsys):
    code = main(
        [
            "deploy",
            "k8s",
            "--model-repository",
            str(REPOSITORY),
            "--out",
            str(tmp_path),
            "--gpu",
            "--kserve",
            "--validate",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "InferenceService" in out and "check-jsonschema" in out
    service = load(tmp_path, "inferenceservice.yaml")
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == "kserve-tritonserver"
    assert model["storageUri"] == "pvc://triton-model-repository"
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert not (tmp_path / "deployment.yaml").exists()
    assert load(tmp_path, "hpa.yaml")["spec"]["scaleTargetRef"]["name"] == "triton-predictor"


@pytest.mark.integration
def test_the_validators_reject_a_misspelt_field(tmp_path):
    write_manifests(REPOSITORY, tmp_path, DeploySettings())
    write_manifests(REPOSITORY, tmp_path / "k", DeploySettings(kserve=True))
    deployment = load(tmp_path, "deployment.yaml")
    deployment["spec"]["replica"] = deployment["spec"].pop("replicas")
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump(deployment))
    service = load(tmp_path / "k", "inferenceservice.yaml")
    service["spec"]["predictor"]["model"]["storageURI"] = service["spec"]["predictor"]["model"].pop(
        "storageUri"
    )
    (tmp_path / "inferenceservice.yaml").write_text(yaml.safe_dump(service))
    report = validate_manifests(tmp_path).set_index("file")
    assert not report.loc["deployment.yaml", "passed"]
    assert "'replica' was unexpected" in report.loc["deployment.yaml", "message"]
    assert not report.loc["inferenceservice.yaml", "passed"]
    assert "storageURI" in report.loc["inferenceservice.yaml", "message"]
    assert report.loc["service.yaml", "passed"] and report.loc["hpa.yaml", "passed"]


def test_the_deployment_probes_health_mounts_shared_memory_and_requests_the_accelerator():
    files = manifests(
        DeploySettings(accelerator="neuron", requirements=("numpy==1.26.4",), models=ONE)
    )
    pod = files["deployment.yaml"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    check = ["python3", "/opt/labkit/ready_check.py", "--url=http://127.0.0.1:8000"]
    assert container["readinessProbe"]["exec"]["command"][:3] == check
    assert container["livenessProbe"]["exec"]["command"][-1] == "--live"
    assert container["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "ready-check")
    assert mount == {"name": "ready-check", "mountPath": "/opt/labkit", "readOnly": True}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["medium"] == "Memory"
    assert container["resources"]["limits"]["aws.amazon.com/neuron"] == "1"
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "inf2.xlarge"}
    assert pod["tolerations"][0]["key"] == "aws.amazon.com/neuron"
    repo = next(v for v in pod["volumes"] if v["name"] == "model-repository")
    assert repo["persistentVolumeClaim"] == {
        "claimName": "triton-model-repository",
        "readOnly": True,
    }
    assert container["image"] == triton_image() and container["command"] == ["tritonserver"]


def test_the_readiness_probe_is_the_balancers_check_shipped_in_a_config_map(tmp_path):
    """The pod runs the file labkit's balancer runs on each replica, with the image's python3:
    not Triton's /v2/health/ready, which stays 200 after a Python stub died."""
    from labkit.cluster import ready_check

    write_manifests(REPOSITORY, tmp_path, DeploySettings())
    data = load(tmp_path, "configmap.yaml")["data"]
    assert data == {"ready_check.py": Path(ready_check.__file__).read_text()}
    assert "ready_check.py: |" in (tmp_path / "configmap.yaml").read_text()  # readable as written
    pod = load(tmp_path, "deployment.yaml")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "ready-check")
    assert volume["configMap"]["name"] == load(tmp_path, "configmap.yaml")["metadata"]["name"]
    probes = [pod["containers"][0][p] for p in ("readinessProbe", "livenessProbe")]
    assert all("/v2/health/ready" not in json.dumps(p) for p in probes)
    # KServe's kserve-tritonserver runtime serves HTTP on 8080: its probes ask there
    write_manifests(REPOSITORY, tmp_path / "k", DeploySettings(kserve=True))
    model = load(tmp_path / "k", "inferenceservice.yaml")["spec"]["predictor"]["model"]
    assert "--url=http://127.0.0.1:8080" in model["readinessProbe"]["exec"]["command"]
    assert model["startupProbe"]["httpGet"]["port"] == 8080
    assert (tmp_path / "k" / "configmap.yaml").is_file()


def test_the_ngc_image_installs_the_repository_requirements_before_the_server():
    files = manifests(
        DeploySettings(image=ngc_image(), requirements=("transformers==5.0.0",), models=ONE)
    )
    container = files["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/bin/sh", "-c"]
    assert (
        "pip install --no-cache-dir 'transformers==5.0.0' && exec tritonserver"
        in container["args"][0]
    )


def test_the_autoscaler_scales_on_the_queue_metric_the_adapter_rule_defines(tmp_path):
    write_manifests(REPOSITORY, tmp_path, DeploySettings(replicas=2, max_replicas=6))
    hpa = load(tmp_path, "hpa.yaml")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    rule = load(tmp_path, "prometheus-adapter-values.yaml")["rules"]["custom"][0]
    assert rule["name"]["as"] == metric
    assert "nv_inference_queue_duration_us" in rule["metricsQuery"]
    assert "nv_inference_request_success" in rule["metricsQuery"]


def test_no_secret_value_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_NeverWriteThisTokenAnywhere")
    paths = write_manifests(REPOSITORY, tmp_path, DeploySettings(kserve=False))
    paths += write_manifests(REPOSITORY, tmp_path / "k", DeploySettings(kserve=True))
    for path in paths:
        assert "hf_NeverWriteThisTokenAnywhere" not in path.read_text(), path
    env = load(tmp_path, "deployment.yaml")["spec"]["template"]["spec"]["containers"][0]["env"]
    token = next(e for e in env if e["name"] == "HF_TOKEN")
    assert token == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN", "optional": True}},
    }
    assert not any(
        load(tmp_path, p.name).get("kind") == "Secret"
        for p in paths
        if p.suffix == ".yaml" and p.parent == tmp_path
    )


def test_the_repository_python_requirements_are_pinned_with_numpy_below_2():
    requirements = python_requirements(REPOSITORY)
    names = {r.split("=")[0].split("<")[0] for r in requirements}
    assert {"numpy", "torch", "transformers"} <= names
    numpy = next(r for r in requirements if r.startswith("numpy"))
    assert numpy == "numpy<2" or numpy.startswith("numpy==1.")


def test_the_shipped_kserve_schema_is_a_valid_json_schema():
    schema = json.loads(kserve_schema().read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["kind"] == {"const": "InferenceService"}
    assert "V1beta1PredictorSpec" in schema["$defs"]


@pytest.mark.parametrize(
    ("quantity", "size"),
    [("8Gi", 8 * 2**30), ("1.5Gi", 3 * 2**29), ("512Mi", 2**29), ("1G", 10**9), ("129e6", 129 * 10**6),
     ("1k", 1000), ("1000", 1000), (".5Ki", 512)],
)  # fmt: skip
def test_memory_reads_every_kubernetes_quantity_form(quantity, size):
    from labkit.deploy.k8s import memory_bytes

    assert memory_bytes(quantity) == size


@pytest.mark.parametrize(
    "change, match",
    [
        ({"accelerator": "tpu"}, "accelerator='tpu'"),
        ({"name": "Bad_Name"}, "not a Kubernetes name"),
        ({"replicas": 5}, "between 1 and max_replicas"),
        ({"cache_size": 0}, "cache_size=0: the response cache needs 1 byte or more"),
        ({"cache_size": "lots"}, "cache_size='lots': the response cache needs 1 byte or more"),
        ({"cache_size": 8 * 2**30}, "does not fit in memory='8Gi'"),
        ({"cache_size": 1024, "memory": "lots"}, "memory='lots' is not a Kubernetes memory"),
        ({"cache_size": 1024, "memory": "1K"}, "memory='1K' is not a Kubernetes memory"),
        ({"models": ()}, "the manifests need the models to deploy"),
    ],
)
def test_bad_settings_are_refused_with_the_value_named(change, match):
    with pytest.raises(ConfigError, match=match):
        manifests(replace(DeploySettings(models=ONE), **change))


# -- pipelines and the response cache ----------------------------------------------------------
def test_every_pipeline_travels_whole_with_the_packages_its_steps_import(tmp_path):
    """A chosen ensemble brings its steps and ``ask`` (BLS) the models its parameters name; the
    pod loads exactly those, explicitly, and the image holds what they import: the tokenizer
    step's ``tokenizers``, which ``ask`` and its callees do not need."""
    repo = Repository(REPOSITORY)
    steps = [step.model_name for step in repo.config("minilm_pipeline").ensemble_scheduling.step]
    called = {k: v.string_value for k, v in repo.config("ask").parameters.items()}
    assert deployed_models(REPOSITORY, ["minilm_pipeline"]) == sorted(["minilm_pipeline", *steps])
    assert deployed_models(REPOSITORY, ["ask"]) == sorted(
        ["ask", called["embedding_model"], called["llm_model"]]
    )
    write_manifests(REPOSITORY, tmp_path, DeploySettings(models=("minilm_pipeline",)))
    args = load(tmp_path, "deployment.yaml")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--model-control") or a.startswith("--load")] == [
        "--model-control-mode=explicit",
        "--load-model=minilm_encode",
        "--load-model=minilm_pipeline",
        "--load-model=minilm_tokenize",
    ]
    requirements = (tmp_path / "requirements.txt").read_text().split()
    assert any(r.startswith("tokenizers==") for r in requirements), requirements
    assert requirements == python_requirements(REPOSITORY, sorted(["minilm_pipeline", *steps]))
    code = main(["deploy", "k8s", "--model-repository", str(REPOSITORY), "--out",
                 str(tmp_path / "ask"), "--model", "ask", "--kserve"])  # fmt: skip
    assert code == 0
    model = load(tmp_path / "ask", "inferenceservice.yaml")["spec"]["predictor"]["model"]
    loaded = [a.removeprefix("--load-model=") for a in model["args"] if a.startswith("--load-m")]
    assert loaded == ["ask", "minilm", "smollm2_stream"]
    assert "--model-control-mode=explicit" in model["args"]
    asked = (tmp_path / "ask" / "requirements.txt").read_text().split()
    assert not any(r.startswith("tokenizers==") for r in asked), asked
    assert any(r.startswith("transformers==") for r in asked), asked  # minilm, smollm2_stream


def test_by_default_every_model_the_image_runs_is_deployed_and_smollm2_vllm_is_left_out(
    tmp_path, caplog
):
    """smollm2_vllm's stub runs in the checkout's .venv-vllm, which no image has: it is left out
    with a warning (and a line of the README) that sends it to Triton's vLLM image."""
    names = Repository(REPOSITORY).models()
    with caplog.at_level(logging.WARNING, logger="labkit.deploy.k8s"):
        write_manifests(REPOSITORY, tmp_path, DeploySettings())
    warned = [r.getMessage() for r in caplog.records if "smollm2_vllm" in r.getMessage()]
    assert len(warned) == 1 and "vllm-python-py3" in warned[0], warned
    assert "write_vllm_backend_model" in warned[0] and ".venv-vllm" in warned[0]
    args = load(tmp_path, "deployment.yaml")["spec"]["template"]["spec"]["containers"][0]["args"]
    loaded = [a.removeprefix("--load-model=") for a in args if a.startswith("--load-model=")]
    assert loaded == [n for n in names if n != "smollm2_vllm"]
    assert "--model-control-mode=explicit" in args and "--model-control-mode=none" not in args
    readme = (tmp_path / "README.md").read_text()
    assert "- `smollm2_vllm`: its stub runs in the lab's 'vllm' environment" in readme
    assert not any(
        r.startswith("vllm") for r in (tmp_path / "requirements.txt").read_text().split()
    )


@pytest.mark.parametrize(
    ("models", "match"),
    [
        (("smollm2_vllm",), r"smollm2_vllm cannot be deployed in this image: .*vllm-python-py3"),
        (("nope", "minilm"), r"no model 'nope' in the repository 'model_repository'; its models: "
                             r"ask, minilm, .*smollm2_vllm"),
    ],
)  # fmt: skip
def test_a_model_the_image_cannot_run_or_an_unknown_one_is_refused_with_the_reason(
    tmp_path, models, match
):
    with pytest.raises(ConfigError, match=match):
        write_manifests(REPOSITORY, tmp_path, DeploySettings(models=models))
    assert not list(tmp_path.iterdir())


def test_a_pipeline_that_needs_a_model_the_image_cannot_run_is_refused_or_left_out(
    tmp_path, caplog
):
    repo = Repository(REPOSITORY).copy_to(tmp_path / "repo")
    repo.edit("ask", parameters={"llm_model": "smollm2_vllm"})
    with pytest.raises(ConfigError, match="ask cannot be deployed.*it needs smollm2_vllm, and"):
        deployed_models(repo, ["ask"])
    with caplog.at_level(logging.WARNING, logger="labkit.deploy.k8s"):
        chosen = deployed_models(repo)
    assert "ask" not in chosen and "smollm2_vllm" not in chosen and "minilm" in chosen
    assert any("leaving ask out" in r.getMessage() for r in caplog.records)


def test_the_readme_names_the_repository_by_its_folder_and_copies_exactly_the_deployed_models(
    tmp_path,
):
    write_manifests(REPOSITORY, tmp_path, DeploySettings(models=("ask",)))
    readme = (tmp_path / "README.md").read_text()
    assert str(ROOT) not in readme and str(tmp_path) not in readme
    command = "cp -rL model_repository/ask model_repository/minilm model_repository/smollm2_stream"
    assert f"`{command} <mount>/`" in readme
    assert "- `smollm2`: not chosen (`--model`)" in readme


def test_copy_repository_copies_exactly_the_deployed_models_with_links_resolved(tmp_path):
    copied = copy_repository(
        REPOSITORY, tmp_path / "claim", DeploySettings(models=("minilm_pipeline",))
    )
    assert sorted(p.name for p in copied.iterdir()) == [
        "minilm_encode",
        "minilm_pipeline",
        "minilm_tokenize",
    ]
    shared = copied / "minilm_encode" / "1" / "minilm.py"  # a link to minilm's code in the repo
    assert (REPOSITORY / "minilm_encode" / "1" / "minilm.py").is_symlink()
    assert not shared.is_symlink()
    assert shared.read_text() == (REPOSITORY / "minilm" / "1" / "model.py").read_text()
    assert not list(copied.rglob("__pycache__"))
    with pytest.raises(ConfigError, match="it is not empty"):
        copy_repository(REPOSITORY, copied, DeploySettings(models=ONE))


def test_a_copied_config_that_names_a_path_of_this_machine_is_refused(tmp_path):
    repo = Repository(REPOSITORY).copy_to(tmp_path / "repo")
    weights = tmp_path / "weights"
    repo.edit("minilm", parameters={"huggingface_model": str(weights)})
    with pytest.raises(ConfigError, match=rf"minilm/config.pbtxt names {weights}, a path of "
                                          "this machine that the pod cannot reach"):  # fmt: skip
        copy_repository(repo, tmp_path / "claim", DeploySettings(models=("ask",)))
    assert list((tmp_path / "claim").iterdir()) == []  # nothing half-copied is left


def test_the_load_arguments_name_each_model_once_after_explicit_mode():
    settings = DeploySettings(models=("a", "b"))
    assert load_args(settings) == [
        "--model-control-mode=explicit",
        "--load-model=a",
        "--load-model=b",
    ]


def test_a_cache_size_starts_triton_with_the_images_own_cache_in_every_form():
    size = 64 * 2**20
    flags = [f"--cache-config=local,size={size}", "--cache-directory=/opt/tritonserver/caches"]
    plain = manifests(DeploySettings(cache_size=size, requirements=("numpy==1.26.4",), models=ONE))
    container = plain["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-2:] == flags
    kserve = manifests(
        DeploySettings(cache_size=size, kserve=True, requirements=("x==1",), models=ONE)
    )
    assert kserve["inferenceservice.yaml"]["spec"]["predictor"]["model"]["args"][-2:] == flags
    ngc = manifests(
        DeploySettings(cache_size=size, image=ngc_image(), requirements=("x==1",), models=ONE)
    )
    script = ngc["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert script.endswith(" ".join(flags))  # after the pip install, on tritonserver's line
    none = manifests(DeploySettings(requirements=("x==1",), models=ONE))
    args = none["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith("--cache")]


def test_a_repository_with_a_cached_model_gets_a_cache_unless_one_is_given(tmp_path):
    from labkit import pipeline

    repo = Repository(REPOSITORY).copy_to(tmp_path / "repo")
    pipeline.add_cached_twin(repo)  # minilm_cached: response_cache { enable: true }
    write_manifests(repo.path, tmp_path / "out", DeploySettings())
    container = load(tmp_path / "out", "deployment.yaml")["spec"]["template"]["spec"]
    args = container["containers"][0]["args"]
    assert f"--cache-config=local,size={DEFAULT_CACHE_BYTES}" in args
    readme = (tmp_path / "out" / "README.md").read_text()
    assert f"Response cache: {DEFAULT_CACHE_BYTES} bytes" in readme and "`minilm_cached`" in readme
    code = main(["deploy", "k8s", "--model-repository", str(repo.path), "--out",
                 str(tmp_path / "cli"), "--cache-size", "1048576"])  # fmt: skip
    assert code == 0
    args = load(tmp_path / "cli", "deployment.yaml")["spec"]["template"]["spec"]
    assert "--cache-config=local,size=1048576" in args["containers"][0]["args"]
    write_manifests(REPOSITORY, tmp_path / "plain", DeploySettings())
    assert "Response cache: off" in (tmp_path / "plain" / "README.md").read_text()
