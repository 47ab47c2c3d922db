"""``labkit bench batching | threads | inflight | frontend | vllm-start | inflight-soak | soak | pipeline``: benchmarks that write their figures
(JSON and a table)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from labkit import bench, llm_serving, pipeline, soak
from labkit.cluster import threads
from labkit.llm_serving import frontend, startup
from labkit.runs import run_folder


def register(sub) -> None:
    parser = sub.add_parser("bench", help="benchmarks that write their figures (JSON and a table)")
    kinds = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    p = kinds.add_parser("batching", help="dynamic batching off then on, one model, one server")
    d = bench.BatchingSettings()
    p.add_argument("--model", default=d.model, help="model to measure (default: %(default)s)")
    p.add_argument("--model-repository", default="model_repository", help="source model repository")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument(
        "--max-queue-delay-microseconds", type=int, default=d.max_queue_delay_microseconds
    )
    p.add_argument("--string-data", default=d.string_data, help="the prompt every request sends")
    p.add_argument("--max-tokens", type=int, help="request parameter max_tokens (new tokens)")
    p.add_argument("--request-count", type=int, help="requests per measurement window")
    p.add_argument("--run-dir", help="where the copy, logs and CSVs go (default: runs/...)")
    p.add_argument("--json", help="also write the result to this JSON file")
    p.set_defaults(handler=_cli_batching)
    _register_inflight(kinds)
    _register_frontend(kinds)
    _register_vllm_start(kinds)
    _register_threads(kinds)
    d = soak.SoakSettings()
    p = kinds.add_parser("soak", help="load a model for a while, then reload it and kill its stub")
    p.add_argument("--model", default=d.model, help="model to load (default: %(default)s)")
    p.add_argument("--model-repository", default=None, help="source model repository")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    p.add_argument("--memory-window", type=float, default=d.memory_window_s, help="seconds")
    p.add_argument("--no-faults", action="store_true", help="skip the reload and the killed stub")
    p.add_argument("--fault-window", type=float, default=d.fault_window_s, help="seconds")
    p.add_argument("--run-dir", help="where the copy, logs and figures go (default: runs/...)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.set_defaults(handler=_cli_soak)
    p = kinds.add_parser(
        "pipeline",
        help="MiniLM as an ensemble against one model, the response cache, and ask (BLS)",
    )
    p.add_argument("--model-repository", default=None, help="source model repository")
    p.add_argument("--cache-mib", type=int, default=1, help="the response cache's size in MiB")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each comparison, in turns")
    p.add_argument("--request-count", type=int, default=30, help="requests per window")
    p.add_argument("--run-dir", help="where the copy, logs and CSVs go (default: runs/...)")
    p.add_argument("--json", help="also write the result to this JSON file")
    p.set_defaults(handler=_cli_pipeline)


def _register_threads(kinds) -> None:
    d = threads.ThreadsSettings()
    p = kinds.add_parser(
        "threads",
        help="torch threads per instance: 1 and 2 instances, one server and 2 replicas, in rounds",
    )
    p.add_argument(
        "--models",
        default="tiny-falcon,smollm2,minilm,minilm_encode",
        help="models to measure, one after the other (default: %(default)s)",
    )
    p.add_argument("--threads", default=",".join(map(str, d.threads)), help="thread counts")
    p.add_argument(
        "--concurrency", default=",".join(map(str, d.concurrencies)), help="concurrency levels"
    )
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="new tokens a request")
    p.add_argument("--request-count", type=int, default=d.request_count, help="per window")
    p.add_argument("--model-repository", default=None, help="source model repository")
    p.add_argument("--run-dir", help="where the copies, logs and CSVs go (default: runs/...)")
    p.add_argument("--json", help="also write every model's result to this JSON file")
    p.set_defaults(handler=_cli_threads)


def _cli_threads(args) -> int:
    run_dir = run_folder(args.run_dir, notebook="bench-threads")
    results = []
    for model in _names(args.models):
        settings = threads.ThreadsSettings(
            model=model,
            threads=_levels(args.threads),
            concurrencies=_levels(args.concurrency),
            rounds=args.rounds,
            max_tokens=args.max_tokens,
            request_count=args.request_count,
        )
        result = threads.measure_threads(run_dir / model, settings, source=args.model_repository)
        print(threads.table(result), flush=True)
        results.append(result)
    _also_write(args.json, [dataclasses.asdict(r) for r in results])
    print(f"run folder: {run_dir}")
    return 0


def _cli_batching(args) -> int:
    settings = bench.BatchingSettings(
        model=args.model,
        concurrency=args.concurrency,
        max_batch_size=args.max_batch_size,
        max_queue_delay_microseconds=args.max_queue_delay_microseconds,
        string_data=args.string_data,
        request_parameters={"max_tokens": args.max_tokens} if args.max_tokens else {},
        measurement_request_count=args.request_count,
    )
    run_dir = run_folder(args.run_dir, notebook="bench-batching")
    result = bench.batching_off_on(args.model_repository, run_dir, settings)
    print(bench.table(result))
    _also_write(args.json, result)
    print(f"run folder: {run_dir}")
    return 0


def _cli_pipeline(args) -> int:
    run_dir = run_folder(args.run_dir, notebook="bench-pipeline")
    result = pipeline.benchmark(
        run_dir,
        cache_mib=args.cache_mib,
        rounds=args.rounds,
        request_count=args.request_count,
        source=args.model_repository,
    )
    print(pipeline.table(result))
    _also_write(args.json, result)
    print(f"run folder: {run_dir}")
    return 0 if all(t["met"] for t in result["targets"].values()) else 1


def _cli_soak(args) -> int:
    settings = soak.SoakSettings(
        model=args.model,
        concurrency=args.concurrency,
        duration_s=args.duration,
        memory_window_s=args.memory_window,
        faults=not args.no_faults,
        fault_window_s=args.fault_window,
    ).check()
    run_dir = run_folder(args.run_dir, notebook="bench-soak")
    result = soak.run_soak(settings, run_dir, source=args.model_repository)
    _also_write(args.json, result)
    print(soak.table(result))
    print(f"figures: {run_dir / 'soak.json'}")
    return 0 if all(result["passed"].values()) else 1


def _register_inflight(kinds) -> None:
    d = llm_serving.StudySettings()
    p = kinds.add_parser(
        "inflight",
        help="no batching, dynamic batching, in-flight batching and vLLM, in tokens (AIPerf)",
        description="One server, one run: the same workloads against every scheduler of the "
        "text model, measured with AIPerf (TTFT, ITL, tokens/s), then the in-process limit and "
        "float32 against bfloat16. The full matrix takes long on 2 cores; --concurrency 8 "
        "--workload mixed measures what the ratios need.",
    )
    p.add_argument("--model-repository", default="model_repository", help="source model repository")
    p.add_argument("--model", default=d.model, help="plain model folder (default: %(default)s)")
    p.add_argument("--inflight-model", default=d.inflight_model, help="in-flight model folder")
    p.add_argument("--vllm-model", default=d.vllm_model, help="vLLM model folder")
    p.add_argument(
        "--scheduler", type=_names, default=d.schedulers, help="none,dynamic,inflight,vllm"
    )
    p.add_argument(
        "--no-standalone",
        action="store_true",
        help="with vllm, skip vLLM's own OpenAI server on the same settings (the reference)",
    )
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin: by default the servers run on every core but the last, AIPerf on the last",
    )
    p.add_argument("--workload", type=_names, default=d.workloads, help="fixed16,mixed")
    p.add_argument("--clients", choices=["both", "stream", "whole"], default="both",
                   help="streaming clients, non-streaming (whole answer) clients, or both")  # fmt: skip
    p.add_argument("--concurrency", type=_levels, default=d.concurrency, help="e.g. 1,4,8,16")
    p.add_argument("--requests", type=int, default=d.requests, help="requests per level")
    p.add_argument(
        "--num-threads",
        type=int,
        default=d.num_threads,
        help="torch threads of every scheduler's model and of the in-process limit (default: "
        "the cores less one, %(default)s here: torch's default collapses when the client shares "
        "the cores)",
    )
    p.add_argument("--no-precision", action="store_true", help="skip float32 against bfloat16")
    p.add_argument(
        "--run-dir", help="where the copy, logs and AIPerf exports go (default: runs/...)"
    )
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.set_defaults(handler=_cli_inflight)
    d = soak.InflightSoakSettings()
    p = kinds.add_parser("inflight-soak", help="many streams for a while on the in-flight model")
    p.add_argument("--model-repository", default="model_repository", help="source model repository")
    p.add_argument("--model", default=d.model, help="model to soak (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    p.add_argument("--memory-window", type=float, default=d.memory_window_s, help="seconds")
    p.add_argument("--run-dir", help="where the copy, logs and figures go (default: runs/...)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.set_defaults(handler=_cli_inflight_soak)


def _register_frontend(kinds) -> None:
    d = frontend.FrontendSettings()
    p = kinds.add_parser(
        "frontend",
        help="vLLM in Triton against vLLM's own server, per dtype, measured in rounds (AIPerf)",
        description="Every server up at once, pinned alike; each round measures every way once, "
        "in the opposite order to the round before. Reports each round's ratio of Triton's "
        "output tokens/s to vLLM's own server's, their median, spread and load average.",
    )
    p.add_argument("--model-repository", default="model_repository", help="source model repository")
    p.add_argument("--vllm-model", default=d.vllm_model, help="vLLM model folder")
    p.add_argument("--dtype", type=_names, default=d.dtypes, help="float32,bfloat16")
    p.add_argument("--defaults", action="store_true",
                   help="also vLLM's own server with its defaults (compiled: a first start of minutes)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--requests", type=int, default=d.requests, help="requests per measurement")
    p.add_argument("--clients", choices=["stream", "whole"], default="stream",
                   help="streaming clients or whole-answer clients")  # fmt: skip
    p.add_argument("--stream-interval", type=int, default=0,
                   help="both engines' stream_interval (default: the model's config)")  # fmt: skip
    p.add_argument("--no-pin", action="store_true", help="do not pin servers and AIPerf apart")
    p.add_argument(
        "--run-dir", help="where the copy, logs and AIPerf exports go (default: runs/...)"
    )
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.set_defaults(handler=_cli_frontend)


def _register_vllm_start(kinds) -> None:
    d = startup.StartSettings()
    p = kinds.add_parser(
        "vllm-start",
        help="vLLM's own server's start-up, eager against compiled (cold and cached), per dtype",
        description="One server at a time. Per dtype: a compiled start with an empty compile "
        "cache, then eager and cached compiled starts in turns; each timed to /health and to "
        "its first answer, with the load average; the compile cache's size.",
    )
    p.add_argument("--model-repository", default="model_repository", help="source model repository")
    p.add_argument("--vllm-model", default=d.vllm_model, help="vLLM model folder")
    p.add_argument("--dtype", type=_names, default=d.dtypes, help="float32,bfloat16")
    p.add_argument("--turns", type=int, default=d.turns, help="eager/cached pairs per dtype")
    p.add_argument("--aot", choices=["0", "1"], help="VLLM_USE_AOT_COMPILE for the compiled starts "
                   "(default: the model's, 0; vLLM's own is 1 with torch 2.10 and later)")  # fmt: skip
    p.add_argument("--run-dir", help="where the copy, logs and caches go (default: runs/...)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.set_defaults(handler=_cli_vllm_start)


def _cli_vllm_start(args) -> int:
    settings = startup.StartSettings(
        vllm_model=args.vllm_model,
        dtypes=args.dtype,
        turns=args.turns,
        aot=None if args.aot is None else args.aot == "1",
    )
    run_dir = run_folder(args.run_dir, notebook="bench-vllm-start")
    result = startup.run(run_dir, settings, source=args.model_repository)
    text = startup.table(result)
    (run_dir / "vllm-start.txt").write_text(text + "\n")
    print(text)
    _also_write(args.json, result)
    print(f"run folder: {run_dir}")
    return 0


def _cli_frontend(args) -> int:
    settings = frontend.FrontendSettings(
        vllm_model=args.vllm_model,
        dtypes=args.dtype,
        defaults=args.defaults,
        rounds=args.rounds,
        concurrency=args.concurrency,
        requests=args.requests,
        streaming=args.clients == "stream",
        stream_interval=args.stream_interval,
        pin=False if args.no_pin else None,
    )
    run_dir = run_folder(args.run_dir, notebook="bench-frontend")
    result = frontend.run(run_dir, settings, source=args.model_repository)
    text = frontend.table(result)
    (run_dir / "frontend.txt").write_text(text + "\n")
    print(text)
    _also_write(args.json, result)
    print(f"run folder: {run_dir}")
    return 0


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _levels(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in _names(text))


def _cli_inflight(args) -> int:
    settings = llm_serving.StudySettings(
        model=args.model,
        inflight_model=args.inflight_model,
        vllm_model=args.vllm_model,
        standalone=not args.no_standalone,
        pin=not args.no_pin,
        schedulers=args.scheduler,
        workloads=args.workload,
        streaming={"both": (True, False), "stream": (True,), "whole": (False,)}[args.clients],
        concurrency=args.concurrency,
        requests=args.requests,
        num_threads=args.num_threads,
        precision=not args.no_precision,
    )
    run_dir = run_folder(args.run_dir, notebook="bench-inflight")
    result = llm_serving.run(run_dir, settings, source=args.model_repository)
    table = result.table()
    (run_dir / "inflight.txt").write_text(table + "\n")
    print(table)
    _also_write(args.json, result)
    print(f"run folder: {run_dir}")
    return 0


def _cli_inflight_soak(args) -> int:
    settings = soak.InflightSoakSettings(
        model=args.model,
        concurrency=args.concurrency,
        duration_s=args.duration,
        memory_window_s=args.memory_window,
    )
    run_dir = run_folder(args.run_dir, notebook="bench-inflight-soak")
    result = soak.inflight_soak(args.model_repository, run_dir, settings)
    _also_write(args.json, result)
    print(soak.inflight_soak_table(result))
    print(f"figures: {run_dir / 'inflight-soak.json'}")
    return 0


def _also_write(path: str | None, result: object) -> None:
    """``--json FILE``: the figures the benchmark wrote into its run folder, written there too."""
    if path:
        data = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {path}")
