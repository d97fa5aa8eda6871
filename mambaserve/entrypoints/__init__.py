"""User-facing entry points: the `mambaserve` CLI (generate, serve, bench) and the HTTP server."""
