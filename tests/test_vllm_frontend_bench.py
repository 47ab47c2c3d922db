"""`labkit bench frontend`: the folders each way starts from, the per-round ratios and their
verdict, the table, and the command line. The rounds themselves (Triton and vLLM's own servers
up at once, pinned) need two vLLM engines per dtype and run by hand; their figures are in
docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.cli import main
from labkit.errors import ConfigError, ServerError
from labkit.llm_serving import frontend, standalone
from labkit.repository import Repository
from labkit.settings import project_root


def _rows(tokens: dict[str, list[float]]) -> list[dict]:
    return [
        {"way": way, "round": i + 1, "output_tokens_per_s": value, "failed": 0}
        for way, values in tokens.items()
        for i, value in enumerate(values)
    ]


def test_each_ratio_is_per_round_and_met_only_when_the_median_clears_the_target_by_the_spread():
    s = frontend.FrontendSettings(dtypes=("float32", "bfloat16"), defaults=True, rounds=3)
    rows = _rows({
        "triton_float32": [100, 90, 120],
        "own_float32": [95, 80, 110],  # 1.053, 1.125, 1.091: median 1.091, spread 0.036: met
        "own_defaults_float32": [100, 100, 100],
        "triton_bfloat16": [50, 60, 40],
        "own_bfloat16": [50, 50, 50],  # 1.0, 1.2, 0.8: median 1.0 does not clear 1.0
    })  # fmt: skip
    r = frontend.ratios(rows, s)
    assert r["float32_vs_own"] == {
        "rounds": [1.053, 1.125, 1.091], "median": 1.091, "spread": 0.036, "target": 1.0,
        "met": True,
    }  # fmt: skip
    assert r["float32_vs_own_defaults"]["rounds"] == [1.0, 0.9, 1.2]
    assert r["float32_vs_own_defaults"]["target"] == 0.95
    assert r["float32_vs_own_defaults"]["met"] is False  # median 1.0 - 0.95 < spread 0.15
    assert r["bfloat16_vs_own"]["median"] == 1.0 and r["bfloat16_vs_own"]["met"] is False
    assert "bfloat16_vs_own_defaults" not in r  # not measured: no figure, not a zero
    result = frontend.FrontendResult(settings={}, host={}, run_dir="", rows=rows, ratios=r,
                                     load_average=[[1.0, 2.0, 3.0]] * 3)  # fmt: skip
    text = frontend.table(result)
    assert "float32_vs_own" in text and "1.053, 1.125, 1.091" in text
    assert "load average at each round's start: 1/2/3, 1/2/3, 1/2/3" in text


def test_each_reference_starts_from_a_folder_with_its_served_ways_settings(tmp_path, monkeypatch):
    # the copy's relative EXECUTION_ENV_PATH is made absolute by a run's own copy, not here
    monkeypatch.setattr(frontend, "check_vllm_environment", lambda repo, model: None)
    repo = Repository(project_root() / "model_repository").copy_to(tmp_path / "repo")
    s = frontend.FrontendSettings(defaults=True, stream_interval=4)
    folders = frontend.write_folders(repo, s)
    assert folders["triton_float32"] == folders["own_float32"] == "smollm2_vllm"
    assert folders["triton_bfloat16"] == folders["own_bfloat16"] == "smollm2_vllm_bfloat16"
    settings = standalone.load_settings(repo.model_dir("smollm2_vllm"))
    # the model compiles as shipped, as vLLM's own server does by default: the references agree
    for way, dtype, eager in (("own_bfloat16", "bfloat16", False),
                              ("own_defaults_float32", "float32", False),
                              ("own_defaults_bfloat16", "bfloat16", False)):  # fmt: skip
        config = repo.config(folders[way])
        params = {k: v.string_value for k, v in config.parameters.items()}
        command, _ = standalone.engine_command(settings, params, "/w", 1, "python")
        flags = " ".join(command)
        assert f"--dtype {dtype}" in flags and "--stream-interval 4" in flags
        assert ("--enforce-eager" in flags) is eager


def test_bad_settings_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="dtypes must come from"):
        frontend.FrontendSettings(dtypes=("int8",)).check()
    with pytest.raises(ConfigError, match="at least the concurrency"):
        frontend.FrontendSettings(requests=4, concurrency=8).check()
    with pytest.raises(ConfigError, match="stream_interval"):
        frontend.FrontendSettings(stream_interval=-1).check()
    settings = standalone.load_settings(project_root() / "model_repository" / "smollm2_vllm")
    with pytest.raises(ConfigError, match="'stream_interval' must be >= 1, got 0"):
        standalone.engine_command(settings, {"stream_interval": "0"}, "/w", 1, "python")


def test_the_bench_command_takes_the_frontend_options(monkeypatch, tmp_path):
    seen = {}

    def fake_run(run_dir, settings, source=None):
        seen["settings"] = settings
        raise SystemExit("the fake run ended the command")

    monkeypatch.setattr(frontend, "run", fake_run)
    with pytest.raises(SystemExit, match="the fake run ended the command"):  # not argparse
        main(["bench", "frontend", "--dtype", "bfloat16", "--defaults", "--rounds", "5",
              "--stream-interval", "4", "--clients", "whole", "--run-dir", str(tmp_path)])  # fmt: skip
    s = seen["settings"]
    assert s.dtypes == ("bfloat16",) and s.defaults and s.rounds == 5
    assert s.stream_interval == 4 and s.streaming is False
    assert s.ways() == ["triton_bfloat16", "own_bfloat16", "own_defaults_bfloat16"]


def _completions_server(status: int):
    """A loopback HTTP server answering /v1/completions with ``status``; it records each body."""
    import http.server
    import threading

    bodies: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            size = int(self.headers["Content-Length"])
            bodies.append({"path": self.path, **json.loads(self.rfile.read(size))})
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b'{"choices": [{"text": " there"}]}')

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, bodies


@pytest.mark.parametrize("status", [200, 500])
def test_vllms_own_server_is_warmed_as_tritons_models_are_and_a_failure_is_named(status):
    # the frontend bench warms Triton's models with labkit.server.warm_up: the reference gets
    # the same two short requests, so neither side meets its first round cold
    server, bodies = _completions_server(status)
    try:
        own = standalone.StandaloneVllm(f"127.0.0.1:{server.server_port}", None, Path("log"))
        if status == 200:
            assert own.warm_up() == 2
            assert len(bodies) == 2
        else:
            with pytest.raises(ServerError, match="warming up vLLM's own server"):
                own.warm_up()
            assert len(bodies) == 1  # the first failure ends it
        assert bodies[0] == {
            "path": "/v1/completions",
            "model": standalone.SERVED_NAME,
            "prompt": "Hello",
            "max_tokens": 2,
        }
    finally:
        server.shutdown()
        server.server_close()


def test_greedy_answers_are_asked_alone_of_each_way_and_the_differing_ones_kept(monkeypatch):
    from types import SimpleNamespace

    from labkit.llm_serving import apis

    asked = []

    def triton(url, model, request):
        asked.append(("triton", url, model, request))
        return {"answer": f"{request.prompt}:{request.max_tokens}"}

    def openai(url, model, request):
        asked.append(("own", url, model, request))
        flipped = request.prompt == "b" and url == "own-bf"
        return {"answer": "other" if flipped else f"{request.prompt}:{request.max_tokens}"}

    monkeypatch.setattr(apis, "ask_triton", triton)
    monkeypatch.setattr(apis, "ask_openai", openai)
    s = frontend.FrontendSettings(dtypes=("float32", "bfloat16"))
    w = SimpleNamespace(prompts=["a", "b", "a", "c"], max_tokens=[4, 8, 4, 2])
    tri = SimpleNamespace(http_url="tri")
    targets = {
        "triton_float32": (tri, "m", None),
        "own_float32": (SimpleNamespace(url="own-f"), "reference", None),
        "triton_bfloat16": (tri, "m_bf16", None),
        "own_bfloat16": (SimpleNamespace(url="own-bf"), "reference", None),
    }
    out = frontend.greedy_answers(targets, w, s)
    assert out["float32_vs_own"] == {"compared": 3, "equal": 3, "differ": []}  # (a, 4) once
    assert out["bfloat16_vs_own"]["equal"] == 2
    assert out["bfloat16_vs_own"]["differ"] == [
        {"prompt": "b", "max_tokens": 8, "triton": "b:8", "reference": "other"}
    ]
    assert {r.stop for *_, r in asked} == {()}  # greedy to max_tokens: no stop string
    result = frontend.FrontendResult({}, {}, "", answers=out)
    assert "greedy answers, bfloat16_vs_own: 2 of 3 the same text" in frontend.table(result)
