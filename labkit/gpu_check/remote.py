"""The GPU check's remote part: what runs on the bare GPU machine, from a bundle made here.

That machine has Python, torch, transformers and numpy (2.x) and nothing fetchable; labkit itself
is not importable there (it needs tritonclient, pandas, protobuf...). So this file uses only the
standard library at import time, and torch and transformers where it builds the model; the
bundle (:mod:`labkit.gpu_check.bundle`) copies it in as ``run.py``::

    python3 run.py --bundle DIR --out OUT     # what scripts/gpu-check.sh --run does

It unpacks Triton 2.51 (server, Python backend, the stub for this Python), puts the bundled
numpy<2 first on the stub's ``PYTHONPATH`` (the 2.51 backend breaks on numpy 2) and this
Python's libpython first on ``LD_LIBRARY_PATH``; builds a model from the bundled config with
random weights (seeded); starts Triton with one instance of each model on the GPU
(``KIND_GPU``), then:

1. checks that batched greedy answers equal the answers alone in float32, and measures that
   agreement in float16 and bfloat16 (and against float32);
2. runs the batching benchmark with dynamic batching off, then on (the same load, one model
   each), and the in-flight model's when the bundle has one;
3. reads GPU utilisation and memory from Triton's metrics (and ``nvidia-smi`` beside them)
   while the benchmarks run.

Everything goes into ``OUT/gpu-check.json``, rewritten after every step so that a run cut short
still says how far it got, plus the end of the server's log. Exit status: 0 every check passed,
1 a check failed, 2 the runner itself failed, 3 not run (the reason is in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import site
import socket
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

# -- the bundle's layout (the builder writes these names) ---------------------------------------
MANIFEST = "manifest.json"
RUNNER = "run.py"
ARCHIVE = "bundle.tar.xz"  # the server, its libraries, the repository, the model's config
TREE = "tree"  # the same, unpacked: what a test bundle holds instead of the archive
SERVER_DIR = "pytriton/tritonserver"
LIBS_DIR = "nvidia_pytriton.libs"
REPOSITORY_DIR = "repository"
MODEL_DIR = "model"  # config.json, generation_config.json and the tokenizer: no weights
RESULT = "gpu-check.json"
SERVER_LOG = "tritonserver.log"

EXIT_PASSED, EXIT_FAILED, EXIT_ERROR, EXIT_NOT_RUN = 0, 1, 2, 3
GLIBC_NEEDED = (2, 35)  # nvidia-pytriton 0.7.0 is a manylinux_2_35 wheel

#: Prompts of different lengths, so that a batch is padded (on the left).
PROMPTS = [
    "I am going",
    "Where is the nearest",
    "How can you be",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived",
    "def fibonacci(n):",
    "A short poem about the sea:",
    "The three primary colours are",
]
BENCH_PROMPT = "Where is the nearest"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="labkit's GPU check, run from its bundle")
    parser.add_argument("--bundle", required=True, help="the bundle folder (manifest.json...)")
    parser.add_argument("--out", required=True, help="where gpu-check.json goes")
    parser.add_argument("--work", help="scratch folder (default: a new one under TMPDIR)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="the whole run's bound")
    parser.add_argument("--bench-seconds", type=float, help="each benchmark's window")
    parser.add_argument("--keep-work", action="store_true", help="leave the scratch folder")
    args = parser.parse_args(argv)
    check = Check(Path(args.bundle), Path(args.out), args.budget_s, args.bench_seconds)
    return check.run(Path(args.work) if args.work else None, keep=args.keep_work)


class Check:
    """One run of the check; :attr:`result` is what gpu-check.json holds."""

    def __init__(
        self, bundle: Path, out: Path, budget_s: float, bench_seconds: float | None = None
    ) -> None:
        self.bundle = bundle.resolve()
        self.out = out
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        self.manifest = json.loads((self.bundle / MANIFEST).read_text())
        self.bench_seconds = bench_seconds or float(self.manifest["bench"]["seconds"])
        self.result: dict = {
            "check": "labkit gpu check",
            "status": "running",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "bundle": {k: self.manifest[k] for k in ("labkit", "created", "python", "device")},
            "failures": [],
        }
        self.server: Server | None = None

    # -- the steps ---------------------------------------------------------------------------
    def run(self, work: Path | None, keep: bool = False) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        made = work is None
        work = work or Path(tempfile.mkdtemp(prefix="labkit-gpu-check-"))
        code = EXIT_ERROR
        try:
            reasons = self.preflight()
            if reasons:
                self.result.update(status="not_run", reason="; ".join(reasons))
                code = EXIT_NOT_RUN
            else:
                self.serve_and_measure(work)
                failed = self.result["failures"]
                self.result["status"] = "failed" if failed else "passed"
                code = EXIT_FAILED if failed else EXIT_PASSED
        except Exception as exc:  # noqa: BLE001 (every failure ends up in the JSON)
            self.result.update(
                status="error",
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
            )
        finally:
            if self.server is not None:
                self.server.stop()
                self.server.copy_log(self.out / SERVER_LOG)
            self.result["seconds"] = round(time.monotonic() - self.deadline + self.budget_s, 1)
            self.save()
            sys.stdout.write(summary(self.result) + "\n")  # the device run's output shows it
            if made and not keep:
                shutil.rmtree(work, ignore_errors=True)
        return code

    def save(self) -> None:
        self.result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        tmp = self.out / f".{RESULT}.tmp"
        tmp.write_text(json.dumps(self.result, indent=2, default=str) + "\n")
        tmp.replace(self.out / RESULT)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def preflight(self) -> list[str]:
        """This machine's facts; the reasons the check cannot run here (empty: it can)."""
        host, reasons = host_facts(), []
        self.result["host"] = host
        self.save()
        wanted = self.manifest["python"]
        if host["python"] != wanted:
            reasons.append(
                f"this is Python {host['python']}, the bundle's stub is for {wanted}; "
                f"rebuild it with scripts/gpu-check.sh --bundle DIR --python {host['python']}"
            )
        libc, version = platform.libc_ver()
        if libc == "glibc" and _version(version) < GLIBC_NEEDED:
            reasons.append(
                f"glibc {version}: the bundled Triton (nvidia-pytriton's manylinux_2_35 build) "
                "needs glibc 2.35 or newer"
            )
        if not host["libpython"]:
            reasons.append(
                f"{sys.executable} has no shared libpython, which the Python backend's stub links"
            )
        for name in ("torch", "transformers"):
            if host.get(name) is None:
                reasons.append(f"{name} is not installed for {sys.executable}")
        if self.manifest["device"] == "gpu" and not host.get("cuda_available"):
            reasons.append(
                "no usable NVIDIA GPU: torch.cuda.is_available() is False "
                f"(torch {host.get('torch')}, CUDA build {host.get('torch_cuda')}, "
                f"nvidia-smi: {host.get('nvidia_smi') or 'not found'})"
            )
        return reasons

    def serve_and_measure(self, work: Path) -> None:
        root = unpack(self.bundle, work)
        stub_site = install_stub_numpy(self.bundle, self.manifest, work)
        self.result["stub_python"] = stub_imports(stub_site)
        self.save()
        weights = build_model(root / MODEL_DIR, work / "weights", self.manifest["model"]["seed"])
        self.result["model"] = {**self.manifest["model"], **weights}
        repository = copy_repository(root / REPOSITORY_DIR, work / "repository", work / "weights")
        self.server = Server(root, repository, stub_site, work / SERVER_LOG)
        failed = self.start_server()
        self.save()
        self.result["agreement"] = self.agreement()
        self.save()
        self.result["benchmarks"] = self.benchmarks(failed)
        self.result["batching_speedup"] = speedup(self.result["benchmarks"])

    def start_server(self) -> dict[str, str]:
        """Start Triton; the optional models that failed to load, with Triton's reasons."""
        started = time.monotonic()
        failed = self.server.start(timeout_s=min(240.0, self.left_s() - 60))
        instances = self.server.instances()
        self.result["server"] = {
            "seconds_to_ready": round(time.monotonic() - started, 1),
            "version": self.server.version(),
            "instances": instances,
            "failed_to_load": failed,
        }
        optional = {self.manifest["bench"]["models"].get("inflight")}
        for name, reason in failed.items():
            if name not in optional:
                raise RuntimeError(
                    f"model {name} failed to load: {reason}\n{self.server.log_tail()}"
                )
        wanted = "cuda" if self.manifest["device"] == "gpu" else "cpu"
        for model, where in instances.items():
            if model not in failed and not where.startswith(wanted):
                self.result["failures"].append(f"{model} runs on {where}, not on {wanted}")
        return failed

    def benchmarks(self, failed: dict[str, str]) -> dict:
        """Each benchmark of the manifest, saved as it ends; one that cannot run says why."""
        bench, found = self.manifest["bench"], {}
        self.result["benchmarks"] = found
        if "inflight" not in bench["models"]:
            found["inflight"] = {"status": "not_run", "reason": bench["note"]}
        for name, model in bench["models"].items():
            if model in failed:
                found[name] = {"status": "not_run", "reason": f"did not load: {failed[model]}"}
            elif self.left_s() < self.bench_seconds + 30:
                found[name] = {"status": "not_run", "reason": "out of time"}
                self.result["failures"].append(f"benchmark {name}: out of time")
            else:
                found[name] = self.benchmark(name, model)
            self.save()
        return found

    def agreement(self) -> dict:
        """Batched greedy answers against the answers alone, per dtype; float32 must agree.

        Batched twice: one request holding every prompt, and one request per prompt sent at
        once, which Triton's dynamic batcher merges (the tutorial's case).
        """
        found, alone_fp32, n = {}, None, len(PROMPTS)
        for dtype, model in self.manifest["agreement"].items():
            start = time.monotonic()
            alone = [self.server.infer(model, [p])[0] for p in PROMPTS]
            alone_s = time.monotonic() - start
            start = time.monotonic()
            batched = self.server.infer(model, PROMPTS)
            batched_s = time.monotonic() - start
            concurrent = at_once(self.server.infer, [(model, [p]) for p in PROMPTS])
            same = sum(a == b for a, b in zip(alone, batched, strict=True))
            merged = sum(a == b[0] for a, b in zip(alone, concurrent, strict=True))
            row = {
                "model": model,
                "batched_equals_alone": f"{same}/{n}",
                "concurrent_equals_alone": f"{merged}/{n}",
                "alone_s": round(alone_s, 3),
                "batched_s": round(batched_s, 3),
                "answers_alone": alone,
                "answers_batched": batched,
            }
            if dtype == "float32":
                alone_fp32 = alone
                if same != n or merged != n:
                    self.result["failures"].append(
                        f"float32: batched greedy answers differ from the answers alone "
                        f"(one request: {same}/{n} equal, concurrent requests: {merged}/{n})"
                    )
            elif alone_fp32 is not None:
                agree = sum(a == b for a, b in zip(alone, alone_fp32, strict=True))
                row["alone_equals_float32"] = f"{agree}/{n}"
            found[dtype] = row
        return found

    def benchmark(self, name: str, model: str) -> dict:
        """Concurrent clients for a window; throughput, latency, batch size and the GPU."""
        settings = self.manifest["bench"]
        endpoint = "generate" if name == "inflight" else "infer"
        self.server.call(model, BENCH_PROMPT, endpoint)  # warm: the first call pays for kernels
        before = self.server.metrics()
        sampler = Sampler(self.server, model)
        sampler.start()
        load = run_load(
            lambda: self.server.call(model, BENCH_PROMPT, endpoint),
            settings["concurrency"],
            self.bench_seconds,
        )
        sampler.stop()
        after = self.server.metrics()
        count = delta(before, after, "nv_inference_count", model)
        executions = delta(before, after, "nv_inference_exec_count", model)
        load.update(
            model=model,
            endpoint=endpoint,
            concurrency=settings["concurrency"],
            avg_batch_size=round(count / executions, 2) if executions else None,
            gpu=sampler.summary(),
        )
        if name == "inflight":  # Triton runs a decoupled model once per request
            load["avg_batch_size"] = None
            load["note"] = "in-flight: the engine batches inside the model, Triton cannot count it"
        if load["errors"]:
            self.result["failures"].append(f"benchmark {name}: {load['errors']} requests failed")
        return load


