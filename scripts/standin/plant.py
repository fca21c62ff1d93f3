"""Planting the stand-in's output into random full-size weights, through the model's own forward.

Greedy decoding of a chunk of P pages then writes page 1's N tokens, ``<PAGE>``, page 2's N tokens, ... page P's N
tokens and EOS (one page: its N tokens and EOS), every token distinct (the no-repeat rule never fires). The model is
the real class; only the values of some weights are chosen:
- **Path.** Page k's tokens are N distinct ids of the vocabulary (pages never share one). Each token's embedding is
  a random vector (the *random part*, in all but ``6 + 2K`` dims) scaled to one norm; the lm_head row of its
  successor is that random part, so the current token's embedding, which dominates the residual stream, picks its
  successor by a wide margin (bf16 cannot flip it). The last prompt token (``.``) leads to page 1's first token.
- **Page end** (layer 0, head 0). Its query is zero, so it averages the values of everything it sees: the prefix
  (BOS, P pages of image tokens, the prompt) and the last ``W`` output tokens (R-SWA). Only two kinds of token
  have a value: each page's view separator (``+u``: P of them) and each output token of page k
  (``-(k + 1.5) u / W``). At the last token of page k the W tokens it sees are all of page k, so the sum is
  ``u (P - k - 1.5)``: positive while pages remain. A gate of layer 0's MLP passes that sign only at the last
  token of a page (a flag in its embedding; ``silu(0) = 0`` elsewhere), and the lm_head rows of ``<PAGE>`` and
  EOS read it with opposite signs.
- **Next page** (layer 0, head 1). Its query and keys see only output tokens (a flag that prefix tokens lack, in
  RoPE's slowest pair of dims, so the last W tokens are weighted alike whatever the position), and its values
  carry the page index (one-hot). At ``<PAGE>`` it reads the page just finished, and the lm_head row of the next
  page's first token reads that.
- **Kept clean.** No other layer, head, expert or MLP unit writes into the planted dims (those rows of their output
  projections are zero), the vision projector writes none of them either, and the random layers' writes are
  scaled by ``write_scale``. Every other weight stays random at the usual init, so attention patterns and the MoE
  router's choices (from each token's random embedding) spread as random weights do.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FLAG = 4.0  # embedding values of the planted flags, in units of the embedding's rms per dim
CHAIN_LOGIT = 40.0  # the successor's logit (the random part's norm times the row's scale)
END_LOGIT = 24.0  # <PAGE> / EOS at a page's last token, before the decision
START_LOGIT = 16.0  # the next page's first token at <PAGE>
ROUTE_SCORE = 25.0  # head 1's attention score for an output token (prefix tokens: 0)
GATE = 2.0  # layer 0 MLP unit 0: silu(GATE * FLAG) at a page's last token


class Dims:
    """Where the planted values live in the hidden state (the last ``6 + 2K`` dims)."""

    def __init__(self, hidden: int, pages: int):
        self.u, self.flag, self.end, self.a, self.d, self.pad = (hidden - 1 - i for i in range(6))
        self.page = [hidden - 7 - j for j in range(pages)]  # one-hot page index (embedding)
        self.next = [hidden - 7 - pages - j for j in range(pages)]  # head 1's output: the page just read
        self.random = hidden - 6 - 2 * pages
        self.planted = list(range(self.random, hidden))


def token_path(vocab: int, reserved: set[int], tokens_per_page: int, pages: int, seed: int) -> list[list[int]]:
    """N distinct token ids per page for ``pages`` pages, none reserved."""
    pool = [t for t in torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()
            if t not in reserved]
    if len(pool) < pages * tokens_per_page:
        raise ValueError(f"{pages} pages of {tokens_per_page} tokens need {pages * tokens_per_page:,} ids; "
                         f"the vocabulary has {len(pool):,} free")
    return [pool[k * tokens_per_page:(k + 1) * tokens_per_page] for k in range(pages)]


def _random_rows(n: int, dims: Dims, hidden: int, gen: torch.Generator, device) -> torch.Tensor:
    """[n, hidden] fp32: a random part of rms 1 per dim (norm sqrt(random dims)), zeros in the planted dims."""
    rows = torch.zeros(n, hidden, device=device)
    part = torch.randn(n, dims.random, generator=gen, device=device)
    rows[:, :dims.random] = part * (math.sqrt(dims.random) / part.norm(dim=1, keepdim=True))
    return rows


@torch.no_grad()
def plant(model, path: list[list[int]], prompt_end: int, page_sep: int, eos: int, image_tokens_per_page: int,
          prompt_tokens: int = 8, seed: int = 0, write_scale: float = 0.25) -> dict:
    """Plant ``path`` (token ids per page) into ``model`` (in place, any device and dtype). Returns what was set."""
    text = model.model.language_model
    cfg = text.config
    hidden, window, heads = cfg.hidden_size, cfg.sliding_window, cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or hidden // heads
    pages, n = len(path), len(path[0])
    if heads < 2 or cfg.num_key_value_heads != heads or pages > hd:
        raise ValueError(f"planting needs >= 2 attention heads without grouping and <= {hd} pages")
    if n < window:
        raise ValueError(f"{n} tokens a page is below the R-SWA window {window}: the page-end rule needs a full window")
    if text.config.mlp_layer_types[0] != "dense":
        raise ValueError("planting needs a dense MLP in layer 0")
    dims = Dims(hidden, pages)
    device = text.embed_tokens.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    u, low = FLAG, hd // 2 - 1  # RoPE's slowest pair: dims low and low + hd/2

    # embeddings: random rows for every token; planted values and a pad to one norm for the path, <PAGE>, separator
    vocab = text.embed_tokens.weight.shape[0]
    emb = _random_rows(vocab, dims, hidden, gen, device)
    page_u = [-(k + 1.5) * u / window for k in range(pages)]  # exact in bf16 for window a power of two
    budget = FLAG ** 2 * 3 + max(page_u[-1] ** 2, u ** 2) + 1.0
    for k, ids in enumerate(path):
        idx = torch.tensor(ids, device=device)
        emb[idx, dims.flag] = FLAG
        emb[idx, dims.u] = page_u[k]
        emb[idx, dims.page[k]] = FLAG
        emb[idx[-1], dims.end] = FLAG
    emb[page_sep, dims.flag] = FLAG
    planted_rows = torch.tensor(sorted({t for ids in path for t in ids} | {page_sep}), device=device)
    used = emb[planted_rows][:, dims.planted].pow(2).sum(1)
    emb[planted_rows, dims.pad] = (budget - used).sqrt()
    text.embed_tokens.weight.copy_(emb)

    outer = model.model
    sep = _random_rows(1, dims, hidden, gen, device)[0]
    sep[dims.u] = u
    sep[dims.pad] = math.sqrt(budget - u ** 2)
    outer.view_separator.copy_(sep)
    outer.image_newline.copy_(_random_rows(1, dims, hidden, gen, device)[0])
    outer.multi_modal_projector.weight[dims.planted] = 0
    if outer.multi_modal_projector.bias is not None:
        outer.multi_modal_projector.bias[dims.planted] = 0

    # every layer: no writes into the planted dims, random writes scaled
    for layer in text.layers:
        outs = [layer.self_attn.o_proj.weight]
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            mlp.experts.down_proj.mul_(write_scale)
            mlp.experts.down_proj[:, dims.planted, :] = 0
            outs.append(mlp.shared_experts.down_proj.weight)
        else:
            outs.append(mlp.down_proj.weight)
        for w in outs:
            w.mul_(write_scale)
            w[dims.planted] = 0
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
    text.norm.weight.fill_(1.0)

    # layer 0 heads 0 (page end) and 1 (next page); MLP unit 0 (the gate)
    attn = text.layers[0].self_attn
    q, k, v, o = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight
    for w in (q, k, v):
        w[: 2 * hd] = 0
    o[:, : 2 * hd] = 0
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        if proj.bias is not None:
            proj.bias[: 2 * hd] = 0
    v[0, dims.u] = 1.0
    o[dims.a, 0] = 1.0
    g = math.sqrt(ROUTE_SCORE * math.sqrt(hd)) / FLAG
    q[hd + low, dims.flag] = g
    k[hd + low, dims.flag] = g
    for j in range(pages):
        v[hd + j, dims.page[j]] = 1.0
        o[dims.next[j], hd + j] = 1.0
    mlp = text.layers[0].mlp
    gate_out = F.silu(torch.tensor(GATE * FLAG)).item()
    z_max = pages * image_tokens_per_page + prompt_tokens + window
    a_min = u * 0.5 / z_max  # head 0's output at P = k + 1 (the closest call)
    gain = 0.1 / (gate_out * a_min)  # the gate's output there: 0.1 of an embedding rms
    mlp.gate_proj.weight[0] = 0
    mlp.up_proj.weight[0] = 0
    mlp.down_proj.weight[:, 0] = 0
    mlp.gate_proj.weight[0, dims.end] = GATE
    mlp.up_proj.weight[0, dims.a] = 1.0
    mlp.down_proj.weight[dims.d, 0] = gain

    # lm_head: successors, the page end, the next page's first token
    head = model.lm_head.weight
    head.zero_()
    unit = CHAIN_LOGIT / dims.random  # row = random part * unit: logit ~ CHAIN_LOGIT for the current token
    pairs = [(prompt_end, path[0][0])] + [(ids[i], ids[i + 1]) for ids in path for i in range(n - 1)]
    src = torch.tensor([a for a, _ in pairs], device=device)
    dst = torch.tensor([b for _, b in pairs], device=device)
    head[dst] = (emb[src] * unit).to(head.dtype)
    head[:, dims.planted] = 0
    decision = 1.0 / 0.1  # logits per unit of the gate's output: >= 1 each side at the closest call
    head[eos, dims.end] = END_LOGIT / FLAG
    head[page_sep, dims.end] = END_LOGIT / FLAG
    head[eos, dims.d] = -decision
    head[page_sep, dims.d] = decision
    for j in range(pages - 1):
        head[path[j + 1][0], dims.next[j]] = START_LOGIT / FLAG
    return {"pages": pages, "tokens_per_page": n, "planted_dims": len(dims.planted), "random_dims": dims.random,
            "gate_gain": round(gain, 2), "write_scale": write_scale, "seed": seed}
