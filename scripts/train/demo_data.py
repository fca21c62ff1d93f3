"""Training data for the demo model: pages rendered on the fly by DataLoader workers, a replay pool, batches.

`PageStream` yields (uint8 [S, S] page, int32 label ids, int16 character grid, int16 image slot per label
token) from training seeds only
(>= synth.HELD_OUT_LIMIT); `PagePool` pulls them in a thread and keeps a ring buffer so that a step never waits
once the buffer holds a batch; `make_batch` builds right-padded 1- or n-page samples.
"""

from __future__ import annotations

import queue
import random
import threading

import torch

from ingest.synth.documents import page_arrays


class PageStream(torch.utils.data.IterableDataset):
    """Endless pages from training seeds: (uint8 [S, S], int32 label ids). Worker w of n takes document seeds
    seed_base + w, + w + n, ...; documents have 1-3 pages; difficulty is read from a shared value."""

    def __init__(self, tokenizer_json: str, size: int, scan_prob: float, seed_base: int, difficulty, kind="document",
                 chars: bool = True, open_words: float = 0.0, sparse: float = 0.0):
        self.tokenizer_json, self.size, self.scan_prob = tokenizer_json, size, scan_prob
        self.seed_base, self.difficulty, self.kind, self.chars = seed_base, difficulty, kind, chars
        self.open_words, self.sparse = open_words, sparse

    def __iter__(self):
        from tokenizers import Tokenizer

        torch.set_num_threads(1)
        tok = Tokenizer.from_str(self.tokenizer_json)
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        k = 0
        while True:
            seed = self.seed_base + wid + nw * k
            k += 1
            d = float(self.difficulty.value)
            kind = "sparse" if self.kind == "document" and sparse_document(seed, self.sparse) else self.kind
            for arr, label, grid, slots in page_arrays(seed, 1 + seed % 3, self.size, self.scan_prob * d, d,
                                                       kind, chars=True, slots=True,
                                                       open_words=self.open_words):
                enc = tok.encode(label, add_special_tokens=False)
                yield (torch.from_numpy(arr.copy()), torch.tensor(enc.ids, dtype=torch.int32),
                       char_tensor(grid, self.size), token_slots(enc.offsets, slots))


def sparse_document(seed: int, share: float) -> bool:
    """Whether training document `seed` is drawn as nearly empty pages (a fixed `share` of seeds)."""
    return share > 0 and (seed * 2654435761 % 2**32) / 2**32 < share


def put_until_stopped(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put into a bounded queue, waiting while it is full, unless `stop` is set first (then False)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.5)
            return True
        except queue.Full:
            continue
    return False


def token_slots(offsets: list[tuple[int, int]], char_slots) -> torch.Tensor:
    """int16 per token: the image slot of the token's first character that has one (`synth.doc.char_slots`),
    -1 for markup, boxes and whitespace-only tokens."""
    out = torch.full((len(offsets),), -1, dtype=torch.int16)
    for i, (a, b) in enumerate(offsets):
        for j in range(a, min(b, len(char_slots))):
            if char_slots[j] >= 0:
                out[i] = int(char_slots[j])
                break
    return out


