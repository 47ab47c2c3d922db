"""``labkit doctor``: check that this machine can run the lab, and say how to fix what cannot.

Each check returns a :class:`Check` with status ``ok``, ``warn`` or ``fail`` and, unless it is ok,
the fix. :func:`run_checks` runs them all (a check that crashes is reported as a fail, never
raised); :func:`to_frame` makes a DataFrame for the notebook; the command exits 1 on any fail.
Secrets are never shown: the token check names the variable, never its value.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from . import proc
from .doctor_machine import (
    Check,
    check_docker,
    check_gpu,
    check_hub,
    check_neuron,
    check_ports,
    check_public_servers,
    check_shm,
    check_token,
    passed,
)
from .errors import LabkitError, MissingDependencyError
from .server import ServerBinary, TritonServer, locate_tritonserver

log = logging.getLogger(__name__)

STATUSES = ("ok", "warn", "fail")
PROBE_MODEL = "labkit_probe"
_PROBE_CODE = '''"""labkit doctor's probe: echoes its text input, to prove the Python backend runs."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            echoed = np.array([b"echo: " + t for t in text.reshape(-1)], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", echoed)]))
        return responses
'''


# -- Python and the server ----------------------------------------------------------------------
def check_python() -> Check:
    """This Python and its shared libpython (the Python-backend stub links it)."""
    version = ".".join(map(str, sys.version_info[:3]))
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return Check(
            "python",
            "fail",
            f"Python {version} at {sys.executable} has no shared libpython",
            "use a Python built with --enable-shared (conda, Debian's "
            "python3, or pyenv with PYTHON_CONFIGURE_OPTS=--enable-shared)",
        )
    if not (Path(libdir) / soname).exists():
        return Check(
            "python",
            "fail",
            f"{soname} is missing from {libdir}",
            "reinstall this Python; its shared library is gone",
        )
    return passed("python", f"Python {version} at {sys.executable}; {soname} in {libdir}")


def check_tritonserver() -> Check:
    binary = locate_tritonserver()
    return passed("tritonserver", f"{binary.path} (from {binary.source})")


def check_python_backend(binary: ServerBinary | None = None) -> Check:
    """The Python-backend stub exists and links *this* Python's libpython (``ldd``)."""
    binary = binary or locate_tritonserver()
    backends = binary.backend_directory or binary.path.parent.parent / "backends"
    stub = backends / "python" / "triton_python_backend_stub"
    if not stub.is_file():
        return Check(
            "python backend",
            "fail",
            f"no Python-backend stub at {stub}",
            "install the Python backend (the NGC image and nvidia-pytriton ship it)",
        )
    if not shutil.which("ldd"):
        return Check(
            "python backend",
            "warn",
            f"stub at {stub}; ldd is missing, so which libpython it loads is unknown",
            "install libc-bin to inspect it",
        )
    env = {**os.environ, **binary.env}
    out = proc.run(["ldd", stub], timeout_s=20, env=env, check=False).stdout
    line = next((ln.strip() for ln in out.splitlines() if "libpython" in ln), "")
    wanted = f"libpython{sys.version_info[0]}.{sys.version_info[1]}"
    libdir = Path(sysconfig.get_config_var("LIBDIR") or "/nonexistent").resolve()
    target = line.split("=>", 1)[-1].split("(")[0].strip()
    if wanted not in line:
        return Check(
            "python backend",
            "fail",
            f"stub {stub} is built for another Python ({line or 'no libpython'}), not {wanted}",
            "use the stub for this Python (nvidia-pytriton ships 3.8 to 3.13)",
        )
    if "not found" in target or Path(target).resolve().parent != libdir:
        return Check(
            "python backend",
            "fail",
            f"stub loads {target or line}, not this "
            f"Python's library in {libdir}; it would die with `undefined symbol: "
            "_PyModule_Add`",
            f"put {libdir} first on LD_LIBRARY_PATH (labkit's "
            "TritonServer does this for the bundled server)",
        )
    return passed("python backend", f"stub {stub} loads {target}")


def _write_probe(repository: Path) -> None:
    from google.protobuf import text_format  # noqa: PLC0415
    from tritonclient.grpc import model_config_pb2 as mc  # noqa: PLC0415

    config = mc.ModelConfig(name=PROBE_MODEL, backend="python", max_batch_size=0)
    config.input.add(name="text_input", data_type=mc.TYPE_STRING, dims=[-1])
    config.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[-1])
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    (repository / PROBE_MODEL / "1").mkdir(parents=True)
    (repository / PROBE_MODEL / "config.pbtxt").write_text(text_format.MessageToString(config))
    (repository / PROBE_MODEL / "1" / "model.py").write_text(_PROBE_CODE)


def check_server(startup_timeout_s: float = 120.0) -> Check:
    """Start Triton on free loopback ports with a Python-backend probe model and call it."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="labkit-doctor-") as tmp:
        repository = Path(tmp) / "repository"
        _write_probe(repository)
        server = TritonServer(
            repository,
            http_port=0,
            grpc_port=0,
            metrics_port=0,
            startup_timeout_s=startup_timeout_s,
            log_path=Path(tmp) / "log",
        )
        try:
            server.start()
            base = f"http://{server.http_url}"
            with urllib.request.urlopen(f"{base}/v2", timeout=10) as r:
                version = json.load(r)["version"]
            request = urllib.request.Request(
                f"{base}/v2/models/{PROBE_MODEL}/generate",
                data=json.dumps({"text_input": "hi"}).encode(),
            )
            with urllib.request.urlopen(request, timeout=30) as r:
                answer = json.load(r)["text_output"]
        except (LabkitError, OSError) as exc:
            return Check(
                "server",
                "fail",
                f"Triton could not serve a Python-backend model: {exc}",
                "read the log above; `labkit doctor` checks above name the "
                "usual causes (libpython, stub, numpy, /dev/shm)",
            )
        finally:
            server.stop()
    if answer != "echo: hi":
        return Check(
            "server",
            "fail",
            f"the probe model answered {answer!r}, not 'echo: hi'",
            "check numpy<2 in the server's Python environment",
        )
    took = time.monotonic() - start
    return passed("server", f"Triton {version} served a Python-backend model ({took:.1f} s)")


def check_numpy(version: str | None = None) -> Check:
    version = version or importlib.metadata.version("numpy")
    if int(version.split(".")[0]) >= 2:
        return Check(
            "numpy",
            "fail",
            f"numpy {version}: Triton 2.51's Python backend breaks every "
            "string (BYTES) tensor with numpy 2",
            'pip install "numpy<2" (pandas<3 too)',
        )
    return passed("numpy", f"numpy {version} (below 2, as the Python backend needs)")


# -- tools --------------------------------------------------------------------------------------
def check_perf_analyzer() -> Check:
    from .profiling import locate_perf_analyzer  # noqa: PLC0415

    locate_perf_analyzer.cache_clear()  # report the machine as it is now
    try:
        tool = locate_perf_analyzer()
    except LabkitError as exc:
        return Check(
            "perf_analyzer",
            "fail",
            str(exc).splitlines()[0],
            "apt-get install libb64-0d; pip install 'tritonclient[all]==2.51.0' "
            "nvidia-cuda-runtime-cu12",
        )
    result = proc.run([tool.path, "--version"], timeout_s=30, env=tool.environ(), check=False)
    version = (result.stdout or result.stderr).strip().splitlines()[:1]
    return passed("perf_analyzer", f"{tool.path} ({version[0] if version else 'version unknown'})")


def check_model_analyzer() -> Check:
    try:
        version = importlib.metadata.version("triton-model-analyzer")
    except importlib.metadata.PackageNotFoundError:
        return Check(
            "model analyzer",
            "warn",
            "triton-model-analyzer is not installed (only the Model Analyzer notebook needs it)",
            "pip install 'triton-model-analyzer==1.58.0' (or make install-analyzer)",
        )
    program = Path(sys.executable).parent / "model-analyzer"
    where = program if program.is_file() else shutil.which("model-analyzer")
    if not where:
        return Check(
            "model analyzer",
            "warn",
            f"triton-model-analyzer {version} is installed "
            "but its model-analyzer command is not found",
            "reinstall it in this env",
        )
    return passed("model analyzer", f"triton-model-analyzer {version} at {where}")


def check_kernel() -> Check:
    from .runner import check_kernel as kernel_python  # noqa: PLC0415

    try:
        python = kernel_python("python3")
    except LabkitError as exc:
        return Check("jupyter kernel", "fail", str(exc), "see the command in the detail")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = proc.run([python, "-c", "import labkit"], timeout_s=60, env=env, cwd="/", check=False)
    if found.returncode != 0:
        return Check(
            "jupyter kernel",
            "warn",
            f"kernel python3 runs {python}, which cannot import labkit outside the checkout",
            "run `pip install -e .` in the checkout so notebooks opened in Jupyter find labkit",
        )
    return passed("jupyter kernel", f"kernel python3 runs {python}, which imports labkit")


# -- all together -------------------------------------------------------------------------------
CHECKS: list[Callable[[], Check]] = [
    check_python,
    check_tritonserver,
    check_python_backend,
    check_numpy,
    check_server,
    check_perf_analyzer,
    check_model_analyzer,
    check_kernel,
    check_ports,
    check_public_servers,
    check_shm,
    check_gpu,
    check_neuron,
    check_docker,
    check_token,
    check_hub,
]


def run_checks(server: bool = True) -> list[Check]:
    """Run every check (``server=False`` skips starting Triton); a crash becomes a fail."""
    results = []
    for check in CHECKS:
        if check is check_server and not server:
            continue
        name = check.__name__.removeprefix("check_").replace("_", " ")
        try:
            results.append(check())
        except Exception as exc:  # noqa: BLE001 (the doctor reports, it never crashes)
            log.debug("check %s crashed", name, exc_info=True)
            results.append(
                Check(
                    name,
                    "fail",
                    f"{type(exc).__name__}: {exc}",
                    "see the detail; run `labkit -v doctor` for the traceback",
                )
            )
    return results


def to_frame(checks: Sequence[Check]):
    """A pandas DataFrame (check, status, detail, fix) for the notebook."""
    import pandas as pd  # noqa: PLC0415

    return pd.DataFrame([asdict(c) for c in checks]).rename(columns={"name": "check"})


def format_table(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status.upper():<4}  {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def exit_code(checks: Sequence[Check]) -> int:
    return 1 if any(c.status == "fail" for c in checks) else 0


def require_no_failures(checks: Sequence[Check]) -> None:
    """Raise :class:`MissingDependencyError` naming each failed check and its fix."""
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise MissingDependencyError(
            "this machine cannot run the lab yet: "
            + "; ".join(f"{c.name}: {c.detail} (fix: {c.fix})" for c in failed)
        )


def register_cli(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine for the lab; exits 1 on a failure")
    p.add_argument("--no-server", action="store_true", help="do not start a Triton server")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(handler=_cli)


def _cli(args) -> int:
    checks = run_checks(server=not args.no_server)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        print(format_table(checks))
        counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
        print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return exit_code(checks)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(subprocess.call([sys.executable, "-m", "labkit.cli", "doctor", *sys.argv[1:]]))
