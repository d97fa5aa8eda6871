"""Train the small demo model that ships in ``mambaserve/assets/demo-model/``.

What it does: trains, from scratch and in one go, a byte-level BPE tokenizer and a tiny
``GraniteMoeHybridForCausalLM`` (Mamba2 layers with two NoPE attention layers among them, a small
top-2 MoE plus a shared expert in every layer, tied embeddings), evaluates its held-out
perplexity, and writes a Hugging Face checkpoint (config.json, model.safetensors in float32,
generation_config.json, tokenizer.json, tokenizer_config.json with a chat template) and a model
card (README.md) to ``--out``. The model is a demo: it writes Python-looking text and is useful
for nothing else. It exists so that mambaserve runs out of the box, and so that the engine can be
checked against ``transformers`` on a model whose next-token distributions are sharp.

Corpus: the ``.py`` files of the running interpreter's own standard library (found through
``sysconfig.get_paths()["stdlib"]``), without test suites, idlelib, site-packages and generated
files (codec tables, Sphinx dumps). The files in ``HELD_OUT`` and ``VALIDATION`` are never trained
on, neither by the tokenizer nor by the model: held-out perplexity is measured on the first, the
checkpoint is picked on the second. Paths are sorted and every
random choice is seeded, so a rerun on the same Python and library versions sees the same data.
Bit-for-bit equal weights are only promised on CPU (CUDA reductions are not deterministic).

How to run (from the repository root)::

    python tools/train_demo_model.py --device cuda --out /tmp/demo-model   # the shipped recipe
    python tools/train_demo_model.py --device cpu --steps 20 --out /tmp/demo-smoke   # smoke test

``--steps N`` fixes the number of optimizer steps (and so the cosine schedule). With only
``--max-minutes``, the script times steps 10 to 40 and then fixes the step count that fits the
budget; the model card records that count, so ``--steps`` replays the schedule.

Runtime: about 2 minutes on one H200 (1.6 minutes of training, about 900 steps, plus 10 to 20
seconds of tokenizer training, evaluation and saving). On 2 CPU cores a step of 32 x 512 tokens
takes about 10 s, so the full recipe takes hours there; use ``--steps`` for a smoke test.

Why so short: the corpus (about 2.2 M tokens for Python 3.12) is smaller than the model (4 M
parameters). Validation loss bottoms out after about 7 passes over it; a 4-minute run (19
passes, no dropout) ended with training loss 1.15 and validation loss 4.19, its best checkpoint
giving held-out perplexity 47. Hence the training-only dropout, a schedule that ends near that
point, and keeping the checkpoint with the lowest validation loss.

The Mamba2 layers of ``transformers`` have no fast kernel installed here, so they run its
plain-PyTorch chunked scan. For training only, this script swaps that scan for an equivalent
einsum formulation (checked against the library's own at start-up, forward and backward), which
materializes no (chunk x chunk x state) broadcast products; evaluation and generation use the
library's code unchanged.
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import re
import sysconfig
import time
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.models.granitemoehybrid import modeling_granitemoehybrid

# Files by path relative to the stdlib root; all exist in Python 3.10 to 3.13. HELD_OUT measures
# the reported perplexity; VALIDATION picks the checkpoint (lowest loss). Neither is trained on.
HELD_OUT = (
    "bisect.py",
    "colorsys.py",
    "fractions.py",
    "graphlib.py",
    "heapq.py",
    "sched.py",
    "shlex.py",
    "textwrap.py",
)
VALIDATION = ("calendar.py", "fnmatch.py", "glob.py", "netrc.py", "tabnanny.py")
EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "pydoc_data", "__pycache__"}
MAX_FILE_BYTES = 300_000
GENERATED = re.compile(r"auto-?generated|automatically generated|file is generated|generated from", re.I)

EOS = "<|endoftext|>"
SPECIAL_TOKENS = (EOS, "<|user|>", "<|assistant|>", "<|system|>")
# Each message is "<|role|>\n{content}<|endoftext|>\n"; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|endoftext|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)
SAMPLE_PROMPT = "def fibonacci(n):"


# ----------------------------------------------------------------------------- corpus


def collect_corpus() -> tuple[Path, dict[str, list[str]]]:
    """Return the stdlib root and the texts of its "train", "validation" and "held_out" files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    splits = {"train": [], "validation": [], "held_out": []}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if EXCLUDED_DIRS.intersection(parts[:-1]) or parts[0].startswith("config-"):
            continue
        if parts[-1].startswith("_sysconfigdata"):  # describes the build machine, not Python
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        # Generated files (codec tables, token.py, keyword.py) say so in their first lines.
        if GENERATED.search(text[:400]) or not text.strip():
            continue
        split = "held_out" if rel in HELD_OUT else "validation" if rel in VALIDATION else "train"
        splits[split].append(text)
    if len(splits["held_out"]) != len(HELD_OUT) or len(splits["validation"]) != len(VALIDATION):
        raise SystemExit(f"some held-out or validation files are missing from {root}")
    return root, splits


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style pre-tokenization) with the special tokens at ids 0..3."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Concatenate files as `<|endoftext|> file <|endoftext|> file ...`: (num_tokens,) int64."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(eos)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- model


