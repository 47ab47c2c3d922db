"""Pipelines and caching (notebook 08): MiniLM as an ensemble, and Triton's response cache.

The lab's repository serves the all-MiniLM-L6-v2 encoder two ways:

- ``minilm``: one Python model, text in, embedding out (tokenize, encode and pool in one
  ``execute``);
- ``minilm_pipeline``: an ensemble (``platform: "ensemble"``, no code of its own) whose steps
  are ``minilm_tokenize`` (the ``tokenizers`` library, no torch) and ``minilm_encode`` (torch: the
  encoder, mean pooling and normalisation, with ``minilm``'s own code). Triton's ensemble
  scheduler passes each step's outputs to the next in the server, so a client sends text and
  gets the embedding, as from ``minilm``.

A third shape is ``ask``: business logic scripting (BLS), a Python model that calls other
models itself (``minilm`` to embed a question, then ``smollm2_stream`` to answer it from the
passages it ranked), streaming the answer back; :func:`ask` and :func:`ask_from_client` run it
and the same steps from the client.

This module measures what a learner asks of them: whether the two answer alike
(:func:`compare_embeddings`), what the ensemble costs against the single model served alike
(:func:`match_encoder`), and what a second instance buys (:func:`ensemble_rounds`, perf_analyzer
in alternating rounds), and what the response cache does
(:func:`hit_and_miss_rounds`, :func:`fill_cache`, and the server's own counters in
:func:`labkit.profiling.cache_metrics`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from labkit import embedding, proc, profiling, streaming
from labkit.errors import ConfigError, InferenceError
from labkit.repository import (
    ModelConfig,
    Repository,
    apply_edits,
    diff_configs,
    prepare_run_repository,
)
from labkit.server import TritonServer, served_config, serving

log = logging.getLogger(__name__)

SINGLE = "minilm"
PIPELINE = "minilm_pipeline"
TOKENIZER = "minilm_tokenize"
ENCODER = "minilm_encode"
#: ``minilm`` with the response cache on, a model of its own (see :func:`add_cached_twin`).
CACHED = "minilm_cached"
#: ``minilm_pipeline`` with the response cache on: the ensemble's answer cached whole, at its door.
PIPELINE_CACHED = "minilm_pipeline_cached"
#: ``minilm`` served as the ensemble's encoder step is: its instances and its batching (see
#: :func:`match_encoder`), so that the two differ only by the split into steps.
MATCHED = "minilm_2"
#: What a notebook loads: the single model and the ensemble (which brings its two steps).
MODELS = [SINGLE, PIPELINE]
#: How a measurement names each way of serving MiniLM.
LABELS = {SINGLE: "one model", MATCHED: "one model, as the encoder step", PIPELINE: "ensemble"}

_SUBJECTS = ["the station", "our bakery", "the museum", "bus line 4", "the library", "the park"]
_VERBS = ["opens", "closes", "has trains", "sells bread", "gets busy", "is quiet"]
_TIMES = ["every morning", "on Mondays", "at noon", "after ten", "every ten minutes", "in spring"]


def sentences(count: int, *, salt: str = "") -> list[str]:
    """``count`` different short sentences (``salt`` makes another set of the same kind)."""
    if count < 1:
        raise ConfigError(f"count must be 1 or more, got {count}")
    made = []
    for i, (who, does, when) in enumerate(itertools.product(_SUBJECTS, _VERBS, _TIMES)):
        if i == count:
            break
        made.append(f"{who.capitalize()} {does} {when}{f' ({salt})' if salt else ''}.")
    while len(made) < count:  # more than the combinations: number the rest
        made.append(f"Sentence {len(made)} of the set{f' {salt}' if salt else ''}.")
    return made


# -- the configurations the notebook changes --------------------------------------------------
def with_cache(cfg: ModelConfig, enable: bool = True) -> ModelConfig:
    """A copy of ``cfg`` with ``response_cache { enable: true }`` (or without the cache)."""
    new = ModelConfig()
    new.CopyFrom(cfg)
    if enable:
        new.response_cache.enable = True
    else:
        new.ClearField("response_cache")
    return new


def add_cached_twin(repository: Repository, model: str = SINGLE, name: str = CACHED) -> str:
    """Add ``name``: ``model``'s folder (its code and weights linked) with the response cache on;
    the difference between the two configs, as a diff.

    A model of its own rather than ``model`` reloaded with the cache: Triton 2.51 creates a
    model's cache counters (``nv_cache_num_hits_per_model``...) when the model is first loaded,
    so a model whose reload turns the cache on answers from the cache but ``/metrics`` never
    counts its hits or misses (checked on this machine)."""
    before = repository.config(model)
    repository.add_twin(model, name, with_cache(before))
    return diff_configs(before, repository.config(name), f"{model} -> {name}")


def match_encoder(repository: Repository, instances: int = 2) -> str:
    """Serve the single model and the ensemble's encoder step alike, before the server starts:
    the encoder step gets ``instances`` instances; ``minilm`` gets the encoder step's dynamic
    batching (its ``preferred_batch_size`` included), and a twin of it, :data:`MATCHED`, gets
    that batching and ``instances`` instances too. The ensemble against :data:`MATCHED` then
    measures only the split into steps, and :data:`MATCHED` against ``minilm`` only the
    instances. The diffs written."""
    if instances < 1:
        raise ConfigError(f"instances must be 1 or more, got {instances}")
    encoder = repository.config(ENCODER)
    single = repository.config(SINGLE)
    batched = ModelConfig()
    batched.CopyFrom(single)
    batched.dynamic_batching.CopyFrom(encoder.dynamic_batching)
    diffs = [
        repository.write_config(ENCODER, apply_edits(encoder, instance_count=instances)),
        repository.write_config(SINGLE, batched),
    ]
    repository.add_twin(SINGLE, MATCHED, apply_edits(batched, instance_count=instances))
    diffs.append(diff_configs(batched, repository.config(MATCHED), f"{SINGLE} -> {MATCHED}"))
    return "".join(d for d in diffs if d)


# -- the ensemble answers as the single model does ---------------------------------------------
@dataclass(frozen=True)
class Agreement:
    """The ensemble's vectors against the single model's, for the same texts."""

    texts: int
    max_abs_diff: float
    dimension: int

    def __str__(self) -> str:
        largest = (
            "0: the same float32 numbers" if self.max_abs_diff == 0 else f"{self.max_abs_diff:.1e}"
        )
        return (
            f"{self.texts} sentences, {self.dimension} numbers each: the largest difference "
            f"between the ensemble's and the single model's vectors is {largest}"
        )


def compare_embeddings(server: TritonServer | str, texts: Sequence[str]) -> Agreement:
    """Embed ``texts`` with ``minilm`` and ``minilm_pipeline`` (one request each) and compare."""
    single = embedding.served_embed(server, list(texts), model=SINGLE)
    ensemble = embedding.served_embed(server, list(texts), model=PIPELINE)
    return Agreement(len(texts), float(np.abs(single - ensemble).max()), single.shape[-1])


# -- the response cache: hits against misses, timed by the client ----------------------------
def _request(text: str) -> list:
    tensor = httpclient.InferInput(embedding.INPUT_NAME, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode("utf-8")]], dtype=np.object_))
    return [tensor]


def time_requests(server: TritonServer | str, model: str, texts: Iterable[str]) -> np.ndarray:
    """Send each text alone, one after the other (concurrency 1), on one connection; the
    latency of each in milliseconds, as the client saw it."""
    url = server if isinstance(server, str) else server.http_url
    client = httpclient.InferenceServerClient(url.split("://")[-1], network_timeout=120.0)
    took = []
    try:
        for text in texts:
            inputs = _request(text)
            started = time.perf_counter()
            client.infer(model, inputs)
            took.append((time.perf_counter() - started) * 1000.0)
    except InferenceServerException as exc:
        raise InferenceError(
            f"model {model!r} at {url} refused a request: {exc.message()}"
        ) from exc
    finally:
        client.close()
    return np.array(took)


def hit_and_miss_rounds(
    server: TritonServer, model: str = CACHED, *, rounds: int = 3, per_round: int = 20
) -> pd.DataFrame:
    """Misses and hits in alternating rounds: each round sends ``per_round`` sentences the server
    has never seen (each a miss), then the same sentences again (each a hit). One row per round
    and kind: ``round``, ``kind`` ("miss"/"hit"), ``p50_ms``, ``p99_ms``, ``requests``, and the
    hits and misses the server counted meanwhile (``server_hits``, ``server_misses``)."""
    rows = []
    for number in range(1, rounds + 1):
        texts = sentences(per_round, salt=f"round {number} {uuid.uuid4().hex[:6]}")
        for kind in ("miss", "hit"):
            before = profiling.cache_metrics(server)
            took = time_requests(server, model, texts)
            counted = _row(profiling.cache_metrics(server, since=before), model)
            rows.append(
                {
                    "round": number,
                    "kind": kind,
                    "p50_ms": float(np.percentile(took, 50)),
                    "p99_ms": float(np.percentile(took, 99)),
                    "requests": len(took),
                    "server_hits": int(counted.get("hits", 0)),
                    "server_misses": int(counted.get("misses", 0)),
                }
            )
    return pd.DataFrame(rows)


def _row(frame: pd.DataFrame, model: str) -> dict:
    rows = frame[frame["model"] == model]
    return rows.iloc[0].to_dict() if len(rows) else {}


@dataclass(frozen=True)
class Eviction:
    """What filling the cache past its size did (:func:`fill_cache`)."""

    cache_bytes: int
    sent_bytes: int  # the embeddings sent back, what the cache was offered
    requests: int
    evictions: int
    entries: int
    util: float  # the fraction of the cache in use at the end
    first_evicted: bool  # the first request, sent again, was a miss

    def __str__(self) -> str:
        again = "a miss: it had been evicted" if self.first_evicted else "still a hit"
        return (
            f"{self.requests} requests offered {self.sent_bytes / 1024:.0f} KiB of answers to a "
            f"cache of {self.cache_bytes / 1024:.0f} KiB: it holds {self.entries} of them, "
            f"filling {self.util:.0%} of it by its own gauge (answers and their bookkeeping), "
            "and evicted the least recently used to make room. "
            f"Sent again, the first request was {again}."
        )


def fill_cache(
    server: TritonServer, model: str = CACHED, *, times: float = 2.0, batch: int = 32
) -> Eviction:
    """Offer the cache ``times`` its size in new answers (requests of ``batch`` new sentences,
    ``batch`` x 384 x 4 bytes each), then send the first request again. Its least recently
    used entries are evicted to make room: the first request is then a miss again."""
    size = getattr(server, "cache_size", None)
    if not size:
        raise ConfigError("this server runs without a response cache; start it with cache_size=")
    per_request = batch * embedding.DIMENSION * 4
    count = max(2, int(np.ceil(times * size / per_request)))
    salt = uuid.uuid4().hex[:6]
    time.sleep(METRICS_INTERVAL_S)  # the gauges catch up with what came before this fill
    before = profiling.cache_totals(server)
    first = [sentences(batch, salt=f"fill {salt} {i}") for i in range(count)]
    for texts in first:
        embedding.served_embed(server, texts, model=model)
    filled = settled_totals(server, lookups=before.get("lookups", 0) + count)
    metrics_before = profiling.cache_metrics(server)
    embedding.served_embed(server, first[0], model=model)
    again = _row(profiling.cache_metrics(server, since=metrics_before), model)
    return Eviction(
        cache_bytes=int(size),
        sent_bytes=count * per_request,
        requests=count,
        evictions=int(filled.get("evictions", 0) - before.get("evictions", 0)),
        entries=int(filled.get("entries", 0)),
        util=float(filled.get("util", 0.0)),
        first_evicted=bool(again.get("misses", 0) >= 1),
    )


#: A little over Triton's metrics interval (2 s by default): the cache's gauges refresh on it.
METRICS_INTERVAL_S = 2.2


def settled_totals(server: TritonServer, *, lookups: float, timeout_s: float = 15.0) -> dict:
    """:func:`labkit.profiling.cache_totals` once they count ``lookups`` lookups or more.

    The whole cache's gauges (entries, util, evictions...) are refreshed on Triton's metrics
    interval (2 s by default), not at each request as the per-model counters are: read at once
    after a burst of requests, they can still show the cache as it was before it."""
    proc.wait_until(
        lambda: profiling.cache_totals(server).get("lookups", 0) >= lookups, timeout_s, 0.2
    )
    # One more refresh after the one that counted the lookups: a fresh clone's make test read
    # 0 evictions and 13 entries (more than the cache holds) right after the count was reached.
    time.sleep(METRICS_INTERVAL_S)
    return profiling.cache_totals(server)


def cache_table(server: TritonServer | str, since: pd.DataFrame | None = None) -> pd.DataFrame:
    """The server's cache counters per model, in words a learner reads (with units)."""
    frame = profiling.cache_metrics(server, since=since)
    if frame.empty:
        return pd.DataFrame(columns=["model", "hits", "misses"])
    return pd.DataFrame(
        {
            "model": frame["model"],
            "hits": frame["hits"].astype(int),
            "misses": frame["misses"].astype(int),
            "cache time per hit (µs)": frame["avg_hit_us"].map("{:.1f}".format),
            "cache time per miss (µs)": frame["avg_miss_us"].map("{:.1f}".format),
        }
    )


