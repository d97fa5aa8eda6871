"""Evaluation with lm-evaluation-harness (the optional `eval` extra).

Importing this package registers the `mambaserve` model with lm_eval, which (as of 0.4.x) has
no plugin discovery. Installed mambaserve does that import for any process that imports
`lm_eval.models` (the `mambaserve-lm-eval.pth` hook, `_mambaserve_lm_eval_hook.py`), so plain
`lm_eval --model mambaserve` works; `python -m mambaserve.eval ...` and an explicit
`import mambaserve.eval` before `lm_eval.simple_evaluate(model="mambaserve", ...)` do too.
"""

try:
    import lm_eval  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError('mambaserve.eval needs lm-evaluation-harness: pip install "mambaserve[eval]"') from e

from mambaserve.eval.lm_eval_model import MambaServeLM

__all__ = ["MambaServeLM"]
