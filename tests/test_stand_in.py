"""The CPU stand-in for NGC's image (``labkit image base``), the lab's image built on it
(``labkit image build --base``), and the host's pip settings served to that build.

The fast tests check the pieces (the mirror, the wheel page, the certificate, the build command);
the docker tier builds both images once per machine (``tests/docker_tier.py``) and checks what a
user's build relies on: NGC's layout, a stub that links, the lab's imports, and nothing of this
host's pip configuration left in any layer.
"""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request

import pytest
from docker_tier import base_image as built_base
from docker_tier import lab_image

from labkit.errors import MissingDependencyError
from labkit.server import base_image, docker, image, pip_server

# -- the pieces, without Docker ------------------------------------------------------------------


def test_the_mirror_is_read_from_deb822_and_one_line_sources_and_never_the_security_one(tmp_path):
    deb822 = tmp_path / "debian.sources"
    deb822.write_text(
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: http://mirror.example/debian-security\n"
    )
    assert base_image.apt_mirror(deb822) == "http://mirror.example/debian"
    security_only = tmp_path / "security.sources"
    security_only.write_text("URIs: http://mirror.example/debian-security\n")
    found = base_image.apt_mirror(security_only)
    assert "security" not in found


def test_the_build_on_a_base_takes_the_base_tag_and_the_host_network():
    cmd = image.build_command(base="triton_labkit_base:2.51-cpu")
    assert cmd[cmd.index("-t") + 1] == "triton_transformer_server:2.51-cpu"
    assert cmd[cmd.index("--network") + 1] == "host"
    assert "BASE_IMAGE=triton_labkit_base:2.51-cpu" in cmd
    assert "--network" not in image.build_command()  # NGC's build is the tutorial's, bridged


def _get(url: str, timeout_s: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        return answer.read()


def test_pip_settings_are_read_from_pips_own_report(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cert = tmp_path / "ca.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    fake = tmp_path / "python"
    report = f"global.find-links='file://{wheels} /nonexistent'\n:env:.cert='{cert}'\n"
    fake.write_text(f"#!/bin/sh\nprintf '%s' \"{report}\"\n")
    fake.chmod(0o755)
    assert pip_server.host_pip(fake) == pip_server.HostPip((wheels,), cert)


def test_the_pip_page_serves_wheels_and_the_certificate_and_nothing_else(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"W" * 10)
    (folder / "notes.txt").write_text("not a wheel")
    cert = tmp_path / "ca.pem"
    cert.write_bytes(b"PEM")
    with pip_server.serving(pip_server.HostPip((folder,), cert)) as url:
        page = _get(f"{url}wheels/", 10).decode()
        assert 'href="torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"' in page
        assert "notes.txt" not in page
        name = "torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl"
        assert _get(f"{url}wheels/{name}", 10) == b"W" * 10
        assert _get(f"{url}ca.pem", 10) == b"PEM"
        with pytest.raises(urllib.error.HTTPError) as missing:
            _get(f"{url}wheels/notes.txt")
        assert missing.value.code == 404
        missing.value.close()
    with pytest.raises(urllib.error.URLError):  # gone with the block
        _get(f"{url}ca.pem", 2)
    with pip_server.serving(pip_server.HostPip()) as nothing:
        assert nothing is None


def test_no_docker_command_is_a_sentence_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "docker command is not installed" in docker.daemon_problem()
    with pytest.raises(MissingDependencyError, match="apt-get install docker.io"):
        docker.require_daemon()


@pytest.mark.parametrize(
    ("said", "fix"),
    [
        ("Cannot connect to the Docker daemon at unix:///var/run/docker.sock.", "start it"),
        ("permission denied while trying to connect to the Docker daemon socket", "docker group"),
    ],
)
def test_a_daemon_that_cannot_be_used_is_named_with_its_fix(tmp_path, monkeypatch, said, fix):
    fake = tmp_path / "docker"
    fake.write_text(f"#!/bin/sh\necho '{said}' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    problem = docker.daemon_problem()
    assert said in problem and fix in problem


# -- the images, built for real (the docker tier) -------------------------------------------------


def _in(tag: str, *command: str) -> str:
    done = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", tag, *command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.docker
def test_the_stand_in_lays_out_triton_as_ngcs_image_does():
    tag = built_base()
    listing = _in(tag, "sh", "-c", "ls /opt/tritonserver/backends/python /opt/tritonserver/caches")
    for name in (
        "libtriton_python.so",
        "triton_python_backend_stub",
        "triton_python_backend_utils.py",
        "local",
    ):
        assert name in listing
    # the stub links against the image's own libpython and finds every library it needs
    linked = _in(tag, "ldd", "/opt/tritonserver/backends/python/triton_python_backend_stub")
    assert "not found" not in linked and "libpython3.11" in linked
    assert "Usage: tritonserver" in _in(tag, "sh", "-c", "tritonserver --help 2>&1 || true")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.docker
def test_the_labs_image_on_the_stand_in_imports_what_the_models_need_and_keeps_no_pip_settings():
    tag = lab_image()
    info = image.require_image(tag)
    assert (info.python or "").startswith("3.11")
    assert info.numpy.startswith("1.") and info.torch.endswith("+cpu") and info.torch_cuda is None
    assert (
        info.transformers
        == image.compare_with_tutorial().set_index("what").loc["transformers", "docker/Dockerfile"]
    )
    # nothing of this host's pip configuration stays: no certificate file, no setting in the
    # image's environment, no local path in its history (the loopback page is dead after the build)
    pip_env = _in(tag, "sh", "-c", "env | grep '^PIP_' | sort").split()
    assert pip_env == [
        "PIP_BREAK_SYSTEM_PACKAGES=1",
        "PIP_DISABLE_PIP_VERSION_CHECK=1",
        "PIP_NO_CACHE_DIR=1",
    ]
    assert "host-ca.pem" not in _in(tag, "ls", "/tmp")
    history = subprocess.run(
        ["docker", "history", "--no-trunc", "--format", "{{.CreatedBy}}", tag],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "HOST_PIP_URL=http://127.0.0.1:" in history  # the build did get the settings...
    settings = pip_server.host_pip()
    for local in [*map(str, settings.folders), str(settings.cert or "/nonexistent/cert")]:
        assert local not in history, f"{local} is in the image's history"  # ...by address only
