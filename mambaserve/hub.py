"""Hugging Face model ids to local checkpoint folders, through `huggingface_hub`, as vLLM takes
them: `LLM("ibm-granite/granite-4.0-h-tiny")` reads the snapshot in the local Hugging Face cache
(`download_dir`, else $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub), and
downloads it first when it is not there, unless HF_HUB_OFFLINE=1.

The cache folder is worked out here at call time (huggingface_hub reads the environment once,
at import), so that a changed HF_HOME is honoured. Knows nothing of models or engines.
"""

from __future__ import annotations

import os
import re

# what a checkpoint needs: weights, configs, tokenizer files, chat templates (no .bin/.pt/.gguf copies)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+|[A-Za-z0-9][\w.-]*")
_TRUE = ("1", "ON", "YES", "TRUE")


def is_offline() -> bool:
    """Whether HF_HUB_OFFLINE asks for the cache only (huggingface_hub's values: 1, ON, YES, TRUE)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def cache_dir(download_dir: str | None = None) -> str:
    """The Hugging Face hub cache folder models are read from (and downloaded to)."""
    if download_dir:
        return os.path.expanduser(download_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def looks_like_repo_id(name: str) -> bool:
    """"org/name" or "name" (no path separators beyond the one, no leading dot): what the Hub takes."""
    return bool(_REPO_ID.fullmatch(name)) and not name.startswith(".")


def resolve_model_path(model: str, revision: str | None = None, download_dir: str | None = None,
                       kind: str = "model") -> str:
    """A local folder for `model`: itself when it exists on disk, else the snapshot of the Hub
    repo `model` at `revision` (a branch, tag or commit; default "main") in the cache, downloaded
    when missing and the Hub may be used. Raises ValueError, saying why, for a path that does not
    exist and is no repo id, an id that is not cached while HF_HUB_OFFLINE=1 or the Hub cannot be
    reached, an unknown repo or revision, or a cache without huggingface_hub installed; the
    messages call `model` a `kind` ("model", "tokenizer")."""
    if os.path.exists(model):
        return model
    if not looks_like_repo_id(model):
        raise ValueError(f"{kind} path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ValueError(f"{kind} path {model!r} does not exist, and huggingface_hub (needed to read it as a "
                         "Hugging Face model id) is not installed") from None
    where, offline = cache_dir(download_dir), is_offline()
    what = f"{kind} {model!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return snapshot_download(model, revision=revision, cache_dir=where, local_files_only=offline,
                                 allow_patterns=ALLOW_PATTERNS)
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ValueError(f"{what} is not on the Hugging Face Hub (nor a local path): {type(e).__name__}") from None
    except LocalEntryNotFoundError:
        if offline:
            raise ValueError(f"{what} is not in the Hugging Face cache {where} and HF_HUB_OFFLINE=1 forbids "
                             "downloading it (download it once with network, or pass a local folder)") from None
        raise ValueError(f"{what} is not in the Hugging Face cache {where} and the Hub could not be reached to "
                         "download it (no network?); pass a local folder or download it where there is one") from None
    except HfHubHTTPError as e:
        raise ValueError(f"could not download {what} from the Hugging Face Hub: {e}") from None
