"""The flags of `mambaserve serve`: vLLM's names and meanings (`vllm serve`), besides the engine
flags of `engine.arg_utils`. Only argparse: what the flags do is `server.build_server`'s.

Flags accepted for vLLM command lines that change nothing here say so in their help (and
`--disable-log-requests` is the default already); flags we cannot honour are refused in
`server.build_server` with the reason.
"""

from __future__ import annotations

import argparse
import json
import os

from mambaserve.engine.arg_utils import add_engine_args
from mambaserve.entrypoints.async_engine import DEFAULT_MAX_BACKLOG_TOKENS
from mambaserve.entrypoints.http_middleware import DEFAULT_BODY_READ_TIMEOUT, DEFAULT_MAX_BODY_BYTES
from mambaserve.entrypoints.http_protocol import DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE_TIMEOUT
from mambaserve.entrypoints.tool_parsers import PARSERS as TOOL_PARSERS


def _json_list(text: str) -> list[str]:
    """vLLM's form of --allowed-origins/methods/headers: a JSON list (a bare word is one item)."""
    try:
        value = json.loads(text)
    except ValueError:
        return [text]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Add the model positional, the engine flags and the "server" group to `p`."""
    p.add_argument("model_tag", nargs="?", default=None, help="checkpoint directory or model id (same as --model)")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--uds", default=None, help="serve on this Unix domain socket instead of --host/--port")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) clients send; the first is the one reported (default: --model as given)")
    g.add_argument("--api-key", default=os.environ.get("MAMBASERVE_API_KEY") or os.environ.get("VLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $MAMBASERVE_API_KEY, else $VLLM_API_KEY)")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"],
                   help='CORS: origins a browser may call from, as JSON (default ["*"])')
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], help='CORS: methods (default ["*"])')
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], help='CORS: request headers (default ["*"])')
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--root-path", default=None, help="the path prefix a proxy serves this app under (ASGI root_path)")
    g.add_argument("--ssl-keyfile", default=None, help="HTTPS: the private key file")
    g.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate file")
    g.add_argument("--ssl-ca-certs", default=None, help="HTTPS: CA certificates to verify clients with")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, help="HTTPS: whether client certificates are required "
                                                               "(ssl.CERT_NONE 0, CERT_OPTIONAL 1, CERT_REQUIRED 2)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, replacing the tokenizer's")
    g.add_argument("--response-role", default="assistant", help="the role of chat replies (default assistant)")
    g.add_argument("--enable-log-requests", action="store_true", help="log each request (prompt sizes, parameters)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="do not log requests: the default already (kept for vLLM command lines)")
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="most waiting sequences (n=4 counts 4; prompts x n for a list of prompts): a "
                        "request that would pass it gets 503, one that alone would gets 400 (default: unbounded)")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    g.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT,
                   help="seconds a request's whole body may take to arrive (408 after; default %(default)g)")
    g.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                   help="seconds a request's headers may take to arrive (408 after; default %(default)g)")
    g.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_KEEP_ALIVE_TIMEOUT,
                   help="seconds an idle keep-alive connection stays open (default %(default)g: longer than the "
                        "openai/httpx clients' 5 s, so a client never reuses a connection as it closes; behind a "
                        "load balancer, longer than its idle timeout)")
    g.add_argument("--max-stream-backlog-tokens", type=int, default=DEFAULT_MAX_BACKLOG_TOKENS,
                   help="generated tokens a streaming client may leave unread before it is dropped and its "
                        "request aborted (default %(default)d)")
    g.add_argument("--tokenize-requires-api-key", action="store_true",
                   help="with --api-key, /tokenize and /detokenize need the key too (default: open, as in vLLM)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": find the calls in replies with --tool-call-parser')
    g.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                   help="the format of the model's tool calls (granite: Granite 4.0's <tool_call> JSON)")
    g.add_argument("--structured-outputs-config", default=None,
                   help='defaults for constrained requests, as JSON: {"disable_any_whitespace": true, '
                        '"disable_additional_properties": true, "backend": "xgrammar"}')


def served_model_names(args: argparse.Namespace) -> list[str]:
    """--served-model-name, else a local folder's name (`demo-model` for the bundled model), else
    the Hugging Face model id as given (as vLLM names it)."""
    if args.served_model_name:
        return list(args.served_model_name)
    model = args.model
    return [os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model]


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a template. Raises
    ValueError for neither (a path that does not exist, most likely)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
