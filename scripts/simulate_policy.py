#!/usr/bin/env python3
"""Replay the engine's draft policy offline: what tau, rounds and decode time a block-drafter policy would give,
without running the target again. For choosing a policy for a machine you are not on (issue 7: the GPU).

The target decodes held-out pages once (``lossless`` with the drafter: its own greedy tokens); one R-SWA forward
gives the drafter's features at every position (`engine.drafters.block_teacher`), so each round's draft is the
drafter's forward on the committed context, and the accepted length is its agreement with the decoded tokens.
The rules are `engine.drafters.policy.DraftPolicy`'s for the block drafter alone: K doubles while drafts are fully
accepted and falls to just past the accepted ones after a miss (``fullk``: stays at the block), and a wholly
rejected draft benches the drafter for 1, 2, 4 .. 16 rounds of single steps (``nosit``: never). With float-equal
features it reproduces the engine's rounds exactly (tests/test_block_drafter.py checks it on a tiny model).

Time is estimated from a live check's per-step costs (``--costs``: a `train_drafter.py --eval-only --json`
record: ms per bare step by verify width, ms per draft; default: the H200 figures of session 12) plus
``--host-ms`` of host work per verify round; ``plain`` is one width-1 step per token. Prefill is left out (the
same on both sides). Prints a table, then one JSON line.

    python scripts/simulate_policy.py --model models/demo --pages 24 --multi-frac 0.5
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.drafters.block import BlockDrafterNet, PageMemory, drafter_folder  # noqa: E402
from engine.drafters.block_teacher import TeacherSequence, make_examples  # noqa: E402
from engine.drafters.policy import MAX_BACKOFF  # noqa: E402

# session 12, H200, fp32 demo model, batched-GEMV projections + matmul attention
# (docs/results/eval_drafter_demo_s12e_bmv_matmul_h200_2026-12-04.json)
H200_COSTS = {"ms_step_by_width": {"1": 0.753, "2": 0.923, "4": 0.964, "8": 1.115, "9": 1.108}, "ms_draft": 0.423}
POLICIES = {"default": (True, False), "nosit": (False, False), "fullk": (True, True), "fullk+nosit": (False, True)}


def simulate(net: BlockDrafterNet, seqs: list[TeacherSequence], embed, head, eos: int, sits_out: bool = True,
             full_k: bool = False, k_max: int | None = None) -> dict:
    """Rounds of the block drafter alone over every sequence (batched across sequences), as the engine runs them
    with ``k_max`` (default: the block) and the policy flags. Returns counts and the verify widths used."""
    c = net.config
    k_max = min(k_max or c.block, c.block)
    dtype = next(net.parameters()).dtype
    state = [{"t": 0, "k": k_max, "sit": 0, "backoff": 1, "fed": s.prompt_len} for s in seqs]
    rounds = singles = accepted = 0
    widths: dict[int, int] = {}
    by_position = torch.zeros(c.block)
    proposed = torch.zeros(c.block)
    with torch.no_grad():
        memory_all = None  # every sequence's page memory, projected once; each forward picks its rows by index
        if c.memory:
            prompts = [s.features[: s.prompt_len] for s in seqs]
            memory_all = net.encode_memory(torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True).to(dtype),
                                           [p.shape[0] for p in prompts])
        while True:
            ask = []
            for i, (s, st) in enumerate(zip(seqs, state)):
                if st["t"] >= len(s.output_ids) - 1:
                    continue  # decoded to its end
                if st["sit"] > 0 or s.prompt_len + st["t"] < c.context:  # benched, or too little context
                    st["sit"] = max(0, st["sit"] - 1)
                    st["t"] += 1
                    singles += 1
                else:
                    ask.append(i)
            if not ask:
                if all(st["t"] >= len(s.output_ids) - 1 for s, st in zip(seqs, state)):
                    break
                continue
            feats, last, targets = make_examples(seqs, [(i, state[i]["t"]) for i in ask], c.context, c.block, embed)
            memory = None
            if memory_all is not None:
                memory = PageMemory(memory_all.kv, memory_all.allowed, torch.tensor(ask, device=feats.device))
            drafts = net(feats.to(dtype), last.to(dtype), head, memory).argmax(-1).tolist()
            targets = targets.tolist()
            for row, i in enumerate(ask):
                s, st = seqs[i], state[i]
                t = st["t"]
                # the engine's room: up to max_new_tokens (= the decode's length unless it ended with EOS) less one
                room = len(s.output_ids) - t - 2 if s.output_ids[-1] != eos else c.block
                k = min(st["k"], room)
                if k < 1:
                    st["t"] += 1
                    singles += 1
                    continue
                a = 0
                while a < k and drafts[row][a] == targets[row][a]:
                    a += 1
                rounds += 1
                accepted += a - (a > 0 and targets[row][a - 1] == eos)  # the engine counts a drafted EOS as emitted
                widths[k + 1] = widths.get(k + 1, 0) + 1
                proposed[:k] += 1
                by_position[:a] += 1
                st["t"] += a + 1
                st["k"] = k_max if full_k else min(k_max, 2 * (a + 1))
                if a == 0 and sits_out:
                    st["sit"], st["backoff"] = st["backoff"], min(MAX_BACKOFF, 2 * st["backoff"])
                else:
                    st["backoff"] = 1
    tokens = sum(len(s.output_ids) for s in seqs)
    return {"tokens": tokens, "rounds": rounds, "singles": singles, "forwards": rounds + singles, "accepted": accepted,
            "tau": round(accepted / max(1, rounds), 3), "widths": dict(sorted(widths.items())),
            "acceptance_by_position": [round(float(a / p), 3) if p else 0.0 for a, p in zip(by_position, proposed)]}


def estimate_ms(result: dict, costs: dict, host_ms: float) -> tuple[float, float]:
    """(lossless ms, plain ms) of the decode loops by the per-step costs; a width uses the smallest measured width
    at or above it."""
    by_width = {int(w): ms for w, ms in costs["ms_step_by_width"].items()}

    def step(w: int) -> float:
        return by_width[min((m for m in by_width if m >= w), default=max(by_width))]

    verify = sum(n * (costs["ms_draft"] + host_ms + step(w)) for w, n in result["widths"].items())
    # a plain decode emits its first token from the prefill, then one step per token; so does the lossless one
    return verify + result["singles"] * step(1), (result["tokens"] - 1) * step(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", help="drafter folder (default: <model>/drafter)")
    ap.add_argument("--pages", type=int, default=24, help="held-out pages (seeds 820,000 ..), decoded once")
    ap.add_argument("--multi-frac", type=float, default=0.5)
    ap.add_argument("--multi-pages", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=1500)
    ap.add_argument("--costs", help="a live-check JSON record (train_drafter.py --eval-only --json) for the step costs")
    ap.add_argument("--host-ms", type=float, default=0.08, help="host work per verify round, ms")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", help="also write the record here")
    args = ap.parse_args(argv)

    from engine.model import load_model
    from scripts.train_drafter import decoded_heldout_seqs

    loaded = load_model(args.model, args.device, args.dtype)
    folder = Path(args.drafter) if args.drafter else drafter_folder(args.model)
    net = BlockDrafterNet.load(folder, loaded.device, loaded.dtype)
    costs = H200_COSTS if not args.costs else json.loads(Path(args.costs).read_text())["eval"]
    seqs, chunks = decoded_heldout_seqs(loaded, net, args.pages, args.multi_frac, args.multi_pages, args.seed,
                                        args.max_new_tokens)
    model = loaded.model
    rows = {}
    for name in args.policies.split(","):
        sits_out, full_k = POLICIES[name]
        r = simulate(net, seqs, model.get_input_embeddings(), model.lm_head, loaded.eos_token_id, sits_out, full_k)
        lossless_ms, plain_ms = estimate_ms(r, costs, args.host_ms)
        rows[name] = {**r, "est_lossless_s": round(lossless_ms / 1000, 3), "est_plain_s": round(plain_ms / 1000, 3),
                      "est_x_plain": round(plain_ms / lossless_ms, 3)}
    print(f"{'policy':>12} {'tau':>6} {'rounds':>7} {'singles':>7} {'forwards':>8} {'est s':>7} {'x plain':>8}")
    for name, r in rows.items():
        print(f"{name:>12} {r['tau']:>6.3f} {r['rounds']:>7} {r['singles']:>7} {r['forwards']:>8} "
              f"{r['est_lossless_s']:>7.2f} {r['est_x_plain']:>8.2f}")
    record = {"model": args.model, "drafter": str(folder), "pages": args.pages, "chunks": len(chunks),
              "costs": costs if not args.costs else args.costs, "host_ms": args.host_ms, "policies": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
