"""The tiers' marker rule (tests/conftest.py, FastTierGuard): an unmarked test, which
``make check`` runs, fails when it starts a process or runs past the fast tier's bound, and the
failure names the test, the command and the marker to add. Planted tests run through the guard
in a pytest of their own (pytester, in this process)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from conftest import (
    FAST_TIER_LIMIT_S,
    FILE_SECONDS,
    TIER_MARKERS,
    FastTierGuard,
    duration_fault,
    file_weights,
    marker_for,
    process_fault,
    runs_a_fake,
)

ROOT = Path(__file__).resolve().parent.parent
MARKERS_INI = "[pytest]\nmarkers =\n" + "".join(f"    {m}: a tier\n" for m in TIER_MARKERS)


def run_planted(pytester: pytest.Pytester, source: str, limit_s: float = FAST_TIER_LIMIT_S):
    pytester.makeini(MARKERS_INI)
    pytester.makepyfile(test_planted=source)
    return pytester.runpytest("-p", "no:cacheprovider", plugins=[FastTierGuard(limit_s)])


PLANTED_SERVER = """
import subprocess, sys

import pytest

SERVER = [sys.executable, "-m", "http.server", "0"]

def test_unmarked_starts_a_server():
    subprocess.Popen(SERVER).wait(timeout=1)

def test_unmarked_hides_the_refusal():
    try:
        subprocess.run(SERVER, timeout=1)
    except BaseException:
        pass

@pytest.mark.integration
def test_marked_starts_a_process():
    assert subprocess.run(["true"], timeout=60).returncode == 0

def test_unmarked_starts_nothing():
    assert sum(range(4)) == 6
"""


def test_an_unmarked_test_that_starts_a_server_fails_naming_it_the_command_and_the_marker(
    pytester,
):
    result = run_planted(pytester, PLANTED_SERVER)
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_planted.py::test_unmarked_starts_a_server is in the fast tier*started a "
            "process: *python* -m http.server 0",
            "*Mark it @pytest.mark.integration*",
        ]
    )
    # a refusal the test caught still fails it
    result.stdout.fnmatch_lines(["*test_unmarked_hides_the_refusal is in the fast tier*"])


def test_a_fake_tool_the_test_wrote_runs_in_the_fast_tier(pytester):
    source = """
    import os, stat, subprocess

    def test_fake_nvidia_smi(tmp_path, monkeypatch):
        fake = tmp_path / "nvidia-smi"
        fake.write_text("#!/bin/sh\\necho 'GPU 0: fake'\\n")
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        assert subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    """
    run_planted(pytester, source).assert_outcomes(passed=1)


def test_an_unmarked_test_past_the_bound_fails_naming_the_slowest(pytester):
    source = """
    import time

    import pytest

    def test_unmarked_sleeps():
        time.sleep(0.6)

    @pytest.mark.slow
    def test_marked_sleeps():
        time.sleep(0.6)

    def test_unmarked_is_quick():
        pass
    """
    result = run_planted(pytester, source, limit_s=0.3)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_unmarked_sleeps's call took 0.* s, over the fast tier's 0.3 s.",
            "Mark it @pytest.mark.slow*",
            "The slowest unmarked tests so far:",
            "*0.* s  test_planted.py::test_unmarked_sleeps",
        ]
    )


def test_the_failure_names_a_kernel_and_where_it_was_started():
    kernel = [sys.executable, "-m", "ipykernel_launcher", "-f", "k.json"]
    fault = process_fault("tests/test_x.py::test_y", kernel, thread="labkit-launcher")
    assert fault.startswith("tests/test_x.py::test_y is in the fast tier")
    assert "(from thread 'labkit-launcher')" in fault and "-m ipykernel_launcher -f k.json" in fault
    assert marker_for(" ".join(kernel)).startswith("integration (notebook if")
    assert marker_for("perf_analyzer -m sleepy") == "integration"


def test_only_a_program_under_the_tests_own_folder_counts_as_a_fake(tmp_path):
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    assert runs_a_fake(["docker", "version"], path, tmp_path)
    assert runs_a_fake([fake, "version"], None, tmp_path)
    assert not runs_a_fake(["sh", "-c", "exit 0"], path, tmp_path)
    assert not runs_a_fake(["docker", "version"], os.environ["PATH"], tmp_path)
    assert not runs_a_fake("docker version", path, tmp_path)  # a shell line
    assert not runs_a_fake(["docker", "version"], path, None)  # a test without tmp_path


def test_the_bound_is_20_s_and_the_slowest_are_listed_first():
    slowest = [(f"t{i}", 30.0 - i) for i in range(8)]
    assert duration_fault("t", "call", FAST_TIER_LIMIT_S, slowest, FAST_TIER_LIMIT_S) is None
    fault = duration_fault("t", "setup", 21.5, slowest, 20.0)
    assert fault is not None and "t's setup took 21.5 s, over the fast tier's 20 s" in fault
    assert [line.split()[-1] for line in fault.splitlines()[-5:]] == ["t0", "t1", "t2", "t3", "t4"]


class Planted:
    """A collected item as the schedule sees it: its file and its markers."""

    def __init__(self, path: Path, *markers: str):
        self.path, self.markers = path, markers

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_a_measured_file_weighs_its_seconds_and_a_new_one_the_sum_of_its_markers(tmp_path):
    measured, new = tmp_path / "tests" / "test_aiperf.py", tmp_path / "tests" / "test_new.py"
    items = [
        Planted(measured, "integration"),
        Planted(new, "integration"),
        Planted(new, "integration", "slow"),
        Planted(new),
    ]
    assert file_weights(items, tmp_path) == {measured: 86.0, new: 5.0 + 40.0 + 0.1}
    elsewhere = Path("/elsewhere/tests/test_aiperf.py")  # not under the root: by its markers
    assert file_weights([Planted(elsewhere, "notebook")], tmp_path) == {elsewhere: 150.0}


def test_every_file_the_schedule_measured_is_still_in_the_suite():
    gone = [name for name in FILE_SECONDS if not (ROOT / name).is_file()]
    assert gone == [], f"rename or drop these in tests/conftest.py's FILE_SECONDS: {gone}"