# -- the ensemble's cost: perf_analyzer in alternating rounds ---------------------------------
#: A paragraph of about 120 tokens for notebook 08's throughput rounds: long enough that each
#: encoder call keeps a core busy for a while, as a document's chunk does in retrieval, so what a
#: second instance does shows beyond this host's noise (a one-line sentence takes about
#: 13 ms, and the client's and the server's own work per request then weigh as much).
PASSAGE = (
    "Triton Inference Server serves models from a folder called a model repository. Each model "
    "has a configuration that says its inputs, its outputs, how many copies of it run and how "
    "requests are batched together. A client sends a request over HTTP or gRPC, the server "
    "puts it in the model's queue, and the scheduler hands a batch of queued requests to a free "
    "instance. A Python model runs in a process of its own, and its tensors cross shared memory "
    "on the way in and out. An ensemble chains several models inside the server, so the client "
    "sends one request and gets the final answer."
)


def ensemble_rounds(
    server: TritonServer,
    *,
    rounds: int = 2,
    concurrency: Sequence[int] = (1, 8),
    models: Sequence[str] = (SINGLE, PIPELINE),
    label: str = "",
    run_dir: str | os.PathLike | None = None,
    text: str = "A man is eating a piece of bread.",
    request_count: int = 30,
    timeout_s: float = 120.0,
) -> pd.DataFrame:
    """perf_analyzer on each of ``models`` in turn (A B A B ...), ``rounds`` times, at each
    ``concurrency``; one row per (round, model, concurrency) with ``throughput`` (infer/s),
    ``p50_ms``, ``p99_ms``, the server's ``avg_batch_size`` (requests per execution) and
    ``compute_infer_ms`` (the time of the batch a request ran in, averaged over requests), and
    the host's ``load_average`` just after. Every level is three
    windows of ``request_count`` requests (no stability rule: on a shared host the rounds show
    the noise instead). ``label`` names the setting (``"2 encoder instances"``) in the
    ``setting`` column."""
    if rounds < 1:
        raise ConfigError(f"rounds must be 1 or more, got {rounds}")
    folder = Path(run_dir) if run_dir else None
    frames = []
    for number in range(1, rounds + 1):
        for model in models:
            frame = profiling.perf_analyzer(
                server,
                model,
                concurrency=list(concurrency),
                string_data=text,
                shapes={embedding.INPUT_NAME: [1]},
                measurement_mode="count_windows",
                measurement_request_count=request_count,
                stability_percentage=None,
                run_dir=folder / "perf" if folder else None,
                label=" ".join(part for part in (model, label, f"round {number}") if part),
                timeout_s=timeout_s,
                progress=False,
            )
            kept = ["concurrency", "throughput", "p50_ms", "p99_ms"]
            kept += [c for c in ("avg_batch_size", "compute_infer_ms") if c in frame]
            frames.append(
                frame[kept].assign(
                    round=number,
                    model=model,
                    setting=label or "served alike",
                    load_average=round(os.getloadavg()[0], 2),  # the host's, just after it
                )
            )
    return pd.concat(frames, ignore_index=True)


