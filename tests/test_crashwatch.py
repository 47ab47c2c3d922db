"""The crash watch reads Triton's crashes out of kernel log records, and names the test."""

from __future__ import annotations

import json

import crashwatch


def test_a_stub_and_a_server_segfault_are_found_and_other_records_are_not():
    records = [
        "6,101,5000,-;triton_python_b[8384]: segfault at 7f75895000c8 ip 00007f758a8aa370 sp "
        "00007ffd error 4 in libc.so.6[8c370,7f758a846000+156000] likely on CPU 1\n SUBSYSTEM=x",
        "4,102,5001,-;tritonserver[77]: segfault at 0 ip 0 sp 0 error 6 in libstdc++.so.6",
        "6,103,5002,-;python3[99]: segfault at 0 ip 0 error 4 in libc.so.6",
        "6,104,5003,-;EXT4-fs (vda): mounted filesystem",
    ]
    found = crashwatch.parse(records)
    assert [(process, pid) for process, pid, _ in found] == [
        ("triton_python_b", 8384),
        ("tritonserver", 77),
    ]
    assert found[0][2].startswith("triton_python_b[8384]: segfault at 7f75895000c8")


def test_the_summary_counts_each_tests_crashes_across_workers(tmp_path):
    rows = [
        {"test": "tests/a.py::t", "worker": "gw0", "process": "triton_python_b", "pid": 1},
        {"test": "tests/a.py::t", "worker": "gw0", "process": "triton_python_b", "pid": 2},
        {"test": "tests/b.py::u", "worker": "gw1", "process": "tritonserver", "pid": 3},
        {"test": "tests/b.py::u", "worker": "gw0", "process": "tritonserver", "pid": 3},
    ]
    for row in rows:
        with open(tmp_path / f"{row['worker']}.jsonl", "a") as out:
            out.write(json.dumps(row | {"line": "x"}) + "\n")
    assert crashwatch.summary(tmp_path) == [
        "2 x triton_python_b in tests/a.py::t",
        "1 x tritonserver in tests/b.py::u",
    ]
    assert crashwatch.summary(tmp_path / "none") == []
