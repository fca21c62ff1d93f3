"""Loading a decoder for a model folder: the official reference or the batched engine, with the kernels and the
checkpoint's own block drafter that suit the device."""

from __future__ import annotations

import torch
from loguru import logger

from engine.chunk_decode import ChunkDecoder, EngineDecoder, OfficialDecoder, prompt_length
from engine.model.load import LoadedModel

K_MAX = 16  # most drafted tokens a row verifies in one step


def load_decoder(path: str, device: str = "auto", dtype: str = "auto", mode: str = "official",
                 fast_threshold: float | None = None, max_batch: int | str = 1, kernels: str = "auto",
                 max_pages_per_chunk: int = 0, loop_check=None, vision_attention: str = "auto",
                 vision_ahead: str = "auto", kernel_tiles: str = "measured") -> ChunkDecoder:
    """official: transformers generate(); plain / lossless / fast: `BatchEngine` (CUDA graphs on a GPU) with
    ``max_batch`` rows (``auto``: as many as the free GPU memory holds, `engine.batch.memory.auto_batch`; 1 on the CPU).
    kernels: ``torch`` or ``invariant`` (`engine.model.forward`); ``auto`` = invariant in bf16/fp16 on CUDA, so that a
    chunk's tokens do not depend on its batch. lossless and fast also draft with the checkpoint's block drafter
    when it has one (`load_block_drafter`). max_pages_per_chunk: sizes the rows' prefix region up front.
    loop_check(page_ids) -> bool: the engine stops a page caught looping there (`engine.batch.loop_watch`).
    vision_attention, vision_ahead (auto, on, off): the engine's vision (`engine.model.sam_attention`,
    `engine.batch.vision_ahead`). kernel_tiles: ``measured`` or ``default`` (`engine.kernels.tiles`)."""
    from engine.batch.engine import BatchEngine
    from engine.batch.memory import STEP_TOKENS_PER_ROW, auto_batch
    from engine.batch.rows import MODES
    from engine.model.load import load_model

    if mode != "official" and mode not in MODES:
        raise ValueError(f"engine mode {mode!r} is not available; use 'official', 'plain', 'lossless' or 'fast'")
    loaded = load_model(path, device, dtype)
    if mode == "official":
        return OfficialDecoder(loaded)
    if kernels == "auto":
        kernels = default_kernels(loaded)
    prefix = prompt_length(loaded, max(1, max_pages_per_chunk)) if max_pages_per_chunk else 0
    net = load_block_drafter(loaded) if mode != "plain" else None
    extra = {"fast_threshold": fast_threshold} if fast_threshold is not None else {}
    if max_batch == "auto":
        max_batch = auto_batch(loaded, prefix or prompt_length(loaded, 1), K_MAX, drafting=mode != "plain")
        extra["step_tokens"] = max_batch * STEP_TOKENS_PER_ROW  # the steps' buffers auto sized the rows with
    engine = BatchEngine(loaded, mode, max_batch=int(max_batch), k_max=K_MAX, block_net=net, kernels=kernels,
                         prefix_capacity=prefix, loop_check=loop_check, vision_attention=vision_attention,
                         vision_ahead={"on": True, "off": False}.get(vision_ahead, "auto"),
                         tune_tiles=kernel_tiles == "measured", **extra)
    return EngineDecoder(engine)


def default_kernels(loaded: LoadedModel) -> str:
    """The step kernels for ``loaded`` (`engine.model.forward`): ``invariant`` in bf16/fp16 on CUDA, so that a chunk's
    tokens do not depend on its batch; ``torch`` otherwise (fp32 is exact with either)."""
    return "invariant" if loaded.device.type == "cuda" and loaded.dtype != torch.float32 else "torch"


def load_block_drafter(loaded):
    """The checkpoint's own block drafter (``<model folder>/drafter``, ``python -m scripts.train.drafter``), or None
    when it has none. One that does not fit the model is refused with a warning, and decoding goes on without it."""
    from engine.drafters.block import CONFIG_FILE, BlockDrafterNet, drafter_folder

    folder = drafter_folder(loaded.path)
    if not (folder / CONFIG_FILE).is_file():
        return None
    try:
        net = BlockDrafterNet.load(folder, loaded.device, loaded.dtype)
    except Exception as exc:  # noqa: BLE001 - a broken drafter must not stop decoding
        logger.warning("block drafter in {} not loaded: {}: {}", folder, type(exc).__name__, exc)
        return None
    if net.config.target_hidden != loaded.model.config.text_config.hidden_size or \
            max(net.config.layers) >= loaded.model.config.text_config.num_hidden_layers:
        logger.warning("block drafter in {} was made for another model: not used", folder)
        return None
    logger.info("block drafter loaded from {} (block {}, layers {})", folder, net.config.block, net.config.layers)
    return net
