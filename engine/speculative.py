"""Lossless speculative decoding of a chunk on the R-SWA ring cache: token-identical to `official_generate`.

Loop (see `engine.verify` for one round):
1. processor inputs and the official rule exactly as `engine.official` builds them (n, window and the
   absence of any other logits processor are read from the model's own generate setup);
2. prefill the prefix into an `RswaKVCache` whose ring has room for ``k_max + 1`` tokens per step;
   the first token is the greedy choice after the rule on the prompt;
3. each round: the `DraftPolicy` asks the drafters for a draft (``lossless``; never in ``plain``), then one
   verify forward emits the accepted draft tokens + the target's own token (a draftless round is a plain
   single-token step); stop at EOS or ``max_new_tokens``, as generate does.

Mode ``plain`` is the same engine with no drafts: one token per forward. Mode ``fast`` drafts like
``lossless`` but also accepts a draft token the target gives probability >= ``fast_threshold`` (see
``engine.verify.verify_round``): not token-identical, never truncated; ``relaxed_tokens`` counts those tokens.
Every mode records the log-probability of each emitted token (``DecodeResult.logprobs``).

Stats (``DecodeResult.extra["speculative"]``, merged into ``ChunkOutput.chunk_stats``; pages get their
token share of the counts and times): tokens, forwards (1 prefill + verify_rounds + single_steps),
verify_rounds (forwards with a draft), single_steps (draftless forwards), draft_tokens, accepted_tokens,
tau (accepted draft tokens per verify round), drafters (rounds/proposed/accepted/acceptance by drafter, and
acceptance by position in the draft), draft_share (share of the decode's wall time spent drafting),
prefill_s (processor + vision + prefix forward + first token), draft_s, verify_s, single_s, cache_bytes,
ring_slots. Pages also get the chunk's tau, draft_share, drafters and backend (eager here; static or graphs
from `engine.fast_decoder`). ``DecodeResult.seconds`` is the wall time of the whole decode, processor included.
"""

from __future__ import annotations

import time
from typing import Any

from engine.chunk_decode import ChunkOutput, assemble, describe_model, free_device_memory, no_room, token_budget
from engine.drafters import Drafter
from engine.drafters.block import BlockDrafter, BlockDrafterNet
from engine.drafters.markup import MarkupDrafter
from engine.drafters.ngram import NgramDrafter
from engine.drafters.policy import DraftPolicy
from engine.drafters.suffix_match import ReferenceDrafter, ReplayDrafter
from engine.model import PAGE_SEPARATOR, LoadedModel
from engine.ngram_rule import NoRepeatNgramRule, greedy_token
from engine.official import DecodeResult, decode_text, official_generation_config, official_inputs
from engine.runner import RswaRunner
from engine.verify import token_logprob, verify_round

MODES = ("plain", "lossless", "fast")
DEFAULT_FAST_THRESHOLD = 0.3
DRAFTERS = ("reference", "replay", "markup", "ngram", "block")
SHARED_STATS = ("verify_rounds", "single_steps", "draft_tokens", "accepted_tokens", "relaxed_tokens",
                "prefill_s", "draft_s", "verify_s", "single_s")


def official_rule(loaded: LoadedModel, prompt_kind: str) -> tuple[int, int]:
    """(ngram_size, window_size) of the rule generate() installs with the official config (merged with the
    checkpoint's generation config, as generate does); raises if generate would also apply any other logits
    processor or stopping rule than EOS and max_new_tokens (the engine would then not be exact)."""
    from transformers.models.unlimited_ocr.generation_unlimited_ocr import (
        UnlimitedOcrSlidingWindowNoRepeatNgramLogitsProcessor as Rule)

    config, _ = loaded.model._prepare_generation_config(official_generation_config(loaded, prompt_kind, 1))
    processors = loaded.model._get_logits_processor(config, input_ids_seq_length=1, device="cpu", model_kwargs={})
    others = [type(p).__name__ for p in processors if not isinstance(p, Rule)]
    rules = [p for p in processors if isinstance(p, Rule)]
    if others or len(rules) != 1:
        raise ValueError(f"official generate uses logits processors the engine does not reproduce: {others}")
    if config.stop_strings is not None or config.max_time is not None:
        raise ValueError("official generate stops on stop_strings or max_time; the engine does not reproduce that")
    return rules[0].ngram_size, rules[0].window_size


