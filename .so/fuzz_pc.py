"""Randomised differential check: prefix caching (+ spec decode, chunking, small pools) vs caching
off, one request at a time. Greedy; a divergence is a bug unless the reference's top-2 logprobs at
that position are within TIE of each other."""
import random, sys, traceback
import torch
from mambaserve import LLM, SamplingParams
from tests.models.tiny import checkpoint, hf_model

TIE = 1e-3
ATT = {"granite-moe", "bamba", "falcon-h1", "jamba", "zamba2", "nemotron-h-moe", "granite-dense-rope"}
fams = sys.argv[1].split(",")
seeds = range(int(sys.argv[2]), int(sys.argv[3]))
ck = {}
refs = {}

def ref_engine(name):
    if name not in refs:
        refs[name] = LLM(ck[name], dtype="float32", device="cpu", skip_tokenizer_init=True, block_size=4,
                         enable_prefix_caching=False, max_model_len=96)
    return refs[name]

def gen(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs

bad = 0
cached_total = 0
for name in fams:
    ck[name] = checkpoint(name)
    vocab = hf_model(name).config.vocab_size
    for seed in seeds:
        rng = random.Random(seed * 1000 + hash(name) % 1000)
        g = torch.Generator().manual_seed(seed)
        tok = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()
        cfg = dict(max_num_batched_tokens=rng.choice([3, 7, 16, 64]), mamba_block_size=rng.choice([4, 8, 12, 16]),
                   async_scheduling=rng.choice([True, False]), max_model_len=96)
        if name in ATT:
            cfg["num_kv_blocks"] = rng.choice([30, 48, 200])
        else:
            cfg["num_state_slots"] = rng.choice([3, 5, 9])
        cfg["max_num_seqs"] = rng.choice([2, 4, 8])
        k = rng.choice([0, 0, 1, 3])
        if k:
            cfg["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                                         "prompt_lookup_min": 1}
        try:
            llm = LLM(ck[name], dtype="float32", device="cpu", skip_tokenizer_init=True, block_size=4, **cfg)
        except ValueError as e:
            print(name, seed, "config refused:", e); continue
        sysp = tok(rng.choice([0, 5, 13, 24, 33]))
        rounds, hist = [], []
        for r in range(3):
            batch = []
            for _ in range(rng.choice([1, 2, 3])):
                kind = rng.random()
                if kind < 0.3 and hist:
                    p = rng.choice(hist)  # exact repeat
                elif kind < 0.55 and hist:
                    p = rng.choice(hist) + tok(rng.randint(1, 12))  # extend (multi-turn)
                elif kind < 0.7 and hist:
                    h = rng.choice(hist); p = h[:rng.randint(1, len(h))]  # a prefix of an earlier one
                else:
                    p = sysp + tok(rng.randint(1, 20))
                p = p[:80] or tok(3)
                batch.append(p)
            if rng.random() < 0.3:
                batch.append(batch[0])  # the same prompt twice in one batch
            rounds.append(batch); hist += batch
        mt = rng.choice([4, 9])
        if k == 0 and rng.random() < 0.5:
            params = SamplingParams(temperature=0.9, n=2, seed=seed, max_tokens=mt, ignore_eos=True, logprobs=2)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True, logprobs=2)
        try:
            for batch in rounds:
                got = gen(llm, batch, params)
                want = gen(ref_engine(name), batch, params) if False else [gen(ref_engine(name), [p], params)[0] for p in batch]
                for p, o, w in zip(batch, got, want):
                  cached_total += o.num_cached_tokens or 0
                  for oc, wc in zip(o.outputs, w.outputs):
                    a, b = oc.token_ids, wc.token_ids
                    if a != b:
                        i = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
                        lps = wc.logprobs[i]
                        vals = sorted((lp.logprob for lp in lps.values()), reverse=True)
                        gap = vals[0] - vals[1] if len(vals) > 1 else 99
                        tag = "tie" if gap < TIE else "BUG"
                        if tag == "BUG": bad += 1
                        print(f"{tag} {name} seed={seed} cfg={cfg} len={len(p)} cached={o.num_cached_tokens} pos={i} gap={gap:.2e} got={a} want={b}", flush=True)
        except Exception as e:
            bad += 1
            print(f"EXC {name} seed={seed} cfg={cfg}: {e!r}", flush=True); traceback.print_exc()
        del llm
    print(f"done {name}", flush=True)
print("BAD", bad, "cached tokens", cached_total)
