"""Files written here for another machine, checked for paths of this one.

A manifest, a copied model config, a setup script or a command that names a folder of the
machine that wrote it fails on the machine that runs it, often far from the cause: a pod whose
stub looks for ``/home/me/lab/.venv-vllm``. :func:`machine_paths` lists the folders of this
machine such a file must not name; :func:`find_machine_paths` finds them in a text and
:func:`scan` in every text file of a folder, by file and line.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from labkit.settings import cache_dir, hf_home, project_root

#: Characters that end a path in a text: whitespace, quotes and the punctuation around a path.
_END = r"""\s"'`:;,()\[\]{}<>=|"""
#: Bytes of a file read to tell text from binary (a NUL among them: binary).
_SNIFF_BYTES = 8192


def machine_paths(*extra: str | os.PathLike) -> list[str]:
    """This machine's folders that a file for another machine must not name: the checkout
    (:func:`~labkit.settings.project_root`), the temporary folder, the home folder, labkit's
    cache (``LABKIT_CACHE``), the Hugging Face cache (``HF_HOME``), this Python environment
    (``sys.prefix``) and ``extra``, each as given and resolved, longest first."""
    found = set()
    for folder in (
        project_root(),
        tempfile.gettempdir(),
        Path.home(),
        cache_dir(),
        hf_home(),
        sys.prefix,
        *extra,
    ):
        for form in (Path(folder), Path(folder).resolve()):
            text = str(form).rstrip("/")
            if form.is_absolute() and text.count("/") >= 1 and len(text) > 1:
                found.add(text)
    return sorted(found, key=lambda p: (-len(p), p))


def _pattern(paths: Iterable[str]) -> re.Pattern:
    roots = "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True))
    # a root counts where a path starts (not inside a longer word or path) and ends or goes on
    return re.compile(rf"(?<![\w.~$/-])(?:{roots})(?=[/{_END}]|$)[^{_END}]*")


def find_machine_paths(text: str, paths: Iterable[str] | None = None) -> list[tuple[int, str]]:
    """``(line, path)`` for each path of this machine (:func:`machine_paths`, or ``paths``) in
    ``text``; lines count from 1."""
    pattern = _pattern(machine_paths() if paths is None else paths)
    return [
        (number, match.group(0))
        for number, line in enumerate(text.splitlines(), start=1)
        for match in pattern.finditer(line)
    ]


@dataclass(frozen=True)
class Finding:
    """A path of the writing machine in a file written for another."""

    file: Path
    line: int
    path: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path}"


def scan(
    folder: str | os.PathLike, paths: Iterable[str] | None = None
) -> tuple[list[Finding], list[Path]]:
    """Every path of this machine in the text files under ``folder`` (or in the one file
    ``folder``), and the binary files skipped (a NUL in their first 8 KiB). A file behind a link
    is read; the link's own target is checked too, as line 0."""
    roots = machine_paths() if paths is None else list(paths)
    pattern = _pattern(roots)
    base = Path(folder)
    entries = [base] if not base.is_dir() else sorted(base.rglob("*"))
    findings, binary = [], []
    for file in entries:
        if file.is_symlink():
            findings += [Finding(file, 0, m.group(0)) for m in pattern.finditer(os.readlink(file))]
        if not file.is_file():
            continue
        with open(file, "rb") as handle:
            head = handle.read(_SNIFF_BYTES)
        if b"\0" in head:
            binary.append(file)
            continue
        text = file.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            findings += [Finding(file, number, m.group(0)) for m in pattern.finditer(line)]
    return findings, binary
