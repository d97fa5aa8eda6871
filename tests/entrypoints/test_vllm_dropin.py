"""mambaserve as a drop-in for vLLM users (issue 23): vLLM's own command lines, metric names,
CORS, model ids from the Hugging Face cache, logs and limits.

The command lines are typical ones from vLLM's documentation (`vllm serve`, `vllm bench latency
| throughput | serve`), run with `vllm` replaced by `mambaserve`, MODEL by the bundled demo
model and sizes made tiny; each must run and do what the flags say. Servers run in-process on
loopback (one real subprocess, on a Unix socket). The references are independent: the offline
engine's greedy text, the tokenizer's own ids, the model loaded from its folder.
"""

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from mambaserve import LLM, SamplingParams  # noqa: E402
from mambaserve.config import default_model  # noqa: E402
from mambaserve.entrypoints.cli import build_parser, expand_config, main  # noqa: E402
from tests.entrypoints.servers import serve_in_thread  # noqa: E402

MODEL = default_model()
KEY = "sk-test-dropin"
# What vLLM's Grafana dashboard and its usual alerts query (examples/observability/dashboards)
GRAFANA_QUERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    'vllm:request_success_total{finished_reason="length"}', "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
]


def vllm_line(line: str, **subst) -> list[str]:
    """A vLLM command line as mambaserve's argv: `vllm` dropped (main takes what follows it)."""
    words = shlex.split(line.format(MODEL=MODEL, **subst))
    assert words[0] == "vllm"
    return words[1:]


@contextlib.contextmanager
def serving(argv: list[str]):
    """`mambaserve serve` of argv (the CLI's parsing, --config included) on a free loopback port."""
    parser = build_parser()
    args = parser.parse_args(expand_config(parser, argv))
    args.uvicorn_log_level = "warning"
    with serve_in_thread(args, start_timeout=60) as (url, server, _):
        yield url, server


def greedy(prompt: str, n: int) -> str:
    return offline().generate(prompt, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)[0].outputs[0].text


_OFFLINE = []


def offline() -> LLM:
    if not _OFFLINE:
        _OFFLINE.append(LLM(MODEL, dtype="float32", device="cpu", max_num_seqs=4))
    return _OFFLINE[0]