def build_config(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> GraniteMoeHybridConfig:
    hidden, n_heads = args.hidden_size, 6
    head_dim = hidden // n_heads
    layer_types = ["mamba", "mamba", "mamba", "attention"] * (args.num_layers // 4)
    eos = tokenizer.eos_token_id
    return GraniteMoeHybridConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=n_heads,
        num_key_value_heads=2,
        attention_multiplier=1.0 / head_dim,
        position_embedding_type="nope",
        max_position_embeddings=2048,
        intermediate_size=args.expert_size,
        num_local_experts=args.num_experts,
        num_experts_per_tok=2,
        shared_intermediate_size=args.shared_size,
        router_aux_loss_coef=args.aux_loss_coef,
        mamba_n_heads=2 * hidden // args.mamba_d_head,
        mamba_d_head=args.mamba_d_head,
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        embedding_multiplier=6.0,
        residual_multiplier=0.5,
        logits_scaling=2.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def einsum_chunk_scan(original):
    """The library's `mamba2_chunk_scan`, reformulated with einsums; used only while training.

    Same arguments and result as the original: hidden_states: (b, t, h, p), dt: (b, t, h), A: (h,),
    B, C: (b, t, g, n), D: (h,) -> (b, t, h, p) float32. Calls needing a carried state or a final
    state (inference with a cache) go to the original.
    """

    def scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
             dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **kwargs):
        if initial_states is not None or return_final_states or z is not None:
            return original(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                            initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                            return_final_states=return_final_states, **kwargs)
        # The library computes this scan in float32; autocast would turn the einsums into bf16.
        with torch.autocast(device_type=hidden_states.device.type, enabled=False):
            x = hidden_states.float()
            b, t, h, p = x.shape
            dt = dt.float()
            if dt_bias is not None:
                dt = dt + dt_bias.float()
            if dt_softplus:
                dt = F.softplus(dt)
            dt = dt.clamp(dt_limit[0], dt_limit[1])  # (b, t, h)
            Bh = B.float().repeat_interleave(h // B.shape[2], dim=2)  # (b, t, h, n)
            Ch = C.float().repeat_interleave(h // C.shape[2], dim=2)
            pad = (-t) % chunk_size
            # Padded steps have dt = 0: no input and no decay, so they change nothing before them.
            xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))
            log_a = F.pad(A.float() * dt, (0, 0, 0, pad))
            Bh, Ch = F.pad(Bh, (0, 0, 0, 0, 0, pad)), F.pad(Ch, (0, 0, 0, 0, 0, pad))
            c, l, n = (t + pad) // chunk_size, chunk_size, Bh.shape[-1]
            xdt = xdt.view(b, c, l, h, p)
            Bc, Cc = Bh.view(b, c, l, h, n), Ch.view(b, c, l, h, n)
            cum = log_a.view(b, c, l, h).cumsum(dim=2)  # (b, c, l, h)

            # Within a chunk: y[i] = sum_{j<=i} exp(cum[i] - cum[j]) (C[i].B[j]) xdt[j].
            causal = torch.ones(l, l, dtype=torch.bool, device=x.device).tril()[:, :, None]
            seg = (cum[:, :, :, None, :] - cum[:, :, None, :, :]).masked_fill(~causal, -math.inf)
            scores = torch.einsum("bcihn,bcjhn->bcijh", Cc, Bc) * seg.exp()  # (b, c, l, l, h)
            y = torch.einsum("bcijh,bcjhp->bcihp", scores, xdt)

            # Each chunk's own contribution to the state at its end: (b, c, h, p, n).
            to_end = (cum[:, :, -1:, :] - cum).exp()
            states = torch.einsum("bcjhn,bcjh,bcjhp->bchpn", Bc, to_end, xdt)
            # State entering chunk k = sum_{m<k} exp(total decay of chunks m+1..k-1) states[m].
            chunk_cum = cum[:, :, -1, :].cumsum(dim=1)  # (b, c, h)
            before = F.pad(chunk_cum, (0, 0, 1, 0))[:, :-1]  # cumulative decay before chunk k
            strict = torch.ones(c, c, dtype=torch.bool, device=x.device).tril(-1)[:, :, None]
            carry = (before[:, :, None, :] - chunk_cum[:, None, :, :]).masked_fill(~strict, -math.inf)
            entering = torch.einsum("bkmh,bmhpn->bkhpn", carry.exp(), states)
            y = y + torch.einsum("bcihn,bchpn,bcih->bcihp", Cc, entering, cum.exp())

            y = y.reshape(b, c * l, h, p)[:, :t]
            if D is not None:
                y = y + x * D.float()[:, None]
        return y

    return scan


def check_scan(fast, original) -> float:
    """Max relative difference between `fast` and `original` (outputs and input gradients)."""
    g = torch.Generator().manual_seed(0)
    b, t, h, p, n, chunk = 2, 75, 4, 8, 16, 16  # t not a multiple of the chunk size on purpose
    leaves = [
        torch.randn(b, t, h, p, generator=g),
        torch.randn(b, t, h, generator=g),
        -torch.rand(h, generator=g) - 0.5,
        torch.randn(b, t, 1, n, generator=g),
        torch.randn(b, t, 1, n, generator=g),
        torch.randn(h, generator=g),
        torch.randn(h, generator=g),
    ]
    results = []
    for fn in (fast, original):
        inputs = [x.clone().requires_grad_() for x in leaves]
        x, dt, A, B, C, D, dt_bias = inputs
        y = fn(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), inputs)
        results.append([y, *grads])
    return max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(*results))


