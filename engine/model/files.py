"""Where a model's files are, without loading them (no torch): ``resolve_path`` finds the folder that
``engine.model.load`` loads from, a local folder or a hub id's snapshot already in the local Hugging Face cache (never
downloaded), or says in ``ModelNotFound`` why there is nothing to load there.
"""

from __future__ import annotations

from pathlib import Path

HUB_ID = "baidu/Unlimited-OCR"  # the real model's id on the Hugging Face hub


class ModelNotFound(Exception):
    """Nothing to load at the path (no folder, no config.json, no weights; a hub id not in the local cache)."""


def looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and "\\" not in path


def resolve_path(path: str) -> Path:
    """The local folder of ``path``: the folder itself, or the cached snapshot of a hub id (no download)."""
    folder = Path(path).expanduser()
    if not folder.exists() and looks_like_hub_id(path):
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(path, local_files_only=True))
        except Exception:  # noqa: BLE001 - any cache miss (or a relative folder like models/demo) is "not found"
            raise ModelNotFound(f"model not found at {path}: no such folder, and no hub id {path!r} in the local "
                                f"Hugging Face cache (never downloaded)") from None
    if not folder.exists():
        raise ModelNotFound(f"model not found at {path}: no such folder")
    if not folder.is_dir():
        raise ModelNotFound(f"model not found at {path}: a file, not a folder")
    if not (folder / "config.json").is_file():
        raise ModelNotFound(f"model not found at {path}: the folder has no config.json")
    if not (list(folder.glob("*.safetensors")) or list(folder.glob("pytorch_model*.bin"))):
        raise ModelNotFound(f"model not found at {path}: the folder has no weights (*.safetensors, "
                            f"pytorch_model*.bin)")
    return folder
