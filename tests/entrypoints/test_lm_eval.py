"""mambaserve as an lm-evaluation-harness backend, checked against the harness's `hf` backend.

Three local tasks (`tests/data/lm_eval_tasks/`: multiple choice by loglikelihood, perplexity by
loglikelihood_rolling, greedy generate_until) run through `lm_eval.simple_evaluate` on a tiny
random checkpoint with a tokenizer (`tests/tokenized.py`) and on the bundled demo model. Every
request's loglikelihood must equal transformers' (the `hf` backend, float32) within 1e-4
relative, and every generated answer must be the same text. The same tasks through
`local-completions` against an in-process `mambaserve serve` must give the offline scores.
Nothing is downloaded: the datasets are local JSONL files and the hubs are set offline.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import runpy
import threading
import time
from pathlib import Path

import pytest
import torch

# Before datasets/transformers are imported: a test must never reach the network.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import mambaserve.eval  # noqa: E402,F401  (registers "mambaserve")
from mambaserve import SamplingParams  # noqa: E402
from mambaserve.config import default_model  # noqa: E402
from mambaserve.eval.lm_eval_model import MambaServeLM  # noqa: E402
from tests.tokenized import tokenized_checkpoint  # noqa: E402

TASKS_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval_tasks"
TASKS = ["mambaserve_mc", "mambaserve_ppl", "mambaserve_gen"]
# Small enough that the perplexity texts need several rolling windows.
MAX_LEN = 64
RTOL = 1e-4


def evaluate(model, model_args=None, **kw) -> dict:
    """simple_evaluate over the local tasks, samples logged. The tasks' data_files are relative
    to their folder, so the harness runs from there."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(TASKS_DIR)
        return lm_eval.simple_evaluate(
            model=model, model_args=model_args, tasks=TASKS, log_samples=True, bootstrap_iters=0,
            task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False), **kw)


