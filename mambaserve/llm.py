"""The offline API: `LLM(model).generate(prompts, sampling_params)` and `.chat(messages)`, as in vLLM.

It drives the engine's `step()` until every request is done and returns outputs in input
order. Same loop as the server and the benchmarks.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from mambaserve.chat import render_chat
from mambaserve.config import EngineConfig
from mambaserve.engine.llm_engine import LLMEngine
from mambaserve.outputs import RequestOutput
from mambaserve.sampling_params import SamplingParams


class LLM:
    """An engine for offline generation.

    model: checkpoint directory (default: the bundled demo model) or a config .json with
    load_format="dummy". Other keyword arguments are `EngineConfig` fields (dtype, load_format,
    max_model_len, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, seed,
    enforce_eager, skip_tokenizer_init, revision, download_dir, max_logprobs, generation_config,
    ...): a model may be a Hugging Face model id (`mambaserve.hub`). disable_log_stats is True
    unless given, as in vLLM's LLM. Raises ValueError for bad options, TypeError for unknown
    keywords.
    """

    def __init__(self, model: str | None = None, **kwargs):
        if model is not None:
            kwargs["model"] = model
        kwargs.setdefault("disable_log_stats", True)
        self.llm_engine = LLMEngine(EngineConfig(**kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an already validated EngineConfig (used by the CLI)."""
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine(config)
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every prompt prefix cached so far (KV blocks and state checkpoints), as vLLM's
        `LLM.reset_prefix_cache`: later requests compute their prompts anew (a benchmark's cold
        start). Returns False, and forgets nothing, while requests run (never between `generate`
        calls); True with prefix caching off (nothing to forget)."""
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults of the checkpoint's generation_config.json (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), as vLLM's; plain
        SamplingParams() with generation_config="vllm" or none set. `generate` and `chat` use
        it when given no sampling params."""
        from mambaserve.engine.input_processor import generation_config_folder, generation_sampling_defaults

        return SamplingParams(**generation_sampling_defaults(generation_config_folder(self.llm_engine.config)))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or to each of a list of them.

        messages: a conversation ([{"role": "user", "content": "..."}, ...]) or a list of
        conversations. Each is rendered with the model's chat template (`mambaserve.chat.render_chat`,
        the same text as the server's /v1/chat/completions), or with `chat_template` (a Jinja
        template, as vLLM's argument) instead, and tokenized without adding special tokens
        again; tools (OpenAI tool definitions) and documents go to the template. To make
        the reply a call, constrain it with `SamplingParams(structured_outputs=...)`. The other
        arguments are as in `generate` and `render_chat`. Returns one RequestOutput per
        conversation, in input order, whose `prompt` is the rendered text.
        Raises ValueError for a bad conversation (nothing is queued then), as `render_chat` does.
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a conversation (a list of message dicts) or a list of them")
        conversations = messages if isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = render_chat(tokenizer, conversation, chat_template=chat_template,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               chat_template_kwargs=chat_template_kwargs, tools=tools, documents=documents)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate(
        self,
        prompts: str | dict | list,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for a prompt or a list of prompts (strings, token-id lists, or
        {"prompt_token_ids": [...]} dicts). One SamplingParams for all or one per prompt.
        Returns one RequestOutput per prompt, in input order. Raises ValueError for a bad prompt
        or parameter; then no request of this call is left in the engine."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(None, prompt, p, final_only=True))
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]