def summarize_rounds(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, model, concurrency): the median throughput and p99 over the rounds, and
    their spread (lowest and highest throughput)."""
    grouped = frame.groupby(["setting", "model", "concurrency"], sort=False)
    out = grouped.agg(
        throughput=("throughput", "median"),
        throughput_low=("throughput", "min"),
        throughput_high=("throughput", "max"),
        p50_ms=("p50_ms", "median"),
        p99_ms=("p99_ms", "median"),
        rounds=("round", "nunique"),
    )
    return out.reset_index()


# -- retrieve, then generate: the ask model (BLS) against the same steps from the client --------
ASK = "ask"


@dataclass(frozen=True)
class Asked:
    """One answer to a question, and what it took (seconds, from the request's start)."""

    text: str
    ttft_s: float  # until the answer's first piece arrived
    total_s: float
    prompt: str = ""  # the prompt sent to the language model (the client's pipeline only)


def ask(server: TritonServer, question: str) -> Asked:
    """``question`` to the ``ask`` model: one request; it embeds, ranks, builds the prompt and
    streams the language model's answer back, all inside the server (BLS)."""
    stats = streaming.measure(server.http_url, ASK, question)
    return Asked(stats.text, stats.ttft_s, stats.total_s)


def ask_from_client(
    server: TritonServer, question: str, corpus_vectors: np.ndarray | None = None
) -> Asked:
    """The ``ask`` model's steps run from the client, with the settings its served config holds:
    a round trip to embed the question, the ranking here, a round trip (streamed) to generate.
    The passages are embedded first unless ``corpus_vectors`` gives them (outside the clock, as
    ``ask`` embeds them once at its first request)."""
    params = {k: v["string_value"] for k, v in served_config(server, ASK)["parameters"].items()}
    passages = corpus(server)
    if corpus_vectors is None:
        corpus_vectors = embed_corpus(server, params["embedding_model"], passages)
    started = time.perf_counter()
    asked = embedding.served_embed(server, [question], model=params["embedding_model"])[0]
    best = np.argsort(-(corpus_vectors @ asked), kind="stable")[: int(params["passages"])]
    prompt = params["prompt_template"].format(
        passages="\n".join(f"- {passages[i]}" for i in best), question=question
    )
    pieces, first = [], None
    for piece in streaming.stream(
        server.http_url, params["llm_model"], prompt, return_full_text=False
    ):
        first = first if first is not None else time.perf_counter() - started
        pieces.append(piece)
    total = time.perf_counter() - started
    return Asked("".join(pieces), first if first is not None else total, total, prompt)


def corpus(server: TritonServer) -> list[str]:
    """The passages the ``ask`` model ranks (``ask/1/corpus.json`` in the server's repository)."""
    path = Path(server.model_repository) / ASK / "1" / "corpus.json"
    return json.loads(path.read_text(encoding="utf-8"))


def embed_corpus(server: TritonServer, model: str, passages: Sequence[str]) -> np.ndarray:
    """The passages' vectors from ``model``, 32 per request (its largest batch)."""
    parts = [
        embedding.served_embed(server, list(passages[i : i + 32]), model=model)
        for i in range(0, len(passages), 32)
    ]
    return np.concatenate(parts)


def ask_rounds(server: TritonServer, question: str, *, rounds: int = 2) -> pd.DataFrame:
    """``question`` through ``ask`` (one request, BLS inside the server) and through the same
    steps from the client, in turns, ``rounds`` times; one row per answer: ``round``, ``way``,
    ``ttft_s``, ``total_s``, ``text``. Both are warmed first (``ask`` embeds its passages at its
    first request; the client embeds them once, outside the clock)."""
    if rounds < 1:
        raise ConfigError(f"rounds must be 1 or more, got {rounds}")
    ask(server, question)
    params = {k: v["string_value"] for k, v in served_config(server, ASK)["parameters"].items()}
    vectors = embed_corpus(server, params["embedding_model"], corpus(server))
    rows = []
    for number in range(1, rounds + 1):
        for way, answer in (
            ("ask (BLS, one request)", lambda: ask(server, question)),
            ("the same steps from the client", lambda: ask_from_client(server, question, vectors)),
        ):
            got = answer()
            rows.append(
                {"round": number, "way": way, "ttft_s": got.ttft_s, "total_s": got.total_s,
                 "text": got.text}
            )  # fmt: skip
    return pd.DataFrame(rows)


# -- the same models for a GPU host ----------------------------------------------------------------
#: Where each of the pipeline's models runs on a GPU host: the encoders on the GPU, the tokenizer
#: step on the CPU (the ``tokenizers`` library has no GPU path; it takes microseconds per text).
GPU_KINDS = {SINGLE: "KIND_GPU", TOKENIZER: "KIND_CPU", ENCODER: "KIND_GPU", PIPELINE: None}


@dataclass(frozen=True)
class GpuPipeline:
    """What :func:`write_gpu_configs` wrote: a repository to copy to the GPU host, and how to
    serve it there."""

    repository: Path
    diffs: dict[str, str]  # model -> its config.pbtxt against the CPU one
    docker_command: list[str]  # NGC's image serving it, with the response cache (built, not run)


def write_gpu_configs(
    repo: Repository,
    out_dir: str | os.PathLike,
    *,
    encoder_instances: int = 1,
    cache_size: int = 256 * 1024 * 1024,
    image: str | None = None,
) -> GpuPipeline:
    """The pipeline's models for a GPU host, in ``out_dir/gpu``: ``minilm`` and the encoder step
    on the GPU (``KIND_GPU``, ``encoder_instances`` of the step), the tokenizer step on the CPU,
    the ensemble as it is, and the cached twins of ``minilm`` and of the ensemble. The encoders
    drop their ``preferred_batch_size`` there: a GPU runs a batch of 8 in about the time of 4,
    where a CPU's time grows with the batch. Each folder is
    a copy with its links followed (the encoder step's ``minilm.py`` included), each config
    checked as Triton parses it. The docker command serves them with a ``cache_size``-byte cache
    from the image's own ``/opt/tritonserver/caches``; nothing here needs a GPU."""
    if encoder_instances < 1:
        raise ConfigError(f"encoder_instances must be 1 or more, got {encoder_instances}")
    missing = [name for name in GPU_KINDS if name not in repo.models()]
    if missing:
        raise ConfigError(f"{repo.path} holds no {', '.join(missing)}: the pipeline needs them")
    out = Repository(Path(out_dir) / "gpu", create=True)
    diffs = {}
    for name, kind in GPU_KINDS.items():
        if name in out.models():
            out.remove(name)
        shutil.copytree(repo.model_dir(name), out.path / name)  # links followed: real files
        cpu = repo.config(name)
        count = encoder_instances if name == ENCODER else None
        gpu = apply_edits(cpu, instance_kind=kind, instance_count=count) if kind else cpu
        if name in (SINGLE, ENCODER):  # batches of 4 split a CPU's lock-step clients; a GPU
            gpu.dynamic_batching.ClearField("preferred_batch_size")  # wants them whole
        out.write_config(name, gpu)
        diffs[name] = diff_configs(cpu, gpu, name)
    add_cached_twin(out)
    add_cached_twin(out, PIPELINE, PIPELINE_CACHED)
    names = [*GPU_KINDS, CACHED, PIPELINE_CACHED]
    server = TritonServer(  # for a GPU host: --gpus all whatever this host has
        out.path, mode="docker", image=image, cache_size=cache_size, load_models=names, gpus=True
    )
    return GpuPipeline(out.path, diffs, server.docker_command())


# -- labkit bench pipeline: its targets, as JSON -------------------------------------------
#: The models the benchmark serves: the single model, its twin served as the encoder step is, its
#: cached twin, the ensemble, and ask with the streaming language model it calls.
BENCH_MODELS = [*MODELS, MATCHED, CACHED, PIPELINE_CACHED, "smollm2_stream", ASK]


def benchmark(
    run_dir: str | os.PathLike,
    *,
    cache_mib: int = 1,
    rounds: int = 2,
    concurrency: Sequence[int] = (1, 8),
    request_count: int = 30,
    texts_per_round: int = 20,
    question: str = "What does the response cache do?",
    source: str | os.PathLike | None = None,
) -> dict:
    """Notebook 08's measurements in one run, for ``labkit bench pipeline``: the figures and
    each target against its measurement (:func:`targets`)."""
    run_dir = Path(run_dir)
    repo = prepare_run_repository(run_dir, models=[*MODELS, "smollm2_stream"], source=source)
    match_encoder(repo)
    add_cached_twin(repo)
    add_cached_twin(repo, PIPELINE, PIPELINE_CACHED)
    with serving(run_dir, repo.path, BENCH_MODELS, cache_size=cache_mib * 1024 * 1024) as server:
        agreement = compare_embeddings(server, sentences(32))
        hits = hit_and_miss_rounds(server, rounds=rounds + 1, per_round=texts_per_round)
        pipe_hits = hit_and_miss_rounds(
            server, PIPELINE_CACHED, rounds=rounds + 1, per_round=texts_per_round
        )
        alike = ensemble_rounds(
            server, rounds=rounds, concurrency=concurrency, run_dir=run_dir,
            request_count=request_count, models=(SINGLE, MATCHED, PIPELINE), text=PASSAGE,
        )  # fmt: skip
        eviction = fill_cache(server)
        asked = ask_rounds(server, question, rounds=rounds)
    result = {
        "ensemble_max_abs_diff": agreement.max_abs_diff,
        "cache_hit_p50_ms": float(hits.loc[hits["kind"] == "hit", "p50_ms"].median()),
        "cache_miss_p50_ms": float(hits.loc[hits["kind"] == "miss", "p50_ms"].median()),
        "cache_hit_p99_ms": float(hits.loc[hits["kind"] == "hit", "p99_ms"].median()),
        "cache_miss_p99_ms": float(hits.loc[hits["kind"] == "miss", "p99_ms"].median()),
        "pipeline_cache_hit_p50_ms": float(
            pipe_hits.loc[pipe_hits["kind"] == "hit", "p50_ms"].median()
        ),
        "pipeline_cache_miss_p50_ms": float(
            pipe_hits.loc[pipe_hits["kind"] == "miss", "p50_ms"].median()
        ),
        "cache_evictions": eviction.evictions,
        "cache_first_evicted": eviction.first_evicted,
        "ensemble_rounds": summarize_rounds(alike).to_dict("records"),
        "ask_same_answer": bool(asked["text"].nunique() == 1),
        "ask_ttft_s": asked.groupby("way", sort=False)["ttft_s"].median().to_dict(),
        "ask_total_s": asked.groupby("way", sort=False)["total_s"].median().to_dict(),
        "run_dir": str(run_dir),
    }
    result["targets"] = targets(result)
    return result


def targets(result: dict) -> dict:
    """Each of the pipeline bench's targets: its measurement and whether it was met."""
    hit, miss = result["cache_hit_p50_ms"], result["cache_miss_p50_ms"]
    return {
        "cache_hit_p50_at_most_0.1x_miss_p50": {
            "measured": hit / miss if miss else None,
            "met": bool(miss and hit <= 0.1 * miss),
        },
        "ensemble_max_abs_diff_at_most_1e-5": {
            "measured": result["ensemble_max_abs_diff"],
            "met": result["ensemble_max_abs_diff"] <= 1e-5,
        },
        "ask_answer_equals_client_pipeline": {
            "measured": result["ask_same_answer"],
            "met": bool(result["ask_same_answer"]),
        },
        "cache_evicts_past_its_size": {
            "measured": result["cache_evictions"],
            "met": result["cache_evictions"] > 0 and result["cache_first_evicted"],
        },
    }


def table(result: dict) -> str:
    """The benchmark's result as text: the ensemble's rounds, then each target."""
    rounds = pd.DataFrame(result["ensemble_rounds"])
    lines = [rounds.round(2).to_string(index=False), ""]
    for name, target in result["targets"].items():
        lines.append(f"{name}: measured {target['measured']}, met: {target['met']}")
    return "\n".join(lines)