def responses(results: dict, task: str) -> list:
    """Per document (in order), the list of its requests' responses."""
    return [[r[0] for r in s["resps"]] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def assert_same_scores(ours: dict, ref: dict, rtol: float = RTOL) -> None:
    """Loglikelihoods within rtol, the same greedy flags and the same generated texts, request by
    request; then the same metrics."""
    for doc, ref_doc in zip(responses(ours, "mambaserve_mc"), responses(ref, "mambaserve_mc"), strict=True):
        for (lp, greedy), (ref_lp, ref_greedy) in zip(doc, ref_doc, strict=True):
            assert math.isclose(lp, ref_lp, rel_tol=rtol), (lp, ref_lp)
            assert greedy == ref_greedy
    for doc, ref_doc in zip(responses(ours, "mambaserve_ppl"), responses(ref, "mambaserve_ppl"), strict=True):
        assert math.isclose(doc[0], ref_doc[0], rel_tol=rtol), (doc, ref_doc)
    assert responses(ours, "mambaserve_gen") == responses(ref, "mambaserve_gen")
    for task in TASKS:
        for key, value in ref["results"][task].items():
            if "," in key and isinstance(value, float) and "stderr" not in key:
                assert math.isclose(ours["results"][task][key], value, rel_tol=rtol), (task, key)


def hf_reference(path: str) -> dict:
    """lm_eval's transformers backend, float32, one request at a time (no padding). Its rolling
    windows are max_length tokens where ours are max_model_len - 2 (room for the prefix token and
    one generated token), so it gets MAX_LEN - 2 to cut the same windows."""
    return evaluate("hf", f"pretrained={path},dtype=float32,max_length={MAX_LEN - 2}", device="cpu", batch_size=1)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models spend their time in op overheads, and on a loaded machine two threads that
    spin for each other make these tests many times slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- the tiny checkpoint
@pytest.fixture(scope="module")
def tiny() -> str:
    return tokenized_checkpoint("granite-moe")


@pytest.fixture(scope="module")
def tiny_results(tiny) -> dict:
    return evaluate("mambaserve", f"pretrained={tiny},dtype=float32,max_model_len={MAX_LEN}", batch_size="auto")


@pytest.fixture(scope="module")
def lm(tiny) -> MambaServeLM:
    return MambaServeLM(pretrained=tiny, dtype="float32", max_model_len=MAX_LEN, max_gen_toks=20)


def test_registered_with_lm_eval():
    assert get_model("mambaserve") is MambaServeLM


def test_tiny_equals_transformers(tiny, tiny_results, lm):
    assert_same_scores(tiny_results, hf_reference(tiny))
    # the perplexity texts were long enough for several windows each
    n_tokens = [len(lm.tok_encode(d["text"])) for d in (s["doc"] for s in tiny_results["samples"]["mambaserve_ppl"])]
    assert max(n_tokens) > 2 * MAX_LEN


def test_greedy_continuation_is_greedy(lm):
    """A continuation the engine generated greedily is greedy by loglikelihood, and its summed
    prompt logprobs equal the logprobs it was sampled with."""
    ctx = lm.tok_encode("def add(a, b):\n")
    out = lm.model.generate({"prompt_token_ids": ctx}, SamplingParams(temperature=0.0, max_tokens=6, logprobs=0),
                            use_tqdm=False)[0].outputs[0]
    (lp, greedy), (lp_bad, greedy_bad) = lm._loglikelihood_tokens(
        [(None, ctx, out.token_ids), (None, ctx, out.token_ids[:-1] + [(out.token_ids[-1] + 1) % 200 + 3])])
    assert greedy and not greedy_bad
    assert math.isclose(lp, out.cumulative_logprob, rel_tol=RTOL)
    assert lp_bad < lp


def test_requests_through_the_api(lm):
    """loglikelihood with an empty context (prefix token), an empty continuation, a context cut
    to max_length, rolling over an empty text, and batch_size as a number: same numbers."""
    req = lambda kind, *args: Instance(kind, {}, args, 0)  # noqa: E731
    long_ctx = "x = 1\n" * 40  # more than MAX_LEN tokens
    reqs = [req("loglikelihood", "", "def f():"), req("loglikelihood", "def f():", ""),
            req("loglikelihood", long_ctx, " y = 2"), req("loglikelihood", "a = ", "1")]
    auto = lm.loglikelihood(reqs, disable_tqdm=True)
    assert auto[1] == (0.0, True)
    ids = lm.tok_encode("def f():")
    ref = lm._loglikelihood_tokens([(None, [lm.prefix_token_id], ids)])[0]
    assert math.isclose(auto[0][0], ref[0], rel_tol=RTOL)
    ctx, cont = lm._encode_pair(long_ctx, " y = 2")
    assert len(ctx) + len(cont) > MAX_LEN
    kept = (ctx + cont)[-(MAX_LEN - 1):]  # the longest prompt that leaves one token to generate
    ref = lm._loglikelihood_tokens([(None, kept[: -len(cont)], cont)])[0]
    assert math.isclose(auto[2][0], ref[0], rel_tol=RTOL)
    lm.batch_size = 1
    try:
        for (lp, greedy), (ref_lp, ref_greedy) in zip(lm.loglikelihood(reqs, disable_tqdm=True), auto, strict=True):
            assert math.isclose(lp, ref_lp, rel_tol=RTOL) and greedy == ref_greedy
    finally:
        lm.batch_size = "auto"
    assert lm.loglikelihood_rolling([req("loglikelihood_rolling", "")], disable_tqdm=True) == [0.0]


def test_add_bos_token_puts_bos_first_as_hf_does(tiny):
    """add_bos_token=True with a tokenizer that adds no BOS of its own: the hf backend (its
    tokenizer loaded with add_bos_token) scores every text after BOS, and so must we."""
    from lm_eval.models.huggingface import HFLM

    ours = MambaServeLM(pretrained=tiny, dtype="float32", max_model_len=MAX_LEN, add_bos_token=True)
    ref = HFLM(pretrained=tiny, dtype="float32", max_length=MAX_LEN - 2, device="cpu", batch_size=1,
               add_bos_token=True)
    bos = ours.tokenizer.bos_token_id
    assert ours.tokenizer("Hello world")["input_ids"][0] != bos  # the tokenizer alone adds none
    assert ours.tok_encode("Hello world") == ref.tok_encode("Hello world") == [bos] + ours.tok_encode(
        "Hello world", add_special_tokens=False)
    assert ours.tok_encode(ours.tok_decode([bos]) + "Hi")[:2] != [bos, bos]  # BOS already in the text
    req = lambda kind, *args: Instance(kind, {}, args, 0)  # noqa: E731
    reqs = [req("loglikelihood", "Hello", " world"), req("loglikelihood", "", " world")]
    for (lp, greedy), (ref_lp, ref_greedy) in zip(ours.loglikelihood(reqs, disable_tqdm=True),
                                                  ref.loglikelihood(reqs, disable_tqdm=True), strict=True):
        assert math.isclose(lp, ref_lp, rel_tol=RTOL) and greedy == ref_greedy
    rolling = [req("loglikelihood_rolling", "Hello world")]
    (lp,), (ref_lp,) = ours.loglikelihood_rolling(rolling, True), ref.loglikelihood_rolling(rolling, True)
    assert math.isclose(lp, ref_lp, rel_tol=RTOL)


def test_gen_kwargs(lm):
    eos = lm.tok_decode([lm.eot_token_id])
    p, until = lm._sampling_params({"until": "\n\n"}, eos)
    assert until == ["\n\n", eos] and p.stop == ["\n\n", eos] and p.is_greedy and p.max_tokens == 20
    p, _ = lm._sampling_params({"do_sample": True, "max_new_tokens": 5, "top_p": 0.5, "seed": 3}, eos)
    assert (p.temperature, p.max_tokens, p.top_p, p.seed) == (1.0, 5, 0.5, 3)
    p, _ = lm._sampling_params({"do_sample": False, "temperature": 0.7}, eos)
    assert p.is_greedy
    with pytest.raises(ValueError, match="max_gen_toks"):
        lm._sampling_params({"max_gen_toks": MAX_LEN}, eos)
    # a stop string cuts the text; the cut text is what the harness scores
    req = Instance("generate_until", {}, ("def add(a, b):", {"until": ["\n"], "max_gen_toks": 12}), 0)
    text = lm.generate_until([req], disable_tqdm=True)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, skip_special_tokens=False)
    full = lm.model.generate("def add(a, b):", params, use_tqdm=False)[0].outputs[0].text
    assert text == full.split("\n")[0].split(eos)[0]


