"""The model code's files: one real file per model kind, links that stay inside the repository.

The real files live in ``model_repository/`` (``smollm2/1/`` for text generation, ``minilm/1/``
for embeddings). A variant such as ``smollm2_stream`` and the packaged templates in
``labkit/templates/`` are relative symbolic links to them; a wheel and an sdist carry the
files' contents. The learner's first model (``smollm2_first/1/``, notebook 01) is one short
``model.py`` of its own, read top to bottom.
"""

from __future__ import annotations

import ast
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import imported_as_triton_does
from labkit import repository
from labkit.repository import read_config

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
TEMPLATES = ROOT / "labkit" / "templates"
# Each template folder and the repository folder that holds its real files.
TEMPLATE_SOURCES = {"textgen": "smollm2/1", "embedding": "minilm/1"}
# Built on each machine by `labkit prepare` and ignored by git: links out of the repository.
LOCAL_LINKS = ("weights", "hf_cache")
# What the server's Python environment has (an NGC container included), besides the stdlib.
SERVER_PACKAGES = {"numpy", "torch", "transformers", "triton_python_backend_utils"}
SERVER_PACKAGES |= {"tokenizers"}  # transformers' own tokenizer library (minilm_tokenize)
# Modules that model.py imports only when a config asks for them (in-flight batching).
ON_REQUEST = {"smollm2/1": ("inflight",)}
# The learner's first model: one model.py of about the tutorial's size (about 85 lines of code,
# its bounds on max_tokens and the context included).
FIRST_MODEL = REPOSITORY / "smollm2_first"
FIRST_MODEL_MOST_LINES = 120


def committed_links() -> list[Path]:
    links = []
    for folder, dirs, files in os.walk(REPOSITORY):
        here = Path(folder)
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in dirs + files:
            path = here / name
            local = name in LOCAL_LINKS and here.parent == REPOSITORY
            if path.is_symlink() and not local:
                links.append(path)
    return links


def real_model_code() -> list[Path]:
    """Every Python file under a version folder of the repository that is not a link."""
    return sorted(p for p in REPOSITORY.glob("*/*/*.py") if not p.is_symlink())


