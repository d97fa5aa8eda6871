"""From a `StructuredOutputsParams` to an xgrammar compiled grammar, over the engine's tokenizer.

The tokenizer's vocabulary is given to xgrammar once, padded to the width of the model's logits
(ids the tokenizer lacks are never allowed), with the engine's end-of-sequence ids as the stop
tokens: a matcher allows them exactly where the constraint is complete, so EOS ends a
constrained completion only once its text is whole. Compiled grammars are cached by xgrammar
(keyed by the constraint's text): a schema sent again costs a lookup. Compiling is thread-safe,
so a server can compile (and refuse a bad schema) outside the engine's thread first.
"""

from __future__ import annotations

import json
import re
import threading

from mambaserve.sampling_params import StructuredOutputsParams

INSTALL_HINT = "structured outputs need the xgrammar package: pip install 'mambaserve[structured]'"

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ": keep the reason only
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def import_xgrammar():
    """The xgrammar module, or ValueError with the install hint when it is missing."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT} ({e})") from None
    return xgrammar


def _reason(e: Exception) -> str:
    return _CPP_PREFIX.sub("", str(e)).strip() or type(e).__name__


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the given strings (each a JSON-escaped literal,
    which xgrammar's EBNF reads with the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_LARK_RULE = re.compile(r"\??([A-Za-z_]\w*)\s*:(?!:=)(.*)")
_LITERAL = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'")  # a "..." or '...' literal


def lark_to_ebnf(grammar: str) -> str:
    """A grammar in Lark's notation as xgrammar's EBNF, which vLLM also takes for `grammar`: rules
    `name: ...` (`?name` too), alternatives continued on lines that start with `|`, `[x]` for an
    optional x, 'single-quoted' literals, `-> alias` dropped, `//` comments; the root is the rule
    `start`, else the first. A grammar with a `::=` is EBNF already and comes back unchanged.
    Regex terminals (/.../) and %import are not translated: xgrammar then refuses them."""
    lines = [re.sub(r"\s*//.*$", "", line).strip() for line in grammar.splitlines()]
    if any("::=" in line for line in lines):
        return grammar
    rules: list[list[str]] = []  # [name, body] in order
    for line in filter(None, lines):
        m = _LARK_RULE.fullmatch(line)
        if m:
            rules.append([m.group(1), m.group(2)])
        elif line.startswith("|") and rules:
            rules[-1][1] += " " + line
        else:
            raise ValueError(f"not a Lark rule: {line!r}")
    names = [name for name, _ in rules]
    root = "start" if "start" in names else names[0] if names else None
    out = [f"root ::= {root}"] if root not in (None, "root") else []
    return "\n".join(out + [f"{name} ::= {_lark_body(body)}" for name, body in rules])


def _lark_body(body: str) -> str:
    """One Lark rule body in EBNF: literals double-quoted, [x] as (x)?, aliases dropped."""
    parts, last = [], 0
    for m in _LITERAL.finditer(body):
        parts.append(re.sub(r"->\s*\w+", "", body[last:m.start()]).replace("[", "(").replace("]", ")?"))
        lit = m.group()
        parts.append(lit if lit[0] == '"' else '"' + lit[1:-1].replace("\\'", "'").replace('"', '\\"') + '"')
        last = m.end()
    parts.append(re.sub(r"->\s*\w+", "", body[last:]).replace("[", "(").replace("]", ")?"))
    return "".join(parts).strip()


def dot_excludes_newline(pattern: str) -> str:
    """The regex with every `.` outside a character class written `[^\\n]`. xgrammar's `.`
    matches any character, a newline too, where Python's re matches anything but a newline
    (without DOTALL, a flag xgrammar does not take): `.    return` let a completion open with a
    newline that re.fullmatch then refuses. Escapes and classes are kept as written."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":  # xgrammar has no "[]...]": a "]" ends any class it is in
            in_class = True
        elif c == ".":
            c = r"[^\n]"
        out.append(c)
        i += 1
    return "".join(out)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and logits width; thread-safe, lazily built.

    tokenizer: a transformers tokenizer (None: every compile raises ValueError).
    vocab_size: the model's logits width (>= the tokenizer's length; padding ids are banned).
    stop_token_ids: the engine's end-of-sequence ids, allowed where a constraint is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self._compiler = None
        self._lock = threading.Lock()

    @property
    def xgr(self):
        return import_xgrammar()

    def _get(self):
        """xgrammar's GrammarCompiler, built on first use (reading the vocabulary takes a while
        for 100k-token tokenizers)."""
        if self._compiler is None:
            with self._lock:
                if self._compiler is None:
                    xgr = import_xgrammar()
                    if self.tokenizer is None:
                        raise ValueError("structured outputs need a tokenizer (this engine runs with "
                                         "skip_tokenizer_init=True)")
                    if not self.stop_token_ids:
                        raise ValueError("structured outputs need an end-of-sequence token id (the model "
                                         "config and the tokenizer name none)")
                    info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                              stop_token_ids=self.stop_token_ids)
                    self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The xgrammar CompiledGrammar of `params`. Raises ValueError with the grammar engine's
        reason when the schema, regex or grammar does not compile (or xgrammar is missing)."""
        compiler = self._get()
        kind = params.kind
        try:
            if kind == "json" or kind == "json_object":
                schema = params.json if kind == "json" else {"type": "object"}
                text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
                # strict_mode (the default) already forbids properties a schema does not list
                # unless it allows them: what disable_additional_properties asks for
                return compiler.compile_json_schema(text, any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(dot_excludes_newline(params.regex))
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(lark_to_ebnf(params.grammar))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and kinds of its own
            raise ValueError(f"structured_outputs.{kind} does not compile: {_reason(e)}") from None
