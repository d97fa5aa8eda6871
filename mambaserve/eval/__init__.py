"""Evaluation with lm-evaluation-harness (the optional `eval` extra).

Importing this package registers the `mambaserve` model with lm_eval, which (as of 0.4.x) has
no plugin discovery: `python -m mambaserve.eval ...` is lm_eval's own command line with the
model registered first, and Python code does `import mambaserve.eval` before
`lm_eval.simple_evaluate(model="mambaserve", ...)`.
"""

try:
    import lm_eval  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError('mambaserve.eval needs lm-evaluation-harness: pip install "mambaserve[eval]"') from e

from mambaserve.eval.lm_eval_model import MambaServeLM

__all__ = ["MambaServeLM"]
