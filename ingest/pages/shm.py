"""Prepared pages handed from a page-preparation process to the worker through shared memory (ingest.pages.pool).

``Outbox.pack(obj)`` pickles ``obj`` with its arrays left out (torch tensors, numpy arrays, RGB/L/RGBA page images):
they are copied into one shared-memory block, and the pickle, a few kilobytes of text layers and measures, names
them by their place in it. ``unpack`` in the worker copies each array out of the block into memory of its own and
removes the block. The process that made a block keeps it open until the worker says it has copied it out
(``Outbox.release``): on Windows a block lives only while some process has it open.

Where shared memory is too short for a block (a container's small /dev/shm, where writing past it would kill the
process with SIGBUS) the object is pickled whole through the pipe instead, and ``unpack`` says so (``via_pipe``).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
from PIL import Image

ALIGN = 64
IMAGE_MODES = ("RGB", "L", "RGBA")
SHM_FOLDER = "/dev/shm"  # Linux's shared memory: a tmpfs of limited size (elsewhere the system's memory is used)
SPARE_BYTES = 64 << 20  # left free in SHM_FOLDER


@dataclass(frozen=True)
class Packed:
    block: str | None  # the shared-memory block's name (None: no arrays, or all of it in ``payload``)
    arrays: list[tuple[int, str, tuple[int, ...]]] | None  # (offset, dtype, shape) each; None: pickled whole
    payload: bytes


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, arrays: list[np.ndarray]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        import torch

        self.arrays, self.tensor = arrays, torch.Tensor

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, self.tensor) and obj.device.type == "cpu" and not obj.requires_grad:
            try:
                array = obj.detach().contiguous().numpy()
            except (TypeError, RuntimeError):  # a dtype numpy does not have (bfloat16): pickled as it is
                return None
            return ("tensor", self._keep(array))
        if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            return ("ndarray", self._keep(np.ascontiguousarray(obj)))
        if isinstance(obj, Image.Image) and obj.mode in IMAGE_MODES:
            data = np.frombuffer(obj.tobytes(), dtype=np.uint8)
            return ("image", self._keep(data), obj.mode, obj.size)
        return None

    def _keep(self, array: np.ndarray) -> int:
        self.arrays.append(array)
        return len(self.arrays) - 1


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, views: list[np.ndarray]):
        super().__init__(file)
        self.views = views

    def persistent_load(self, pid: Any) -> Any:
        kind, index, *rest = pid
        view = self.views[index]
        if kind == "image":
            mode, size = rest
            return Image.frombytes(mode, tuple(size), view)  # copies the pixels
        import torch

        array = view.copy()
        return torch.from_numpy(array) if kind == "tensor" else array


def _layout(arrays: list[np.ndarray]) -> tuple[list[tuple[int, str, tuple[int, ...]]], int]:
    places, offset = [], 0
    for a in arrays:
        places.append((offset, a.dtype.str, tuple(a.shape)))
        offset += -(-a.nbytes // ALIGN) * ALIGN
    return places, offset


def _room_for(nbytes: int) -> bool:
    if not os.path.isdir(SHM_FOLDER):
        return True
    try:
        return shutil.disk_usage(SHM_FOLDER).free >= nbytes + SPARE_BYTES
    except OSError:
        return True


class Outbox:
    """The blocks a preparation process made and the worker has not yet copied out."""

    def __init__(self) -> None:
        self._open: dict[str, shared_memory.SharedMemory] = {}

    def pack(self, obj: Any) -> Packed:
        arrays: list[np.ndarray] = []
        buf = io.BytesIO()
        _Pickler(buf, arrays).dump(obj)
        if not arrays:
            return Packed(None, [], buf.getvalue())
        places, size = _layout(arrays)
        if not _room_for(size):
            return Packed(None, None, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        block = shared_memory.SharedMemory(create=True, size=max(1, size))
        try:
            for a, (offset, _, _) in zip(arrays, places):
                np.ndarray(a.shape, a.dtype, buffer=block.buf, offset=offset)[...] = a
        except BaseException:
            block.close()
            block.unlink()
            raise
        self._open[block.name] = block
        return Packed(block.name, places, buf.getvalue())

    def release(self, name: str | None = None) -> None:
        """The worker has copied out the block ``name`` (None: every block): let it go."""
        for key in [name] if name is not None else list(self._open):
            block = self._open.pop(key, None)
            if block is not None:
                block.close()


def unpack(packed: Packed) -> Any:
    """The object ``pack`` packed, its arrays copied out of the block; the block is removed."""
    if packed.arrays is None:
        return pickle.loads(packed.payload)
    if packed.block is None:
        return _Unpickler(io.BytesIO(packed.payload), []).load()
    block = shared_memory.SharedMemory(name=packed.block)
    try:
        views = [np.ndarray(shape, np.dtype(dtype), buffer=block.buf, offset=offset)
                 for offset, dtype, shape in packed.arrays]
        try:
            return _Unpickler(io.BytesIO(packed.payload), views).load()
        finally:
            del views
    finally:
        _close(block)
        block.unlink()


def discard(packed: Packed) -> None:
    """Remove the block of a result nobody wants any more (a cancelled job)."""
    if packed.block is None:
        return
    try:
        block = shared_memory.SharedMemory(name=packed.block)
    except FileNotFoundError:
        return
    _close(block)
    block.unlink()


def _close(block: shared_memory.SharedMemory) -> None:
    try:
        block.close()
    except BufferError:  # an array of it still referenced (by an error's traceback): unmapped once it is collected
        pass


def via_pipe(packed: Packed) -> bool:
    """Whether the arrays came through the pipe (shared memory was short)."""
    return packed.arrays is None
