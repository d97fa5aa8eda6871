import random, time, sys
from tests.engine.test_scheduler_prefix import make, seq
from tests.engine.scheduling import engine_update
random.seed(0)
sched = make(budget=8192, num_slots=1100, num_blocks=200000, block_size=16, m=256, rows=256, max_num_seqs=1024)
for i in range(3000):
    sched.add(seq(str(i), [random.randrange(3, 50000) for _ in range(random.randint(50, 900))], max_tokens=200))
ts = []
for step in range(300):
    t = time.perf_counter(); out = sched.schedule(); ts.append(time.perf_counter() - t)
    engine_update(sched, out)
ts.sort()
print(f"schedule() median {ts[len(ts)//2]*1e6:.0f} us, p90 {ts[int(len(ts)*.9)]*1e6:.0f} us, running {sched.num_running}")