# -- this machine ---------------------------------------------------------------------------------
def host_facts() -> dict:
    """Python, libpython, torch/transformers/numpy, CUDA and the driver, as found here."""
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    facts: dict = {
        "hostname": platform.node(),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "python_full": sys.version.split()[0],
        "executable": sys.executable,
        "libpython": bool(
            sysconfig.get_config_var("Py_ENABLE_SHARED") and (Path(libdir) / soname).exists()
        ),
        "cpus": os.cpu_count(),
        "glibc": platform.libc_ver()[1],
        "dev_shm_mib": _disk_mib("/dev/shm"),
        "nvidia_smi": nvidia_smi_summary(),
    }
    for name in ("numpy", "torch", "transformers"):
        try:
            facts[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 (a missing or broken package is a fact to report)
            facts[name], facts[f"{name}_error"] = None, f"{type(exc).__name__}: {exc}"
    if facts["torch"]:
        import torch  # noqa: PLC0415 (only when it imported above)

        facts["torch_cuda"] = torch.version.cuda
        facts["cuda_available"] = torch.cuda.is_available()
        if facts["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            facts.update(
                gpu=props.name,
                gpu_count=torch.cuda.device_count(),
                gpu_memory_gib=round(props.total_memory / 2**30, 1),
                compute_capability=f"{props.major}.{props.minor}",
                bf16_supported=torch.cuda.is_bf16_supported(),
            )
    return facts


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


# The bare host has only the standard library (no nvidia-ml-py): nvidia-smi's text is its source.
def nvidia_smi_summary() -> str | None:
    """``nvidia-smi``'s GPU name, driver and CUDA version, one line; None without it."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        banner = subprocess.run(
            ["nvidia-smi"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", banner.stdout)
    text = "; ".join(query.stdout.strip().splitlines()) or query.stderr.strip()
    return text + (f"; CUDA {cuda[1]}" if cuda else "")


def _disk_mib(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).total // 2**20
    except OSError:
        return None


# -- the bundle, unpacked -------------------------------------------------------------------------
def unpack(bundle: Path, work: Path) -> Path:
    """The folder that holds the server, the repository and the model config."""
    if (bundle / TREE).is_dir():
        return bundle / TREE
    root = work / TREE
    root.mkdir(parents=True, exist_ok=True)
    trusted = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}  # Python >= 3.11.4
    with tarfile.open(bundle / ARCHIVE, "r:xz") as archive:
        archive.extractall(root, **trusted)
    return root


def install_stub_numpy(bundle: Path, manifest: dict, work: Path) -> Path:
    """The bundled numpy<2 wheel, unpacked into a folder of its own for the stub's PYTHONPATH."""
    target = work / "stub-site"
    wheel = bundle / manifest["numpy_wheel"]
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def stub_imports(stub_site: Path) -> dict:
    """What the stub's Python will import: numpy from the bundle, torch and transformers from here.

    Run in a child with the server's PYTHONPATH, so it is what the stub will see.
    """
    code = (
        "import json, numpy, torch, transformers;"
        "t = torch.from_numpy(numpy.arange(3.0));"
        "print(json.dumps({'numpy': numpy.__version__, 'numpy_from': numpy.__file__,"
        " 'torch': torch.__version__, 'transformers': transformers.__version__,"
        " 'from_numpy': t.tolist()}))"
    )
    env = {**os.environ, "PYTHONPATH": stub_pythonpath(stub_site)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    if done.returncode != 0:
        raise RuntimeError(f"the stub's Python cannot import its packages: {done.stderr[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if not found["numpy"].startswith("1."):
        raise RuntimeError(
            f"the stub would import numpy {found['numpy']} from {found['numpy_from']}"
        )
    return found


def stub_pythonpath(stub_site: Path) -> str:
    """numpy<2 first, then this process's own path (PYTHONPATH, then site-packages: torch and
    transformers), in the order this Python reads them.

    Naming the site-packages keeps them found even when the stub's embedded Python would work
    out another prefix than this interpreter's (a venv, a conda env).
    """
    paths = [str(stub_site)]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths += site.getsitepackages()
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        paths.append(site.getusersitepackages())
    return os.pathsep.join(paths)


def build_model(config_dir: Path, target: Path, seed: int) -> dict:
    """A model from the bundled config with random weights (seeded), saved with its tokenizer."""
    import torch  # noqa: PLC0415 (the bundle's check needs torch only here and in the server)
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 (as above)

    started = time.monotonic()
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(target)
    for item in config_dir.iterdir():
        if (
            item.name not in ("config.json",)
            and item.is_file()
            and not (target / item.name).exists()
        ):
            shutil.copy2(item, target / item.name)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "architecture": type(model).__name__,
        "build_s": round(time.monotonic() - started, 1),
    }


def copy_repository(source: Path, target: Path, weights: Path) -> Path:
    """The bundle's repository, each model folder with ``weights`` linked to the built model."""
    shutil.copytree(source, target)
    for model in sorted(p for p in target.iterdir() if (p / "config.pbtxt").is_file()):
        (model / "weights").symlink_to(weights, target_is_directory=True)
    return target


# -- the server -----------------------------------------------------------------------------------
class Server:
    """The bundled tritonserver on free loopback ports, in its own process group."""

    def __init__(self, root: Path, repository: Path, stub_site: Path, log_path: Path) -> None:
        self.root, self.repository, self.log_path = root, repository, log_path
        self.ports = dict(zip(("http", "grpc", "metrics"), free_ports(3), strict=True))
        server = root / SERVER_DIR
        libdir = sysconfig.get_config_var("LIBDIR")
        self.command = [
            str(server / "bin" / "tritonserver"),
            f"--model-repository={repository}",
            f"--backend-directory={server / 'backends'}",
            f"--cache-directory={server / 'caches'}",
            "--model-control-mode=explicit",
            "--load-model=*",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--metrics-address=127.0.0.1",
            f"--http-port={self.ports['http']}",
            f"--grpc-port={self.ports['grpc']}",
            f"--metrics-port={self.ports['metrics']}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=true",
            "--allow-cpu-metrics=true",
            "--metrics-interval-ms=500",
            "--exit-on-error=false",
            "--exit-timeout-secs=10",
        ]
        self.env = {
            **os.environ,
            "PATH": _prepend(str(Path(sys.executable).parent), os.environ.get("PATH")),
            "LD_LIBRARY_PATH": _prepend(
                f"{libdir}{os.pathsep}{root / LIBS_DIR}", os.environ.get("LD_LIBRARY_PATH")
            ),
            "PYTHONPATH": stub_pythonpath(stub_site),
        }
        self.process: subprocess.Popen | None = None
        self.base = f"http://127.0.0.1:{self.ports['http']}"

    def start(self, timeout_s: float) -> dict[str, str]:
        """Start the server and wait until every model has loaded or failed to.

        Returns each model's failure reason (empty when all loaded): with ``--exit-on-error=false``
        a model that cannot load (the optional in-flight one, say) does not take the rest down.
        """
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed by stop)
        self.process = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with status {self.process.returncode} before it was "
                    f"ready:\n{self.log_tail()}"
                )
            waiting, failed = self.not_ready()
            if waiting is None:
                return failed
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Triton was not ready within {timeout_s:.0f} s (waiting for {waiting}):\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.5)

    def not_ready(self) -> tuple[str | None, dict[str, str]]:
        """(what is still loading, or None; the models that failed and why)."""
        if not _ok(f"{self.base}/v2/health/live"):
            return "HTTP", {}
        if not _ok(f"http://127.0.0.1:{self.ports['metrics']}/metrics"):
            return "metrics", {}
        try:
            index = self._post("/v2/repository/index", {})
        except (OSError, RuntimeError):
            return "the repository index", {}
        states = {row["name"]: row for row in index}
        failed = {}
        for name in self._models():
            row = states.get(name, {})
            if row.get("state") == "UNAVAILABLE" and row.get("reason"):
                failed[name] = row["reason"]
            elif row.get("state") != "READY":
                return f"model {name} ({row.get('state', 'not listed')})", {}
        return None, failed

    def version(self) -> str:
        with urllib.request.urlopen(f"{self.base}/v2", timeout=10) as response:
            return json.load(response)["version"]

    def instances(self) -> dict[str, str]:
        """Each model's device, from the line the lab's model.py logs when it has loaded."""
        text = self.log_path.read_text(errors="replace")
        found = dict(re.findall(r"(\w+): loaded \S+ on (\S+) as", text))
        return {name: found.get(name, "unknown") for name in sorted(self._models())}

    def _models(self) -> list[str]:
        return [p.name for p in self.repository.iterdir() if (p / "config.pbtxt").is_file()]

    def infer(self, model: str, prompts: list[str]) -> list[str]:
        """One /infer request of shape [len(prompts), 1]; one answer per prompt."""
        body = {
            "inputs": [
                {
                    "name": "text_input",
                    "datatype": "BYTES",
                    "shape": [len(prompts), 1],
                    "data": prompts,
                }
            ]
        }
        answer = self._post(f"/v2/models/{model}/infer", body)
        return list(answer["outputs"][0]["data"])

    def call(self, model: str, prompt: str, endpoint: str) -> str:
        if endpoint == "generate":
            return self._post(f"/v2/models/{model}/generate", {"text_input": prompt})["text_output"]
        return self.infer(model, [prompt])[0]

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(), method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{path}: HTTP {exc.code}: {exc.read()[:500]!r}") from None

    def metrics(self) -> dict[tuple[str, str], float]:
        """Triton's Prometheus metrics: ``(name, labels) -> value``."""
        url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return parse_metrics(response.read().decode())

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(process.pid, signal.SIGKILL)  # stubs left behind, if any
        process.wait()
        self._log.close()

    def copy_log(self, target: Path, limit: int = 2_000_000) -> None:
        """The end of the server's log (at most ``limit`` bytes) into ``target``."""
        try:
            with open(self.log_path, "rb") as source:
                source.seek(max(0, source.seek(0, 2) - limit))
                target.write_bytes(source.read())
        except OSError:
            pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def free_ports(count: int) -> list[int]:
    """``count`` different free loopback ports: each pick stays bound until all are made, so the
    OS cannot hand one port out twice (labkit.proc.free_ports; the bundle runs without labkit)."""
    held = []
    try:
        for _ in range(count):
            held.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            held[-1].bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _prepend(first: str, rest: str | None) -> str:
    return first if not rest else f"{first}{os.pathsep}{rest}"


