"""Run a script in the vLLM environment (``.venv-vllm``) beside the model's own modules, the way
a test reads vLLM's own classes without starting Triton: the script gets the model folder and
Triton's Python-backend folder as its arguments and prints one Python literal as its last line."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "model_repository" / "smollm2_vllm"
VENV = ROOT / ".venv-vllm"


def run_in_vllm_venv(script: str, model: Path = MODEL, timeout_s: float = 300) -> object:
    """``script`` run by ``.venv-vllm``'s Python with ``model`` and the Python backend's folder as
    its arguments; the literal its last printed line holds. A failed run fails with its stderr."""
    import pytriton

    backend = Path(pytriton.__file__).parent / "tritonserver" / "backends" / "python"
    done = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", script, str(model), str(backend)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])