def names(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.py")}


# -- links ------------------------------------------------------------------------------------
def test_the_repository_holds_links_to_check():
    assert REPOSITORY / "smollm2_stream" / "1" / "model.py" in committed_links()


def test_every_link_in_the_model_repository_resolves_to_a_file_inside_it():
    for link in committed_links():
        target = os.readlink(link)
        assert not os.path.isabs(target), f"{link} -> {target}: make the link relative"
        resolved = link.resolve()
        assert resolved.is_relative_to(REPOSITORY.resolve()), f"{link} -> {target} leaves it"
        assert resolved.is_file(), f"{link} -> {target} is dangling or not a file"


@pytest.mark.parametrize(
    "twin", sorted(p.name for p in REPOSITORY.glob("*_stream") if p.is_dir()), ids=str
)
def test_a_streaming_twin_links_every_file_to_its_plain_model(twin):
    plain = REPOSITORY / twin.removesuffix("_stream") / "1"
    linked = REPOSITORY / twin / "1"
    assert names(linked) == names(plain) != set()
    for path in linked.glob("*.py"):
        assert path.is_symlink(), f"{path} is a copy; link it to {plain / path.name}"
        assert os.readlink(path) == f"../../{plain.parent.name}/1/{path.name}"


@pytest.mark.parametrize(("template", "source"), TEMPLATE_SOURCES.items())
def test_a_packaged_template_is_the_repository_model_file_for_file(template, source):
    folder, real = TEMPLATES / template, REPOSITORY / source
    assert names(folder) == names(real) and "model.py" in names(real)
    for path in folder.glob("*.py"):
        assert path.is_symlink(), f"{path} is a copy; link it to {real / path.name}"
        assert not os.path.isabs(os.readlink(path)), f"{path}: make the link relative"
        assert path.resolve() == (real / path.name).resolve()


# -- the code itself ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path", sorted(REPOSITORY.glob("*/*/model.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_model_py_defines_triton_python_model_before_anything_else(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    defined = [
        node.name
        for node in tree.body
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    assert defined[:1] == ["TritonPythonModel"], f"first definitions: {defined[:3]}"


@pytest.mark.parametrize("path", real_model_code(), ids=lambda p: str(p.relative_to(ROOT)))
def test_model_code_imports_only_the_server_environment_and_its_siblings(path):
    allowed = set(sys.stdlib_module_names) | SERVER_PACKAGES
    if "labkit_environment" in (path.parent.parent / "config.pbtxt").read_text():
        allowed |= {"vllm"}  # smollm2_vllm runs in .venv-vllm (EXECUTION_ENV_PATH)
    siblings = {p.stem for p in path.parent.glob("*.py")}
    wrong = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            wrong += [a.name for a in node.names if a.name.split(".")[0] not in allowed]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if node.module.split(".")[0] not in allowed:
                wrong.append(node.module)
        elif isinstance(node, ast.ImportFrom):
            wanted = [node.module] if node.module else [a.name for a in node.names]
            if node.level != 1 or not set(wanted) <= siblings:
                wrong.append("." * node.level + (node.module or ",".join(wanted)))
    assert wrong == [], f"{path.name} imports what the server may not have"


@pytest.mark.parametrize("source", TEMPLATE_SOURCES.values())
def test_the_model_folder_imports_as_a_package_the_way_triton_does(source):
    folder = REPOSITORY / source
    with imported_as_triton_does(folder) as model:
        loaded = {name for name in sys.modules if name.startswith("1.")}
        assert model.TritonPythonModel.__module__ == "1.model"
    used = {f"1.{path.stem}" for path in folder.glob("*.py")}  # every file is used...
    assert loaded == used - {f"1.{name}" for name in ON_REQUEST.get(source, ())}


@pytest.mark.parametrize(("source", "module"), [(s, m) for s, ms in ON_REQUEST.items() for m in ms])
def test_a_module_that_model_py_imports_on_request_imports_as_triton_does_it(source, module):
    with imported_as_triton_does(REPOSITORY / source, module) as imported:
        assert imported.__name__ == f"1.{module}"


# -- the learner's first model --------------------------------------------------------------------
def test_the_first_model_folder_holds_one_model_py_and_its_config():
    files = {str(p.relative_to(FIRST_MODEL)) for p in FIRST_MODEL.rglob("*")}
    made_here = {f for f in files if f in LOCAL_LINKS or "__pycache__" in f}  # by labkit, Triton
    assert files - made_here == {"config.pbtxt", "1", "1/model.py"}


def test_the_first_model_py_reads_top_to_bottom_in_the_order_triton_calls_it():
    path = FIRST_MODEL / "1" / "model.py"
    text = path.read_text()
    assert len(text.splitlines()) <= FIRST_MODEL_MOST_LINES
    tree = ast.parse(text, filename=str(path))
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    methods = [n.name for n in model.body if isinstance(n, ast.FunctionDef)]
    assert [m for m in methods if m in ("initialize", "execute", "finalize")] == [
        "initialize",
        "execute",
        "finalize",
    ]
    # the tutorial's defects: max_length counts the prompt; its output was shown as "text"
    assert "max_new_tokens=" in text and "max_length" not in text
    assert '"text_output"' in text and '"text"' not in text


def test_the_first_model_has_the_full_models_inputs_outputs_and_weights():
    first = read_config(FIRST_MODEL / "config.pbtxt")
    full = read_config(REPOSITORY / "smollm2" / "config.pbtxt")
    assert first.name == "smollm2_first" and first.max_batch_size == 0
    assert (first.input, first.output) == (full.input, full.output)
    for key in ("huggingface_model", "labkit_weights", "max_tokens"):
        assert first.parameters[key] == full.parameters[key], key
    assert repository.full_model("smollm2_first") == "smollm2"
    assert repository.full_model("smollm2") == "smollm2"


def test_the_first_model_imports_as_triton_does_and_checks_a_request_without_a_server():
    with imported_as_triton_does(FIRST_MODEL / "1") as model:
        assert {n for n in sys.modules if n.startswith("1.")} == {"1.model"}
        assert model.prompt_text("café".encode()) == "café"
        with pytest.raises(ValueError, match="empty or only spaces"):
            model.prompt_text(b"   ")
        served = model.TritonPythonModel()
        served.max_tokens, served.max_tokens_limit = 16, 512
        assert served.max_tokens_of(Request('{"max_tokens": 4}')) == 4
        assert served.max_tokens_of(Request("")) == 16
        assert served.max_tokens_of(Request('{"temperature": 0.0, "max_tokens": 3}')) == 3
        refused = {'{"max_tokens": 0}': "at least 1", '{"top_k": 2}': "top_k",
                   '{"temperature": 0.5}': "answers greedily",
                   '{"max_tokens": 513}': "over this model's max_tokens_limit of 512"}  # fmt: skip
        for bad, named in refused.items():
            with pytest.raises(ValueError, match=named):
                served.max_tokens_of(Request(bad))


class Request:
    """A request as the first model's ``max_tokens_of`` reads it: only its parameters."""

    def __init__(self, parameters: str) -> None:
        self._parameters = parameters

    def parameters(self) -> str:
        return self._parameters


def test_the_engine_settings_import_only_the_standard_library_so_labkit_can_load_them():
    path = REPOSITORY / "smollm2" / "1" / "engine_settings.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." if node.level else node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names)


# -- packaging ---------------------------------------------------------------------------------
@pytest.mark.integration
def test_a_wheel_and_an_sdist_carry_the_templates_as_real_files(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    skip = shutil.ignore_patterns("__pycache__", *LOCAL_LINKS)
    for name in ("labkit", "model_repository"):
        shutil.copytree(ROOT / name, tree / name, symlinks=True, ignore=skip)
    dist = tmp_path / "dist"

    def build(kind: str) -> Path:  # one process each: setuptools keeps state between builds
        code = f"import sys, setuptools.build_meta as b; print(b.build_{kind}(sys.argv[1]))"
        done = subprocess.run(
            [sys.executable, "-c", code, str(dist)],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return dist / done.stdout.splitlines()[-1]  # the builder prints its progress before

    wheel_path, sdist_path = build("wheel"), build("sdist")
    expected = {
        f"labkit/templates/{template}/{path.name}": path.read_bytes()
        for template in TEMPLATE_SOURCES
        for path in (TEMPLATES / template).glob("*.py")
    }
    with zipfile.ZipFile(wheel_path) as wheel:
        for name, content in expected.items():
            mode = wheel.getinfo(name).external_attr >> 16
            assert not stat.S_ISLNK(mode), f"{name} is a link in the wheel"
            assert wheel.read(name) == content, f"{name} in the wheel differs from the source"
    with tarfile.open(sdist_path) as sdist:
        top = sdist_path.name.removesuffix(".tar.gz")
        for name, content in expected.items():
            member = sdist.getmember(f"{top}/{name}")
            assert member.isfile(), f"{name} is not a plain file in the sdist"
            assert sdist.extractfile(member).read() == content
