"""Where a graphed greedy run first leaves the eager one, and whether a router near tie explains it.

For `test_gpu.py::test_graphs_equal_eager_bf16` on a GPU: the same tiny checkpoint, prompts and
batches as the test (its random prompts, not the tie-free ones), run eagerly and with decode
graphs. Per sequence it prints the first step where the tokens differ or a common top-5
candidate's logprob moves by more than --tol, and the router margins (transformers, float32, on
the CPU) at the positions that step depends on: the smallest ones, and the position of each
margin below --near. Then the same comparison in float32 (TF32 off), where rounding is 2^16
times finer: a padded-graph bug shows there too, a bfloat16 near tie does not.

    PYTHONPATH=. python -m tests.engine.diagnose_graphs_vs_eager --model jamba

Prints only; exits 0. Verdict per sequence: "near tie" when a margin below --near lies at or
before the first difference, else "no near tie: compare the graph's inputs".
"""

from __future__ import annotations

import argparse

import torch

from mambaserve import LLM, SamplingParams
from tests.engine.engines import SHARE, gen_with_logprobs, prompts_for
from tests.models.tiny import checkpoint, hf_model, router_margins, routers_of

LENS = (1, 2, 3, 9, 17, 30, 64, 5, 7)


def first_difference(a, b, tol: float) -> tuple[int | None, float]:
    """(first step where tokens differ or a common candidate's logprob moves by more than tol,
    largest logprob move before it); a, b: (tokens, [{token: logprob}] per step)."""
    worst = 0.0
    for t, (x, y, la, lb) in enumerate(zip(a[0], b[0], a[1], b[1])):
        moves = [abs(la[k] - lb[k]) for k in set(la) & set(lb)]
        step_worst = max(moves, default=0.0)
        if x != y or step_worst > tol:
            return t, step_worst
        worst = max(worst, step_worst)
    return None, worst


def run_pair(name: str, dtype: str, max_tokens: int, prompts: list[list[int]]):
    kw = dict(skip_tokenizer_init=True, dtype=dtype, device="cuda", max_num_seqs=16, cuda_graph_sizes=[1, 2, 4, 8, 16],
              gpu_memory_utilization=SHARE)
    eager, graphed = LLM(checkpoint(name), enforce_eager=True, **kw), LLM(checkpoint(name), **kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    return {len(batch): (gen_with_logprobs(eager, batch, params), gen_with_logprobs(graphed, batch, params))
            for batch in ([prompts[0]], prompts[:3], prompts[:9])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="jamba", help="a config name of tests/models/tiny.py")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tol", type=float, default=0.05, help="logprob move that counts as a difference (nats)")
    ap.add_argument("--near", type=float, default=0.02, help="router margin that counts as a near tie")
    args = ap.parse_args()
    prompts = prompts_for(args.model, lens=LENS)
    hf = hf_model(args.model)
    routed = bool(routers_of(hf))
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in ("bfloat16", "float32"):
        print(f"== {args.model} {dtype}: eager vs decode graphs, {args.max_tokens} greedy steps")
        for size, (eager, graphed) in run_pair(args.model, dtype, args.max_tokens, prompts).items():
            for i, (e, g) in enumerate(zip(eager, graphed)):
                step, worst = first_difference(e, g, args.tol)
                line = f"batch {size} seq {i} (prompt {len(prompts[i])}): "
                if step is None:
                    print(line + f"equal ({worst:.2e} nats at most)")
                    continue
                ge, gg = e[1][step], g[1][step]
                moves = {k: round(ge[k] - gg[k], 4) for k in set(ge) & set(gg)}
                line += (f"first difference at step {step}: tokens {e[0][step]} / {g[0][step]}, "
                         f"eager - graph logprobs {moves}")
                if dtype == "bfloat16" and routed:
                    tokens = prompts[i] + e[0][:step]  # step t's logits read positions < len(prompt) + t
                    margins = router_margins(hf, tokens)
                    near = [(q - len(prompts[i]), round(float(margins[q]), 4))
                            for q in (margins < args.near).nonzero().flatten().tolist()]
                    smallest = margins.argsort()[:3].tolist()
                    line += (f"\n    router margins < {args.near} at steps (negative: prompt) {near or 'none'}; "
                             f"smallest {[(q - len(prompts[i]), round(float(margins[q]), 4)) for q in smallest]}"
                             f"\n    verdict: {'near tie' if near else 'no near tie: compare the graph inputs'}")
                print(line)


if __name__ == "__main__":
    main()
