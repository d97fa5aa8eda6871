"""Lets `lm_eval --model mambaserve` find mambaserve's backend once mambaserve is installed.

lm-evaluation-harness 0.4 fills its model registry by importing `lm_eval.models` and has no
plugin discovery, so an outside model is known only if its module was imported first. The
`mambaserve-lm-eval.pth` file that mambaserve installs imports this tiny module at interpreter
start; it installs an import hook that, right after `lm_eval.models` has been imported (and so
only in processes that use lm_eval), imports `mambaserve.eval`, which registers the model. It
costs nothing elsewhere: no mambaserve, torch or lm_eval import happens until lm_eval does.
"""

import importlib.abc
import importlib.machinery
import sys

_TARGET = "lm_eval.models"


class _RegisterAfterLoad(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            import mambaserve.eval  # noqa: F401  (registers "mambaserve" with lm_eval)
        except Exception as e:  # never break lm_eval itself
            print(f"mambaserve: could not register the lm_eval backend: {e}", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RegisterAfterLoad(spec.loader)
        return spec


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