# -- measuring ------------------------------------------------------------------------------------
# Not labkit.load.Load: labkit is not importable on the bare GPU machine (standard library only).
def run_load(call, concurrency: int, seconds: float) -> dict:
    """``concurrency`` threads calling ``call`` in a loop for ``seconds``; what they saw."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < stop_at:
            start = time.monotonic()
            try:
                call()
            except Exception as exc:  # noqa: BLE001 (counted and reported, never raised)
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            with lock:
                latencies.append(time.monotonic() - start)

    started = time.monotonic()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 180)
    elapsed = time.monotonic() - started
    return {
        "seconds": round(elapsed, 2),
        "requests": len(latencies),
        "errors": len(errors),
        "first_errors": errors[:3],
        "throughput": round(len(latencies) / elapsed, 2) if elapsed else None,
        **latency_figures(latencies),
    }


def at_once(function, arguments: list[tuple]) -> list:
    """``function(*args)`` for each of ``arguments``, each in its own thread, all started
    together; the results in order. The first exception a call raised is raised here."""
    results: list = [None] * len(arguments)
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            results[index] = function(*arguments[index])
        except Exception as exc:  # noqa: BLE001 (raised again below, in the caller's thread)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(arguments))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def latency_figures(latencies: list[float]) -> dict:
    if not latencies:
        return {"p50_ms": None, "p99_ms": None, "avg_latency_ms": None}
    ordered = sorted(latencies)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 1),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 1),
        "avg_latency_ms": round(statistics.fmean(ordered) * 1000, 1),
    }


_METRIC = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    """Prometheus text into ``(name, labels) -> value`` (labels as written, braces dropped)."""
    found = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match and not line.startswith("#"):
            try:
                found[(match[1], (match[2] or "").strip("{}"))] = float(match[3])
            except ValueError:
                continue
    return found


def delta(before: dict, after: dict, name: str, model: str) -> float:
    """How much counter ``name`` of ``model`` grew between two :meth:`Server.metrics`."""
    label = f'model="{model}"'
    total = 0.0
    for (metric, labels), value in after.items():
        if metric == name and label in labels.split(","):
            total += value - before.get((metric, labels), 0.0)
    return total


def gpu_figures(metrics: dict) -> dict:
    """GPU utilisation (0..1) and memory from Triton's metrics, summed over GPUs."""
    values: dict[str, float] = {}
    for (metric, _), value in metrics.items():
        if metric in (
            "nv_gpu_utilization",
            "nv_gpu_memory_used_bytes",
            "nv_gpu_memory_total_bytes",
        ):
            values[metric] = values.get(metric, 0.0) + value
    return values


