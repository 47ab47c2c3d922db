"""vLLM's compile cache, filled for the lab's vLLM model before a lesson starts it: ``labkit
prepare --warm-vllm``, which ``make install`` runs.

The model compiles (``enforce_eager`` false, as vLLM's own server does by default). Its first
start with a set of settings compiles the model's graphs (about 2 minutes on 2 cores); a later
start with the same settings finds them in the cache and loads them instead. On a CPU that cache
is inductor's (torch.compile's), which the model's ``vllm_settings`` keeps in ``torchinductor``
under vLLM's cache root (:func:`labkit.settings.vllm_cache_root`). It is keyed by the graphs
themselves (the model, its dtype, the shapes the settings give), not by the front end that
started the engine. A few C++ kernels' keys also hold the path of the environment's torch, so a
``.venv-vllm`` elsewhere (another checkout) compiles those again at its first start: 11 kernels,
and 54 s to the first answer against 52 s (2026-12-06, 2 cores). So :func:`warm` starts vLLM's own server once per dtype the lab serves, on the
shipped config's other settings, has it answer one request and stops it; Triton's engine on the
same settings then finds the graphs. The dtypes: float32 as shipped, and bfloat16, the twin
notebook 06 and ``labkit bench frontend`` write the same way (only ``dtype`` changed).

A stamp in the cache root (:data:`STAMP`) keeps a key of each warmed start: the server's command
(less its port and interpreter), its environment and vLLM's version. A later :func:`warm` with
the same key, whose graphs' folder is not empty, starts nothing; a changed config, weights
folder or vLLM warms again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from labkit.repository import Repository, apply_edits, prepare_run_repository
from labkit.settings import runs_root, vllm_cache_root

from .standalone import server_command, start_standalone

#: The stamp of warmed starts, in vLLM's cache root: key -> what was warmed, when, in how long.
STAMP = "labkit-warm.json"
#: The variable that names where a compiled engine's graphs are kept (vllm_settings sets it).
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
#: The dtypes the lab serves the vLLM model in (06's and the frontend bench's twins).
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Warmed:
    """One dtype's warm-up: the seconds its start took, or None where the stamp had it."""

    dtype: str
    key: str
    seconds: float | None


def vllm_version(python: str) -> str:
    """The vLLM distribution installed beside ``python`` (its dist-info folder's name)."""
    site = Path(python).parent.parent / "lib"
    found = sorted(p.name for p in site.glob("python*/site-packages/vllm*.dist-info"))
    return ",".join(found) or "unknown"


def start_key(repo: Repository, model: str) -> str:
    """What decides whether a start of ``model`` finds its graphs: its server command without the
    port and interpreter, the environment it adds (where the graphs are kept among it), and
    vLLM's version."""
    command, environment = server_command(repo, model, 0)
    payload = {"arguments": command[1:], "environment": environment,
               "vllm": vllm_version(command[0])}  # fmt: skip
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def graphs_kept(repo: Repository, model: str) -> bool:
    """Whether the folder ``model``'s engine keeps its compiled graphs in holds any: one emptied
    since (``/tmp`` cleaned, a cache deleted by hand) makes the stamp's word void."""
    _, environment = server_command(repo, model, 0)
    folder = Path(environment.get(INDUCTOR_CACHE, ""))
    return folder.is_dir() and any(folder.iterdir())


def read_stamp(root: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        stamp = json.loads((root / STAMP).read_text())
        if isinstance(stamp, dict):
            return stamp
    return {}


def write_stamp(root: Path, stamp: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".{STAMP}.partial"
    partial.write_text(json.dumps(stamp, indent=2, sort_keys=True))
    partial.replace(root / STAMP)


def dtype_folders(repo: Repository, model: str, dtypes: tuple[str, ...]) -> dict[str, str]:
    """Each dtype's model folder in the run's copy: the model itself for its own dtype, else a
    twin with only ``dtype`` changed, as 06 and the frontend bench write theirs."""
    base = repo.config(model)
    shipped = base.parameters["dtype"].string_value if "dtype" in base.parameters else ""
    folders = {}
    for dtype in dtypes:
        if dtype == shipped:
            folders[dtype] = model
        else:
            folders[dtype] = f"{model}_{dtype}"
            repo.add_twin(model, folders[dtype], apply_edits(base, parameters={"dtype": dtype}))
    return folders


def warm(
    repository: str | os.PathLike = "model_repository",
    model: str = "smollm2_vllm",
    dtypes: tuple[str, ...] = DTYPES,
    *,
    timeout_s: float = 1200.0,
) -> list[Warmed]:
    """Start vLLM's own server on ``model`` once per dtype whose start the stamp does not hold,
    each answering one request; stamp each. The work folder (``<runs>/vllm-warm``: the repository
    copy and each server's log) is removed once every start succeeded, and kept for its logs when
    one fails (:class:`~labkit.errors.ServerError`, with the end of the log)."""
    root = vllm_cache_root()
    work = runs_root() / "vllm-warm"
    shutil.rmtree(work, ignore_errors=True)
    repo = prepare_run_repository(work, source=repository)
    done = []
    folders = dtype_folders(repo, model, dtypes)
    kept = {dtype: graphs_kept(repo, folder) for dtype, folder in folders.items()}  # before any
    for dtype, folder in folders.items():
        key = start_key(repo, folder)
        if key in read_stamp(root) and kept[dtype]:
            done.append(Warmed(dtype, key, None))
            continue
        began = time.monotonic()
        with start_standalone(work, repo, folder, timeout_s=timeout_s) as server:
            server.warm_up(count=1, timeout_s=timeout_s)
        seconds = round(time.monotonic() - began, 1)
        stamp = read_stamp(root)
        stamp[key] = {"model": model, "dtype": dtype, "seconds": seconds,
                      "when": datetime.now(timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
        write_stamp(root, stamp)
        done.append(Warmed(dtype, key, seconds))
    shutil.rmtree(work, ignore_errors=True)
    return done
