"""No file the lab writes for another machine names a path of the machine that wrote it.

Each test writes what the lab hands out into ``tmp_path`` and scans it with
:func:`labkit.deploy.scan`, which fails on the checkout, ``tmp_path`` itself, the temporary
folder, the home folder, ``LABKIT_CACHE``, ``HF_HOME`` and this venv (``sys.prefix``), naming the
file and line: the Kubernetes and KServe manifests and the copy of the models into the claim,
Triton's vLLM image command and its ``backend: "vllm"`` twin, the Neuron model folders, the
vllm-neuron setup script and its engine arguments, and the GPU check's bundle. The first test
shows the checker catches such a path.

One command is exempt, narrowly: the Neuron guide's ``docker run`` (notebook 05) serves the
repository the notebook just built, on the inf2 host that runs it, so its ``-v SRC:/models``
names that host's own folder; the test takes exactly that pair out and scans the rest.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from labkit.deploy import DeploySettings, copy_repository, machine_paths, scan, write_manifests
from labkit.gpu_check import build_bundle, bundle, remote
from labkit.neuron import walkthrough
from labkit.neuron.compiler import CompiledModel
from labkit.neuron.gen import GenOptions, TensorSpec, generate_model
from labkit.neuron.vllm import setup_command
from labkit.repository import Repository
from labkit.repository.folder import EXECUTION_ENV_PATH
from labkit.server.image import vllm_run_command, write_vllm_backend_model
from labkit.settings import project_root

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY = ROOT / "model_repository"


def assert_portable(folder: Path, tmp_path: Path, *, binaries: tuple[str, ...] = ()) -> None:
    """No path of this machine in ``folder``'s text files; binary files only under
    ``binaries`` (folders relative to ``folder``, copied unchanged from a wheel)."""
    findings, binary = scan(folder, machine_paths(tmp_path))
    assert not findings, "paths of the writing machine:\n" + "\n".join(map(str, findings))
    unexpected = [
        p for p in binary if not any(p.relative_to(folder).is_relative_to(b) for b in binaries)
    ]
    assert not unexpected, f"binary files the scan cannot read: {unexpected}"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# -- the checker -------------------------------------------------------------------------------
def test_the_checker_names_the_file_and_line_of_each_path_of_this_machine(tmp_path):
    out = tmp_path / "out"
    venv = project_root() / ".venv-vllm"
    bad = write(
        out / "m" / "config.pbtxt",
        f'name: "m"\nparameters {{ key: "{EXECUTION_ENV_PATH}" value {{ string_value: "{venv}" '
        f"}} }}\n# weights in {Path.home()}/.cache/x, and {tmp_path}\n",
    )
    (out / "link").symlink_to(tmp_path / "elsewhere")
    write(
        out / "clean.txt",
        "$$TRITON_MODEL_DIRECTORY/../../.venv-vllm /opt/tritonserver/caches /var/tmp/x "
        "/models /dev/shm https://example.org/tmp/x\n",
    )
    findings, binary = scan(out, machine_paths(tmp_path))
    said = {(f.file.name, f.line, f.path) for f in findings}
    assert said == {
        ("config.pbtxt", 2, str(venv)),
        ("config.pbtxt", 3, f"{Path.home()}/.cache/x"),
        ("config.pbtxt", 3, str(tmp_path)),
        ("link", 0, str(tmp_path / "elsewhere")),
    }
    assert str(next(f for f in findings if f.line == 2)) == f"{bad}:2: {venv}"
    assert binary == []
    with pytest.raises(AssertionError, match=r"config.pbtxt:2: "):
        assert_portable(out, tmp_path)


def test_the_checker_reads_no_binary_file_but_says_which_it_skipped(tmp_path):
    blob = tmp_path / "lib.so"
    blob.write_bytes(b"\x7fELF\0" + str(tmp_path).encode())
    assert scan(blob, machine_paths(tmp_path)) == ([], [blob])


# -- Kubernetes and KServe ---------------------------------------------------------------------
def run_repository(tmp_path: Path) -> Repository:
    """A run's copy of the lab's repository as a run leaves it: smollm2_vllm pointed at this
    checkout's .venv-vllm by its absolute path (set_execution_environments)."""
    repo = Repository(REPOSITORY).copy_to(tmp_path / "run" / "model_repository")
    venv = str(project_root() / ".venv-vllm")
    repo.edit("smollm2_vllm", parameters={EXECUTION_ENV_PATH: venv})
    return repo