class Sampler:
    """Samples GPU utilisation and memory every half second: Triton's metrics and nvidia-smi."""

    def __init__(self, server: Server, model: str) -> None:
        self.server, self.model = server, model
        self.triton: list[dict] = []
        self.smi: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        smi = shutil.which("nvidia-smi")
        while not self._stop.wait(0.5):
            try:
                figures = gpu_figures(self.server.metrics())
            except OSError:
                figures = {}
            if figures:
                self.triton.append(figures)
            if smi:
                sample = _smi_sample(smi)
                if sample:
                    self.smi.append(sample)

    def summary(self) -> dict:
        util = [s["nv_gpu_utilization"] for s in self.triton if "nv_gpu_utilization" in s]
        used = [
            s["nv_gpu_memory_used_bytes"] for s in self.triton if "nv_gpu_memory_used_bytes" in s
        ]
        total = [
            s["nv_gpu_memory_total_bytes"] for s in self.triton if "nv_gpu_memory_total_bytes" in s
        ]
        found: dict = {"samples": len(self.triton)}
        if util:
            found["triton_utilization_mean"] = round(statistics.fmean(util), 3)
            found["triton_utilization_max"] = round(max(util), 3)
        if used:
            found["triton_memory_used_max_mib"] = round(max(used) / 2**20)
        if total:
            found["triton_memory_total_mib"] = round(max(total) / 2**20)
        if not util and not used:
            found["triton_note"] = "Triton reported no GPU metrics (DCGM did not start?)"
        if self.smi:
            found["nvidia_smi_utilization_mean"] = round(
                statistics.fmean(s[0] for s in self.smi) / 100, 3
            )
            found["nvidia_smi_memory_used_max_mib"] = round(max(s[1] for s in self.smi))
        return found


