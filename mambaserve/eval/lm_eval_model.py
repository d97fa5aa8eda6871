"""mambaserve as a model backend of lm-evaluation-harness (`python -m mambaserve.eval --model mambaserve`).

The three request kinds of the harness become batched `LLM.generate` calls:
- `loglikelihood`: context + continuation token ids go in as a prompt with `max_tokens=1` and
  `prompt_logprobs=1`; the continuation's logprobs are summed, and it is greedy when every one
  of its tokens is the most likely token at its position.
- `loglikelihood_rolling`: the text is cut into windows of at most max_length tokens (the
  harness's own `get_rolling_token_windows`), all windows of all texts are scored together and
  summed per text.
- `generate_until`: greedy unless gen_kwargs ask for sampling, stopped at the `until` strings,
  the EOS token and `max_gen_toks`.

Tokenization and truncation follow the harness's vLLM backend, so the two give the same
requests to their engines. This module (with `mambaserve/eval/`) is the only place that
imports lm_eval; the engine knows nothing about it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import lm_eval.models  # noqa: F401  (lm_eval registers its own models only into an empty registry)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from mambaserve.config import EngineConfig
from mambaserve.llm import LLM
from mambaserve.sampling_params import SamplingParams

logger = logging.getLogger("mambaserve.eval")

# Scoring requests per generate() call when batch_size is "auto": bounds the host memory taken
# by the prompt-logprob dicts (a few hundred bytes per prompt token) without starving the engine.
_AUTO_SCORE_CHUNK = 1024

# gen_kwargs passed straight to SamplingParams (the rest of its fields are set here).
_SAMPLING_KEYS = ("top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                  "include_stop_str_in_output")
_MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")

# vLLM-backend model_args that mean nothing here: accepted with a warning so that a vLLM command
# line runs unchanged (revision, tokenizer_mode, swap_space, trust_remote_code are engine options).
_IGNORED_ARGS = ("tokenizer_revision",)


@register_model("mambaserve")
class MambaServeLM(TemplateLM):
    """lm_eval model over the offline engine.

    pretrained: checkpoint directory (default: the bundled demo model). dtype, max_model_len
    (alias max_length), gpu_memory_utilization, enforce_eager, max_num_seqs (default:
    max_batch_size, else the engine's), seed, load_format, tokenizer, device and any other
    `EngineConfig` field go to the engine. batch_size: "auto" (the engine batches by itself) or
    the number of requests per generate() call. add_bos_token, prefix_token_id, max_gen_toks and
    truncation_side as in the harness's vLLM backend.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_length: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        max_num_seqs: int | None = None,
        seed: int = 1234,
        load_format: str = "auto",
        tokenizer: str | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        max_gen_toks: int = 256,
        batch_size: int | str = "auto",
        max_batch_size: int | None = None,
        device: str | None = None,
        truncation_side: str = "left",
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        **kwargs: Any,
    ):
        super().__init__()
        if max_model_len is not None and max_length is not None and int(max_model_len) != int(max_length):
            raise ValueError(f"max_model_len={max_model_len} and max_length={max_length} disagree: pass one")
        if int(data_parallel_size) != 1:
            raise ValueError("mambaserve runs one engine: data_parallel_size must be 1 (tensor_parallel_size splits "
                             "the model over several devices)")
        if truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
        for name in _IGNORED_ARGS:
            if name in kwargs:
                logger.warning("mambaserve ignores model_args %s=%r", name, kwargs.pop(name))
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ValueError(f"unknown model_args for mambaserve: {', '.join(unknown)} "
                             f"(engine options: {', '.join(sorted(fields))})")
        max_len = max_model_len if max_model_len is not None else max_length
        engine_args = dict(
            dtype=dtype, load_format=load_format, tokenizer=tokenizer, seed=int(seed),
            max_model_len=int(max_len) if max_len is not None else None,
            gpu_memory_utilization=float(gpu_memory_utilization), enforce_eager=bool(enforce_eager),
            device=_engine_device(device), tensor_parallel_size=int(tensor_parallel_size),
        )
        if max_num_seqs is not None or max_batch_size is not None:
            engine_args["max_num_seqs"] = int(max_num_seqs if max_num_seqs is not None else max_batch_size)
        engine_args.update(kwargs)
        if engine_args.get("skip_tokenizer_init"):
            raise ValueError("lm_eval needs a tokenizer: skip_tokenizer_init cannot be set")

        self.batch_size = "auto" if str(batch_size).startswith("auto") else int(batch_size)
        if self.batch_size != "auto":
            if self.batch_size < 1:
                raise ValueError(f"batch_size must be 'auto' or >= 1, got {batch_size}")
            logger.warning("batch_size=%d sends %d requests at a time to the engine; with batch_size=auto it "
                           "batches all of them itself (faster)", self.batch_size, self.batch_size)
        self.model = LLM(pretrained, **engine_args)
        self.tokenizer = self.model.get_tokenizer()
        self.add_bos_token = add_bos_token
        if add_bos_token and self.tokenizer.bos_token_id is None:
            raise ValueError("add_bos_token=True but the tokenizer has no BOS token")
        self.custom_prefix_token_id = prefix_token_id
        self._max_gen_toks = int(max_gen_toks)
        self.truncation_side = truncation_side
        engine = self.model.llm_engine
        self._max_length = engine.max_model_len
        self._eos_ids = engine.eos_token_ids

    # ------------------------------------------------------------------ what the harness asks
    @property
    def eot_token_id(self) -> int:
        if self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        if not self._eos_ids:
            raise ValueError("the model and its tokenizer declare no EOS token")
        return self._eos_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """The token that conditions a continuation with an empty context (BOS, else EOS)."""
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.eot_token_id

    @property
    def max_length(self) -> int:
        """Longest prompt plus output, in tokens (the engine's max_model_len)."""
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "mambaserve")).replace("/", "__")

    def tok_encode(self, string: str | list[str], add_special_tokens: bool | None = None, **kwargs):
        """Token ids of a string (or a list of strings). Special tokens are the tokenizer's
        default unless add_special_tokens (or the add_bos_token model arg) says otherwise; a
        string that already starts with the BOS text gets none added. add_bos_token=True puts
        BOS first wherever special tokens are added, also with a tokenizer whose special tokens
        hold no BOS (the harness's hf and vllm backends load the tokenizer so)."""
        if not string:
            return []
        strings = [string] if isinstance(string, str) else list(string)
        bos_text = self.tokenizer.decode([self.prefix_token_id])
        out = []
        for s in strings:
            kw = dict(kwargs)
            if add_special_tokens is not None:
                kw["add_special_tokens"] = add_special_tokens
            elif bos_text and s.startswith(bos_text):
                kw["add_special_tokens"] = False
            elif self.add_bos_token is not None:
                kw["add_special_tokens"] = self.add_bos_token
            ids = self.tokenizer(s, **kw)["input_ids"]
            if self.add_bos_token and kw.get("add_special_tokens") and ids[:1] != [self.tokenizer.bos_token_id]:
                ids = [self.tokenizer.bos_token_id] + ids
            out.append(ids)
        return out[0] if isinstance(string, str) else out

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the tokenizer's chat template; a template that rejects a
        system message gets the conversation without it (as the vLLM backend does)."""
        import jinja2

        kw = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                  continue_final_message=not add_generation_prompt)
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kw)
        except jinja2.exceptions.TemplateError:
            logger.warning("the chat template failed; retrying without the system message")
            return self.tokenizer.apply_chat_template([m for m in chat_history if m["role"] != "system"], **kw)

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: (cache_key, context_ids, continuation_ids) triples; the context is never
        empty. Returns (sum of the continuation's logprobs, whether it is the greedy one)."""
        max_ids = self.max_length - 1  # the engine keeps room for one generated token
        prompts, ctx_lens, cut = [], [], 0
        for _, ctx, cont in requests:
            ids = (list(ctx) + list(cont))[-max_ids:]
            ctx_len = len(ids) - len(cont)
            if ctx_len < 1:
                raise ValueError(f"a continuation of {len(cont)} tokens does not fit max_length {self.max_length} "
                                 "with one token of context")
            cut += len(ctx) > ctx_len
            prompts.append(ids)
            ctx_lens.append(ctx_len)
        if cut:
            logger.warning("%d of %d requests exceed max_length %d: their contexts are cut from the left",
                           cut, len(requests), self.max_length)

        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)  # stays for empty continuations
        todo = [i for i in range(len(requests)) if len(prompts[i]) > ctx_lens[i]]
        # longest first, so that requests of one call are alike and the slowest start first
        todo.sort(key=lambda i: -len(prompts[i]))
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        outs = self._generate([{"prompt_token_ids": prompts[i]} for i in todo], [params] * len(todo),
                              _AUTO_SCORE_CHUNK, disable_tqdm, "Running loglikelihood requests")
        for i, out in zip(todo, outs):
            results[i] = _continuation_score(prompts[i], out.prompt_logprobs, ctx_lens[i])
        for req, result in zip(requests, results):
            if req[0] is not None:  # rolling windows are cached per text, by loglikelihood_rolling
                self.cache_hook.add_partial("loglikelihood", req[0], result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, from windows of at most max_length tokens that
        each predict new tokens only (the first conditions on the prefix token)."""
        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 2, context_len=1)):  # -1 context, -1 generated
                windows.append((None, ctx, cont))
                owner.append(n)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for n, (lp, _) in zip(owner, scores):
            totals[n] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id]) or (self.tokenizer.eos_token or "")
        prompts, params, untils, cut = [], [], [], 0
        for context, gen_kwargs in (req.args for req in requests):
            p, until = self._sampling_params(gen_kwargs, eos)
            ids = self.tok_encode(context)
            room = self.max_length - p.max_tokens
            if len(ids) > room:
                cut += 1
                ids = ids[-room:] if self.truncation_side == "left" else ids[:room]
            prompts.append({"prompt_token_ids": ids})
            params.append(p)
            untils.append(until)
        if cut:
            logger.warning("%d of %d contexts + max_gen_toks exceed max_length %d: cut from the %s",
                           cut, len(requests), self.max_length, self.truncation_side)

        outs = self._generate(prompts, params, len(prompts), disable_tqdm, "Running generate_until requests")
        res = []
        for out, until, req in zip(outs, untils, requests):
            res.append(_cut_at_stops(out.outputs[0].text, until))
            self.cache_hook.add_partial("generate_until", req.args, res[-1])
        return res

    def _generate(self, prompts: list, params: list, auto_chunk: int, disable_tqdm: bool, desc: str) -> list:
        """RequestOutputs of the prompts, in order: `batch_size` requests per generate() call, or
        auto_chunk when it is "auto" (the engine then shows its own progress bar)."""
        if self.batch_size == "auto":
            chunk, bar = max(auto_chunk, 1), None
        else:
            chunk, bar = self.batch_size, tqdm(total=len(prompts), disable=disable_tqdm, desc=desc)
        outs = []
        for start in range(0, len(prompts), chunk):
            outs += self.model.generate(prompts[start : start + chunk], params[start : start + chunk],
                                        use_tqdm=bar is None and not disable_tqdm)
            if bar is not None:
                bar.update(len(outs) - bar.n)
        if bar is not None:
            bar.close()
        return outs

    def _sampling_params(self, gen_kwargs: dict, eos: str) -> tuple[SamplingParams, list[str]]:
        """gen_kwargs of a task (until, max_gen_toks or an alias, do_sample, temperature, ...) as
        SamplingParams and the stop strings. Greedy unless do_sample or a temperature says
        otherwise; do_sample=True without a temperature samples at 1 (as transformers does)."""
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"gen_kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kw = dict(gen_kwargs)
        until = kw.pop("until", None)
        until = [] if until is None else [until] if isinstance(until, str) else list(until)
        if eos and eos not in until:
            until.append(eos)
        max_tokens = self.max_gen_toks
        for key in _MAX_TOKEN_KEYS:
            if kw.get(key) is not None:
                max_tokens = int(kw[key])
                break
        for key in _MAX_TOKEN_KEYS:
            kw.pop(key, None)
        if max_tokens >= self.max_length:
            raise ValueError(f"max_gen_toks {max_tokens} leaves no room for a prompt within max_length "
                             f"{self.max_length}: lower max_gen_toks (model_args or gen_kwargs) or raise max_model_len")
        do_sample = kw.pop("do_sample", None)
        temperature = kw.pop("temperature", None)
        if do_sample is False or (do_sample is None and temperature is None):
            temperature = 0.0
        elif temperature is None:
            temperature = 1.0
        sp = {"skip_special_tokens": False}  # the harness's vLLM backend keeps special tokens
        sp.update({k: kw.pop(k) for k in _SAMPLING_KEYS if k in kw})
        if kw:
            logger.warning("mambaserve ignores gen_kwargs %s", sorted(kw))
        # Stop strings are checked by the engine too, so a completion stops as soon as one shows.
        stops = [s for s in until if s]
        return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), stop=stops, **sp), until


def _continuation_score(ids: list[int], prompt_logprobs: list, ctx_len: int) -> tuple[float, bool]:
    """Sum of the logprobs of ids[ctx_len:] and whether each was the most likely token.
    prompt_logprobs[j] maps token id -> Logprob at position j (None at position 0)."""
    total, greedy = 0.0, True
    for tok, d in zip(ids[ctx_len:], prompt_logprobs[ctx_len:]):
        lp = d[tok].logprob
        total += lp
        if greedy and max(x.logprob for x in d.values()) > lp:
            greedy = False
    return total, greedy


def _cut_at_stops(text: str, until: list[str]) -> str:
    """The text before the first occurrence of any stop string (the harness's rule)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def _engine_device(device: str | None) -> str:
    """lm_eval's --device ("cuda:0" by default on its command line, "cuda", "cpu", None) as the
    engine's device option. Without a GPU, a CUDA device falls back to the CPU with a warning:
    the command line asks for cuda:0 whether or not the user did."""
    if device is None:
        return "auto"
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            logger.warning("device=%s but no CUDA device is available: running on the CPU", device)
            return "cpu"
        if device not in ("cuda", "cuda:0"):
            logger.warning("mambaserve runs on the current CUDA device; choose it with CUDA_VISIBLE_DEVICES "
                           "(ignoring device=%s)", device)
        return "cuda"
    if device == "cpu":
        return "cpu"
    raise ValueError(f"mambaserve runs on 'cuda' or 'cpu', got device={device!r}")
