"""Pipelines and caching (notebook 08): MiniLM as an ensemble, and Triton's response cache.

The lab's repository serves the all-MiniLM-L6-v2 encoder two ways:

- ``minilm``: one Python model, text in, embedding out (tokenize, encode and pool in one
  ``execute``);
- ``minilm_pipeline``: an ensemble (``platform: "ensemble"``, no code of its own) whose steps
  are ``minilm_tokenize`` (the ``tokenizers`` library, no torch) and ``minilm_encode`` (torch: the
  encoder, mean pooling and normalisation, with ``minilm``'s own code). Triton's ensemble
  scheduler passes each step's outputs to the next in the server, so a client sends text and
  gets the embedding, as from ``minilm``.

This module measures what a learner asks of them: whether the two answer alike
(:func:`compare_embeddings`), what the ensemble costs and what a second encoder instance buys
(:func:`ensemble_rounds`, perf_analyzer in alternating rounds), and what the response cache does
(:func:`hit_and_miss_rounds`, :func:`fill_cache`, and the server's own counters in
:func:`labkit.profiling.cache_metrics`).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from labkit import embedding, profiling
from labkit.errors import ConfigError, InferenceError
from labkit.repository import ModelConfig, Repository, apply_edits
from labkit.server import TritonServer, reload

log = logging.getLogger(__name__)

SINGLE = "minilm"
PIPELINE = "minilm_pipeline"
TOKENIZER = "minilm_tokenize"
ENCODER = "minilm_encode"
#: What a notebook loads: the single model and the ensemble (which brings its two steps).
MODELS = [SINGLE, PIPELINE]
#: How a measurement names each way of serving MiniLM.
LABELS = {SINGLE: "one model", PIPELINE: "ensemble"}

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


def set_cache(server: TritonServer, repository: Repository, model: str, enable: bool = True) -> str:
    """Turn the response cache of ``model`` on (or off) in the run's copy and reload it live;
    the diff that was written. The server must run with a cache (``cache_size=``)."""
    if enable and server.mode != "remote" and getattr(server, "cache_size", None) is None:
        raise ConfigError(
            f"this server runs without a response cache, so {model}'s response_cache would "
            "never be used; start it with cache_size= (labkit serve --cache-size)"
        )
    return reload(
        server, model, with_cache(repository.config(model), enable), repository=repository
    )


def set_instances(server: TritonServer, repository: Repository, model: str, count: int) -> str:
    """Serve ``count`` instances of ``model`` (reloaded live, warmed); the diff written."""
    cfg = apply_edits(repository.config(model), instance_count=count)
    return reload(server, model, cfg, repository=repository)


# -- the ensemble answers as the single model does ---------------------------------------------
@dataclass(frozen=True)
class Agreement:
    """The ensemble's vectors against the single model's, for the same texts."""

    texts: int
    max_abs_diff: float
    dimension: int

    def __str__(self) -> str:
        return (
            f"{self.texts} sentences, {self.dimension} numbers each: the largest difference "
            f"between the ensemble's and the single model's vectors is {self.max_abs_diff:.1e}"
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
    server: TritonServer, model: str = SINGLE, *, rounds: int = 3, per_round: int = 20
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


def fill_cache(
    server: TritonServer, model: str = SINGLE, *, times: float = 2.0, batch: int = 32
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
    before = profiling.cache_totals(server)
    first = [sentences(batch, salt=f"fill {salt} {i}") for i in range(count)]
    for texts in first:
        embedding.served_embed(server, texts, model=model)
    filled = profiling.cache_totals(server)
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


def cache_table(server: TritonServer | str, since: pd.DataFrame | None = None) -> pd.DataFrame:
    """The server's cache counters per model, in words a learner reads (with units)."""
    frame = profiling.cache_metrics(server, since=since)
    return pd.DataFrame(
        {
            "model": frame["model"],
            "hits": frame["hits"].astype(int),
            "misses": frame["misses"].astype(int),
            "cache time per hit (µs)": frame["avg_hit_us"].round(1),
            "cache time per miss (µs)": frame["avg_miss_us"].round(1),
        }
    )


# -- the ensemble's cost: perf_analyzer in alternating rounds ---------------------------------
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
    ``p50_ms`` and ``p99_ms``. Every level is three windows of ``request_count`` requests
    (no stability rule: on a shared host the rounds show the noise instead). ``label`` names
    the setting (``"2 encoder instances"``) in the ``setting`` column."""
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
                label=f"{model} {label} round {number}".strip(),
                timeout_s=timeout_s,
                progress=False,
            )
            frames.append(
                frame[["concurrency", "throughput", "p50_ms", "p99_ms"]].assign(
                    round=number, model=model, setting=label or "1 encoder instance"
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
