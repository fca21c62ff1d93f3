"""The configured model's files: found as the worker loads them (``engine.model.files.resolve_path``: a folder, or a
hub id already in the local cache; never downloaded), or one line saying why not, where model.path came from and
how to point it at a checkpoint. ``uflash check``, ``uflash run`` before it takes anything in, and the worker when it
loads the model all say the same line.
"""

from __future__ import annotations

from pathlib import Path

from engine.model.files import HUB_ID, ModelNotFound, resolve_path
from ingest.config import Settings
from ingest.errors import ModelUnavailable


def locate_model(settings: Settings) -> Path:
    """The local folder of the configured model; ``ModelUnavailable`` (see ``model_not_found``) when there is none."""
    try:
        return resolve_path(settings.model_path)
    except ModelNotFound as e:
        raise model_not_found(settings, e) from None


def model_origin(settings: Settings) -> str:
    """Where the configured model.path comes from, in words."""
    origin = settings.origin("model", "path")
    if origin.startswith("not set"):
        return "model.path not set: the demo model bundled with uflash"
    return f"model.path = {settings.model.path!r} from {origin}"


def model_not_found(settings: Settings, e: ModelNotFound) -> ModelUnavailable:
    """``ModelUnavailable`` for a model whose files are not there: the reason, where model.path came from, and how to
    point it at a downloaded checkpoint."""
    target = settings.config_file or f"a {settings.config_dir / 'config.toml'}"
    example = settings.config_dir / "models" / "Unlimited-OCR"
    where = model_origin(settings) + ("" if settings.config_file else f"; {settings.source()}")
    return ModelUnavailable(f"{e} ({where}); point model.path in {target} (or $UFLASH_MODEL__PATH) at "
                            f"a downloaded checkpoint, e.g. `huggingface-cli download {HUB_ID} --local-dir "
                            f"{example}` and then path = \"{example}\" under [model]")