class RouterBalance:
    """Switch-style load-balancing loss for every MoE router, gathered with forward hooks.

    Recomputes the router logits from each MoE block's input, so it does not depend on how a
    given `transformers` version returns or records them.
    """

    def __init__(self, model: torch.nn.Module, top_k: int):
        self.top_k, self.losses, self.usage = top_k, [], None
        self.moe_blocks = [m for m in model.modules() if type(m).__name__ == "GraniteMoeHybridMoE"]
        for block in self.moe_blocks:
            block.register_forward_hook(self._hook)

    def _hook(self, block, inputs, output):
        if not torch.is_grad_enabled():
            return
        x = inputs[0].reshape(-1, inputs[0].shape[-1])  # (tokens, hidden)
        logits = F.linear(x, block.router.weight).float()  # (tokens, experts)
        num_experts = logits.shape[-1]
        chosen = F.one_hot(logits.topk(self.top_k, dim=-1).indices, num_experts).sum(1).float()
        fraction = chosen.mean(0) / self.top_k  # share of routed slots per expert
        self.losses.append(num_experts * (fraction * logits.softmax(-1).mean(0)).sum())
        usage = fraction.detach()
        self.usage = usage if self.usage is None else self.usage + usage

    def pop_loss(self) -> torch.Tensor:
        loss = torch.stack(self.losses).mean()
        self.losses = []
        return loss


def add_dropout(model: torch.nn.Module, p: float) -> None:
    """Dropout on the embeddings and on every mixer and MLP output, active in training only.

    GraniteMoeHybrid has no residual dropout of its own; the stdlib corpus has fewer tokens than
    the model has parameters, so without it the model starts memorizing after a few passes.
    """

    def hook(module, inputs, output):
        if not module.training or p == 0:
            return output
        if isinstance(output, tuple):  # attention returns (output, weights)
            return (F.dropout(output[0], p, training=True), *output[1:])
        return F.dropout(output, p, training=True)

    for name, module in model.named_modules():
        if name.endswith(("embed_tokens", ".mamba", ".self_attn", ".block_sparse_moe", ".shared_mlp")):
            module.register_forward_hook(hook)


