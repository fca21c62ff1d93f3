"""Prepared pages handed from a page-preparation process to the worker through shared memory (ingest.pages.pool).

``Outbox.pack(obj)`` pickles ``obj`` with its arrays left out (torch tensors, numpy arrays, RGB/L/RGBA page images):
they are copied into one shared-memory block, and the pickle, a few kilobytes of text layers and measures, names
them by their place in it. ``unpack`` in the worker maps the block and hands the tensors and arrays out as views of it,
without a copy (a page's pixels are megabytes: copying them, into memory the system must first fault in and zero,
cost more than the processor); the page images are copied (PIL makes images of its own). The block's name is removed
at once; its memory goes once no view of it is left (``unmap_unused``). The process that made a block keeps it open
until the worker says it has mapped it (``Outbox.release``): on Windows a block lives only while a process has it
open.

Where shared memory is too short for a block (a container's small /dev/shm, where writing past it would kill the
process with SIGBUS) the object is pickled whole through the pipe instead, and ``unpack`` says so (``via_pipe``).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import shutil
import threading
import weakref
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

        return torch.from_numpy(view) if kind == "tensor" else view


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
    """The blocks a preparation process made and the worker has not yet mapped."""

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
        """The worker has mapped the block ``name`` (None: every block): let it go."""
        for key in [name] if name is not None else list(self._open):
            block = self._open.pop(key, None)
            if block is not None:
                block.close()


_mapped: list[tuple[weakref.ref, shared_memory.SharedMemory]] = []  # blocks mapped here, by the array over each
_mapped_lock = threading.Lock()


def unpack(packed: Packed) -> Any:
    """The object ``pack`` packed, its tensors and arrays views of the block (its images copied); the block's name is
    removed, its memory unmapped once nothing here uses it."""
    if packed.arrays is None:
        return pickle.loads(packed.payload)
    if packed.block is None:
        return _Unpickler(io.BytesIO(packed.payload), []).load()
    unmap_unused()
    block = shared_memory.SharedMemory(name=packed.block)
    block.unlink()  # the name goes now; the memory stays while it is mapped (on Windows: while this handle is open)
    whole = np.ndarray((block.size,), np.uint8, buffer=block.buf)
    try:
        views = [whole[offset:offset + np.dtype(dtype).itemsize * math.prod(shape)].view(dtype).reshape(shape)
                 for offset, dtype, shape in packed.arrays]
        return _Unpickler(io.BytesIO(packed.payload), views).load()
    finally:
        with _mapped_lock:
            _mapped.append((weakref.ref(whole), block))
        del whole


def unmap_unused() -> None:
    """Unmap the blocks none of whose arrays is left (the pool's thread calls it every second or so)."""
    with _mapped_lock:
        for entry in [e for e in _mapped if e[0]() is None]:
            try:
                entry[1].close()
            except BufferError:  # still exported after all (a traceback holding a view): later
                continue
            _mapped.remove(entry)


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
