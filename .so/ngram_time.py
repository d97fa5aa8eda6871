import random, time
from mambaserve.engine.spec_decode import NgramProposer
random.seed(0)
p = NgramProposer(5, 1)  # wide n range as code prompts use
for n in (1024, 8192, 32768):
    toks = [random.randrange(3, 49000) for _ in range(n)]
    t = time.perf_counter(); reps = 50
    for _ in range(reps):
        p.propose(toks, 4)
    print(n, f"{(time.perf_counter() - t) / reps * 1e6:.0f} us per propose (no recurring n-gram: every n tried)")
    toks2 = toks + toks[100:110]
    t = time.perf_counter()
    for _ in range(reps):
        p.propose(toks2, 4)
    print(n, f"{(time.perf_counter() - t) / reps * 1e6:.0f} us per propose (a 5-gram recurs)")