# ----------------------------------------------------------------------------- train / eval


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens: (batch, seq_len + 1)."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def held_out_nll(model, stream: torch.Tensor, seq_len: int, device: str, autocast: bool,
                 batch: int = 16) -> tuple[float, int]:
    """Mean token NLL over non-overlapping windows of `stream` (each predicts seq_len tokens)."""
    was_training = model.training
    model.eval()
    windows = [stream[s : s + seq_len + 1] for s in range(0, len(stream) - 1, seq_len)]
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        group = windows[i : i + batch]
        width = max(len(w) for w in group)
        ids = torch.full((len(group), width), -100, dtype=torch.long)
        for row, w in enumerate(group):
            ids[row, : len(w)] = w
        ids = ids.to(device)
        inputs, labels = ids[:, :-1].clamp(min=0), ids[:, 1:]
        # Short rows are padded at the end; causality keeps real tokens from seeing the padding.
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=inputs, use_cache=False).logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                              ignore_index=-100, reduction="sum")
        total += nll.item()
        count += int((labels != -100).sum())
    model.train(was_training)
    return total / count, count


def greedy_sample(model, tokenizer, device: str, max_new_tokens: int = 40) -> str:
    ids = tokenizer(SAMPLE_PROMPT, return_tensors="pt").input_ids.to(device)
    model.eval()
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=False)


