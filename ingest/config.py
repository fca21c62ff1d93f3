"""Settings: ``config.toml`` (or ``--config PATH``), overridden by ``UFLASH_*`` environment variables.

Environment variables use ``__`` between section and key: ``UFLASH_WATCH__SETTLE_SECONDS=5``.
Relative paths (folders, a relative SQLite file) are resolved against the config file's folder,
so a scheduled task that starts in another working directory finds the same files.
"""

from __future__ import annotations

import os
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ingest.errors import ConfigError

CONFIG_ENV = "UFLASH_CONFIG"
DEFAULT_CONFIG_NAME = "config.toml"
# the demo model that ships with uflash, beside its packages: the model when model.path is not set
BUNDLED_DEMO_MODEL = Path(__file__).resolve().parents[1] / "models" / "demo"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FolderSettings(_Section):
    inbox: Path = Path("var/inbox")
    outbox: Path = Path("var/outbox")
    archive: Path = Path("var/archive")
    failed: Path = Path("var/failed")
    logs: Path = Path("var/logs")


class DatabaseSettings(_Section):
    url: str = "sqlite:///var/uflash.db"  # or postgresql+psycopg://user@host/db (pip install -e ".[postgres]")
    busy_timeout_ms: int = Field(default=30_000, ge=0)


class ModelSettings(_Section):
    path: str = "models/demo"  # not set (no config file, or the key left out): BUNDLED_DEMO_MODEL
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")  # cuda:N: one worker per GPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class EngineSettings(_Section):
    mode: Literal["official", "plain", "lossless", "fast"] = "lossless"
    fast_threshold: float = Field(default=0.3, gt=0.0, le=1.0)  # fast mode: accept a draft token at this probability
    max_pages_per_chunk: int = Field(default=16, ge=1)
    context_limit: int = Field(default=32_768, ge=512)
    context_margin: float = Field(default=0.1, ge=0.0, lt=1.0)
    default_tokens_per_page: int = Field(default=1_200, ge=1)
    max_tokens_per_page: int | None = Field(default=None, ge=1)  # cap on output; None: up to the context
    max_batch: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"  # chunks decoding together; auto: as many as
    # free GPU memory holds
    kernels: Literal["auto", "torch", "invariant"] = "auto"  # auto: batch-invariant in bf16/fp16 on CUDA
    vision_attention: Literal["auto", "model", "sdpa", "flex"] = "auto"  # SAM's attention; auto: flex on CUDA in bf16
    vision_ahead: Literal["auto", "on", "off"] = "auto"  # waiting chunks' pages through the tower while rows decode
    kernel_tiles: Literal["measured", "default"] = "measured"  # invariant kernels' tiles: measured on the card (only
    # those bitwise equal to the default kept) or the default ones


@dataclass(frozen=True)
class Thresholds:
    """The ``[quality]`` section of config.toml: the parameters of the figures computed here, and the thresholds
    of the grade (``ingest.quality.grades``: a page is *poor* when any poor rule fires, *fair* when any fair rule fires,
    else *good*; rules whose figure is missing do not fire). The defaults of the thresholds a calibration chooses
    (``ingest.quality.calibration.FITTED``) are the demo model's; each model's own come from its calibration
    (docs/grades.md)."""

    distinct_20_poor: float = 0.80  # Distinct-20 below this: poor (repetition)
    distinct_20_fair: float = 0.95
    mean_logprob_poor: float = -0.15  # mean log-probability of the emitted tokens below this: poor
    mean_logprob_fair: float = -0.08
    unsure_word_prob: float = 0.5  # a word whose confidence is below this is one the model was unsure of ...
    unsure_words_poor: float = 0.25  # ... and a share of such words above this: poor
    unsure_words_fair: float = 0.12
    ink_min_chars: int = 40  # compare the text with the print on the page when either has at least this many chars
    ink_short: float = 0.4  # characters read / characters of print measured on the page below this: poor
    ink_long: float = 2.5  # ... above this: poor
    ink_short_fair: float = 0.6
    ink_long_fair: float = 2.0
    repeat_share: float = 0.5  # a page whose character 8-grams are this much on another page repeats it ...
    repeat_min_chars: int = 40  # ... when it has at least this many characters
    low_confidence_prob: float = 0.5  # a token whose probability is below this is low-confidence (a figure)
    text_layer_min_chars: int = 20  # compare with the text layer only when it has at least this many chars
    neighbour_low: float = 0.25  # characters / median of the neighbours' below this (or above high): fair
    neighbour_high: float = 4.0
    neighbour_min_chars: int = 200  # ... only when the neighbours' median has at least this many chars
    loop_min_repeats: int = 3  # a looping tail repeats its unit at least this often
    loop_min_tokens: int = 32  # ... and covers at least this many tokens
    loop_tail_tokens: int = 200  # or: the last 1, 2 or 3 times this many tokens (a near-loop under the no-repeat rule)
    loop_tail_distinct: float = 0.5  # ... have Distinct-10 below this


