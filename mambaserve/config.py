"""Engine configuration: one dataclass, validated on creation (ValueError on bad values).

Field names follow vLLM's `EngineArgs` so its users find what they expect.
"""

from __future__ import annotations

import logging
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("mambaserve")

COMPILATION_MODES = ("eager", "piecewise", "full_and_piecewise")
# vLLM's names: "fp8" quantizes a checkpoint's weights at load, "compressed-tensors" reads a
# checkpoint quantized in that format (also detected from its quantization_config when unset)
QUANTIZATION_METHODS = ("fp8", "compressed-tensors")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

# state-checkpoint granularity when mamba_block_size is unset: the SSD chunk size of the
# Granite 4.0-H / Bamba / Nemotron-H checkpoints (rounded up to a multiple of block_size)
DEFAULT_MAMBA_BLOCK_SIZE = 256


def default_model() -> str:
    """The bundled demo checkpoint (a small trained Granite 4.0-H-style hybrid)."""
    return str(Path(__file__).parent / "assets" / "demo-model")


@dataclass(frozen=True)
class CacheConfig:
    """How the caches are laid out and shared (vLLM's `CacheConfig` names), built and validated
    by `EngineConfig` from its flat fields of the same names (`EngineConfig.cache_config`).

    block_size: tokens per KV block of the attention layers. enable_prefix_caching: reuse the
    caches of a prompt prefix that an earlier request computed: KV blocks for attention layers,
    state checkpoints (conv + SSM state of every Mamba layer, copied out of a running slot) for
    Mamba layers. mamba_block_size: granularity of the state checkpoints, in tokens: a prefix
    can be reused only up to a multiple of it (None: `DEFAULT_MAMBA_BLOCK_SIZE`, rounded up to a
    multiple of block_size); for a model with attention layers it must be a multiple of
    block_size (checked where the model is known: `check_model`). num_state_checkpoints: rows
    of the checkpoint pool beside the running state slots (None: the share `cache.budget` gives
    them; 0 turns checkpoints off, so that only pure-attention prefixes could be reused, which
    none of our models have). Raises ValueError for bad values.
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    mamba_block_size: int | None = None
    num_state_checkpoints: int | None = None

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        m = self.mamba_block_size
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"mamba_block_size must be an integer >= 1, got {m!r}")
        n = self.num_state_checkpoints
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"num_state_checkpoints must be an integer >= 0, got {n!r}")

    @property
    def resolved_mamba_block_size(self) -> int:
        """mamba_block_size, or the default: DEFAULT_MAMBA_BLOCK_SIZE rounded up to a multiple of block_size."""
        if self.mamba_block_size is not None:
            return self.mamba_block_size
        b = self.block_size
        return -(-DEFAULT_MAMBA_BLOCK_SIZE // b) * b

    def check_model(self, has_attention: bool) -> None:
        """Raise ValueError when prefix caching is on for a model with attention layers and
        mamba_block_size is not a multiple of block_size: a checkpoint position must end a KV block."""
        m = self.resolved_mamba_block_size
        if self.enable_prefix_caching and has_attention and m % self.block_size:
            raise ValueError(f"mamba_block_size ({m}) must be a multiple of block_size ({self.block_size}) "
                             "for a model with attention layers")


SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = {"ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
              "draft_model": {"method", "num_speculative_tokens", "model"}}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys), built by `from_dict`.

    method "ngram": prompt lookup (`engine.spec_decode.NgramProposer`): the longest n-gram
    (prompt_lookup_max >= n >= prompt_lookup_min) ending the sequence that occurred earlier in
    its tokens proposes the tokens that followed it. method "draft_model": a second, small model
    (`model`: a checkpoint directory of any supported family) proposes greedily. Either way
    num_speculative_tokens (k) drafts per sequence and step are verified by one forward of k + 1
    tokens of the target model, which keeps its output distribution exactly.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    @classmethod
    def from_dict(cls, spec: dict | SpeculativeConfig) -> SpeculativeConfig:
        """Validate a `speculative_config` dict. Raises ValueError for a non-dict, an unknown
        method or key, a missing key, or a bad value (k and the lookup lengths >= 1,
        prompt_lookup_min <= prompt_lookup_max; ngram's defaults as vLLM's: 5 for both when neither
        is given, else the one given for both)."""
        if isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        method = spec.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPECULATIVE_METHODS}, got {method!r}")
        unknown = sorted(set(spec) - _SPEC_KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown} for method {method!r} "
                             f"(accepted: {sorted(_SPEC_KEYS[method])})")

        def positive(key, default=None):
            v = spec.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config: {key} must be an integer >= 1, got {v!r}")
            return v

        k = positive("num_speculative_tokens", spec.get("num_speculative_tokens"))
        if method == "draft_model":
            model = spec.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(f"speculative_config: method 'draft_model' needs a 'model' directory, got {model!r}")
            return cls(method, k, model=model)
        hi, lo = spec.get("prompt_lookup_max"), spec.get("prompt_lookup_min")
        hi, lo = (5, 5) if hi is None and lo is None else (hi if hi is not None else lo, lo if lo is not None else hi)
        hi, lo = positive("prompt_lookup_max", hi), positive("prompt_lookup_min", lo)
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        return cls(method, k, prompt_lookup_max=hi, prompt_lookup_min=lo)


@dataclass
class EngineConfig:
    """model: checkpoint directory (or a bare config .json with load_format="dummy").
    tokenizer: directory of the tokenizer (default: the model's). dtype: "auto", "float32",
    "bfloat16", "float16". device: "auto" (CUDA when present), "cuda", "cpu".
    max_model_len: longest prompt + output in tokens (default: the model's limit, clamped to
    what the cache can hold). max_num_seqs: most running requests (default: 1,024 on GPUs of 70 GiB
    or more, else 256; clamped to the state slots that fit). max_num_batched_tokens: token budget
    of one step (default 8192 on GPU, 2048 on CPU). block_size: tokens per KV block.
    gpu_memory_utilization: fraction of GPU memory the engine may use in all (weights,
    activations, caches). cpu_cache_bytes: byte budget of the caches on the CPU.
    num_kv_blocks / num_state_slots: force the pool sizes (tests).
    mamba_ssm_cache_dtype: dtype of the SSM state. "auto" (default, as in vLLM): the model
    family's own default where it declares one (float32 for Nemotron-H), else the model dtype;
    "float32" keeps the state exact to the kernels' float32 accumulation at twice the bytes
    (decode of large batches reads and writes every running request's state each step).
    async_scheduling: launch the next decode step before the host has read the current one's
    tokens (they feed it on the device), so that the device does not wait for the host's
    per-token work; a sequence that stops on a token costs one dropped step.
    compilation_mode: "eager", "piecewise" or "full_and_piecewise" (GPU default);
    enforce_eager=True forces "eager". cuda_graph_sizes: decode batch sizes to capture.
    quantization: None (the checkpoint's own quantization_config when it has one, else none),
    "fp8" (vLLM's online FP8: every linear layer's weights quantized to float8_e4m3fn per output
    channel at load, activations per token at run time; lm_head, embeddings, norms, routers and
    the Mamba conv/scan stay in the model dtype) or "compressed-tensors" (an FP8 checkpoint of
    that format: which layers are quantized and how follows its quantization_config; ValueError
    when the checkpoint has none). kv_cache_dtype: "auto" (the model dtype) or "fp8" /
    "fp8_e4m3" (attention keys and values stored as float8_e4m3fn with a per-tensor scale, 1.0
    or the checkpoint's k_scale / v_scale: half the bytes per KV block; the Mamba states are
    not affected, see mamba_ssm_cache_dtype).
    max_queue_len: most waiting sequences (a request with n=4 counts 4): add_request refuses one
    that would pass it (QueueFullError), or whose n alone does (ValueError); None: unbounded.

    tensor_parallel_size: ranks the model is split over (one GPU each, or CPU processes),
    started by the engine on this node or by torchrun (`engine.executor`); 1 runs in this
    process alone. Under tensor parallelism gpu_memory_utilization and cpu_cache_bytes are per
    rank.

    enable_prefix_caching (default on), mamba_block_size, num_state_checkpoints: prefix caching,
    as `CacheConfig` (`cache_config`) describes them.

    vLLM options taken so that a vLLM call or command line moves over unchanged, at the values
    this engine implements (other values raise ValueError saying so): tokenizer_mode "auto" or
    "slow" (the slow Python tokenizer), pipeline_parallel_size and data_parallel_size 1;
    trust_remote_code is passed to the tokenizer's loading. swap_space (GiB of CPU swap for
    preempted KV blocks) is accepted and has no effect: preempted requests are recomputed.

    model (and tokenizer) may be a Hugging Face model id, read from the local Hugging Face cache
    (download_dir, else $HF_HOME's) at `revision`, downloaded when missing unless
    HF_HUB_OFFLINE=1 (`mambaserve.hub`); `model` then holds the snapshot folder.
    seed: the global random seed (torch's, and dummy weights'); None is taken as 0, vLLM V1's
    default. max_model_len above the model's max_position_embeddings is refused unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's switch). max_logprobs: most logprobs and
    prompt_logprobs a request may ask for (-1: the vocabulary). generation_config: "auto" reads
    the checkpoint's generation_config.json (end tokens, default sampling parameters), "vllm"
    reads none, a folder reads that folder's. disable_log_stats: no periodic stats lines (the
    `LLM` sets it, as vLLM's does). speculative_config: vLLM's dict (or None: off), validated
    into a `SpeculativeConfig`. cpu_num_threads: torch's intra-op threads on the CPU (default:
    $OMP_NUM_THREADS when set, else 1: cores shared with other work make more threads fall off
    a cliff, see `engine.runner_setup.set_cpu_threads`).
    """

    model: str = field(default_factory=default_model)
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    device: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_cache_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    num_state_slots: int | None = None
    mamba_ssm_cache_dtype: str = "auto"
    enforce_eager: bool = False
    compilation_mode: str | None = None
    cuda_graph_sizes: list[int] | None = None
    async_scheduling: bool = True
    skip_tokenizer_init: bool = False
    max_queue_len: int | None = None
    tensor_parallel_size: int = 1
    trust_remote_code: bool = False
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    enable_prefix_caching: bool = True
    mamba_block_size: int | None = None
    num_state_checkpoints: int | None = None
    revision: str | None = None
    download_dir: str | None = None
    tokenizer_mode: str = "auto"
    swap_space: float | None = None
    max_logprobs: int = 20
    generation_config: str = "auto"
    disable_log_stats: bool = False
    cpu_num_threads: int | None = None
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    speculative_config: dict | SpeculativeConfig | None = None

    def __post_init__(self):
        from mambaserve.hub import resolve_model_path

        self.model = resolve_model_path(os.fspath(self.model), self.revision, self.download_dir)
        if self.tokenizer is not None:
            self.tokenizer = resolve_model_path(os.fspath(self.tokenizer), self.revision, self.download_dir,
                                                kind="tokenizer")
        if self.seed is None:  # vLLM V1 seeds every engine: None means its default, 0
            self.seed = 0
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        self.seed = int(self.seed)
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for the whole vocabulary, got {self.max_logprobs}")
        if self.cpu_num_threads is not None and self.cpu_num_threads < 1:
            raise ValueError(f"cpu_num_threads must be >= 1, got {self.cpu_num_threads}")
        if self.swap_space is not None and self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {self.device!r}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.enable_prefix_caching is None:  # an unset command-line flag: the default
            self.enable_prefix_caching = True
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        self.cache_config  # noqa: B018 - validates block_size and the prefix-caching fields
        unused = [f"{k}={v}" for k, v in (("mamba_block_size", self.mamba_block_size),
                                          ("num_state_checkpoints", self.num_state_checkpoints)) if v is not None]
        if unused and not self.enable_prefix_caching:
            logger.warning("%s: no effect with prefix caching off", ", ".join(unused))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.mamba_ssm_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError("mamba_ssm_cache_dtype must be auto/float32/bfloat16/float16, got "
                             f"{self.mamba_ssm_cache_dtype!r}")
        if self.compilation_mode is not None and self.compilation_mode not in COMPILATION_MODES:
            raise ValueError(f"compilation_mode must be one of {COMPILATION_MODES}, got {self.compilation_mode!r}")
        for name in ("num_kv_blocks", "num_state_slots"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.cuda_graph_sizes is not None and any(int(s) < 1 for s in self.cuda_graph_sizes):
            raise ValueError("cuda_graph_sizes must be positive")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        unsupported = {
            "tokenizer_mode": (self.tokenizer_mode not in ("auto", "slow"),
                               "only 'auto' (transformers' fast tokenizer) and 'slow' are implemented"),
            "pipeline_parallel_size": (self.pipeline_parallel_size != 1,
                                       "pipeline parallelism is not implemented (tensor_parallel_size splits a model)"),
            "data_parallel_size": (self.data_parallel_size != 1,
                                   "one engine per process: run one server per replica behind a load balancer"),
        }
        for name, (bad, why) in unsupported.items():
            if bad:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported: {why}")

    @property
    def cache_config(self) -> CacheConfig:
        """The cache fields as one validated `CacheConfig` (built anew: it follows later edits)."""
        return CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                           mamba_block_size=self.mamba_block_size, num_state_checkpoints=self.num_state_checkpoints)

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        return self.device

    def resolved_max_num_seqs(self) -> int:
        """max_num_seqs, or its default: 1,024 on a GPU of 70 GiB or more (H100, H200: as vLLM's
        offline engine on such GPUs), else 256. The engine clamps it to the state slots that fit."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        if self.resolved_device() == "cuda":
            import torch

            if torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory >= 70 * 2**30:
                return 1024
        return 256

    def resolved_compilation_mode(self) -> str:
        if self.enforce_eager or self.resolved_device() != "cuda":
            return "eager"
        return self.compilation_mode or "full_and_piecewise"
