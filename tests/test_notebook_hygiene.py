"""The suite's notebook hook (../conftest.py) fails a notebook that shows stderr or an error."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import write_notebook

ROOT = Path(__file__).resolve().parents[1]
(ROOT / "test-artifacts").mkdir(exist_ok=True)


@pytest.mark.notebook
def test_a_notebook_that_writes_to_stderr_fails_and_a_clean_one_passes():
    # Inside the checkout (test-artifacts/ is gitignored), so that ../conftest.py applies.
    folder = Path(tempfile.mkdtemp(prefix="hygiene-", dir=ROOT / "test-artifacts"))
    try:
        write_notebook(
            folder / "noisy.ipynb", "print('fine')", "import sys; sys.stderr.write('red\\n')"
        )
        write_notebook(folder / "clean.ipynb", "print('fine')")
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(folder)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            check=False,
        )
    finally:
        shutil.rmtree(folder)
    out = done.stdout + done.stderr
    assert "1 failed, 1 passed" in out, out[-2000:]
    assert "cell 1: stderr: red" in out, out[-2000:]


def test_every_test_size_names_a_parameter_of_its_notebook():
    import ast
    import importlib.util

    import nbformat

    # the suite's root conftest.py (``from conftest import`` finds tests/conftest.py)
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    assert root_conftest.TEST_PARAMETERS
    for name, sizes in root_conftest.TEST_PARAMETERS.items():
        nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
        cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(cells) == 1, f"{name}: {len(cells)} cells tagged parameters"
        defined = {
            target.id
            for node in ast.parse(cells[0].source).body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        assert set(sizes) <= defined, f"{name}: {sorted(set(sizes) - defined)} are not parameters"
