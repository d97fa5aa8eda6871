"""StructuredOutputs on its own (grammar state, masks on the logits) and inside the engine with the
fill ahead: masks filled on a host thread while the engine thread processes the step before.

References: a second matcher per sequence fed the same tokens and filled one row at a time, the
bits unpacked by torch (not xgrammar's kernel) for the masks; the engine without async scheduling
(every fill in place, on the engine thread) for the outputs.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from mambaserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from mambaserve.engine.structured_outputs import StructuredOutputs, default_fill_threads  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "mambaserve" / "assets" / "demo-model"
SCHEMA = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 6}, "v": {"type": "integer"}},
          "required": ["k", "v"]}


class FakeSeq:
    """What the manager reads of a Sequence: its params, whether it finished, its id."""

    def __init__(self, params, request_id="r"):
        self.sampling_params, self.is_finished, self.request_id = params, False, request_id


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO))


def banned(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) bool: the tokens an int32 bitmask (rows, words) bans (bit clear), unpacked by shifts."""
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32)) & 1  # (rows, words, 32)
    return (bits.reshape(bitmask.shape[0], -1)[:, :vocab] == 0)


@pytest.mark.parametrize("rows", [[1, 2, 3], [0, 2, 5], [4], [0, 1, 2, 3, 4, 5]])
def test_mask_of_contiguous_and_scattered_rows(tokenizer, rows):
    vocab = 4096
    so = StructuredOutputs(tokenizer, vocab, [0])
    logits = torch.randn(6, vocab + 3)  # wider than the vocabulary, as padded lm heads are
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32)
    ref = logits.clone()
    ref[rows, :vocab] = ref[rows, :vocab].masked_fill(banned(bitmask, vocab), float("-inf"))
    so._mask(logits, rows, bitmask)
    assert torch.equal(logits, ref)  # other rows and the padding columns untouched


def _params(kind):
    return SamplingParams(structured_outputs=StructuredOutputsParams(**kind))


def test_fill_ahead_equals_a_fresh_fill_and_a_dropped_one_is_replaced(tokenizer):
    vocab = 4096
    so = StructuredOutputs(tokenizer, vocab, [0], fill_threads=2)
    kinds = [dict(json=SCHEMA), None, dict(regex=r"[a-z]{2,5}[0-9]"), dict(choice=["yes", "no"]), None]
    seqs = [FakeSeq(_params(k) if k else SamplingParams(), f"r{i}") for i, k in enumerate(kinds)]
    refs = {}
    compiler = so.compiler
    for seq, k in zip(seqs, kinds):
        if k:
            so.add_request([seq])
            refs[seq] = xgr.GrammarMatcher(compiler.compile(seq.sampling_params.structured_outputs))
    g, ended = torch.Generator().manual_seed(1), []
    for step in range(6):
        logits = torch.randn(len(seqs), vocab, generator=g)
        so.apply(logits, seqs)
        for i, seq in enumerate(seqs):
            if seq in refs and not seq.is_finished:
                want = xgr.allocate_token_bitmask(1, vocab)
                refs[seq].fill_next_token_bitmask(want)
                assert torch.equal(torch.isinf(logits[i]), banned(want, vocab)[0]), (step, i)
        tokens = [(seq, int(logits[i].argmax())) for i, seq in enumerate(seqs) if not seq.is_finished]
        for seq, t in tokens:
            if seq in refs:
                refs[seq].accept_token(t)
        ahead = list(seqs) if step % 3 != 2 else None  # every third step: no step in flight
        closed = so.accept(tokens, fill_ahead=ahead)
        for seq, _ in tokens:
            if seq in refs:
                assert (seq in closed) == refs[seq].is_terminated(), (step, seq.request_id)
                seq.is_finished = seq in closed
                ended += [seq] if seq in closed else []
        if step == 3:
            seqs = list(seqs)  # the step filled ahead was dropped: apply gets another batch and fills anew
    assert ended and so.mask_seconds > 0 and so.host_seconds > 0  # the choice's grammar ends early


def test_default_fill_threads_within_bounds():
    assert 1 <= default_fill_threads() <= 8


def _run(async_scheduling, prompts, params):
    llm = LLM(dtype="float32", device="cpu", async_scheduling=async_scheduling)
    so = llm.llm_engine.structured_outputs
    threads, fill = [], so._fill

    def recording(matchers, *args):
        threads.append(threading.current_thread() is not threading.main_thread())
        return fill(matchers, *args)

    so._fill = recording
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], threads, llm.llm_engine.usage()


def test_outputs_with_the_fill_ahead_equal_those_without_async_scheduling():
    prompts = ["def parse(text):", "class Config:", "import os\n", "# JSON:", "x = ", "for i in"]
    plain = SamplingParams(temperature=0.0, max_tokens=20)
    params = [SamplingParams(temperature=0.0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
              plain,
              SamplingParams(temperature=0.9, seed=4, max_tokens=30, stop=["e"],  # stops while a fill ran ahead
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{3,40}")),
              SamplingParams(temperature=0.0, max_tokens=9,  # the length limit ends it inside the grammar
                             structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA))),
              SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
                  choice=["alpha", "beta", "gamma delta"])),
              SamplingParams(temperature=0.7, seed=2, max_tokens=25)]
    ref, ref_threads, _ = _run(False, prompts, params)
    out, threads, usage = _run(True, prompts, params)
    assert out == ref
    assert not any(ref_threads) and any(threads)  # without async every fill is in place; with it, some ran ahead
    assert usage.structured_output_mask_s > 0 and usage.structured_output_host_s > 0


@pytest.mark.parametrize("where", ["prologue", "fill"])
def test_a_failing_fill_ahead_raises_at_apply_and_never_hangs(tokenizer, monkeypatch, where):
    so = StructuredOutputs(tokenizer, 4096, [0])
    seqs = [FakeSeq(_params(dict(regex=r"[a-z]+")))]
    so.add_request(seqs)

    class Broken:
        def batch_fill_next_token_bitmask(self, *args):
            raise RuntimeError("fill failed")

    if where == "fill":
        so._batch = Broken()
    else:  # before xgrammar's call: the engine thread waits for the fill to start, and must not wait forever
        monkeypatch.setattr(type(so.compiler), "xgr", property(lambda self: Broken.no_such_attribute))
    so.accept([(seqs[0], 5)], fill_ahead=seqs)
    with pytest.raises((RuntimeError, AttributeError)):
        so.apply(torch.zeros(1, 4096), seqs)
