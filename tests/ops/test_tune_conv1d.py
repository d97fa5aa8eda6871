"""The config table that benchmarks/tune_conv1d.py builds from its timings (CPU: synthetic
timings; the script itself needs a GPU)."""

import importlib.util
import json
import sys
from pathlib import Path

from mambaserve.ops import conv1d

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tune_conv1d.py"


def _tune():
    spec = importlib.util.spec_from_file_location("tune_conv1d", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tune_conv1d"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _results(tune, winner_varlen, winner_update, loser_factor=1.5):
    """Per-shape timings where one config is fastest everywhere, the others loser_factor slower."""
    rows = []
    for s in tune.shapes():
        cands = tune.candidates(s)
        win = winner_update if s.kind == "update" else winner_varlen
        us = {json.dumps(c): (10.0 if c == win else 10.0 * loser_factor + i) for i, c in enumerate(cands)}
        rows.append({"name": s.name, "kind": s.kind, "dim": s.dims[0], "num_tokens": s.num_tokens, "us": us})
    return rows


def test_the_table_takes_the_fastest_config_of_every_class():
    tune = _tune()
    win_v, win_u = conv1d.VARLEN_CANDIDATES[13], conv1d.UPDATE_CANDIDATES[7]
    table = tune.build_table(_results(tune, win_v, win_u), "NVIDIA H200")
    conv1d.check_table(table)
    for s in tune.shapes():
        if s.kind == "update":
            assert conv1d.update_config(table, len(s.lens), s.dims[0], s.width) == win_u
        else:
            cfg = conv1d.varlen_config(table, s.num_tokens, s.dims[0], s.width)
            assert cfg == {**win_v, "group": min(win_v["group"], cfg["block_t"])}, s.name


def test_a_config_that_failed_on_a_shape_is_not_chosen_for_its_class():
    tune = _tune()
    win_v, win_u = conv1d.VARLEN_CANDIDATES[0], conv1d.UPDATE_CANDIDATES[0]
    rows = _results(tune, win_v, win_u)
    for r in rows:  # the winner fails on one update shape of batch 256: its class must take another
        if r["name"] == "update b256 granite":
            del r["us"][json.dumps(win_u)]
    table = tune.build_table(rows, "NVIDIA H200")
    assert conv1d.update_config(table, 256, 3328, 4) != win_u
    assert conv1d.update_config(table, 1, 3328, 4) == win_u