def write_model_card(path: Path, info: dict) -> None:
    held = ", ".join(f"`{name}`" for name in HELD_OUT)
    valid = ", ".join(f"`{name}`" for name in VALIDATION)
    cut = ""
    if info["steps"] != info["planned_steps"]:
        cut = f" over {info['planned_steps']} planned steps; the time budget ended the run early"
    text = f"""# mambaserve demo model

A tiny hybrid Mamba2 / attention mixture-of-experts language model (`GraniteMoeHybridForCausalLM`,
{info['params'] / 1e6:.2f} M parameters) that ships with mambaserve as its default model.

**This is a demo model, not useful for anything real.** It was trained for a few minutes on the
Python standard library's source code, so it writes Python-looking text and little else. It exists so
that mambaserve runs out of the box on a machine with no network, and as a correctness check for the
engine against `transformers`: a trained model has sharp next-token distributions, where random
weights have flat ones. It was never trained on chat data: the chat template works, but answers will
be Python-flavoured noise.

## Architecture
- {info['num_layers']} layers, hidden size {info['hidden_size']}: {info['layer_summary']}
  (`layer_types` in config.json uses the transformers 5 names: `linear_attention` is a Mamba2
  layer, `full_attention` an attention layer).
- Mamba2 layers: {info['mamba_heads']} heads of dim {info['mamba_d_head']}, state size
  {info['mamba_d_state']}, 1 group, conv width 4, expand 2, chunk size {info['mamba_chunk']}.
- Attention layers: {info['attn_heads']} query heads, {info['kv_heads']} KV heads, head dim
  {info['head_dim']}, no positional encoding (NoPE), `attention_multiplier` = 1/{info['head_dim']}.
- Every layer: top-{info['top_k']} MoE over {info['experts']} experts (expert size
  {info['expert_size']}) plus a shared expert (size {info['shared_size']}).
- `embedding_multiplier` {info['embedding_multiplier']}, `residual_multiplier`
  {info['residual_multiplier']}, `logits_scaling` {info['logits_scaling']}; tied input/output embeddings.
- Tokenizer: byte-level BPE, {info['vocab_size']} tokens, trained on the same files. Special tokens:
  `<|endoftext|>` (id {info['eos_id']}: end of text, also used as BOS and padding), `<|user|>`,
  `<|assistant|>`, `<|system|>`. No BOS is added automatically.
- Weights in float32 (`model.safetensors`).

## Training
- Corpus: the `.py` files of the **Python {info['python']}** standard library (`{info['stdlib']}`),
  without test suites, idlelib, site-packages and generated files: {info['train_files']} files,
  {info['train_tokens'] / 1e6:.2f} M tokens. Files are joined with `<|endoftext|>` and trained on as
  random windows of {info['seq_len']} tokens.
- {info['steps']} steps of AdamW (peak learning rate {info['lr']}, weight decay 0.1, betas
  (0.9, 0.95), {info['warmup']} warm-up steps then cosine to 10%{cut}), batch {info['batch']} x
  {info['seq_len']} tokens: {info['tokens_seen'] / 1e6:.1f} M tokens seen ({info['epochs']:.1f} passes over the corpus).
  Router load-balancing loss with coefficient {info['aux_coef']}; dropout {info['dropout']} on the
  embeddings and on every mixer and MLP output (training only). The weights kept are those of step
  {info['best_step']}, the lowest loss ({info['valid_loss']:.3f}) on the validation files {valid}
  (also never trained on), checked every few hundred steps.
- Training time: {info['train_seconds'] / 60:.1f} minutes on {info['device_name']}
  (bf16 autocast: {info['autocast']}), seed {info['seed']}, torch {info['torch']},
  transformers {info['transformers']}, tokenizers {info['tokenizers']}.
- Final training loss (mean of the last 50 steps): {info['final_loss']:.3f}.

## Evaluation
- Held-out perplexity: **{info['ppl']:.2f}** (token level: exp of the mean next-token NLL over
  {info['eval_tokens']} tokens, non-overlapping {info['seq_len']}-token windows, float32).
- Held-out files (never seen by the tokenizer or the model): {held}.
- Greedy continuation of `{SAMPLE_PROMPT}` (40 new tokens, `transformers` `generate`, float32):

```python
{info['sample']}
```

## Limitations
The training corpus ({info['train_tokens'] / 1e6:.2f} M tokens) is smaller than the model: after a few
passes over it the model memorizes rather than generalizes, which bounds the held-out perplexity.
The model was trained on {info['seq_len']}-token windows; NoPE attention has no position limit, but
quality beyond {info['seq_len']} tokens is untested.

## Reproduce
From the mambaserve repository root, on a machine with the same Python version (on a GPU the
result matches closely but not bit for bit):

```
python tools/train_demo_model.py --device cuda --steps {info['planned_steps']} --warmup {info['warmup']} \\
    --seed {info['seed']} --out mambaserve/assets/demo-model
```
"""
    path.write_text(text, encoding="utf-8")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (fixes the schedule)")
    ap.add_argument("--max-minutes", type=float, default=1.6, help="training budget when --steps is unset")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden-size", type=int, default=192)
    ap.add_argument("--num-layers", type=int, default=8, help="a multiple of 4: 3 Mamba2 layers, then attention")
    ap.add_argument("--mamba-d-head", type=int, default=32)
    ap.add_argument("--num-experts", type=int, default=8)
    ap.add_argument("--expert-size", type=int, default=32)
    ap.add_argument("--shared-size", type=int, default=64)
    ap.add_argument("--aux-loss-coef", type=float, default=0.01)
    ap.add_argument("--dropout", type=float, default=0.1, help="training-only dropout (see add_dropout)")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--no-fast-scan", action="store_true", help="train with the library's own scan")
    return ap.parse_args()


def pick_experts_implementation(model, device: str, autocast: bool) -> str:
    """The first MoE implementation of `transformers` that runs a training step here.

    Grouped GEMMs are fastest but their support for float32 weights under autocast varies with
    the torch version and the device; the per-expert loop ("eager") always works.
    """
    ids = torch.randint(4, model.config.vocab_size, (2, 80))
    for name in ("grouped_mm", "batched_mm", "eager"):
        try:
            model.set_experts_implementation(name)
            with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=ids.to(device), use_cache=False).logits
            logits.float().logsumexp(-1).mean().backward()
            model.zero_grad(set_to_none=True)
            return name
        except Exception as err:  # noqa: BLE001 - any failure means: try the next one
            print(f"experts implementation {name!r} failed here: {type(err).__name__}: {err}")
            model.zero_grad(set_to_none=True)
    raise SystemExit("no experts implementation works on this device")


