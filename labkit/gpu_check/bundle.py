"""The GPU check's bundle: everything a bare GPU machine lacks, built here, at most 60 MiB.

The machine (DESIGN.md, part 1) has Python 3.12, torch with CUDA, transformers and numpy 2, no
network, and takes at most 64 MiB of files along with the checkout. :func:`build_bundle` writes
into one folder:

- ``bundle.tar.xz``: from the installed ``nvidia-pytriton`` wheel only the ``tritonserver``
  binary, the Python backend with the stub for the target Python put in place, the response
  cache backend and the vendored libraries those need (read from their ELF ``DT_NEEDED``
  entries, so the wheel's libpython 3.13 stays behind); a model repository of the lab's
  ``textgen`` model code (the check's models, ``KIND_GPU``); and the model's ``config.json``
  (SmolLM2-135M's architecture) and tokenizer: no weights travel, the runner builds them;
- the numpy<2 wheel for the target Python, which the runner unpacks into a folder of its own
  that goes first on the stub's ``PYTHONPATH``;
- ``run.py`` (:mod:`labkit.gpu_check.remote`) and ``manifest.json`` (what the runner needs to
  know: the models, the benchmark, the Python the stub is for).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import struct
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from labkit import proc
from labkit.errors import ConfigError, MissingDependencyError, MissingFileError
from labkit.gpu_check import remote
from labkit.repository import CatalogEntry, Repository, build_weights, textgen_config
from labkit.repository.folder import TEMPLATES_DIR
from labkit.settings import cache_dir, runs_root

log = logging.getLogger(__name__)

MIB = 2**20
#: What the device machine takes along with the checkout is 64 MiB; the bundle keeps 4 for it.
SIZE_LIMIT_BYTES = 60 * MIB
NUMPY_VERSION = "1.26.4"  # the last numpy 1: the 2.51 Python backend breaks on numpy 2
#: xz preset of the archive. Measured here on the 3.12 bundle's 105 MiB: preset 1 packs it to
#: 31 MB in 10 s of CPU, preset 6 to 27 MB in 45 s; the archive is rebuilt by every bundle build.
XZ_PRESET = 1
#: The architecture keys of the model's config.json (the rest of SmolLM2's is provenance).
ARCHITECTURE_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "initializer_range",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
)
#: A test-sized variant of the same architecture (for the runner's CPU run here).
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
}
SIZES = ("smollm2-135m", "tiny")
DEVICES = {"gpu": "KIND_GPU", "cpu": "KIND_CPU"}
TOKENIZER_FILES = ("tokenizer.json",)


@dataclass(frozen=True)
class BundleInfo:
    """A built bundle: its folder, its files and their total size."""

    path: Path
    files: dict[str, int]  # name -> bytes
    manifest: dict

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def default_bundle_dir() -> Path:
    """``<runs>/gpu-bundle``: inside an ignored folder, so it is carried, never committed."""
    return runs_root() / "gpu-bundle"


def build_bundle(
    target: str | os.PathLike | None = None,
    *,
    python: str = "3.12",
    device: str = "gpu",
    size: str = "smollm2-135m",
    archive: bool = True,
    bench_seconds: float = 20.0,
    concurrency: int = 8,
    seed: int = 0,
) -> BundleInfo:
    """Build the GPU check's bundle into ``target`` (replacing an earlier bundle there).

    ``python`` is the target machine's Python (its stub and numpy wheel); ``device`` ``gpu``
    (``KIND_GPU`` instances) or ``cpu`` (a run here); ``size`` ``smollm2-135m`` or ``tiny``;
    ``archive=False`` leaves the tree unpacked (a test bundle, not size-checked).
    """
    target = Path(target) if target else default_bundle_dir()
    if device not in DEVICES or size not in SIZES:
        raise ConfigError(
            f"device {device!r} / size {size!r}: use device gpu or cpu, size {' or '.join(SIZES)}"
        )
    _clear(target)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".tree-", dir=target) as staging:
        tree = Path(staging)
        libraries = copy_server(tree, python)
        models = write_repository(tree / remote.REPOSITORY_DIR, DEVICES[device], concurrency)
        model = write_model_config(tree / remote.MODEL_DIR, size)
        if archive:
            with tarfile.open(target / remote.ARCHIVE, "w:xz", preset=XZ_PRESET) as packed:
                packed.add(tree, arcname=".")
        else:
            shutil.copytree(tree, target / remote.TREE, symlinks=True)
    wheel = numpy_wheel(python)
    shutil.copy2(wheel, target / wheel.name)
    shutil.copy2(remote.__file__, target / remote.RUNNER)
    manifest = {
        "labkit": _version("triton-labkit"),
        "nvidia_pytriton": _version("nvidia-pytriton"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": python,
        "device": device,
        "numpy_wheel": wheel.name,
        "libraries": libraries,
        "model": {**model, "seed": seed},
        **models,
        "bench": {**models["bench"], "concurrency": concurrency, "seconds": bench_seconds},
    }
    (target / remote.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    files = {p.name: p.stat().st_size for p in sorted(target.iterdir()) if p.is_file()}
    info = BundleInfo(target, files, manifest)
    if archive and info.total_bytes > SIZE_LIMIT_BYTES:
        raise ConfigError(
            f"the GPU check's bundle is {info.total_bytes / MIB:.1f} MiB, over its "
            f"{SIZE_LIMIT_BYTES / MIB:.0f} MiB limit: {files}"
        )
    log.info(
        "built the GPU check's bundle in %s: %.1f MiB in %.0f s",
        target,
        info.total_bytes / MIB,
        time.monotonic() - started,
    )
    return info


def _clear(target: Path) -> None:
    """An empty ``target``: an earlier bundle there is removed, anything else is refused."""
    if target.exists():
        if any(target.iterdir()) and not (target / remote.MANIFEST).is_file():
            raise ConfigError(
                f"{str(target)!r} is not empty and holds no GPU check bundle; choose an empty "
                "folder (default: runs/gpu-bundle)"
            )
        shutil.rmtree(target)
    target.mkdir(parents=True)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- the server, from the installed wheel ------------------------------------------------------
def wheel_root() -> Path:
    """The site-packages folder that holds ``pytriton/tritonserver`` and its libraries."""
    try:
        import pytriton  # noqa: PLC0415 (only the bundle needs the wheel's files, not its code)
    except ImportError as exc:
        raise MissingDependencyError(
            "the GPU check's bundle takes Triton from the nvidia-pytriton wheel; "
            "pip install nvidia-pytriton==0.7.0 (make install does)"
        ) from exc
    return Path(pytriton.__file__).parent.parent


def copy_server(tree: Path, python: str) -> list[str]:
    """Copy the server, the Python backend with ``python``'s stub, the cache backend and the
    libraries they need into ``tree`` (the wheel's layout, so the binaries' RPATHs resolve).
    Returns the libraries copied."""
    root = wheel_root()
    source = root / remote.SERVER_DIR
    stub = source / "python_backend_stubs" / python / "triton_python_backend_stub"
    if not stub.is_file():
        known = sorted(p.name for p in (source / "python_backend_stubs").iterdir())
        raise MissingFileError(
            f"nvidia-pytriton has no Python-backend stub for Python {python!r}; use one of "
            f"{', '.join(known)}"
        )
    server = tree / remote.SERVER_DIR
    (server / "bin").mkdir(parents=True)
    shutil.copy2(source / "bin" / "tritonserver", server / "bin" / "tritonserver")
    backend = server / "backends" / "python"
    backend.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(source / "backends" / "python" / name, backend / name)
    shutil.copy2(stub, backend / "triton_python_backend_stub")
    shutil.copytree(source / "caches", server / "caches")
    binaries = [p for p in server.rglob("*") if p.is_file() and _is_elf(p)]
    libraries = needed_libraries(binaries, root / remote.LIBS_DIR)
    (tree / remote.LIBS_DIR).mkdir()
    for name in libraries:
        shutil.copy2(root / remote.LIBS_DIR / name, tree / remote.LIBS_DIR / name)
    return libraries


def needed_libraries(binaries: list[Path], library_dir: Path) -> list[str]:
    """The libraries of ``library_dir`` that ``binaries`` load, directly or through each other."""
    present = {p.name for p in library_dir.iterdir()}
    wanted: set[str] = set()
    queue = list(binaries)
    while queue:
        for name in elf_needed(queue.pop()):
            if name in present and name not in wanted:
                wanted.add(name)
                queue.append(library_dir / name)
    return sorted(wanted)


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def elf_needed(path: Path) -> list[str]:
    """The ``DT_NEEDED`` entries of a 64-bit little-endian ELF file (what ``readelf -d`` lists)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ConfigError(f"{path} is not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    needed = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strings + value)
                needed.append(data[strings + value : end].decode())
    return needed


# -- the models --------------------------------------------------------------------------------
#: The check's models: one per dtype for the agreement, one without dynamic batching.
AGREEMENT = {"float32": "gen_float32", "float16": "gen_float16", "bfloat16": "gen_bfloat16"}
NO_BATCHING = "gen_float16_nobatch"
INFLIGHT = "gen_inflight"
INFLIGHT_TEMPLATE = "inflight.py"


def write_repository(repository: Path, kind: str, concurrency: int) -> dict:
    """The check's model folders (the lab's textgen code); returns what the manifest says of them."""
    entry = CatalogEntry("gpu-check", "weights", "random weights at SmolLM2-135M's size", 0.135)
    repo = Repository(repository, create=True)
    batching = {"max_batch_size": 8, "dynamic_batching": True}
    for dtype, name in AGREEMENT.items():
        repo.add_from_template(
            name, "textgen", textgen_config(entry, name, kind=kind, dtype=dtype, **batching)
        )
    config = textgen_config(entry, NO_BATCHING, kind=kind, dtype="float16", max_batch_size=8)
    repo.add_from_template(NO_BATCHING, "textgen", config)
    models = {"batching_off": NO_BATCHING, "batching_on": AGREEMENT["float16"]}
    note = "labkit's textgen template has no in-flight batching (inflight.py) yet"
    if (TEMPLATES_DIR / "textgen" / INFLIGHT_TEMPLATE).is_file():
        config = textgen_config(
            entry,
            INFLIGHT,
            kind=kind,
            dtype="float16",
            decoupled=True,
            inflight_batching=True,
            max_running_requests=concurrency,
        )
        repo.add_from_template(INFLIGHT, "textgen", config)
        models["inflight"] = INFLIGHT
        note = "in-flight batching: the textgen template's inflight.py, through /generate"
    return {"agreement": AGREEMENT, "bench": {"models": models, "note": note}}


def write_model_config(folder: Path, size: str) -> dict:
    """SmolLM2-135M's config.json (architecture keys only) and tokenizer into ``folder``."""
    source = build_weights("smollm2")  # the real model's folder: its config and tokenizer
    real = json.loads((source / "config.json").read_text())
    config = {k: real[k] for k in ARCHITECTURE_KEYS if k in real}
    if size == "tiny":
        config.update(TINY)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: real[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in real}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy2(source / name, folder / name)
    tokenizer = json.loads((source / "tokenizer_config.json").read_text())
    portable = {  # the class name every transformers release knows, with the special tokens
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: v for k, v in tokenizer.items() if k.endswith("_token")},
        "model_max_length": config["max_position_embeddings"],
        "padding_side": "left",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(portable, indent=2) + "\n")
    return {
        "size": size,
        "config": {k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
    }


# -- numpy<2 for the stub ----------------------------------------------------------------------
def numpy_wheel(python: str, version: str = NUMPY_VERSION) -> Path:
    """numpy ``version``'s manylinux wheel for CPython ``python``, downloaded once into the cache."""
    tag = "cp" + python.replace(".", "")
    folder = cache_dir() / "wheels"
    found = sorted(folder.glob(f"numpy-{version}-{tag}-{tag}-*manylinux*x86_64*.whl"))
    if found:
        return found[-1]
    folder.mkdir(parents=True, exist_ok=True)
    proc.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"numpy=={version}",
            "--only-binary=:all:",
            "--no-deps",
            "--python-version",
            python,
            "--implementation",
            "cp",
            "--platform",
            "manylinux2014_x86_64",
            "--dest",
            str(folder),
        ],
        timeout_s=600,
    )
    found = sorted(folder.glob(f"numpy-{version}-{tag}-{tag}-*manylinux*x86_64*.whl"))
    if not found:
        raise MissingFileError(
            f"pip download numpy=={version} for Python {python} left no {tag} wheel in {folder}"
        )
    return found[-1]
