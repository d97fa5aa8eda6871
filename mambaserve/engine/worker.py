"""`python -m mambaserve.engine.worker`: a tensor-parallel rank that rank 0 started
(`engine.executor.main`). Its own module, so that the executor's message classes keep their
names when the worker runs as __main__ (what rank 0 pickles, the worker must unpickle as such)."""

from mambaserve.engine.executor import main

if __name__ == "__main__":
    main()
