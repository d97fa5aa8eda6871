"""The caches' descriptions and bookkeeping: specs (shapes, dtypes, bytes), the state slot and
KV block pools over one index free-list, and the tensor allocation. No model, layer or engine."""
