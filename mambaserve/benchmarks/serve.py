"""`mambaserve bench serve`: load-test any OpenAI-compatible server over HTTP, with vLLM's flags:
--backend vllm or openai (POST /v1/completions) or openai-chat (POST /v1/chat/completions, the
prompt as one user message: random token ids are decoded to text with the tokenizer first), an
API key from $OPENAI_API_KEY on every request (the model listing too), results saved with
--save-result [--result-dir DIR] [--result-filename NAME] (or --output-json PATH).

Requests are sent with `stream: true` at a Poisson (or gamma, with --burstiness) arrival rate,
at most --max-concurrency in flight; each response is read as server-sent events ("data: {json}"
lines, ended by "data: [DONE]"). Every chunk that carries choices counts as one token event:
the first gives the time to first token (TTFT), the gaps between later ones the inter-token
latencies (ITL). A request's output token count is the server's `usage.completion_tokens`
(asked for with stream_options.include_usage), else the tokenized text's length when a
tokenizer is given, else the number of chunks; TPOT = (latency - TTFT) / (tokens - 1).
Prompt tokens the server served from its prefix cache are read from the final usage's
`prompt_tokens_details.cached_tokens` where the server sends it. `--dataset multi_turn` sends
conversations turn by turn (`multi_turn.run_conversations`) and adds TTFT per turn index.
It knows nothing about our engine: it only speaks HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from mambaserve.benchmarks.common import args_record, environment_info, write_json
from mambaserve.benchmarks.datasets import MULTI_TURN, BenchRequest, build_requests
from mambaserve.benchmarks.serve_requests import BACKENDS, request_payload, stream_completion
from mambaserve.benchmarks.serve_results import METRICS, RequestResult, print_serve, serve_record  # noqa: F401
from mambaserve.benchmarks.throughput import add_dataset_args, dataset_options, resolve_dataset


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench serve` (vLLM's `bench serve` names)."""
    parser.add_argument("--base-url", default=None,
                        help="server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--backend", default="vllm", choices=list(BACKENDS),
                        help="vllm and openai: the completions API; openai-chat: the chat completions API")
    parser.add_argument("--endpoint", default=None,
                        help="API path (default: /v1/completions, or /v1/chat/completions for openai-chat)")
    parser.add_argument("--label", default=None, help="the results' label (default: --backend)")
    parser.add_argument("--model", default=None,
                        help="model name sent in requests (default: the first of GET /v1/models); a local checkpoint "
                             "or config path also gives the vocabulary size and tokenizer")
    parser.add_argument("--served-model-name", default=None, help="name sent in requests when it differs from --model")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory: for a ShareGPT file and for counting tokens")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="random token ids are drawn below this (default: the tokenizer's size, or the "
                             "vocab_size of --model, or of the server's model root, when it is a local checkpoint or "
                             "config; else 10000)")
    add_dataset_args(parser)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s (Poisson); inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos (a vLLM extension) so outputs reach max_tokens")
    parser.add_argument("--request-timeout", type=float, default=6 * 3600, help="seconds before a request is abandoned")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help="metrics whose percentiles are reported: a comma list of ttft, tpot, itl, e2el")
    parser.add_argument("--metric-percentiles", default="99", help="percentiles reported, e.g. 25,50,75,99")
    parser.add_argument("--save-result", action="store_true", help="write the results record to a JSON file")
    parser.add_argument("--result-dir", default=None, help="folder of --save-result (default: the current one)")
    parser.add_argument("--result-filename", default=None,
                        help="file name of --save-result "
                             "(default: {label}-{rate}qps[-concurrency{n}]-{model}-{time}.json)")
    parser.add_argument("--output-json", default=None, help="write the results record to this path (older spelling)")
    parser.add_argument("--save-detailed", action="store_true", help="also record every request's lengths and timings")
    parser.add_argument("--disable-tqdm", action="store_true")


async def run_load(requests: list[BenchRequest], url: str, model: str,
                   args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    """Send every request at the chosen rate and concurrency; returns the results (in request
    order) and the benchmark's duration in seconds. The first request is sent once alone
    beforehand to check the server (not counted); ValueError if it fails."""
    import aiohttp
    import numpy as np

    headers = auth_headers()
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    rng = np.random.default_rng(args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as session:
        probe = await stream_completion(session, url, request_payload(model, requests[0], args), requests[0].prompt_len)
        if not probe.success:
            raise ValueError(f"the test request to {url} failed: {probe.error}")
        if not args.disable_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="Requests", dynamic_ncols=True)

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                res = await stream_completion(session, url, request_payload(model, req, args), req.prompt_len)
            else:
                async with sem:
                    res = await stream_completion(session, url, request_payload(model, req, args), req.prompt_len)
            if bar is not None:
                bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if i and args.request_rate != float("inf"):
                # gamma(shape k, scale 1/(rate k)) gaps: mean 1/rate; k = 1 is a Poisson process
                k = args.burstiness
                await asyncio.sleep(float(rng.gamma(k, 1.0 / (args.request_rate * k))))
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration


def auth_headers() -> dict:
    """The API key of $OPENAI_API_KEY as a bearer token (vLLM's client sends it so), or none."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _tokenizer_for(args: argparse.Namespace, local_model: str | None):
    from mambaserve.benchmarks.common import has_tokenizer

    path = args.tokenizer or (local_model if local_model and has_tokenizer(local_model) else None)
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _vocab_size(args: argparse.Namespace, tokenizer, local_model: str | None) -> int:
    if args.vocab_size:
        return args.vocab_size
    if tokenizer is not None:
        return len(tokenizer)
    if local_model:
        from mambaserve.loader import load_config

        return int(load_config(local_model).vocab_size)
    return 10000


async def _first_model(base_url: str) -> tuple[str, str | None]:
    """The first model the server lists: its id, and its "root" (the path it was loaded from,
    as vLLM and mambaserve report it), if any. Sends the API key, as every request does."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), headers=auth_headers()) as s:
            async with s.get(base_url + "/v1/models") as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                first = (await resp.json())["data"][0]
                return first["id"], first.get("root")
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError) as e:
        raise ValueError(f"could not list the models at {base_url}/v1/models ({e}): pass --model") from e


