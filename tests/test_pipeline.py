"""Pipelines and caching (notebook 08): the response cache's server settings, MiniLM as an
ensemble of a tokenizer step and an encoder step, against the real server."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import released_together
from labkit import embedding, pipeline, profiling
from labkit.cli import build_parser
from labkit.errors import InferenceError, ServerError
from labkit.repository import Repository
from labkit.server import TritonServer, locate_tritonserver
from labkit.server.locate import cache_directory

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def empty_repo(tmp_path):
    (tmp_path / "repo").mkdir()
    return tmp_path / "repo"


# -- the response cache in the server's command line ------------------------------------------
def test_no_cache_size_means_no_cache_flags(empty_repo):
    server = TritonServer(empty_repo, mode="docker", image="example/triton:1")
    assert not [a for a in server.docker_command("c1") if a.startswith("--cache")]
    assert server.cache_args("/anywhere") == []


def test_the_bundled_server_finds_its_cache_library_beside_it(empty_repo, monkeypatch):
    monkeypatch.delenv("LABKIT_TRITONSERVER", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    found = locate_tritonserver()
    assert found.source == "nvidia-pytriton"
    assert (found.cache_directory / "local" / "libtritoncache_local.so").is_file()
    command = TritonServer(empty_repo, cache_size=1 << 20).local_command()
    assert "--cache-config=local,size=1048576" in command
    assert f"--cache-directory={found.cache_directory}" in command
    assert not [a for a in TritonServer(empty_repo).local_command() if a.startswith("--cache")]


def test_docker_mode_uses_the_ngc_images_own_caches(empty_repo):
    server = TritonServer(empty_repo, mode="docker", image="example/triton:1", cache_size=4096)
    command = server.docker_command("c1")
    after_image = command[command.index("example/triton:1") + 1 :]
    assert after_image[0] == "tritonserver"
    assert after_image[-2:] == [
        "--cache-config=local,size=4096",
        "--cache-directory=/opt/tritonserver/caches",
    ]


def test_a_server_without_a_caches_folder_beside_it_gets_none(tmp_path):
    binary = tmp_path / "bin" / "tritonserver"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    assert cache_directory(binary) is None
    (tmp_path / "caches" / "local").mkdir(parents=True)
    assert cache_directory(binary) is None  # a folder without a cache library is no cache
    (tmp_path / "caches" / "local" / "libtritoncache_local.so").write_bytes(b"")
    assert cache_directory(binary) == tmp_path / "caches"


@pytest.mark.parametrize("size", [0, -5, True])
def test_a_cache_size_below_one_byte_is_refused_with_the_fix(empty_repo, size):
    with pytest.raises(ServerError, match="1 byte or more"):
        TritonServer(empty_repo, cache_size=size)


def test_labkit_serve_takes_a_cache_size():
    args = build_parser().parse_args(["serve", "--cache-size", "16777216"])
    assert args.cache_size == 16777216
    assert build_parser().parse_args(["serve"]).cache_size is None


# -- the pipeline's committed models -----------------------------------------------------------
def test_the_encoder_step_shares_the_single_models_code_through_a_relative_link():
    link = ROOT / "model_repository" / "minilm_encode" / "1" / "minilm.py"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert link.resolve() == (ROOT / "model_repository" / "minilm" / "1" / "model.py").resolve()


# -- against the real server: one server for the module -----------------------------------------
CACHE_BYTES = 256 * 1024  # room for about 5 answers of 32 texts: the fill test goes past it


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    """The lab's MiniLM models (the single one with the response cache on, the ensemble and its
    two steps) in one server with a small cache."""
    root = tmp_path_factory.mktemp("pipeline")
    repo = Repository(ROOT / "model_repository").copy_to(root / "repo")
    for name in [m for m in repo.models() if not m.startswith("minilm")]:
        repo.remove(name)  # the lab's other models are not this module's subject
    repo.write_config(pipeline.SINGLE, pipeline.with_cache(repo.config(pipeline.SINGLE)))
    return start_module_server(repo.path, load_models=pipeline.MODELS, cache_size=CACHE_BYTES)


@pytest.mark.integration
def test_a_repeated_request_is_a_cache_hit_that_the_server_counts(server):
    text = f"Is this answer cached? {uuid.uuid4().hex}"
    before = profiling.cache_metrics(server)
    miss = pipeline.time_requests(server, pipeline.SINGLE, [text])
    after_miss = profiling.cache_metrics(server)
    hit = pipeline.time_requests(server, pipeline.SINGLE, [text])
    counted = profiling.cache_metrics(server, since=before).set_index("model")
    assert counted.loc["minilm", "misses"] == 1 and counted.loc["minilm", "hits"] == 1
    assert after_miss.set_index("model").loc["minilm", "misses"] >= 1
    assert hit[0] < miss[0]
    cached = embedding.served_embed(server, [text])  # a request of shape [1, 1]: the same key
    np.testing.assert_allclose(cached, embedding.embed([text]), atol=1e-5, rtol=0)


@pytest.mark.integration
def test_a_hit_takes_at_most_a_tenth_of_a_miss_at_concurrency_one(server):
    rounds = pipeline.hit_and_miss_rounds(server, rounds=1, per_round=10)
    p50 = rounds.set_index("kind")["p50_ms"]
    assert p50["hit"] <= 0.1 * p50["miss"], rounds
    counted = rounds.set_index("kind")
    assert counted.loc["miss", "server_misses"] == 10 and counted.loc["hit", "server_hits"] == 10


@pytest.mark.integration
def test_filling_the_cache_past_its_size_evicts_the_least_recently_used_answers(server):
    filled = pipeline.fill_cache(server, times=2.0)
    assert filled.sent_bytes >= 2 * CACHE_BYTES
    assert filled.evictions >= 1 and filled.util <= 1.0
    assert filled.entries * 32 * 384 * 4 <= CACHE_BYTES
    assert filled.first_evicted  # the oldest answer made room: asked again, it is a miss


@pytest.mark.integration
def test_the_ensemble_answers_as_the_single_model_does_on_32_sentences(server):
    texts = pipeline.sentences(30) + ["word " * 400, "Héllo wörld, ça va? 你好"]
    agreement = pipeline.compare_embeddings(server, texts)
    assert agreement.texts == 32 and agreement.dimension == 384
    assert agreement.max_abs_diff <= 1e-5


@pytest.mark.integration
def test_the_encoder_step_batches_texts_of_different_lengths_together(server):
    texts = ["Hi.", "A much longer sentence about the trains that leave the station.", "Why?"] * 3
    before = profiling.metrics(server)
    vectors = released_together(
        lambda text: embedding.served_embed(server, [text], model=pipeline.PIPELINE), texts
    )
    np.testing.assert_allclose(np.concatenate(vectors), embedding.embed(texts), atol=1e-5, rtol=0)
    counts = profiling.metrics(server, since=before).set_index("model").loc[pipeline.ENCODER]
    assert counts["inference_count"] == len(texts)


@pytest.mark.integration
def test_an_empty_text_is_refused_by_the_tokenizer_step_with_its_name(server):
    with pytest.raises(InferenceError, match="minilm_tokenize: text 0 of text_input is empty"):
        embedding.served_embed(server, ["   "], model=pipeline.PIPELINE)