def test_model_args(tiny, caplog):
    with pytest.raises(ValueError, match="unknown model_args.*no_such_option"):
        MambaServeLM(pretrained=tiny, no_such_option=1)
    with pytest.raises(ValueError, match="data_parallel_size"):
        MambaServeLM(pretrained=tiny, data_parallel_size=2)
    with pytest.raises(ValueError, match="device"):
        MambaServeLM(pretrained=tiny, device="mps")
    lm = MambaServeLM.create_from_arg_string(
        f"pretrained={tiny},dtype=float32,max_length=48,max_num_seqs=3,seed=7,enforce_eager=True,"
        "gpu_memory_utilization=0.5,load_format=auto,trust_remote_code=True,tokenizer_revision=main,"
        "swap_space=4",
        {"batch_size": "auto:4", "max_batch_size": None, "device": "cpu"})
    assert "tokenizer_revision" in caplog.text  # accepted and ignored, said so
    cfg = lm.model.llm_engine.config
    # vLLM's engine options reach the engine
    assert (cfg.trust_remote_code, cfg.swap_space) == (True, 4.0)
    assert (lm.max_length, cfg.max_num_seqs, cfg.seed, cfg.enforce_eager, cfg.dtype, cfg.device) == (
        48, 3, 7, True, "float32", "cpu")
    assert lm.batch_size == "auto"


def test_command_line(tiny, monkeypatch, capsys):
    """`python -m mambaserve.eval` is lm_eval's command line with `--model mambaserve` known (run
    in this process: a fresh interpreter would spend most of the test importing). Its default
    --device cuda:0 falls back to the CPU here."""
    monkeypatch.chdir(TASKS_DIR)
    monkeypatch.setattr("sys.argv", [
        "mambaserve.eval", "--model", "mambaserve", "--model_args",
        f"pretrained={tiny},dtype=float32,max_model_len={MAX_LEN}", "--tasks", "mambaserve_gen",
        "--include_path", ".", "--limit", "2", "--batch_size", "auto"])
    runpy.run_module("mambaserve.eval", run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert "mambaserve_gen" in out and "exact_match" in out


# ---------------------------------------------------------------------------- the demo model
DEMO = Path(default_model())


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="the bundled demo model is not in this checkout yet")
def test_demo_model_equals_transformers():
    lm = MambaServeLM(pretrained=str(DEMO), dtype="float32", max_model_len=MAX_LEN)
    ours = evaluate(lm)
    assert_same_scores(ours, hf_reference(str(DEMO)))
    # a trained model knows some Python: better than chance on the multiple choice
    assert ours["results"]["mambaserve_mc"]["acc,none"] > 0.25


# ---------------------------------------------------------------------------- local-completions
@contextlib.contextmanager
def running_server(model: str, name: str, api_key: str):
    """`mambaserve serve` in a background thread of this process, on a free loopback port."""
    from mambaserve.entrypoints.cli import build_parser
    from mambaserve.entrypoints.server import bind_socket, build_server

    args = build_parser().parse_args(["serve", model, "--dtype", "float32", "--max-model-len", str(MAX_LEN),
                                      "--served-model-name", name, "--api-key", api_key,
                                      "--uvicorn-log-level", "warning"])
    server = build_server(args)
    sock = bind_socket("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.mark.skipif(importlib.util.find_spec("mambaserve.entrypoints.server") is None,
                    reason="mambaserve serve (mambaserve/entrypoints/server.py) is not in this checkout yet")
def test_local_completions_equals_offline(tiny, tiny_results, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("tenacity", reason="local-completions needs lm-eval[api]")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-lm-eval")  # local-completions sends it as the bearer token
    with running_server(tiny, "tiny", "sk-lm-eval") as url:
        # max_length is the server's --max-model-len: the harness cuts its windows from it
        served = evaluate("local-completions", dict(model="tiny", base_url=url, tokenizer=tiny,
                                                    tokenizer_backend="huggingface", max_length=MAX_LEN,
                                                    num_concurrent=8))
    assert_same_scores(served, tiny_results)


def test_plain_lm_eval_command_line_knows_mambaserve_without_importing_it_first():
    """The installed .pth hook registers the backend in a fresh `python -m lm_eval` process."""
    import subprocess
    import sys

    code = ("import sys; assert 'mambaserve' not in sys.modules and 'torch' not in sys.modules; "
            "from lm_eval.api.registry import get_model; print(get_model('mambaserve').__name__, "
            "get_model('hf').__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    if proc.returncode != 0 and "_mambaserve_lm_eval_hook" not in sys.modules:
        pytest.skip(f"mambaserve is not installed with its .pth hook here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["MambaServeLM", "HFLM"]