class QualitySettings(_Section):
    """``[quality]``: the fields of ``Thresholds`` (each documented there; defaults are the dataclass's), and whether
    pages caught by the checks are decoded again alone (ingest.quality.repair). The thresholds that grade a model's
    pages are ``ingest.quality.calibration.grading_thresholds``: the keys set here over the model's calibration."""

    __annotations__ = {**{f: type(v) for f, v in vars(Thresholds()).items()}, "repair": bool}
    locals().update(vars(Thresholds()))
    repair: bool = True


class OrientationSettings(_Section):
    """``[orientation]``: scans turned sideways or upside down (ingest.pages.orientation says how each key is used)."""

    auto: bool = True
    sideways_below: float = Field(default=0.75, gt=0.0)  # stripe_ratio below this: probed for a quarter turn
    upside_down_below: float = Field(default=-0.5, ge=-1.0, le=1.0)  # ragged_edges below this: probed for a half turn
    probe_tokens: int = Field(default=256, ge=8)  # tokens decoded per probe
    min_gain: float = Field(default=0.1, ge=0.0)  # a turn must beat the page as it is by this mean log-probability
    min_logprob: float = Field(default=-0.5, le=0.0)  # ... and be read with at least this mean log-probability


class OutputSettings(_Section):
    """What each finished document gets in the outbox (ingest.outputs.write): md (document.md), json (document.json,
    always written: uflash reads it back), pdf (document.pdf, PDF/A-2b), alto (alto/<page>.xml), hocr
    (document.hocr)."""

    formats: list[Literal["md", "json", "pdf", "alto", "hocr"]] = ["md", "json", "pdf", "alto"]

    @field_validator("formats")
    @classmethod
    def _json_kept(cls, v: list[str]) -> list[str]:
        if "json" not in v:
            raise ValueError("keep \"json\" in outputs.formats: document.json is what uflash reads back")
        return list(dict.fromkeys(v))


class WatchSettings(_Section):
    settle_seconds: float = Field(default=5.0, ge=0.0)
    incomplete_grace_seconds: float = Field(default=600.0, ge=0.0)
    rescan_seconds: float = Field(default=60.0, gt=0.0)
    polling: bool = False
    patterns: list[str] = ["*.pdf", "*.tif", "*.tiff", "*.png", "*.jpg", "*.jpeg"]
    max_page_pixels: int = Field(default=150_000_000, ge=1)