@pytest.mark.parametrize(
    "settings",
    [
        DeploySettings(),
        DeploySettings(kserve=True),
        DeploySettings(accelerator="gpu"),
        DeploySettings(accelerator="neuron"),
    ],
    ids=["plain", "kserve", "gpu", "neuron"],
)
def test_the_k8s_manifests_and_the_copy_into_the_claim_name_no_path_of_this_machine(
    tmp_path, settings
):
    repo = run_repository(tmp_path)
    written = write_manifests(repo, tmp_path / "k8s", settings)
    assert {p.name for p in written} >= {"pvc.yaml", "README.md", "requirements.txt"}
    assert_portable(tmp_path / "k8s", tmp_path)
    claim = copy_repository(repo, tmp_path / "claim", settings)
    assert "smollm2_vllm" not in {p.name for p in claim.iterdir()}
    # A checkout where `labkit prepare` ran (make install's warm-up does) links each model's
    # built weights; the claim gets them copied, links resolved: safetensors, binary, as built.
    weights = tuple(p.relative_to(claim) for p in claim.glob("*/weights"))
    assert_portable(claim, tmp_path, binaries=weights)


# -- Triton's vLLM image -----------------------------------------------------------------------
def test_the_vllm_image_command_and_its_backend_twin_name_no_path_of_this_machine(tmp_path):
    out = tmp_path / "gpu"
    twin = write_vllm_backend_model(
        out / "gpu_vllm_backend" / "smollm2_vllm", {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    )
    write(out / "docker_command.sh", shlex.join(vllm_run_command(twin.parent)) + "\n")
    assert_portable(out, tmp_path)


# -- Neuron ------------------------------------------------------------------------------------
def test_the_neuron_setups_name_no_path_of_this_machine(tmp_path):
    """The inf2 folders notebook 05 writes (the generator's add_sub split and batching options,
    the TensorFlow folder), the vLLM Neuron model with its twin's engine arguments and setup
    script, the script's command, and the guide's docker command less its mount of the
    repository it serves on the same host (see the module's docstring)."""
    out = tmp_path / "neuron"
    # compiled for the CPU here: the inf2 folders name the artifact the inf2 host compiles
    compiled = CompiledModel(tmp_path / "add_sub.cpu.pt", "cpu", "key", False, ((1, 4),) * 2,
                             ("int64",) * 2)  # fmt: skip
    io = {
        "inputs": [TensorSpec(f"INPUT__{i}", "INT64", (4,)) for i in range(2)],
        "outputs": [TensorSpec(f"OUTPUT__{i}", "INT64", (4,)) for i in range(2)],
    }
    served_here = GenOptions(
        tmp_path / "here" / "add_sub",
        "1/add_sub.cpu.pt",
        target="cpu",
        compiled_elsewhere=True,
        **io,
    )  # fmt: skip  (not handed out)
    stand_in = generate_model(served_here).path
    walkthrough.core_split(out, compiled)
    walkthrough.batching_options(out, compiled, stand_in)
    walkthrough.tensorflow_model(out)
    made, cfg = walkthrough.llm_model(out)
    write(out / "engine_args.json", json.dumps(made.engine_args) + "\n")
    write(out / "setup_command.sh", shlex.join(setup_command(made, cfg)) + "\n")
    served = tmp_path / "neuron" / "repository"
    words = shlex.split(walkthrough.docker_command("inf2.xlarge", served, "tritonserver-neuron"))
    mount = words.index(f"{served.resolve()}:/models")
    assert words[mount - 1] == "-v"
    write(out / "docker_command.sh", shlex.join(words[: mount - 1] + words[mount + 1 :]) + "\n")
    assert (made.vllm_backend_path / "1" / "model.json").is_file() and made.setup_script.is_file()
    assert_portable(out, tmp_path)


@pytest.mark.integration
def test_the_vllm_neuron_setup_plan_names_no_path_of_this_machine(tmp_path):
    """What notebook 05 shows of the setup script (``--dry-run``: its plan for the inf2 host)."""
    made, cfg = walkthrough.llm_model(tmp_path / "neuron")
    plan = write(tmp_path / "plan" / "setup_dry_run.txt", walkthrough.setup_dry_run(made, cfg))
    assert cfg.execution_env_path in plan.read_text()
    assert_portable(plan.parent, tmp_path)


# -- the GPU check's bundle --------------------------------------------------------------------
def test_the_gpu_checks_model_configs_name_no_path_of_this_machine(tmp_path):
    bundle.write_repository(tmp_path / "bundle" / "repository", "KIND_GPU", concurrency=8)
    bundle.write_model_config(tmp_path / "bundle" / "model", "smollm2-135m")
    assert_portable(tmp_path / "bundle", tmp_path)


@pytest.mark.integration
@pytest.mark.slow
def test_the_gpu_bundle_names_no_path_of_this_machine(tmp_path):
    """The bundle as built (unpacked: ``archive=False``), about 27 s here. The server, its
    libraries and the numpy wheel are binaries copied from their wheels unchanged; the scan
    reads every text file, and no binary file elsewhere."""
    built = build_bundle(tmp_path / "bundle", size="tiny", archive=False)
    wheel = built.manifest["numpy_wheel"]
    assert_portable(built.path, tmp_path, binaries=(remote.TREE, wheel))
