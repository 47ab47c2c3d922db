"""Triton Python-backend model for a Neuron-compiled TensorFlow 2 SavedModel (labkit neuron gen-model).

Settings come from config.pbtxt's parameters (TARGET, COMPILED_MODEL, NEURON_CORE_START_INDEX,
NEURON_CORE_END_INDEX, NUM_THREADS_PER_CORE, BATCH_REQUESTS_TO_NEURON, TAG_SET, SIGNATURE_DEF_KEY).
Inputs and outputs keep the signature's own names. Each instance sees only its cores through
NEURON_RT_VISIBLE_CORES (the deprecated NEURONCORE_GROUP_SIZES of upstream is not used) and
loads one copy of the model per core; a batch is split across the copies and run in threads.
"""

import json
import os
from concurrent import futures

import numpy as np
import triton_python_backend_utils as pb_utils


def instance_cores(start, end, instance_count, instance_index):
    total = end - start + 1
    if end < start or instance_count > total:
        raise pb_utils.TritonModelException(
            f"cannot split Neuron cores {start}:{end} between {instance_count} instances"
        )
    per = total // instance_count
    first = start + instance_index * per
    return first, first + per - 1


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        count = int(config["instance_group"][0]["count"])
        index = 0
        if count > 1:
            tail = args["model_instance_name"].rsplit("_", 1)[-1]
            if not tail.isdigit():
                raise pb_utils.TritonModelException(
                    f"instance name {args['model_instance_name']!r} does not end with _<index>"
                )
            index = int(tail)
        first, last = instance_cores(
            int(params["NEURON_CORE_START_INDEX"]),
            int(params["NEURON_CORE_END_INDEX"]),
            count,
            index,
        )
        os.environ["NEURON_RT_VISIBLE_CORES"] = str(first) if first == last else f"{first}-{last}"
        cores = last - first + 1
        threads = cores * int(params.get("NUM_THREADS_PER_CORE", "1"))
        self.batch_requests = params.get("BATCH_REQUESTS_TO_NEURON", "true") == "true"
        self.inputs = [(t["name"], t["data_type"]) for t in config["input"]]
        self.outputs = [(t["name"], t["data_type"]) for t in config["output"]]
        target = params.get("TARGET", "inf1")
        import tensorflow as tf

        if target in ("inf2", "trn1"):
            import tensorflow_neuronx  # noqa: F401  (registers the Neuron ops)
        elif target == "inf1":
            import tensorflow_neuron  # noqa: F401
        path = params["COMPILED_MODEL"]
        if not os.path.isabs(path):
            path = os.path.join(args["model_repository"], path)
        key = params.get("SIGNATURE_DEF_KEY", "serving_default")
        tags = params.get("TAG_SET", "serve").split(",")
        self.copies = []
        for _ in range(cores):  # each load lands on the next visible core
            loaded = tf.saved_model.load(path, tags=tags)
            if key not in loaded.signatures:
                raise pb_utils.TritonModelException(
                    f"signature {key!r} not in {path!r}; it has {list(loaded.signatures)}"
                )
            self.copies.append((loaded, loaded.signatures[key]))
        self.pool = futures.ThreadPoolExecutor(max_workers=max(threads, len(self.copies)))
        self.tf = tf

    def run(self, feeds):
        """Split the batch across the per-core copies, run them in threads, join the results."""
        n = min(len(self.copies), len(next(iter(feeds.values()))))
        parts = [{k: np.array_split(v, n, axis=0)[i] for k, v in feeds.items()} for i in range(n)]
        jobs = [
            self.pool.submit(
                lambda sig, part: sig(**{k: self.tf.constant(v) for k, v in part.items()}),
                self.copies[i][1],
                parts[i],
            )
            for i in range(n)
        ]
        results = [job.result() for job in jobs]
        return {
            name: np.concatenate([r[name].numpy() for r in results], axis=0)
            for name, _ in self.outputs
        }

    def respond(self, arrays):
        tensors = [
            pb_utils.Tensor(name, arrays[name].astype(pb_utils.triton_string_to_numpy(dt)))
            for name, dt in self.outputs
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def execute(self, requests):
        feeds = [
            {name: pb_utils.get_input_tensor_by_name(r, name).as_numpy() for name, _ in self.inputs}
            for r in requests
        ]
        if not self.batch_requests or len(requests) == 1:
            return [self.respond(self.run(feed)) for feed in feeds]
        sizes = [len(next(iter(f.values()))) for f in feeds]
        joined = {name: np.concatenate([f[name] for f in feeds], axis=0) for name, _ in self.inputs}
        results = self.run(joined)
        bounds = np.cumsum(sizes)[:-1]
        split = {k: np.split(v, bounds, axis=0) for k, v in results.items()}
        return [self.respond({k: v[i] for k, v in split.items()}) for i in range(len(requests))]

    def finalize(self):
        self.pool.shutdown(wait=False)
        self.copies = []