class WorkerSettings(_Section):
    lease_seconds: float = Field(default=300.0, gt=0.0)
    heartbeat_seconds: float = Field(default=30.0, gt=0.0)
    max_attempts: int = Field(default=3, ge=1)
    backoff_seconds: float = Field(default=30.0, ge=0.0)
    poll_seconds: float = Field(default=2.0, gt=0.0)
    prepare_processes: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"  # processes that render and prepare
    # pages for the model; auto: one fewer than the cores, at most 8; 0: the worker's own thread


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="UFLASH_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    folders: FolderSettings = FolderSettings()
    database: DatabaseSettings = DatabaseSettings()
    model: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    quality: QualitySettings = QualitySettings()
    orientation: OrientationSettings = OrientationSettings()
    outputs: OutputSettings = OutputSettings()
    watch: WatchSettings = WatchSettings()
    worker: WorkerSettings = WorkerSettings()
    config_dir: Path = Field(default=Path("."), exclude=True)
    config_file: Path | None = Field(default=None, exclude=True)  # the file read, if any (commands shown name it)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats the file (the file arrives as init kwargs).
        return env_settings, init_settings

    def on_device(self, device: str) -> Settings:
        """These settings with ``model.device`` replaced (``--device``), checked as the config file's value is."""
        try:
            model = ModelSettings(**{**self.model.model_dump(exclude_unset=True), "device": device})
            return self.model_copy(update={"model": model})
        except ValidationError as e:
            raise ConfigError(f"--device {device!r}: use cpu, cuda or cuda:N ({e.errors()[0]['msg']})") from None

    # -- derived values ---------------------------------------------------------------------
    def resolve(self, p: Path | str) -> Path:
        p = Path(p).expanduser()
        return p if p.is_absolute() else (self.config_dir / p).resolve()

    @property
    def inbox(self) -> Path:
        return self.resolve(self.folders.inbox)

    @property
    def outbox(self) -> Path:
        return self.resolve(self.folders.outbox)

    @property
    def archive(self) -> Path:
        return self.resolve(self.folders.archive)

    @property
    def failed(self) -> Path:
        return self.resolve(self.folders.failed)

    @property
    def logs(self) -> Path:
        return self.resolve(self.folders.logs)

    @property
    def database_url(self) -> str:
        """The DB URL with a relative SQLite file made absolute against the config folder."""
        url = self.database.url
        prefix = "sqlite:///"
        if url.startswith(prefix) and not url.startswith(prefix + "/") and ":memory:" not in url:
            return prefix + str(self.resolve(url[len(prefix):]))
        return url

    @property
    def model_path(self) -> str:
        """model.path as a folder resolved against the config folder, or as given (a hub id); the bundled demo model
        when model.path is not set (so a uflash started anywhere without a config file finds it)."""
        if "path" not in self.model.model_fields_set:
            return str(BUNDLED_DEMO_MODEL)
        raw = self.model.path
        local = self.resolve(raw)
        first = raw.split("/", 1)[0]
        looks_like_hub_id = raw.count("/") == 1 and not raw.startswith((".", "~", "/")) and "\\" not in raw
        return raw if looks_like_hub_id and not self.resolve(first).exists() else str(local)

    def source(self) -> str:
        """Where these settings come from, in one line: the config file read, or that none was found (and so where
        relative paths resolve)."""
        if self.config_file is not None:
            return f"config {self.config_file}"
        return (f"no {DEFAULT_CONFIG_NAME} in {self.config_dir}, no --config, no ${CONFIG_ENV}: built-in defaults, "
                f"relative paths under {self.config_dir}")

    def origin(self, section: str, key: str) -> str:
        """Where a key's value comes from: its environment variable, the config file, or the built-in default."""
        env = f"UFLASH_{section}__{key}".upper()
        if any(name.upper() == env for name in os.environ):
            return env
        if key not in getattr(self, section).model_fields_set:
            return "not set: the built-in default"
        return str(self.config_file) if self.config_file is not None else "set by the caller"

    def check_folders(self) -> None:
        """Refuse output folders inside the inbox: the watcher would take its own outputs again."""
        inbox = self.inbox
        for name in ("outbox", "archive", "failed"):
            other = getattr(self, name)
            if other == inbox or inbox in other.parents:
                raise ConfigError(
                    f"folders.{name} ({other}) is inside folders.inbox ({inbox}); "
                    "it would be watched and processed again: move it outside the inbox"
                )
            if name != "outbox" and (inbox in other.parents or other in inbox.parents):
                raise ConfigError(f"folders.{name} ({other}) and folders.inbox ({inbox}) overlap")

    def ensure_folders(self, *names: str) -> None:
        """Create the folders (default: all five) and check that a file can be created in each. A folder that
        cannot be used (a file of that name, a read-only or virtual file system) is a ConfigError naming it,
        found at start rather than as a crash in the middle of a document."""
        for name in names or ("inbox", "outbox", "archive", "failed", "logs"):
            p = getattr(self, name)
            try:
                if p.exists() and not p.is_dir():
                    raise NotADirectoryError("it is a file, not a folder")
                p.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryFile(dir=p, prefix=".uflash-check-"):
                    pass
            except OSError as e:
                raise ConfigError(f"the {name} folder {p} (folders.{name}) cannot be used: "
                                  f"{e.strerror or e}") from None


def _find_config(path: Path | str | None) -> Path | None:
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        return p.resolve()
    env = os.environ.get(CONFIG_ENV)
    if env:
        return _find_config(env)
    p = Path.cwd() / DEFAULT_CONFIG_NAME
    return p.resolve() if p.is_file() else None


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(x) for x in first["loc"]) or "(root)"
    if first["type"] == "extra_forbidden":
        return f"unknown config key '{key}'"
    given = first.get("input")
    shown = f" (got {given!r})" if given is not None and not isinstance(given, dict) else ""
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"bad config value for '{key}': {first['msg']}{shown}{more}"


def load_settings(path: Path | str | None = None, **overrides: Any) -> Settings:
    """Load settings; every problem becomes a one-line ConfigError naming the key."""
    cfg = _find_config(path)
    data: dict[str, Any] = {}
    if cfg is not None:
        try:
            data = tomllib.loads(cfg.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {cfg} is not valid TOML: {e}") from None
    for internal in ("config_dir", "config_file"):
        if internal in data:
            raise ConfigError(f"unknown config key '{internal}'")
    data.update(overrides)
    data["config_dir"] = cfg.parent if cfg else Path.cwd()
    data["config_file"] = cfg.resolve() if cfg else None
    try:
        return Settings(**data)
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None