def _smi_sample(smi: str) -> tuple[float, float] | None:
    try:
        done = subprocess.run(
            [smi, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        util, used = done.stdout.splitlines()[0].split(",")[:2]
        return float(util), float(used)
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def summary(result: dict) -> str:
    """gpu-check.json in a few lines: status, host, agreement per dtype, benchmarks, GPU."""
    host = result.get("host") or {}
    lines = [f"labkit gpu check: {result.get('status')}"]
    if result.get("reason"):
        lines.append(f"  not run: {result['reason']}")
    if result.get("error"):
        lines.append(f"  error: {result['error']}")
    lines.append(
        f"  host: Python {host.get('python_full')}, torch {host.get('torch')} "
        f"(CUDA {host.get('torch_cuda')}), transformers {host.get('transformers')}, "
        f"GPU {host.get('gpu') or host.get('nvidia_smi') or 'none'}"
    )
    for dtype, row in (result.get("agreement") or {}).items():
        versus = row.get("alone_equals_float32")
        lines.append(
            f"  {dtype:<9} batched == alone {row['batched_equals_alone']} (one request), "
            f"{row.get('concurrent_equals_alone')} (concurrent requests)"
            + (f", alone == float32 {versus}" if versus else "")
        )
    for name, row in (result.get("benchmarks") or {}).items():
        if row.get("throughput") is None:
            lines.append(f"  {name:<13} {row.get('status', '-')}: {row.get('reason', '')}")
            continue
        gpu = row.get("gpu") or {}
        lines.append(
            f"  {name:<13} {row['throughput']:.2f} infer/s, p50 {row['p50_ms']} ms, "
            f"p99 {row['p99_ms']} ms, batch {row.get('avg_batch_size')}, GPU util "
            f"{gpu.get('triton_utilization_mean', gpu.get('nvidia_smi_utilization_mean'))}, "
            f"memory {gpu.get('triton_memory_used_max_mib', gpu.get('nvidia_smi_memory_used_max_mib'))} MiB"
        )
    if result.get("batching_speedup"):
        lines.append(f"  dynamic batching: x{result['batching_speedup']} throughput")
    lines.extend(f"  FAILED: {failure}" for failure in result.get("failures") or [])
    return "\n".join(lines)


def speedup(benchmarks: dict) -> float | None:
    """Throughput with dynamic batching on over off."""
    on, off = benchmarks.get("batching_on") or {}, benchmarks.get("batching_off") or {}
    if on.get("throughput") and off.get("throughput"):
        return round(on["throughput"] / off["throughput"], 2)
    return None


if __name__ == "__main__":
    sys.exit(main())
