"""Structured outputs: completions constrained to a JSON schema, any JSON object, a regex, a
choice among strings or an EBNF grammar (`StructuredOutputsParams`), by masking the logits of
the constrained sequences at every step.

The grammar engine is xgrammar (https://github.com/mlc-ai/xgrammar), chosen over llguidance
because it compiles a grammar once into a cache of token masks per parser state (adaptive token
masks: most of the vocabulary is decided at compile time, so a step's mask costs microseconds),
fills the masks of a whole batch on host threads in one call (`BatchGrammarMatcher`), applies
them to logits on the device with its own kernel, and takes vLLM's request formats (JSON
schema, regex, EBNF, builtin JSON) as they are: vLLM's default backend is the same.

- `grammar.py`: the compiler (the tokenizer's vocabulary as xgrammar sees it, compiled grammars
  cached by constraint) and the translation of each kind of constraint into a grammar.
- `mambaserve/engine/structured_outputs.py` (the engine's side, beside the sequences it reads):
  a matcher per constrained sequence, the batched mask of a step applied to the logits rows
  that need it, each sampled token advancing its matcher.

xgrammar is imported on first use only: an engine serves unconstrained requests without it,
and a constrained request without it is a ValueError that says how to install it.
This package knows nothing about the engine, the scheduler, the model or HTTP.
"""

from mambaserve.structured_outputs.grammar import GrammarCompiler

__all__ = ["GrammarCompiler"]
