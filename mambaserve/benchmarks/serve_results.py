"""What a `bench serve` run measured: one `RequestResult` per streamed request, the run's
record (throughput, TTFT/TPOT/ITL/E2EL statistics, per turn for multi-turn conversations) and
its printout. No HTTP here: `serve.py` sends the requests."""

from __future__ import annotations

from dataclasses import dataclass, field

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What one streamed request measured. ttft, latency and itl in seconds. turn: its index in
    its conversation (multi_turn), else None; usage_cached_tokens: the server's
    usage.prompt_tokens_details.cached_tokens, None when it sent none."""

    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    num_chunks: int = 0
    text: str = ""
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int | None = None
    turn: int | None = None
    error: str = ""


def serve_record(results: list[RequestResult], duration: float, tokenizer=None, detailed: bool = False,
                 percentiles: tuple[float, ...] = (99,)) -> dict:
    """Aggregate per-request results: counts, throughput, and TTFT/TPOT/ITL/E2EL statistics (ms:
    mean, median, std and each of `percentiles`, as p{q}_{metric}_ms); with `detailed`, also the
    per-request lengths and timings (seconds)."""
    import numpy as np

    ok = [r for r in results if r.success]
    out_lens, source = [], "chunks"
    for r in ok:
        if r.usage_completion_tokens is not None:
            out_lens.append(r.usage_completion_tokens)
            source = "usage"
        elif tokenizer is not None:
            out_lens.append(len(tokenizer(r.text, add_special_tokens=False)["input_ids"]))
            source = "tokenizer"
        else:
            out_lens.append(r.num_chunks)
    tpots = [(r.latency - r.ttft) / (n - 1) for r, n in zip(ok, out_lens) if n > 1]
    series = {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [x for r in ok for x in r.itl],
              "e2el": [r.latency for r in ok]}
    in_tokens, out_tokens = sum(r.prompt_len for r in ok), sum(out_lens)
    rec = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens, "output_token_count_source": source,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, xs in series.items():
        a = np.asarray(xs, dtype=np.float64) * 1e3
        for stat, fn in (("mean", np.mean), ("median", np.median), ("std", np.std)):
            rec[f"{stat}_{name}_ms"] = float(fn(a)) if a.size else 0.0
        for q in sorted(set(percentiles) | {99}):
            rec[f"p{q:g}_{name}_ms"] = float(np.percentile(a, q)) if a.size else 0.0
    cached = [r.usage_cached_tokens for r in ok if r.usage_cached_tokens is not None]
    if cached:
        rec["total_cached_tokens"] = sum(cached)
    turns = sorted({r.turn for r in ok if r.turn is not None})
    if turns:
        rec["per_turn"] = [turn_record(t, [r for r in ok if r.turn == t]) for t in turns]
    rec["errors"] = [r.error for r in results if not r.success][:20]
    if detailed:
        rec.update({"input_lens": [r.prompt_len for r in ok], "output_lens": out_lens, "ttfts": series["ttft"],
                    "e2els": series["e2el"], "itls": [r.itl for r in ok]})
    return rec


def turn_record(turn: int, results: list[RequestResult]) -> dict:
    """TTFT statistics (ms) of the requests of one turn index, their mean prompt length and
    cached tokens (where the server reported them)."""
    import numpy as np

    a = np.asarray([r.ttft for r in results], dtype=np.float64) * 1e3
    rec = {"turn": turn, "completed": len(results), "mean_prompt_len": float(np.mean([r.prompt_len for r in results])),
           "mean_ttft_ms": float(a.mean()), "median_ttft_ms": float(np.median(a)),
           "p99_ttft_ms": float(np.percentile(a, 99))}
    cached = [r.usage_cached_tokens for r in results if r.usage_cached_tokens is not None]
    if cached:
        rec["cached_tokens"] = sum(cached)
    return rec


def print_serve(rec: dict, metrics: tuple[str, ...] = ("ttft", "tpot", "itl"), percentiles=(99,)) -> None:
    w = 44
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w + 12, c="="))
    for label, key, fmt in (("Successful requests:", "completed", "d"), ("Failed requests:", "failed", "d"),
                            ("Benchmark duration (s):", "duration", ".2f"),
                            ("Total input tokens:", "total_input_tokens", "d"),
                            ("Total generated tokens:", "total_output_tokens", "d"),
                            ("Request throughput (req/s):", "request_throughput", ".2f"),
                            ("Output token throughput (tok/s):", "output_throughput", ".2f"),
                            ("Total token throughput (tok/s):", "total_token_throughput", ".2f")):
        print(f"{label:<{w}}{rec[key]:>12{fmt}}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in metrics:
        print("{s:{c}^{n}}".format(s=titles[name], n=w + 12, c="-"))
        for stat in ("mean", "median", *(f"p{q:g}" for q in percentiles)):
            label = f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {name.upper()} (ms):"
            print(f"{label:<{w}}{rec[f'{stat}_{name}_ms']:>12.2f}")
    if "total_cached_tokens" in rec:
        print(f"{'Prompt tokens from the prefix cache:':<{w}}{rec['total_cached_tokens']:>12d}")
    if rec.get("per_turn"):
        print("{s:{c}^{n}}".format(s="TTFT per turn (ms): mean / median / p99", n=w + 12, c="-"))
        for t in rec["per_turn"]:
            label = f"Turn {t['turn']} ({t['mean_prompt_len']:.0f} prompt tokens):"
            print(f"{label:<{w - 12}}{t['mean_ttft_ms']:>8.1f} {t['median_ttft_ms']:>8.1f} {t['p99_ttft_ms']:>8.1f}")
    print("=" * (w + 12))