class SpeculativeDecoder:
    """ChunkDecoder of modes ``plain`` and ``lossless`` (token-identical to the official path).

    k_max: most draft tokens per verify round (the ring holds window + k_max slots).
    replay_k_max: the same for the replay drafter of a re-run, whose drafts are nearly always right (a wider verify
    costs less per token: on a 2-core CPU a re-run took 0.31 / 0.26 / 0.22 of the first run at 16 / 32 / 64,
    `scripts/bench_replay_k.py`); the eager engine sizes each chunk's ring for it. The static runner's widths are
    fixed when it is built (k_max + 1), so there the replay drafter stays within k_max.
    drafters: names, in priority order, used in lossless mode: ``reference`` (needs reference_texts),
    ``replay`` (needs replay_ids), ``markup`` (box-header punctuation), ``ngram`` (always available), ``block``
    (needs ``block_net``, a trained `BlockDrafterNet` for this target; the runner then keeps the features it
    needs on every forward).
    block_beside_copies: False (default): a chunk with a full copy source (replay ids, or a text layer on every
    page) decodes without the block drafter. The copy drafters alone were faster there (issue 5's CPU benchmark,
    20 text-layer pages: 4.26x official alone, 3.39x with the block drafter asked too); it serves pages with
    nothing to copy.
    block_sits_out: True (default): the block drafter sits out rounds after a wholly rejected draft, as
    `DraftPolicy` benches any drafter; False: it drafts every round (14% fewer forwards on hard CPU pages but no
    faster there, where a draft costs ~0.45 of a plain step; to be measured on a GPU).
    block_full_k: False (default): after a miss the block drafter's K falls to just past what was accepted, as
    for every drafter; True: it always drafts its whole block (`DraftPolicy` ``keeps_k``). On the CPU a wider verify
    costs more (3.7% fewer forwards, slower: session 13); on the H200 a width-9 verify costs 1.11 ms against 0.96 at
    width 4, and the offline policy replay (`scripts/simulate_policy.py`) puts it ahead there; to be measured.
    """

    def __init__(self, loaded: LoadedModel, mode: str = "lossless", k_max: int = 16,
                 drafters: tuple[str, ...] = DRAFTERS, fast_threshold: float = DEFAULT_FAST_THRESHOLD,
                 block_net: BlockDrafterNet | None = None, block_beside_copies: bool = False, block_sits_out: bool = True,
                 replay_k_max: int = 64, block_full_k: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        unknown = set(drafters) - set(DRAFTERS)
        if unknown:
            raise ValueError(f"unknown drafters {sorted(unknown)}; choose among {DRAFTERS}")
        if k_max < 1 or replay_k_max < 1:
            raise ValueError("k_max and replay_k_max must be >= 1")
        if not 0.0 < fast_threshold <= 1.0:
            raise ValueError("fast_threshold must be in (0, 1]")
        self.fast_threshold = fast_threshold
        self.block_net = block_net
        self.block_beside_copies = block_beside_copies
        self.block_sits_out = block_sits_out
        self.block_full_k = block_full_k
        if block_net is not None and block_net.config.target_hidden != loaded.model.config.text_config.hidden_size:
            raise ValueError(f"the block drafter was made for hidden size {block_net.config.target_hidden}, the "
                             f"model has {loaded.model.config.text_config.hidden_size}")
        self.loaded = loaded
        self.mode = mode
        self.k_max = k_max
        self.replay_k_max = replay_k_max
        self.drafter_names = tuple(drafters)
        self.model_name = loaded.name
        self.device = str(loaded.device)
        self.runner = RswaRunner(loaded.model)
        self._rules = {kind: official_rule(loaded, kind) for kind in ("single", "multi")}

    def describe(self) -> dict[str, Any]:
        return {**describe_model(self.loaded), "mode": self.mode,
                "k_max": self.k_max, "replay_k_max": self.replay_k_max, "drafters": self._active_names() if self.mode != "plain" else [],
                **({"fast_threshold": self.fast_threshold} if self.mode == "fast" else {})}

    def free_memory(self) -> None:
        free_device_memory()

    def decode(self, images: list, context_limit: int, max_new_tokens: int | None = None,
               reference_texts: list[str] | None = None, replay_ids: list[int] | None = None) -> ChunkOutput:
        """reference_texts: known text per page (e.g. the PDF text layer); replay_ids: output ids of an
        earlier run of the same pages. Both only steer the drafts, never the output."""
        n = len(images)
        budget = token_budget(self.loaded, n, context_limit, max_new_tokens)
        if budget is None:
            return no_room(n, context_limit)
        limit, limit_is_room = budget
        t0 = time.perf_counter()
        res = self.generate(images, limit, reference_texts, replay_ids)
        out = assemble(res, n, hit_context=(res.finish_reason != "eos" and limit_is_room),
                       page_sep_id=self.loaded.page_sep_id)
        stats = res.extra["speculative"]
        out.chunk_stats.update(stats, wall_seconds=round(time.perf_counter() - t0, 4))
        for page in out.pages:
            share = page.stats["tokens"] / len(res.output_ids) if res.output_ids else 0.0
            page.stats.update({key: _scaled(stats[key], share) for key in SHARED_STATS}, tau=stats["tau"],
                              mode=self.mode, draft_share=stats["draft_share"], drafters=stats["drafters"],
                              backend=stats.get("backend", "eager"))
        return out

    def generate(self, images: list, max_new_tokens: int, reference_texts: list[str] | None = None,
                 replay_ids: list[int] | None = None) -> DecodeResult:
        """One decode of ``images`` (1 page: single prompt, else multi), up to ``max_new_tokens``."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        loaded, eos = self.loaded, self.loaded.eos_token_id
        kind = "single" if len(images) == 1 else "multi"
        t0 = time.perf_counter()
        inputs = official_inputs(loaded, images, kind)
        prompt_ids = inputs["input_ids"][0].tolist()
        rule = NoRepeatNgramRule(*self._rules[kind], prompt_ids)
        drafters = self._drafters(kind, reference_texts, replay_ids)
        block = next((d for d in drafters if isinstance(d, BlockDrafter)), None)
        self.runner.capture_layers = tuple(self.block_net.config.layers) if block else ()
        caps = self._caps(drafters, self.replay_k_max)
        cache, logits = self.runner.prefill(inputs, max_step_tokens=max([self.k_max, *caps.values()]) + 1)
        if block:
            block.feed(self.runner.features)
        output = [greedy_token(logits, rule.banned())]
        logprobs = [token_logprob(logits, output[0])]
        rule.extend(output)
        fast = self.fast_threshold if self.mode == "fast" else None
        strict = frozenset(i for i in (eos, loaded.page_sep_id) if i is not None)
        policy = DraftPolicy(drafters, self.k_max, caps)

        def one_round(last: int, draft: list[int]) -> tuple[list[int], list[float], int]:
            step = verify_round(self.runner, cache, rule, last, draft, eos, fast, strict)
            if block:
                block.feed(self.runner.features[: len(step.emitted)])  # the inputs this round committed
            return step.emitted, step.logprobs, step.relaxed

        loop = run_rounds(policy, one_round, output, logprobs, rule, eos, max_new_tokens,
                          prefill_s=time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        stats = {"mode": self.mode, "k_max": self.k_max, "tokens": len(output), **loop,
                 "cache_bytes": cache.nbytes(), "ring_slots": cache.ring_size}
        return DecodeResult(prompt_ids=prompt_ids, output_ids=output,
                            finish_reason="eos" if output[-1] == eos else "length", seconds=seconds,
                            text=decode_text(loaded, output), prompt_kind=kind, n_pages=len(images),
                            ngram_window=self._rules[kind][1], extra={"speculative": stats}, logprobs=logprobs)

    def _drafters(self, kind: str, reference_texts: list[str] | None, replay_ids: list[int] | None) -> list[Drafter]:
        """The configured drafters that have what they need for this decode (none in plain mode)."""
        if self.mode == "plain":
            return []  # lossless and fast draft alike
        drafters: list[Drafter] = []
        for name in self.drafter_names:
            if name == "reference" and reference_texts:
                separator = PAGE_SEPARATOR if kind == "multi" else None
                drafters.append(ReferenceDrafter(self.loaded.tokenizer, reference_texts, separator))
            elif name == "replay" and replay_ids:
                drafters.append(ReplayDrafter(replay_ids))
            elif name == "markup":
                drafters.append(MarkupDrafter(self.loaded.tokenizer))
            elif name == "ngram":
                drafters.append(NgramDrafter())
            elif name == "block" and self.block_net is not None and (
                    self.block_beside_copies or not self._copy_source(reference_texts, replay_ids)):
                block = self._block_drafter()
                block.sits_out, block.keeps_k = self.block_sits_out, self.block_full_k  # read by DraftPolicy
                drafters.append(block)
        return drafters

    @staticmethod
    def _caps(drafters: list[Drafter], replay_k_max: int) -> dict[str, int]:
        """Per-drafter draft caps other than k_max (`DraftPolicy`): the replay drafter's, when it drafts."""
        return {"replay": replay_k_max} if any(d.name == "replay" for d in drafters) else {}

    def _block_drafter(self) -> Drafter:
        """The block drafter of one decode (the eager one here; the static path drafts from static buffers)."""
        model = self.loaded.model
        return BlockDrafter(self.block_net, model.get_input_embeddings(), model.lm_head)

    def _copy_source(self, reference_texts: list[str] | None, replay_ids: list[int] | None) -> bool:
        """A configured copy drafter has something for every page of the chunk."""
        if replay_ids and "replay" in self.drafter_names:
            return True
        return bool(reference_texts) and "reference" in self.drafter_names and all(t.strip() for t in reference_texts)

    def _active_names(self) -> list[str]:
        return [n for n in self.drafter_names if n != "block" or self.block_net is not None]


def run_rounds(policy: DraftPolicy, one_round, output: list[int], logprobs: list[float], rule: NoRepeatNgramRule,
               eos: int, max_new_tokens: int, prefill_s: float) -> dict[str, Any]:
    """The decode loop shared by the eager and the static engines. `output` (first token already chosen) and
    `logprobs` grow in place until EOS or `max_new_tokens`; each round the policy drafts (or not) and
    ``one_round(last_token, draft) -> (emitted, their logprobs, relaxed accepts)`` verifies. Returns the loop's
    stats: verify_rounds, single_steps, forwards, draft_tokens, accepted_tokens, tau, relaxed_tokens, drafters
    and the time split (prefill_s, draft_s, verify_s, single_s)."""
    times = {"prefill_s": prefill_s, "draft_s": 0.0, "verify_s": 0.0, "single_s": 0.0}
    started = time.perf_counter() - prefill_s
    rounds = singles = relaxed = 0
    while output[-1] != eos and len(output) < max_new_tokens:
        t = time.perf_counter()
        name, draft = policy.propose(output, max_new_tokens - len(output) - 1)
        t_draft = time.perf_counter()
        emitted, step_logprobs, step_relaxed = one_round(output[-1], draft)
        t_done = time.perf_counter()
        logprobs += step_logprobs
        relaxed += step_relaxed
        times["draft_s"] += t_draft - t
        if draft:
            policy.record(name, len(draft), len(emitted) - 1)
            times["verify_s"] += t_done - t_draft
            rounds += 1
        else:
            times["single_s"] += t_done - t_draft
            singles += 1
        output += emitted
        rule.extend(emitted)
    accepted = sum(s.accepted for s in policy.stats.values())
    return {"verify_rounds": rounds, "single_steps": singles, "forwards": 1 + rounds + singles,
            "draft_tokens": sum(s.proposed for s in policy.stats.values()), "accepted_tokens": accepted,
            "tau": round(accepted / rounds, 4) if rounds else 0.0, "relaxed_tokens": relaxed,
            "drafters": {name: s.as_dict() for name, s in policy.stats.items()},
            "draft_share": round(times["draft_s"] / max(1e-9, time.perf_counter() - started), 4),
            **{key: round(value, 4) for key, value in times.items()}}


def _scaled(value: float, share: float) -> float:
    return round(value * share, 4) if isinstance(value, float) else round(value * share, 2)


def decode_ids(loaded: LoadedModel, images: list, max_new_tokens: int, mode: str = "lossless", k_max: int = 16,
               drafters: tuple[str, ...] = DRAFTERS, reference_texts: list[str] | None = None,
               replay_ids: list[int] | None = None, fast_threshold: float = DEFAULT_FAST_THRESHOLD,
               block_net: BlockDrafterNet | None = None, replay_k_max: int = 64) -> list[int]:
    """Output ids of one decode (EOS included when reached), for tests and benchmarks."""
    decoder = SpeculativeDecoder(loaded, mode=mode, k_max=k_max, drafters=drafters, fast_threshold=fast_threshold,
                                 block_net=block_net, replay_k_max=replay_k_max)
    return decoder.generate(images, max_new_tokens, reference_texts, replay_ids).output_ids
