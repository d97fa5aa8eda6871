"""What importing the ops loads: nothing of mambaserve outside `ops/`, neither the engine nor
transformers; and without Triton the package still imports and runs the reference backend.

Each case runs in a fresh interpreter: the test process has loaded everything already.
"""

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_import_ops_loads_only_ops():
    _run("""
        import sys
        import mambaserve.ops
        loaded = sorted(m for m in sys.modules if m.startswith("mambaserve"))
        outside = [m for m in loaded if m != "mambaserve" and not m.startswith("mambaserve.ops")]
        assert not outside, f"import mambaserve.ops loaded {outside}"
        assert "transformers" not in sys.modules, "import mambaserve.ops loaded transformers"
    """)


@pytest.mark.parametrize("module", ["mambaserve.forward_context", "mambaserve.layers.mamba2",
                                    "mambaserve.layers.attention", "mambaserve.models"])
def test_lower_floors_do_not_load_the_engine(module):
    _run(f"""
        import sys
        import {module}
        engine = sorted(m for m in sys.modules if m.startswith("mambaserve.engine"))
        assert not engine, f"import {module} loaded {{engine}}"
    """)


def test_public_names_load_on_first_use():
    _run("""
        import sys
        import mambaserve
        assert "mambaserve.llm" not in sys.modules
        from mambaserve import LLM, SamplingParams
        assert LLM.__module__ == "mambaserve.llm" and SamplingParams.__module__ == "mambaserve.sampling_params"
        assert "LLM" in dir(mambaserve)
        try:
            mambaserve.NoSuchName
        except AttributeError:
            pass
        else:
            raise AssertionError("unknown attribute did not raise")
    """)


def test_ops_without_triton_run_the_reference():
    """Triton is a Linux-only dependency: elsewhere the ops import and run their references."""
    _run("""
        import sys
        sys.modules["triton"] = None  # import triton now raises ImportError
        import torch
        from mambaserve import ops
        from mambaserve.ops import dispatch
        assert not dispatch.HAS_TRITON
        x = torch.randn(4, 8)
        out = ops.silu_and_mul(x)
        assert torch.allclose(out, ops.reference.silu_and_mul(x))
        try:
            with ops.backend("triton"):
                pass
        except ValueError as e:
            assert "not installed" in str(e)
        else:
            raise AssertionError("backend('triton') without Triton did not raise")
    """)