def complete(base: str, model: str, headers=None, prefix: str = "") -> dict:
    r = httpx.post(f"{base}{prefix}/v1/completions", headers=headers or {}, timeout=60,
                   json={"model": model, "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------- vllm serve
def test_serve_memory_and_context_line():
    # docs: "Configure memory and context length" (8192 there; the demo model has 2,048 positions)
    argv = vllm_line("vllm serve {MODEL} --gpu-memory-utilization 0.95 --max-model-len 1024")
    with serving(argv) as (base, server):
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == 1024
        assert complete(base, "demo-model")["choices"][0]["text"] == greedy("def add(a, b):", 6)


def test_serve_name_port_and_quiet_line_refuses_a_context_past_the_positions(capsys):
    line = ("vllm serve {MODEL} --gpu-memory-utilization=0.8 --port 6002 --served-model-name=VLINSTRUCT "
            "--trust-remote-code --max-model-len {LEN} --disable-log-requests")
    assert main(vllm_line(line, LEN=8192)) == 2  # as vLLM: past max_position_embeddings without the env switch
    assert "max_position_embeddings=2048" in capsys.readouterr().err
    with serving(vllm_line(line, LEN=1024)) as (base, server):
        assert server.config.port == 6002  # the socket is the test's; the flag was taken
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["VLINSTRUCT"]
        assert complete(base, "VLINSTRUCT")["model"] == "VLINSTRUCT"


def test_serve_chat_template_line(tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    argv = vllm_line("vllm serve {MODEL} --max-model-len 1024 --chat-template {T} --tensor-parallel-size 1 "
                     "--served-model-name chatbot --response-role bot", T=template)
    with serving(argv) as (base, _):
        msgs = [{"role": "user", "content": "def add(a, b):"}]
        tok = httpx.post(f"{base}/tokenize", json={"model": "chatbot", "messages": msgs}).json()["tokens"]
        assert tok == offline().get_tokenizer()("<user>def add(a, b):", add_special_tokens=False)["input_ids"]
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                       json={"model": "chatbot", "messages": msgs, "max_tokens": 5, "temperature": 0}).json()
        assert r["choices"][0]["message"]["role"] == "bot"
        assert r["choices"][0]["message"]["content"] == greedy("<user>def add(a, b):", 5)


def test_serve_flags_of_the_issue_cors_key_names_root_path_logprobs(caplog):
    origin = "http://ui.example"
    argv = vllm_line("vllm serve {MODEL} --dtype half --api-key {KEY} --served-model-name granite g2 "
                     "--enable-log-requests --disable-log-stats --swap-space 4 --root-path /api "
                     "--allowed-origins '[\"{ORIGIN}\"]' --disable-uvicorn-access-log --generation-config vllm "
                     "--max-logprobs 3 --max-model-len 512 --log-level info", KEY=KEY, ORIGIN=origin)
    with caplog.at_level("INFO", logger="mambaserve"), serving(argv) as (base, _):
        auth = {"Authorization": f"Bearer {KEY}"}
        # a browser's preflight carries no key: answered by CORS, not refused
        pre = httpx.options(f"{base}/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
        other = httpx.options(f"{base}/v1/completions", headers={"Origin": "http://evil.example",
                                                                  "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
        # uvicorn puts the root path before the path the proxy forwards: the key is still asked for
        assert httpx.get(f"{base}/v1/models").status_code == 401
        ids = [m["id"] for m in httpx.get(f"{base}/v1/models", headers=auth).json()["data"]]
        assert ids == ["granite", "g2"]
        got = httpx.post(f"{base}/v1/completions", headers={**auth, "Origin": origin}, timeout=60,
                         json={"model": "g2", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0})
        assert got.status_code == 200 and got.json()["model"] == "g2"
        assert got.headers["access-control-allow-origin"] == origin
        too_many = httpx.post(f"{base}/v1/completions", headers=auth,
                              json={"model": "granite", "prompt": "x", "max_tokens": 1, "logprobs": 4})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
        assert httpx.post(f"{base}/v1/completions", headers=auth, json={
            "model": "granite", "prompt": "x", "max_tokens": 1, "logprobs": 3}).status_code == 200
    text = caplog.text
    assert "swap_space=4 GiB has no effect" in text and "request cmpl-" in text  # --enable-log-requests
    assert "dtype float16" in text and "Avg prompt throughput" not in text  # --disable-log-stats


def test_serve_config_yaml_and_flags_after_it_win(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("port: 8123\nmax-model-len: 512\nserved_model_name: [from-yaml]\nenforce-eager: true\n"
                   "enable_chunked_prefill: false\nmax_num_batched_tokens: 512\n")
    parser = build_parser()
    args = parser.parse_args(expand_config(parser, vllm_line("vllm serve {MODEL} --config {C} --port 9000", C=cfg)))
    assert (args.port, args.max_model_len, args.served_model_name) == (9000, 512, ["from-yaml"])
    assert args.enforce_eager and not args.enable_chunked_prefill and args.model_tag == MODEL
    bad = tmp_path / "bad.yaml"
    bad.write_text("no-such-flag: 1\n")
    with pytest.raises(ValueError, match="no-such-flag"):
        expand_config(parser, ["serve", "--config", str(bad)])


def test_cli_version_log_level_after_subcommand_and_subcommand_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("mambaserve ")
    args = build_parser().parse_args(["serve", MODEL, "--log-level", "debug"])
    assert args.log_level == "DEBUG"
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--no-such-flag"])
    err = capsys.readouterr().err
    assert "usage: mambaserve bench throughput" in err and "--no-such-flag" in err
    for flag, why in (("--tokenizer-mode mistral", "tokenizer_mode"), ("-pp 2", "pipeline parallelism")):
        assert main(["generate", *flag.split(), "--max-tokens", "1"]) == 2
        assert why in capsys.readouterr().err


def test_cli_takes_no_flag_prefixes_and_reports_an_unreadable_prompts_file(tmp_path, capsys):
    """`--prompt x` once matched --prompts-file by prefix and died in a traceback opening x."""
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "hi"])
    assert "unrecognized arguments: --prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", MODEL, "--max-model", "64"])  # --max-model-len, abbreviated
    missing = tmp_path / "no-such-prompts.txt"
    with pytest.raises(SystemExit, match="cannot read --prompts-file .*no-such-prompts.txt"):
        main(["generate", "--prompts-file", str(missing), "--max-tokens", "1"])


def test_uds_server_subprocess_logs_summary_and_stops_cleanly(tmp_path):
    sock = tmp_path / "vllm.sock"
    argv = vllm_line("vllm serve {MODEL} --uds {S} --api-key {KEY} --max-model-len 512", S=sock, KEY=KEY)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mambaserve.entrypoints.cli", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://localhost", timeout=60)
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        r = client.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                        json={"prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy("def add(a, b):", 6)
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    # the start-up summary at the default level
    for piece in ("GraniteMoeHybridForCausalLM", "max_model_len 512", "state slots", "KV blocks", "1 CPU thread"):
        assert piece in err, err


# ---------------------------------------------------------------------------- vllm bench
def test_bench_latency_line(tmp_path, capsys):
    out = tmp_path / "lat.json"
    # docs: "vllm bench latency --model ... --input-len 32 --output-len 128 --batch-size 8" (vLLM's defaults)
    argv = vllm_line("vllm bench latency --model {MODEL} --input-len 8 --output-len 4 --batch-size 2 "
                     "--num-iters-warmup 1 --num-iters 2 --disable-detokenize --output-json {O}", O=out)
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    assert rec["output_tokens_per_iter"] == [8, 8] and rec["input_len"] == 8
    assert rec["args"]["skip_tokenizer_init"] is True  # --disable-detokenize: no tokenizer, no text
    assert main(vllm_line("vllm bench latency --model {MODEL} --profile")) == 2
    assert "profile_step.py" in capsys.readouterr().err


@pytest.mark.parametrize("line, dataset, expected_out", [
    # docs: "vllm bench throughput --model ... --input-len 128 --output-len 128 --num-prompts 1000
    # --tensor-parallel-size 2"
    ("vllm bench throughput --model {MODEL} --input-len 8 --output-len 4 --num-prompts 5 --tensor-parallel-size 1",
     "random", 20),
    ("vllm bench throughput --model {MODEL} --dataset-name random --random-input-len 8 --random-output-len 3 "
     "--num-prompts 4 --n 2", "random", 24),
])
def test_bench_throughput_lines(tmp_path, line, dataset, expected_out):
    out = tmp_path / "thr.json"
    assert main(vllm_line(line + " --output-json {O}", O=out)) == 0
    rec = json.loads(out.read_text())
    assert rec["dataset"] == dataset and rec["total_output_tokens"] == expected_out


@pytest.fixture(scope="module")
def keyed_server():
    with serving(["serve", MODEL, "--api-key", KEY, "--max-model-len", "512", "--served-model-name", "demo"]) as s:
        yield s[0]


def test_bench_serve_lines_with_a_key_and_grafana_names(keyed_server, tmp_path, monkeypatch):
    base = keyed_server
    port = base.rsplit(":", 1)[1]
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    share = tmp_path / "sharegpt.json"
    share.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"def f{i}(x): return x + {i}"},
                                                    {"from": "gpt", "value": "It adds one to x and returns it."}]}
                                 for i in range(6)]))
    lines = [  # docs: the random-synthetic recipe, the chat backend recipe, the Grafana example's sharegpt run
        ("vllm bench serve --backend vllm --base-url {BASE} --model demo --dataset-name random --random-input-len 8 "
         "--random-output-len 4 --num-prompts 6 --max-concurrency 2 --save-result --result-dir {D}", 6 * 4),
        ("vllm bench serve --backend openai-chat --model demo --endpoint /v1/chat/completions --dataset-name random "
         "--random-input-len 8 --random-output-len 3 --num-prompts 4 --port {PORT} --ignore-eos "
         "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result --result-dir {D} "
         "--result-filename chat.json", 4 * 3),
        ("vllm bench serve --model demo --tokenizer {MODEL} --endpoint /v1/completions --dataset-name sharegpt "
         "--dataset-path {SHARE} --request-rate 30.0 --num-prompts 4 --port {PORT} --output-json {D}/share.json", None),
    ]
    for i, (line, tokens) in enumerate(lines):
        d = tmp_path / f"r{i}"
        assert main(vllm_line(line, BASE=base, PORT=port, D=d, SHARE=share)) == 0, line
        (path,) = list(d.glob("*.json"))
        rec = json.loads(path.read_text())
        assert rec["completed"] == rec["num_prompts"] and rec["failed"] == 0, rec["errors"]
        if tokens is not None and "ignore-eos" in line:
            assert rec["total_output_tokens"] == tokens
    assert "p50_e2el_ms" in json.loads((tmp_path / "r1" / "chat.json").read_text())
    assert (tmp_path / "r0").glob("vllm-infqps-concurrency2-demo-*.json")
    text = httpx.get(f"{base}/metrics").text
    series = {line.split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    names = {s.split("{")[0] for s in series}
    for query in GRAFANA_QUERIES:
        name = query.split("{")[0]
        assert name in names, name
        if "{" in query:
            assert any(s.startswith(name + "{") and query[len(name) + 1:-1] in s for s in series), query
    assert all('model_name="demo"' in s for s in series if s.startswith("vllm:"))
    assert not [s for s in series if s.split("{")[0].endswith("_created")]


def test_bench_serve_probe_without_the_key_says_so(keyed_server, monkeypatch, capsys):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main(["bench", "serve", "--base-url", keyed_server, "--num-prompts", "1", "--disable-tqdm"]) == 2
    assert "401" in capsys.readouterr().err


# ---------------------------------------------------------------------------- LLM(...) and model ids
def _hub_cache(root: Path, repo: str, commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """A Hugging Face hub cache holding `repo` (models--org--name/refs/main -> snapshots/<commit>)."""
    folder = root / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in Path(MODEL).iterdir():
        shutil.copy(f, snap / f.name)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return snap


def test_model_id_from_an_offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = _hub_cache(tmp_path / "dl", "acme/tiny-hybrid")
    p = SamplingParams(temperature=0.0, max_tokens=8)
    want = offline().generate("class Stack:", p, use_tqdm=False)[0].outputs[0].text
    llm = LLM("acme/tiny-hybrid", download_dir=str(tmp_path / "dl"), dtype="float32", device="cpu", max_num_seqs=2,
              swap_space=1, tokenizer_mode="slow", disable_log_stats=False, revision="main", max_logprobs=2,
              generation_config="vllm")
    assert Path(llm.llm_engine.config.model) == snap
    assert llm.generate("class Stack:", p, use_tqdm=False)[0].outputs[0].text == want
    assert llm.get_default_sampling_params().max_tokens == SamplingParams().max_tokens  # "vllm": none read
    with pytest.raises(ValueError, match="max_logprobs=2"):
        llm.generate("x", SamplingParams(logprobs=3, max_tokens=1), use_tqdm=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))  # $HF_HOME/hub, read at the call
    _hub_cache(tmp_path / "home" / "hub", "acme/other")
    from mambaserve.hub import resolve_model_path

    assert resolve_model_path("acme/other").startswith(str(tmp_path / "home" / "hub"))
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1 forbids"):
        LLM("acme/not-cached")


def test_llm_limits_and_generation_config_defaults(monkeypatch):
    llm = offline()
    with pytest.raises(ValueError, match="max_logprobs=20"):
        llm.generate("x", SamplingParams(logprobs=5000, max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_position_embeddings=2048"):
        LLM(MODEL, max_model_len=100000)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert LLM(MODEL, max_model_len=4096, device="cpu", max_num_seqs=2).llm_engine.max_model_len == 4096
    # the demo model's generation_config.json sets max_new_tokens 128: vLLM's default max_tokens then
    assert llm.get_default_sampling_params().max_tokens == 128


def test_cpu_threads_default_and_override(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        LLM(MODEL, device="cpu", max_num_seqs=2)
        assert torch.get_num_threads() == 1
        LLM(MODEL, device="cpu", max_num_seqs=2, cpu_num_threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_stat_logger_lines():
    from mambaserve.engine.stat_logger import StatLogger
    from mambaserve.engine.stats import EngineUsage

    def usage(prompt, gen, running):
        return EngineUsage(num_running=running, num_waiting=1, num_slots_used=running, num_slots_total=8,
                           num_blocks_used=4, num_blocks_total=16, prompt_tokens=prompt, generation_tokens=gen,
                           steps=1, preemptions=0, step_breakdown={})

    log = StatLogger(interval=10.0)
    t0 = log._last_time
    assert log.maybe_log(lambda: usage(100, 50, 2), now=t0 + 5) is None  # not yet
    line = log.maybe_log(lambda: usage(100, 50, 2), now=t0 + 10)
    assert "Avg prompt throughput: 10.0 tokens/s" in line and "generation throughput: 5.0" in line
    assert "Running: 2 reqs, Waiting: 1 reqs" in line and "State slots: 2/8 (25.0%)" in line and "4/16" in line
    assert "Prefix cache" not in line  # never looked up
    cached = dataclasses.replace(usage(300, 60, 2), prefix_cache_queries=400, prefix_cache_hits=100)
    line = log.maybe_log(lambda: cached, now=t0 + 20)
    assert line.endswith("Prefix cache hit rate: 25.0%")
    cached = dataclasses.replace(cached, prefix_cache_queries=600, prefix_cache_hits=250)
    line = log.maybe_log(lambda: cached, now=t0 + 30)
    assert line.endswith("Prefix cache hit rate: 75.0%")  # over the period: 150 of 200