def train(model, args, train_stream, valid_stream, device: str) -> dict:
    """AdamW + cosine over random windows; returns the best-by-validation state and a log."""
    on_cuda = device.startswith("cuda")
    config = model.config
    balance = RouterBalance(model, config.num_experts_per_tok)
    add_dropout(model, args.dropout)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=on_cuda,
    )
    gen = torch.Generator().manual_seed(args.seed)
    budget = args.max_minutes * 60
    total_steps = args.steps if args.steps else None  # None until calibrated
    calibrate_at = (10, 40)  # with only a budget, time steps [10, 40) to size the schedule
    losses, pending, best = [], [], {"loss": math.inf, "step": 0, "state": None}
    t_train = t_log = time.time()
    t_cal, paused, step = 0.0, 0.0, 0

    model.train()
    while total_steps is None or step < total_steps:
        # Until calibrated (step 40), the schedule is in its warm-up or barely into the cosine.
        lr = lr_at(step, total_steps or 10**9, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = sample_batch(train_stream, args.batch_size, args.seq_len, gen).to(device)  # (B, L + 1)
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=on_cuda):
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits  # (B, L, V)
        lm_loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss = lm_loss + args.aux_loss_coef * balance.pop_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        pending.append(lm_loss.detach())
        step += 1

        if total_steps is None and step in calibrate_at:
            if on_cuda:
                torch.cuda.synchronize()
            if step == calibrate_at[0]:
                t_cal = time.time()
            else:
                per_step = (time.time() - t_cal) / (calibrate_at[1] - calibrate_at[0])
                remaining = budget - (time.time() - t_train - paused)
                total_steps = step + max(1, int(remaining / per_step * 0.97))
                print(f"calibration: {per_step * 1000:.1f} ms/step -> {total_steps} steps in {args.max_minutes} min")
        done = step == total_steps or (not args.steps and time.time() - t_train - paused > budget * 1.02)
        if step % args.log_every == 0 or done:
            values = torch.stack(pending).tolist()
            losses.extend(values)
            rate = len(values) * args.batch_size * args.seq_len / (time.time() - t_log)
            print(f"step {step:5d}/{total_steps or '?'} loss {sum(values) / len(values):.4f} lr {lr:.2e} "
                  f"{rate:,.0f} tok/s t {time.time() - t_train - paused:.0f} s", flush=True)
            pending, t_log = [], time.time()
        if step % args.eval_every == 0 or done:
            t_eval = time.time()
            nll, _ = held_out_nll(model, valid_stream, args.seq_len, device, on_cuda)
            mark = ""
            if nll < best["loss"]:
                best = {"loss": nll, "step": step, "state": copy.deepcopy(model.state_dict())}
                mark = " (best)"
            print(f"  validation loss {nll:.4f} ppl {math.exp(nll):.2f}{mark}", flush=True)
            paused += time.time() - t_eval  # evaluation does not count against the budget
            t_log += time.time() - t_eval
        if done:
            if step != total_steps:
                print(f"budget reached at step {step}, before the planned {total_steps or '?'}")
            break
    if on_cuda:
        torch.cuda.synchronize()
    usage = (balance.usage / step / len(balance.moe_blocks)).tolist()
    return dict(steps=step, planned_steps=total_steps or step, losses=losses, seconds=time.time() - t_train - paused,
                best=best, usage=usage)


