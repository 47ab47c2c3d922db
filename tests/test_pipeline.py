"""Pipelines and caching (notebook 08): the response cache's server settings, MiniLM as an
ensemble of a tokenizer step and an encoder step, against the real server."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc.model_config_pb2 import ModelInstanceGroup

from conftest import model_counts, released_together, wait_for
from labkit import embedding, pipeline, profiling, streaming
from labkit.cli import build_parser, main
from labkit.errors import ConfigError, InferenceError, ServerError
from labkit.lessons import pipeline as lesson
from labkit.lessons.takeaway import sentence_count
from labkit.repository import Repository, apply_edits, prepare_run_repository
from labkit.server import TritonServer, locate_tritonserver
from labkit.server.locate import cache_directory

ROOT = Path(__file__).resolve().parents[1]
#: What a learner must never read (the root conftest.py's rule for executed notebooks).
INTERNAL = re.compile(r"_vs_|\bRatio\(|\bConclusion\(|\bmet:|\bnot measured\b")


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


@pytest.mark.integration
def test_labkit_serve_starts_the_server_with_the_cache_size_it_is_given(empty_repo, tmp_path):
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "labkit.cli", "serve", "--model-repository", str(empty_repo)]
    command += ["--http-port=0", "--grpc-port=0", "--metrics-port=0", f"--log-file={log}"]
    lines: list[str] = []
    with subprocess.Popen(
        [*command, "--cache-size", "1048576"], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    ) as serve:
        reader = threading.Thread(target=lambda: lines.extend(serve.stdout), daemon=True)
        reader.start()
        try:
            ready = wait_for(
                lambda: next((x for x in list(lines) if "Triton is ready" in x), None),
                120,
                "labkit serve saying the server is ready",
            )
            metrics_url = re.search(r"metrics: (\S+)", ready).group(1)
            # the server says the size it was given, and its metrics show the cache it made
            assert re.search(r"cache_config: '\{.*size.*1048576", log.read_text()), log.read_text()
            assert "nv_cache_util" in set(profiling.scrape(metrics_url)["name"])
        finally:
            serve.send_signal(signal.SIGINT)
            code = serve.wait(timeout=60)
            reader.join(timeout=10)  # its output ended with the process
    assert code == 0


@pytest.mark.parametrize("size", ["0", "-5"])
def test_labkit_serve_refuses_a_cache_size_below_one_byte_before_starting(empty_repo, size, capsys):
    code = main(["serve", "--model-repository", str(empty_repo), "--cache-size", size])
    assert code == 2
    assert f"cache_size={int(size)}: the response cache needs a size of 1 byte or more" in (
        capsys.readouterr().err
    )


def test_labkit_serve_refuses_a_cache_size_that_is_not_a_number(empty_repo, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model-repository", str(empty_repo), "--cache-size", "16M"])
    assert exit_.value.code == 2
    assert "argument --cache-size: invalid int value: '16M'" in capsys.readouterr().err


# -- the pipeline's committed models -----------------------------------------------------------
def test_the_encoder_step_shares_the_single_models_code_through_a_relative_link():
    link = ROOT / "model_repository" / "minilm_encode" / "1" / "minilm.py"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert link.resolve() == (ROOT / "model_repository" / "minilm" / "1" / "model.py").resolve()


def test_the_cached_twin_differs_from_minilm_by_its_name_and_response_cache_only(tmp_path):
    repo = Repository(ROOT / "model_repository").copy_to(tmp_path / "repo")
    diff = pipeline.add_cached_twin(repo)
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in "+++---"]
    assert changed == [
        '-name: "minilm"',
        '+name: "minilm_cached"',
        "+response_cache {",
        "+  enable: true",
        "+}",
    ]
    assert (repo / "minilm_cached" / "1" / "model.py").read_bytes() == (
        ROOT / "model_repository" / "minilm" / "1" / "model.py"
    ).read_bytes()


def test_the_gpu_configs_put_the_encoders_on_the_gpu_and_keep_the_tokenizer_on_the_cpu(tmp_path):
    repo = Repository(ROOT / "model_repository").copy_to(tmp_path / "repo")
    written = pipeline.write_gpu_configs(repo, tmp_path / "out", encoder_instances=2, image="x:1")
    out = Repository(written.repository)
    kinds = {
        name: [(ModelInstanceGroup.Kind.Name(g.kind), g.count) for g in out.config(name).instance_group]
        for name in (pipeline.SINGLE, pipeline.TOKENIZER, pipeline.ENCODER)
    }  # fmt: skip
    assert kinds == {
        pipeline.SINGLE: [("KIND_GPU", 1)],
        pipeline.TOKENIZER: [("KIND_CPU", 1)],
        pipeline.ENCODER: [("KIND_GPU", 2)],
    }
    assert out.config(pipeline.PIPELINE) == repo.config(pipeline.PIPELINE)  # wired the same
    assert not written.diffs[pipeline.PIPELINE].strip()
    assert "+  kind: KIND_GPU" in written.diffs[pipeline.ENCODER]
    # the CPU's batches of 4 (two batches for 8 lock-step clients) are left behind on a GPU
    assert list(repo.config(pipeline.ENCODER).dynamic_batching.preferred_batch_size) == [4]
    assert not out.config(pipeline.ENCODER).dynamic_batching.preferred_batch_size
    assert "-  preferred_batch_size: 4" in written.diffs[pipeline.ENCODER]
    for name in (pipeline.CACHED, pipeline.PIPELINE_CACHED):
        assert out.config(name).response_cache.enable
    # a folder to copy to another host: the encoder step's shared code is a file, not a link
    shared = out.path / pipeline.ENCODER / "1" / "minilm.py"
    assert shared.is_file() and not shared.is_symlink()
    command = written.docker_command
    assert command[:4] == ["docker", "run", "--gpus", "all"]
    assert command[-2:] == [
        f"--cache-config=local,size={256 * 1024 * 1024}",
        "--cache-directory=/opt/tritonserver/caches",
    ]
    loaded = {a.split("=", 1)[1] for a in command if a.startswith("--load-model=")}
    assert {pipeline.PIPELINE, pipeline.PIPELINE_CACHED, pipeline.CACHED} <= loaded


def test_the_gpu_configs_refuse_a_repository_without_the_pipeline(tmp_path):
    repo = Repository(tmp_path / "repo", create=True)
    with pytest.raises(ConfigError, match="holds no minilm, minilm_tokenize"):
        pipeline.write_gpu_configs(repo, tmp_path / "out")


# -- against the real server: one server for the module -----------------------------------------
CACHE_BYTES = 256 * 1024  # room for about 5 answers of 32 texts: the fill test goes past it
MINILM = ["minilm", "minilm_tokenize", "minilm_encode", "minilm_pipeline"]
LLM = "smollm2_stream"
UNLOADED = "ask_unloaded_llm"


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    """The lab's MiniLM models (the single one, its twin with the response cache on, the ensemble
    and its two steps), smollm2's streaming twin and the ask model that calls both, in one server
    with a small cache."""
    root = tmp_path_factory.mktemp("pipeline")
    repo = prepare_run_repository(root, models=[LLM])  # smollm2's weights linked
    for name in set(repo.models()) - {LLM, "smollm2", pipeline.ASK} - set(MINILM):
        repo.remove(name)  # the lab's other models are not this module's subject
    pipeline.add_cached_twin(repo)
    pipeline.add_cached_twin(repo, pipeline.PIPELINE, pipeline.PIPELINE_CACHED)
    # ask, calling a language model that the server does not load (smollm2: in the repository)
    cfg = repo.config(pipeline.ASK)
    repo.add_twin(pipeline.ASK, UNLOADED, apply_edits(cfg, parameters={"llm_model": "smollm2"}))
    models = [*pipeline.MODELS, pipeline.CACHED, pipeline.PIPELINE_CACHED, LLM, pipeline.ASK]
    models.append(UNLOADED)
    return start_module_server(repo.path, load_models=models, cache_size=CACHE_BYTES)


@pytest.mark.integration
def test_a_repeated_request_is_a_cache_hit_that_the_server_counts(server):
    text = f"Is this answer cached? {uuid.uuid4().hex}"
    before = profiling.cache_metrics(server)
    miss = pipeline.time_requests(server, pipeline.CACHED, [text])
    missed = profiling.cache_metrics(server, since=before).set_index("model").loc[pipeline.CACHED]
    hit = pipeline.time_requests(server, pipeline.CACHED, [text])
    counted = profiling.cache_metrics(server, since=before).set_index("model")
    assert (missed["misses"], missed["hits"]) == (1, 0)
    assert (counted.loc[pipeline.CACHED, "misses"], counted.loc[pipeline.CACHED, "hits"]) == (1, 1)
    assert pipeline.SINGLE not in counted.index  # the model without response_cache never asks
    assert len(hit) == len(miss) == 1  # times are compared over many requests in the next test
    # a request of shape [1, 1] again: the same key, the cached answer, the model's own vector
    cached = embedding.served_embed(server, [text], model=pipeline.CACHED)
    np.testing.assert_allclose(cached, embedding.embed([text]), atol=1e-5, rtol=0)


@pytest.mark.integration
def test_a_hit_takes_at_most_a_tenth_of_a_miss_at_concurrency_one(server):
    rounds = pipeline.hit_and_miss_rounds(server, rounds=1, per_round=10)
    p50 = rounds.set_index("kind")["p50_ms"]
    assert p50["hit"] <= 0.1 * p50["miss"], rounds
    counted = rounds.set_index("kind")
    assert counted.loc["miss", "server_misses"] == 10 and counted.loc["hit", "server_hits"] == 10


def encoded_count(server) -> int:
    return int(
        profiling.metrics(server).set_index("model").loc[pipeline.ENCODER, "inference_count"]
    )


@pytest.mark.integration
def test_the_cached_ensemble_answers_a_repeated_text_at_its_door_without_its_steps(server):
    texts = pipeline.sentences(10, salt=f"ensemble {uuid.uuid4().hex[:6]}")
    first = encoded_count(server)
    before = profiling.cache_metrics(server)
    missed = pipeline.time_requests(server, pipeline.PIPELINE_CACHED, texts)
    # the encoder step counts a request when it releases it, a moment after the answer left
    wait_for(lambda: encoded_count(server) >= first + len(texts), 30, "the misses encoded")
    encoded = encoded_count(server)
    hit = pipeline.time_requests(server, pipeline.PIPELINE_CACHED, texts)
    counted = profiling.cache_metrics(server, since=before).set_index("model")
    row = counted.loc[pipeline.PIPELINE_CACHED]
    assert (row["misses"], row["hits"]) == (len(texts), len(texts))
    # a hit never reached the steps: one more new text, sent after the hits, is the next request
    # the encoder step runs (one instance, in order), so once it is counted, the hits would be too
    pipeline.time_requests(server, pipeline.PIPELINE_CACHED, [f"A new text {uuid.uuid4().hex}"])
    after = wait_for(
        lambda: (n := encoded_count(server)) > encoded and n, 30, "the new text encoded"
    )
    assert after == encoded + 1
    assert np.median(hit) <= 0.1 * np.median(missed), (hit, missed)
    cached = embedding.served_embed(server, texts[:1], model=pipeline.PIPELINE_CACHED)  # a hit
    np.testing.assert_allclose(cached, embedding.embed(texts[:1]), atol=1e-5, rtol=0)


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

    def settled():  # the last test's requests may still be counted by the step (CI saw 41 for 9)
        def count():
            return (
                profiling.metrics(server)
                .set_index("model")
                .loc[pipeline.ENCODER]["inference_count"]
            )

        first = count()
        time.sleep(0.5)
        return first == count() or None

    wait_for(settled, 30, "the encoder step's counters to settle")
    before = profiling.metrics(server)
    vectors = released_together(
        lambda text: embedding.served_embed(server, [text], model=pipeline.PIPELINE), texts
    )
    np.testing.assert_allclose(np.concatenate(vectors), embedding.embed(texts), atol=1e-5, rtol=0)

    def encoded():  # a step's counters move when it releases the request, after the answer left
        counts = profiling.metrics(server, since=before).set_index("model").loc[pipeline.ENCODER]
        return counts.to_dict() if counts["inference_count"] >= len(texts) else None

    counts = wait_for(encoded, 30, f"the encoder step counting {len(texts)} texts")
    assert counts["inference_count"] == len(texts)


@pytest.mark.integration
def test_an_empty_text_is_refused_by_the_tokenizer_step_with_its_name(server):
    with pytest.raises(InferenceError, match="minilm_tokenize: text 0 of text_input is empty"):
        embedding.served_embed(server, ["   "], model=pipeline.PIPELINE)


@pytest.mark.integration
def test_ask_answers_as_its_steps_run_from_the_client_do(server):
    question = "What does the response cache do?"
    inside = pipeline.ask(server, question)
    outside = pipeline.ask_from_client(server, question)
    assert inside.text.strip() and inside.text == outside.text  # greedy: one answer
    assert "response cache answers a request" in outside.prompt  # the passage ranked first
    assert 0 < inside.ttft_s <= inside.total_s


@pytest.mark.integration
def test_an_empty_question_to_ask_is_a_400_with_the_embedding_steps_message(server):
    with pytest.raises(
        InferenceError, match=r"\(400\): ask: step minilm: text 0 of text_input is empty"
    ):
        pipeline.ask(server, "   ")
    assert pipeline.ask(server, "When is bread baked?").text  # the next question is answered


@pytest.mark.integration
def test_ask_whose_language_model_is_not_loaded_names_it(server):
    pieces = []
    with pytest.raises(
        InferenceError, match=r"ask: step smollm2: .*; load smollm2 \(ask calls it\)"
    ):
        for piece in streaming.stream(server.http_url, UNLOADED, "What is vLLM?"):
            pieces.append(piece)
    assert pieces == []  # the error came before any text


# -- ask and a client that leaves -------------------------------------------------------------
LEFT_QUEUED = "ask: a question was cancelled by its client before it ran; no step ran for it"
LEFT_MID_ANSWER = "ask: a question was cancelled by its client after"
LONG_QUESTION = "Tell me a long story about the station."  # its answer runs past 200 tokens


class HeldQuestion:
    """A question to ``ask`` on a gRPC stream of its own, read as it comes, cancellable."""

    def __init__(self, server, question: str, **parameters) -> None:
        self.arrived: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.client.start_stream(callback=lambda result, error: self.arrived.put((result, error)))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([question.encode()], dtype=np.object_))
        self.client.async_stream_infer(
            pipeline.ASK, [text], parameters=parameters or None, enable_empty_final_response=True
        )
        self.pieces: list[str] = []
        self.done = False

    def read(self, until_pieces: int | None = None, timeout_s: float = 300) -> str:
        """Read the answer until it ends (or ``until_pieces`` pieces came); the text so far."""
        deadline = time.monotonic() + timeout_s
        while not self.done and (until_pieces is None or len(self.pieces) < until_pieces):
            result, error = self.arrived.get(timeout=max(0.1, deadline - time.monotonic()))
            assert error is None, error
            out = result.as_numpy("text_output")
            if out is not None:
                self.pieces.extend(x.decode() for x in out.reshape(-1))
            self.done = result.get_response().parameters["triton_final_response"].bool_param
        return "".join(self.pieces)

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def logged(server, line: str) -> int:
    return Path(server.log_path).read_text(encoding="utf-8", errors="replace").count(line)


def queued(server, model: str) -> int:
    """Requests Triton holds for ``model`` that its instances have not taken yet."""
    samples = profiling.scrape(server)
    rows = samples[
        (samples["name"] == "nv_inference_pending_request_count") & (samples["model"] == model)
    ]
    return int(rows["value"].sum())


def settled(server, model: str) -> dict:
    """``model``'s counters once two reads half a second apart agree (a step's request is counted
    when it is released, a moment after its answer left)."""

    def same():
        first = model_counts(server, model)["inference_count"]
        time.sleep(0.5)
        row = model_counts(server, model)
        return row.to_dict() if row["inference_count"] == first else None

    return wait_for(same, 30, f"{model}'s counters to settle")


@pytest.mark.integration
def test_questions_cancelled_while_queued_for_ask_run_no_step(server):
    """ask has one instance: questions wait for it. One whose client left runs no step."""
    question = "When is bread baked?"
    alone = pipeline.ask(server, question).text  # ask embeds its passages at its first question
    settled(server, LLM)
    before, seen = profiling.metrics(server), logged(server, LEFT_QUEUED)
    held = HeldQuestion(server, LONG_QUESTION, max_tokens=200)
    try:
        held.read(until_pieces=1)
        left = [HeldQuestion(server, f"What about question {i}?") for i in range(3)]
        wait_for(lambda: queued(server, pipeline.ASK) == 3, 60, "3 questions queued for ask")
        for question_left in left:
            question_left.cancel()
        held.read()
    finally:
        held.cancel()
    # the next question waits behind the three that left: answered, they have been dealt with
    assert pipeline.ask(server, question).text == alone
    llm = wait_for(
        lambda: (
            (row := model_counts(server, LLM, since=before).to_dict())["inference_count"] >= 2
            and row
        ),
        30,
        "the language model counting the two questions answered",
    )
    assert llm["inference_count"] == 2  # the held question and the last one; none that left
    assert model_counts(server, pipeline.SINGLE, since=before)["inference_count"] == 2
    assert logged(server, LEFT_QUEUED) == seen + 3
    assert len(held.pieces) > 16  # its max_tokens reached the language model (16 by default)


@pytest.mark.integration
def test_a_question_left_mid_answer_stops_ask_and_the_next_is_answered(server):
    question = "When is bread baked?"
    alone = pipeline.ask(server, question).text
    seen = logged(server, LEFT_MID_ANSWER)
    held = HeldQuestion(server, LONG_QUESTION, max_tokens=200)
    try:
        held.read(until_pieces=2)
        assert not held.done  # left in the middle of its answer
    finally:
        held.cancel()
    wait_for(lambda: logged(server, LEFT_MID_ANSWER) > seen, 60, "ask stopping the answer")
    assert pipeline.ask(server, question).text == alone


# -- the lesson's figures and verdicts -----------------------------------------------------------
SERVED = (pipeline.SINGLE, pipeline.MATCHED, pipeline.PIPELINE)


def rounds(*by_model: list[float], clients: int = 8, batch: float = 4.0, batch_ms: float = 200.0):
    """Fake :func:`pipeline.ensemble_rounds` rows: one list of infer/s per model of SERVED."""
    rows = []
    for model, values in zip(SERVED, by_model, strict=True):
        for number, value in enumerate(values, 1):
            rows.append(
                {"round": number, "model": model, "setting": "served alike", "concurrency": clients,
                 "throughput": value, "p50_ms": 1000 / value, "p99_ms": 2000 / value,
                 "avg_batch_size": batch, "compute_infer_ms": batch_ms}
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_the_single_model_is_served_as_the_encoder_step_so_only_the_split_differs(tmp_path):
    repo = Repository(ROOT / "model_repository").copy_to(tmp_path / "repo")
    diff = pipeline.match_encoder(repo, instances=2)
    encoder, single, matched = (
        repo.config(m) for m in (pipeline.ENCODER, pipeline.SINGLE, pipeline.MATCHED)
    )
    assert [g.count for g in encoder.instance_group] == [2]
    assert [g.count for g in matched.instance_group] == [2]
    assert [g.count for g in single.instance_group] == [1]  # the second instance's baseline
    for cfg in (single, matched):
        assert cfg.dynamic_batching == encoder.dynamic_batching
    assert list(single.dynamic_batching.preferred_batch_size) == [4]
    assert "+  preferred_batch_size: 4" in diff and "+  count: 2" in diff
    with pytest.raises(ConfigError, match="1 or more"):
        pipeline.match_encoder(repo, instances=0)


@pytest.mark.parametrize(
    ("single", "ensemble", "word"),
    [
        ([30.0, 31.0], [15.0, 16.0], "loss"),
        ([30.0, 31.0], [34.0, 35.0], "tie"),  # +13%: under x1.20
        ([30.0, 31.0], [45.0, 29.0], "tie"),  # one round the other way
        ([30.0, 31.0], [36.0, 37.2], "gain"),  # x1.20 exactly: the bar
        ([30.0, 60.0], [45.0, 90.0], "gain"),  # the host doubled its speed: both sides alike
    ],
)
def test_the_ensemble_is_judged_against_the_single_model_served_alike(single, ensemble, word):
    frame = rounds([10.0, 10.0], single, ensemble)
    verdict = lesson.rounds_verdict(frame, pipeline.PIPELINE, pipeline.MATCHED, 8, "ensemble")
    assert verdict.word == word and verdict.of == "infer/s"
    assert verdict.comparison == "ensemble, 8 clients"


def lesson_inputs(ensemble=(29.0, 31.0), second=(30.0, 31.0)):
    frame = pd.concat(
        [
            rounds([20.0, 21.0], [20.0, 21.0], [19.0, 20.0], clients=1, batch=1.0, batch_ms=50.0),
            rounds(
                [15.0, 15.5], list(second), list(ensemble), clients=8, batch=4.0, batch_ms=150.0
            ),
        ]
    )
    hits = pd.DataFrame(
        [
            {"round": r, "kind": k, "p50_ms": p, "p99_ms": 2 * p, "requests": 20,
             "server_hits": 20 * (k == "hit"), "server_misses": 20 * (k == "miss")}
            for r in (1, 2) for k, p in (("miss", 30.0), ("hit", 0.2))
        ]
    )  # fmt: skip
    asked = pd.DataFrame(
        [
            {"round": r, "way": way, "ttft_s": t, "total_s": 2.0, "text": " It answers."}
            for r in (1, 2)
            for way, t in (("ask (BLS, one request)", 0.30), ("the same steps from the client", 0.31))
        ]
    )  # fmt: skip
    agreement = pipeline.Agreement(texts=32, max_abs_diff=2e-7, dimension=384)
    eviction = pipeline.Eviction(1 << 20, 2 << 20, 43, 79, 21, 0.98, True)
    pipe_hits = hits.assign(p50_ms=hits["p50_ms"] * 1.5)
    return agreement, frame, hits, eviction, pipe_hits, asked


def conclusion(**inputs):
    agreement, frame, hits, eviction, pipe_hits, asked = lesson_inputs(**inputs)
    return lesson.pipeline_conclusion(
        agreement, frame, hits, eviction, pipeline_hits=pipe_hits, asked=asked
    )


def test_the_verdicts_are_the_split_the_second_instance_the_cache_and_ask():
    table = conclusion().verdict_table().set_index("comparison")
    assert list(table["verdict"]) == ["tie", "tie", "gain", "tie", "gain", "tie"]
    assert list(table.index[:4]) == [
        "ensemble against one model served alike, 1 client",
        "ensemble against one model served alike, 8 clients",
        "2 instances of one model against 1, 8 clients",
        "2 instances of one model against 1, 1 client",
    ]
    assert table.loc["2 instances of one model against 1, 8 clients", "median"] == 2.0
    assert table.loc["repeated text against a new one, cached", "median"] == 150.0
    assert table.loc["ask against the same steps from the client", "each round"] == "x1.03, x1.03"


def test_the_takeaway_names_each_verdict_and_its_number():
    said = conclusion().takeaway
    assert sentence_count(said) == 3
    assert said[0].endswith("served alike at 8 clients: tie, x0.98 infer/s.")
    assert said[1].endswith("at 8 clients: gain, x2.00 infer/s.")
    assert "0.20 ms against 30.0 ms" in said[2]
    # a slower ensemble and a second instance that did nothing: the words follow the figures
    moved = conclusion(ensemble=(10.0, 10.0), second=(15.0, 15.5)).takeaway
    assert ": loss, x0.66 infer/s." in moved[0] and ": tie, x1.00 infer/s." in moved[1]


def test_the_figures_and_the_table_show_the_measurements_in_words():
    done = conclusion()
    assert len(done.figures) <= 6
    assert str(done.figures["2 instances of one model against 1, 8 clients"]) == "x2.00 infer/s"
    measured = done.table.set_index("figure")["measured"]
    assert measured["time of a batch of 4.0 against 1 request (one model)"] == "x3.00"
    assert measured["repeated text p50 against new, ensemble (ms)"] == "0.30 against 45.0"
    assert measured["ask's answers and the client's"] == "the same"
    assert measured["first request, sent again"] == "a miss"
    shown = str(done) + str(done.takeaway) + done.table.to_string()
    assert not INTERNAL.search(shown), shown
    for table in (done.table, lesson.rounds_table(lesson_inputs()[1])):
        assert not [c for c in table.columns if "_" in c], table.columns


def test_the_rounds_and_the_cache_rounds_have_a_row_each():
    rows = lesson.rounds_table(lesson_inputs()[1])
    assert len(rows) == 6 and set(rows["clients"]) == {1, 8}
    single = rows[rows["served as"] != "ensemble, encoder step 2 instances"]
    assert list(single["requests per execution"].unique()) == [1.0, 4.0]
    assert (
        rows.set_index("served as").loc["ensemble, encoder step 2 instances"].isna().sum().sum()
        == 4
    )
    hits = lesson_inputs()[2]
    both = lesson.hit_miss_table(hits, hits)
    assert list(both["served as"]) == ["one model"] * 2 + ["ensemble"] * 2
    assert list(both["round"]) == [1, 2, 1, 2]
    assert both.loc[0, "repeated p50 (ms)"] == 0.2 and both.loc[0, "hits counted"] == 20
    asked = lesson.ask_table(lesson_inputs()[5])
    assert list(asked["answer"].unique()) == ["It answers."]


def test_an_eviction_reads_in_words():
    said = str(lesson_inputs()[3])
    assert said.startswith("43 requests offered 2048 KiB of answers to a cache of 1024 KiB")
    assert "a miss: it had been evicted" in said


def test_the_benchmarks_targets_are_judged_from_its_figures():
    result = {
        "cache_hit_p50_ms": 0.1,
        "cache_miss_p50_ms": 20.0,
        "ensemble_max_abs_diff": 2e-7,
        "ask_same_answer": True,
        "cache_evictions": 80,
        "cache_first_evicted": True,
    }
    judged = pipeline.targets(result)
    assert all(t["met"] for t in judged.values())
    assert judged["cache_hit_p50_at_most_0.1x_miss_p50"]["measured"] == pytest.approx(0.005)
    slow_hit = pipeline.targets({**result, "cache_hit_p50_ms": 3.0})
    assert not slow_hit["cache_hit_p50_at_most_0.1x_miss_p50"]["met"]
    assert not pipeline.targets({**result, "ensemble_max_abs_diff": 1e-3})[
        "ensemble_max_abs_diff_at_most_1e-5"
    ]["met"]


def test_labkit_bench_pipeline_takes_its_settings():
    args = build_parser().parse_args(["bench", "pipeline", "--cache-mib", "2", "--json", "f.json"])
    assert (args.cache_mib, args.rounds, args.json) == (2, 2, "f.json")
