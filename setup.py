"""Only what pyproject.toml cannot say: install mambaserve-lm-eval.pth at the top of
site-packages (see _mambaserve_lm_eval_hook.py), for regular and editable installs alike."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 64 (PEP 660 editable installs)
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # pragma: no cover
    editable_wheel = None

PTH = "mambaserve-lm-eval.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


def _pth_text() -> str:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH)) as f:
        return f.read()


class _StrategyWithPth:
    """Wraps setuptools' editable strategy: writes its files, then the .pth beside them."""

    def __init__(self, strategy):
        self._strategy = strategy

    def __call__(self, wheel, files, mapping):
        self._strategy(wheel, files, mapping)
        wheel.writestr(PTH, _pth_text())

    def __enter__(self):
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self._strategy.__exit__(*exc)


cmdclass = {"build_py": BuildPyWithPth}
if editable_wheel is not None:

    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _StrategyWithPth(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=cmdclass)