def main() -> None:
    args = parse_args()
    if args.num_layers % 4:
        raise SystemExit("--num-layers must be a multiple of 4")
    t_start = time.time()
    torch.manual_seed(args.seed)
    device, on_cuda = args.device, args.device.startswith("cuda")
    if on_cuda:
        torch.set_float32_matmul_precision("high")

    root, splits = collect_corpus()
    print(f"corpus: {root}: " + ", ".join(f"{len(v)} {k} files" for k, v in splits.items()))
    tokenizer = train_tokenizer(splits["train"], args.vocab_size)
    streams = {k: encode_stream(tokenizer, v) for k, v in splits.items()}
    print(f"tokenizer: {len(tokenizer)} tokens; " + ", ".join(f"{k} {len(v):,} tokens" for k, v in streams.items())
          + f" ({time.time() - t_start:.1f} s)")

    config = build_config(tokenizer, args)
    model = GraniteMoeHybridForCausalLM(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters, layer types {config.layer_types}")

    original_scan = modeling_granitemoehybrid.mamba2_chunk_scan
    if not args.no_fast_scan:
        fast_scan = einsum_chunk_scan(original_scan)
        err = check_scan(fast_scan, original_scan)
        print(f"einsum scan vs library scan: max relative difference {err:.2e}")
        if err > 1e-4:
            raise SystemExit("einsum scan disagrees with the library's scan")
        modeling_granitemoehybrid.mamba2_chunk_scan = fast_scan
    experts_impl = pick_experts_implementation(model, device, on_cuda)
    print(f"experts implementation: {experts_impl}")

    run = train(model, args, streams["train"], streams["validation"], device)
    modeling_granitemoehybrid.mamba2_chunk_scan = original_scan
    best = run["best"]
    model.load_state_dict(best["state"])
    print(f"kept the step-{best['step']} weights (validation loss {best['loss']:.4f})")

    # Save first, so that a failure below costs only the model card.
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, do_sample=False, max_new_tokens=128,
    )
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out, save_jinja_files=False)
    for extra in ("special_tokens_map.json", "chat_template.jinja", "added_tokens.json"):
        (args.out / extra).unlink(missing_ok=True)

    # Evaluate and sample in float32 with the library's own code, as a user would load it.
    torch.set_float32_matmul_precision("highest")
    nll, eval_tokens = held_out_nll(model, streams["held_out"], args.seq_len, device, autocast=False)
    ppl = math.exp(nll)
    print(f"held-out perplexity {ppl:.3f} over {eval_tokens} tokens")
    try:
        sample = greedy_sample(model, tokenizer, device)
    except Exception as err:  # noqa: BLE001 - the checkpoint is saved; report and go on
        sample = f"(generation failed: {type(err).__name__}: {err})"
    print(f"greedy sample:\n{sample}\n")

    if on_cuda:
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    steps, losses = run["steps"], run["losses"]
    tokens_seen = steps * args.batch_size * args.seq_len
    info = dict(
        params=params, num_layers=config.num_hidden_layers,
        layer_summary=", ".join("Mamba2" if t in ("mamba", "linear_attention") else "attention"
                                for t in config.layer_types),
        hidden_size=config.hidden_size, mamba_heads=config.mamba_n_heads, mamba_d_head=config.mamba_d_head,
        mamba_d_state=config.mamba_d_state, mamba_chunk=config.mamba_chunk_size,
        attn_heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads, top_k=config.num_experts_per_tok,
        experts=config.num_local_experts, expert_size=config.intermediate_size,
        shared_size=config.shared_intermediate_size, embedding_multiplier=config.embedding_multiplier,
        residual_multiplier=config.residual_multiplier, logits_scaling=config.logits_scaling,
        vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id,
        python=platform.python_version(), stdlib=root, train_files=len(splits["train"]),
        train_tokens=len(streams["train"]), seq_len=args.seq_len, steps=steps, planned_steps=run["planned_steps"],
        lr=args.lr, warmup=args.warmup,
        batch=args.batch_size, tokens_seen=tokens_seen, epochs=tokens_seen / len(streams["train"]),
        aux_coef=args.aux_loss_coef, dropout=args.dropout, train_seconds=run["seconds"], device_name=device_name,
        autocast=on_cuda, seed=args.seed, torch=torch.__version__, transformers=transformers.__version__,
        tokenizers=tokenizers.__version__, final_loss=sum(losses[-50:]) / len(losses[-50:]),
        best_step=best["step"], valid_loss=best["loss"], ppl=ppl, eval_tokens=eval_tokens, sample=sample,
    )
    write_model_card(args.out / "README.md", info)

    size = sum(f.stat().st_size for f in args.out.iterdir()) / 2**20
    print("summary:")
    print(f"  parameters       {params:,}")
    print(f"  steps            {steps} ({tokens_seen / 1e6:.1f} M tokens, {info['epochs']:.1f} epochs); "
          f"kept step {best['step']}")
    print(f"  training time    {run['seconds'] / 60:.2f} min on {device_name}")
    print(f"  final train loss {info['final_loss']:.4f}; validation loss {best['loss']:.4f}")
    print(f"  held-out ppl     {ppl:.3f} ({eval_tokens} tokens)")
    print(f"  expert usage     {[round(u, 3) for u in run['usage']]} ({experts_impl} experts)")
    print(f"  output           {args.out} ({size:.1f} MiB): {sorted(f.name for f in args.out.iterdir())}")
    print(f"  wall time        {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
