"""Teacher data for the block drafter: the target's features of a decoded sequence, from one forward under the
R-SWA mask (prefix global, output window n), checked against the target's own greedy tokens.

A plain forward without a cache uses full causal attention and disagrees with generate() after n output tokens
(docs/unlimited_ocr_notes.md), so a drafter trained on its features would learn another model. Here the mask is
`engine.official.rswa_mask`, and `teacher_features` replays the official no-repeat-ngram rule over the logits of
the same forward: every output token must be the target's greedy choice, or the data is refused.

`label_features` is the cheap variant for synthetic pages: the same forward over the page's *label* tokens (no
decode at all), keeping the target's own greedy choice at every position (``next_ids``). Where the label and the
greedy choice agree, the label path is the path the target decodes; `make_examples` cuts each block at the
first disagreement, so the drafter learns only the target's greedy chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.load import LoadedModel
from engine.model.vision import embed_chunks
from engine.ngram_rule import NoRepeatNgramRule, greedy_token, official_rule
from engine.official import official_inputs, rswa_mask


class TeacherMismatch(RuntimeError):
    """The teacher-forced forward does not reproduce the decoded tokens (wrong mask, or a different model)."""


@dataclass
class TeacherSequence:
    features: torch.Tensor  # [P + T, len(layers) * H]: outputs of the chosen layers at every input position
    output_ids: list[int]  # o_0 .. o_{T-1}
    prompt_len: int  # P
    next_ids: list[int] | None = None  # label data: the target's greedy choice after o_0 .. o_t (None: decoded)


def _forward(loaded: LoadedModel, images: list, output_ids: list[int], layers: list[int]):
    """(prompt ids, P, features [P + T, L*H], logits [P + T, V] fp32) of one R-SWA forward."""
    model = loaded.model
    inputs = official_inputs(loaded, images, "single" if len(images) == 1 else "multi")
    prompt_ids = inputs["input_ids"][0].tolist()
    prompt = embed_chunks(model, loaded.image_token_id, [inputs])[0]
    P, T = prompt.shape[1], len(output_ids)
    out_ids = torch.tensor([output_ids], device=prompt.device)
    embeds = torch.cat([prompt, model.get_input_embeddings()(out_ids).to(prompt.dtype)], dim=1)
    mask = rswa_mask(P, P + T, loaded.sliding_window, device=prompt.device)
    kept: dict[int, torch.Tensor] = {}
    text_layers = model.model.language_model.layers
    hooks = [text_layers[i].register_forward_hook(
        lambda _m, _a, out, i=i: kept.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in layers]
    try:
        logits = model(inputs_embeds=embeds, attention_mask=mask, use_cache=False).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return prompt_ids, P, torch.cat([kept[i][0] for i in layers], dim=-1), logits


def _greedy(raw_choice: int, row: torch.Tensor, banned: set[int]) -> int:
    """The greedy token of one row given its unbanned argmax: the bans change the choice only when they hit the
    argmax itself (masking other ids cannot move the first maximum), so the row is read again only then."""
    return greedy_token(row, banned) if raw_choice in banned else raw_choice


@torch.inference_mode()
def label_features(loaded: LoadedModel, images: list, label_ids: list[int], layers: list[int]) -> TeacherSequence:
    """Features along a page's label tokens (end with EOS), and the target's greedy choice at every position
    (official no-repeat-ngram rule applied along the label path)."""
    kind = "single" if len(images) == 1 else "multi"
    prompt_ids, P, features, logits = _forward(loaded, images, label_ids, layers)
    rule = NoRepeatNgramRule(*official_rule(loaded, kind), prompt_ids)
    rows = logits[P : P + len(label_ids)]
    raw = rows.argmax(-1).tolist()  # one device sync for the page, not one per token
    next_ids = []
    for t, token in enumerate(label_ids):
        rule.extend([token])
        next_ids.append(_greedy(raw[t], rows[t], rule.banned()))
    return TeacherSequence(features=features, output_ids=list(label_ids), prompt_len=P, next_ids=next_ids)


@torch.inference_mode()
def teacher_features(loaded: LoadedModel, images: list, output_ids: list[int], layers: list[int],
                     check: bool = True) -> TeacherSequence:
    """Features of prompt + output_ids (one forward, R-SWA mask). check: replay the official rule over the
    forward's logits and raise `TeacherMismatch` unless every output token is the greedy choice."""
    kind = "single" if len(images) == 1 else "multi"
    prompt_ids, P, features, logits = _forward(loaded, images, output_ids, layers)
    if check:
        rule = NoRepeatNgramRule(*official_rule(loaded, kind), prompt_ids)
        rows = logits[P - 1 : P - 1 + len(output_ids)]
        raw = rows.argmax(-1).tolist()
        for t, token in enumerate(output_ids):
            choice = _greedy(raw[t], rows[t], rule.banned())
            if choice != token:
                raise TeacherMismatch(f"output token {t}: the R-SWA forward chooses {choice}, the decode had {token}")
            rule.extend([token])
    return TeacherSequence(features=features, output_ids=list(output_ids), prompt_len=P)


def training_windows(seqs: list[TeacherSequence], context: int) -> list[tuple[int, int]]:
    """(sequence index, anchor t) pairs usable for training: the context [P+t-C, P+t) lies inside the sequence
    and o_{t+1} exists."""
    return [(s, t) for s, seq in enumerate(seqs)
            for t in range(max(0, context - seq.prompt_len), len(seq.output_ids) - 1)]


def make_examples(seqs: list[TeacherSequence], picks: list[tuple[int, int]], context: int, block: int,
                  embed_tokens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features [B, C, F], embedding of o_t [B, H], targets o_{t+1} .. o_{t+k} [B, k], -100 past the end).
    Label data: the targets are the target's greedy choices, up to the first one the label path leaves."""
    feats, lasts, targets = [], [], []
    for s, t in picks:
        seq = seqs[s]
        p = seq.prompt_len + t
        feats.append(seq.features[p - context : p])
        lasts.append(seq.output_ids[t])
        if seq.next_ids is None:
            nxt = seq.output_ids[t + 1 : t + 1 + block]
        else:
            nxt = []
            for j in range(t, min(t + block, len(seq.output_ids) - 1)):
                nxt.append(seq.next_ids[j])  # the target's o_{j+1}
                if seq.output_ids[j + 1] != seq.next_ids[j]:
                    break  # the greedy path leaves the label here: later positions are not the target's
        targets.append(nxt + [-100] * (block - len(nxt)))
    device = seqs[0].features.device
    last = embed_tokens(torch.tensor(lasts, device=device))
    return torch.stack(feats), last, torch.tensor(targets, device=device)