def _metric_args(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """--percentile-metrics and --metric-percentiles, checked (ValueError)."""
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    if not metrics or any(m not in METRICS for m in metrics):
        raise ValueError(f"--percentile-metrics must be a comma list of {', '.join(METRICS)}, "
                         f"got {args.percentile_metrics!r}")
    try:
        qs = tuple(float(q) for q in args.metric_percentiles.split(","))
    except ValueError:
        qs = ()
    if not qs or any(not 0 < q <= 100 for q in qs):
        raise ValueError(f"--metric-percentiles must be a comma list of numbers in (0, 100], "
                         f"got {args.metric_percentiles!r}")
    return metrics, qs


def _result_path(args: argparse.Namespace, model: str) -> str | None:
    """Where the record goes: --output-json, else with --save-result --result-dir/--result-filename
    (vLLM's default name: label, rate, concurrency, model, time)."""
    if args.output_json:
        return args.output_json
    if not args.save_result:
        return None
    import datetime

    name = args.result_filename
    if name is None:
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{args.label or args.backend}-{rate}qps{conc}-{os.path.basename(model.rstrip('/'))}-{stamp}.json"
    return os.path.join(args.result_dir or ".", name)


def main(args: argparse.Namespace) -> int:
    """`mambaserve bench serve`: build the dataset, load the server, print and save the results."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise SystemExit('mambaserve bench serve needs aiohttp: pip install "mambaserve[server]"') from None
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    metrics, qs = _metric_args(args)
    args.endpoint = args.endpoint or BACKENDS[args.backend][0]
    resolve_dataset(args)
    model, root = args.served_model_name or args.model, None
    if model is None:
        model, root = asyncio.run(_first_model(base_url))
    elif not os.path.exists(args.model or ""):
        try:  # the server's root may be a local checkpoint: its vocabulary and tokenizer
            root = asyncio.run(_first_model(base_url))[1]
        except ValueError:
            root = None  # a server that does not list its models: --tokenizer or --vocab-size then
    # a checkpoint or config on this machine (--model, or the server's root) gives vocabulary and tokenizer
    local_model = next((m for m in (args.model, root) if m and os.path.exists(m)), None)
    tokenizer = _tokenizer_for(args, local_model)
    vocab_size = _vocab_size(args, tokenizer, local_model)
    if args.dataset == MULTI_TURN:
        if BACKENDS[args.backend][1] == "chat":
            raise ValueError("--dataset multi_turn sends token-id histories: use a completions backend")
        from mambaserve.benchmarks.multi_turn import conversations_from_args, run_conversations

        requests = conversations_from_args(args, vocab_size)
        results, duration = asyncio.run(run_conversations(requests, base_url + args.endpoint, model, args,
                                                          tokenizer, vocab_size))
    else:
        requests = build_requests(args.dataset, args.num_prompts, vocab_size=vocab_size, tokenizer=tokenizer,
                                  input_len=args.input_len, output_len=args.output_len,
                                  range_ratio=args.random_range_ratio, seed=args.seed, **dataset_options(args))
        if BACKENDS[args.backend][1] == "chat":  # a chat message is text: token-id prompts are decoded first
            if tokenizer is None and any(isinstance(r.prompt, list) for r in requests):
                raise ValueError(f"--backend {args.backend} sends text: pass --tokenizer (or a --model with one) to "
                                 "turn the dataset's random token ids into text")
            for r in requests:
                if isinstance(r.prompt, list):
                    r.prompt = tokenizer.decode(r.prompt)
        results, duration = asyncio.run(run_load(requests, base_url + args.endpoint, model, args))
    rec = serve_record(results, duration, tokenizer, detailed=args.save_detailed, percentiles=qs)
    print_serve(rec, metrics, qs)
    path = _result_path(args, model)
    if path:
        record = {"benchmark": "serve", "environment": environment_info(device="cpu"), "role": "client",
                  "args": args_record(args), "backend": args.backend, "label": args.label or args.backend,
                  "base_url": base_url, "endpoint": args.endpoint, "model": model, "dataset": args.dataset,
                  "num_prompts": len(requests), "request_rate": args.request_rate,
                  "max_concurrency": args.max_concurrency, **rec}
        write_json(path, record)
    return 0