def char_tensor(grid, size: int) -> torch.Tensor:
    """int16 [size // 16, size // 8] character classes; -1 everywhere (ignored) when the page has no grid."""
    if grid is None:
        return torch.full((size // 16, size // 8), -1, dtype=torch.int16)
    return torch.from_numpy(grid.astype("int16"))


class PagePool:
    """Fresh pages from the DataLoader (pulled by a thread) plus a ring buffer of recent pages for replay. ``log``
    (message, **fields) hears of a data-worker failure, after which training goes on from the buffer."""

    def __init__(self, loader, capacity: int, seed: int, *, log, queue_pages: int = 512):
        self.q: queue.Queue = queue.Queue(maxsize=queue_pages)  # bounded: idle workers when the GPU is slower
        self.buf: list = []
        self.capacity, self.pos = capacity, 0
        self.rng = random.Random(seed)
        self.fresh_used = self.replayed = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.log = log
        self.it = iter(loader)
        self.thread = threading.Thread(target=self._pull, daemon=True)
        self.thread.start()

    def _pull(self):
        try:
            for item in self.it:
                if not put_until_stopped(self.q, item, self.stop):
                    return
        except BaseException as exc:  # noqa: BLE001 - a dead data worker: train on from the replay buffer
            self.error = exc
            self.log("data workers failed; continuing from the replay buffer", error=f"{type(exc).__name__}: {exc}")

    def _get(self):
        while True:
            try:
                return self.q.get(timeout=1.0)
            except queue.Empty:
                if self.error is not None or not self.thread.is_alive():
                    if self.buf:
                        return None
                    raise RuntimeError(f"no training data: {self.error!r}")

    def close(self) -> None:
        """Stop the pulling thread and the DataLoader workers (frees the CPUs for evaluation and saving)."""
        self.stop.set()
        self.thread.join(timeout=10)
        shutdown = getattr(self.it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.it = None

    def _add(self, item):
        if len(self.buf) < self.capacity:
            self.buf.append(item)
        else:
            self.buf[self.pos] = item
            self.pos = (self.pos + 1) % self.capacity

    def take(self, n: int, wait_min: int = 0) -> list:
        out = []
        while len(self.buf) + len(out) < max(n, wait_min):
            item = self._get()
            if item is None:
                break
            out.append(item)
        while len(out) < n:
            try:
                out.append(self.q.get_nowait())
            except queue.Empty:
                break
        for item in out:
            self._add(item)
        self.fresh_used += len(out)
        self.replayed += n - len(out)
        return out + [self.rng.choice(self.buf) for _ in range(n - len(out))]


def make_batch(pages: list, n_pages: int, prompt: list[int], page_sep: int, eos: int, pad: int, device,
               tpp: int | None = None):
    """Samples of n_pages consecutive entries of `pages` ((pixels, ids[, char grid[, token slots]]) each) ->
    input ids [B, T] (right-padded), lengths, pixels [N, S, S], character grids [N, S/16, S/8] (-100 = ignore;
    None when the pages carry none) and alignment targets [B, T] (None without token slots or `tpp`): at the
    position that predicts an output token, the sequence position of the image slot showing that token
    (BOS is position 0, page k's slots start at 1 + k * tpp), else -1."""
    seqs, aligns = [], []
    with_slots = tpp is not None and all(len(p) > 3 for p in pages)
    for i in range(0, len(pages), n_pages):
        chunk = pages[i : i + n_pages]
        target: list[int] = []
        align: list[int] = []
        for k, (_, ids, *rest) in enumerate(chunk):
            if n_pages > 1:
                target.append(page_sep)
                align.append(-1)
            target += ids.tolist()
            if with_slots:
                slots = rest[1].long()
                align += torch.where(slots >= 0, slots + 1 + k * tpp, -1).tolist()
        seqs.append(prompt + target + [eos])
        aligns.append(align)
    T = -(-max(len(s) for s in seqs) // 16) * 16  # a multiple of 16 suits the attention kernels
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in seqs])
    pixels = torch.stack([p[0] for p in pages])
    batch = (ids.to(device, non_blocking=True), lengths.to(device), pixels.to(device, non_blocking=True))
    grids = None  # decided here, on the CPU: the training step then needs no host sync to know
    if all(len(p) > 2 and p[2] is not None for p in pages):
        stacked = torch.stack([p[2] for p in pages])
        if bool((stacked > 0).any()):
            grids = stacked.long().masked_fill_(stacked < 0, -100).to(device, non_blocking=True)
    targets = None
    if with_slots and any(a >= 0 for align in aligns for a in align):
        targets = torch.full((len(seqs), T), -1, dtype=torch.long)
        for b, align in enumerate(aligns):  # the query predicting output token j sits one position before it
            start = len(prompt) - 1
            targets[b, start : start + len(align)] = torch.tensor(align, dtype=torch.long)
        targets = targets.to(device, non_blocking=True)
    return batch + (grids, targets)


class BatchPrefetcher:
    """Builds the next training batches in a thread while the GPU runs the current step (`make_batch` costs
    40-90 ms of Python a step, a fifth of a step on the GPU). `plan()` -> (vision_only, n_pages) is asked per
    batch; `build(pages, n_pages)` makes it. `next()` returns (vision_only, n_pages, batch) and re-raises an
    error of the thread."""

    def __init__(self, pool: PagePool, plan, build, pages_per_step: int, depth: int = 2):
        self.pool, self.plan, self.build, self.pages_per_step = pool, plan, build, pages_per_step
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        wait = self.pages_per_step
        try:
            while not self.stop.is_set():
                vision_only, n_pages = self.plan()
                per = max(1, self.pages_per_step // n_pages)
                pages = self.pool.take(per * n_pages, wait_min=wait)
                wait = 0
                put_until_stopped(self.q, (vision_only, n_pages, self.build(pages, n_pages)), self.stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop
            put_until_stopped(self.q, exc, self.stop)

    def next(self):
        item = self.q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        try:
            while True:
                self.q.get_nowait()
        except queue.Empty:
            pass
        self.thread.join(timeout=10)
