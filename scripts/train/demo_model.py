"""Building blocks of the demo Unlimited-OCR model: tokenizer, config presets, init, forward with R-SWA, save.

The model is the real transformers class (`UnlimitedOcrForConditionalGeneration`) at a small size. The training
forward (`score`) computes the vision features itself (so the vision tower can run without gradients while
frozen), scatters them into the `<image>` positions and runs the decoder with the R-SWA mask of
`engine.official.rswa_mask` (prefix global, output window n), right-padded batches included.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from rapidfuzz.distance import Levenshtein

from engine.model.tiny import BOS, CONTROL_TOKENS, EOS, PAD
from engine.official import PROMPTS, rswa_mask

WINDOW = 128  # R-SWA output window of the real model
PRESETS = {
    # ~13.7M parameters, 1024-pixel base mode (273 tokens a page, like the real model). bf16: ~27 MB, 2 shards.
    # SAM: windowed attention only (16x16-patch windows; no global layer: a third of the vision FLOPs, and
    # reading needs no page-wide attention at patch level: the CLIP stage mixes the 256 tokens globally).
    "demo": dict(
        image_size=1024, vocab=4096,
        sam=dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=3, window_size=16, global_attn_indexes=[],
                 mlp_dim=768, output_channels=128, downsample_channels=[256, 320], use_rel_pos=False),
        enc=dict(hidden_size=320, intermediate_size=640, num_hidden_layers=2, num_attention_heads=5),
        text=dict(hidden_size=320, intermediate_size=896, num_hidden_layers=4, num_attention_heads=5,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=192)),
    # A wider, deeper decoder (6 layers of 384, 6 heads) for character-level tokens: reading a glyph inside a
    # 64 x 64-pixel vision token takes a few hops (where am I, what is next); ~21M parameters, ~42 MB in bf16.
    "demo_l": dict(
        image_size=1024, vocab=4096,
        sam=dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=3, window_size=16, global_attn_indexes=[],
                 mlp_dim=768, output_channels=128, downsample_channels=[256, 384], use_rel_pos=False),
        enc=dict(hidden_size=384, intermediate_size=768, num_hidden_layers=2, num_attention_heads=6),
        text=dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=256)),
    # CPU learnability probes: 256-pixel pages (21 tokens a page), ~3M parameters.
    "small": dict(
        image_size=256, vocab=1024,
        sam=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, window_size=8, global_attn_indexes=[],
                 mlp_dim=512, output_channels=128, downsample_channels=[192, 192], use_rel_pos=False),
        enc=dict(hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=3),
        text=dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=3,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128)),
    # CPU tests: 256-pixel pages (21 tokens a page), well under 1M parameters.
    "tiny": dict(
        image_size=256, vocab=600,
        sam=dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=2, window_size=4, global_attn_indexes=[1],
                 mlp_dim=96, output_channels=48, downsample_channels=[64, 64], use_rel_pos=False),
        enc=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2),
        text=dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=48)),
}


def tokens_per_page(image_size: int) -> int:
    q = math.ceil(image_size // 16 / 4)
    return q * (q + 1) + 1


# ---------------------------------------------------------------- tokenizer
def build_tokenizer(texts: list[str], vocab_size: int, max_token_length: int | None = None):
    """Byte-level BPE with the real model's special tokens: bos id 0, eos 1, pad 2, then `<image>`, `<|ref|>`,
    `<|/ref|>`, `<|det|>`, `<|/det|>`, `<|grounding|>`, `<td>`, `</td>`, `<PAGE>` (each a single token).
    Digits are split into groups of at most 3 (as DeepSeek's tokenizer does), so box coordinates 0-999 are
    one token each. max_token_length: no token longer than that many (byte-level) characters, so that a token
    is a few adjacent glyphs rather than a whole word (None: BPE's default, most words one token); 1: one token
    per character (every non-digit character is its own pre-token, so BPE only merges the bytes of one
    character and digit groups), each output token then shows as one glyph on the page."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    if max_token_length == 1:  # one token per character; digit groups (0-999) stay single tokens
        split, max_token_length = pre_tokenizers.Split(Regex(r"\p{N}{1,3}|[^\p{N}]"), behavior="isolated"), None
    else:
        split = pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD, *CONTROL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  max_token_length=max_token_length)
    numbers = [" ".join(str(i) for i in range(j, j + 50)) for j in range(0, 1000, 50)]
    tok.train_from_iterator(list(texts) + numbers * 20 + list(PROMPTS.values()) * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=CONTROL_TOKENS, model_max_length=32768)


def tokenizer_corpus(n_docs: int, seed0: int = 700_000_000) -> list[str]:
    """Labels of synthetic pages (training seeds only) at several difficulties, for BPE training."""
    from ingest.synth.documents import layout_labels

    return [label for k in range(n_docs) for label in layout_labels(seed0 + k, 1, difficulty=(k % 5) / 4)]


# ---------------------------------------------------------------- config / init
def make_config(tokenizer, preset: str | dict = "demo", window: int = WINDOW, text_init: float = 0.02):
    from transformers import UnlimitedOcrConfig

    p = PRESETS[preset] if isinstance(preset, str) else preset
    size = p["image_size"]
    q = math.ceil(size // 16 / 4)
    sam = dict(p["sam"], image_size=size, patch_size=16, initializer_range=0.02)
    enc = dict(p["enc"], image_size=q * 16, patch_size=16)
    if sam["downsample_channels"][-1] != enc["hidden_size"]:
        raise ValueError("the CLIP encoder's hidden size must equal the SAM output channels")
    text = dict(p["text"], num_key_value_heads=p["text"]["num_attention_heads"], vocab_size=len(tokenizer), max_position_embeddings=32768, sliding_window=window,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, initializer_range=text_init)
    return UnlimitedOcrConfig(vision_config=dict(sam_config=sam, encoder_config=enc), text_config=text,
                              image_token_id=tokenizer.convert_tokens_to_ids("<image>"))


def _sincos_2d(h: int, w: int, dim: int) -> torch.Tensor:
    """MAE-style 2-D sine-cosine position table [h, w, dim]."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter)
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    parts = [torch.sin(ys[..., None] * omega), torch.cos(ys[..., None] * omega),
             torch.sin(xs[..., None] * omega), torch.cos(xs[..., None] * omega)]
    table = torch.cat(parts, -1)
    return F.pad(table, (0, dim - table.shape[-1]))


def new_model(config, seed: int = 0):
    """A fresh model for training from scratch: normal init (std 0.02) everywhere, including the SAM tower
    (its config default 1e-10 leaves it dead), and a 2-D sine-cosine SAM position table (instead of zeros) so
    that a frozen random tower still tells the decoder where each feature comes from."""
    from transformers import UnlimitedOcrForConditionalGeneration

    torch.manual_seed(seed)
    model = UnlimitedOcrForConditionalGeneration(config)
    with torch.no_grad():
        for module in model.model.vision_tower.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                module.weight.normal_(0.0, 0.02)
                if module.bias is not None:
                    module.bias.zero_()
        sam = model.model.vision_tower.sam_encoder
        if sam.pos_embed is not None:
            h, w, dim = sam.pos_embed.shape[1:]
            sam.pos_embed.copy_(0.5 * _sincos_2d(h, w, dim)[None])
    return model


def set_experts_implementation(model, name: str, autocast_dtype=torch.bfloat16) -> str:
    """Use a batched MoE kernel for training when it works here (the eager one loops over experts): set it, then
    run one MoE block forward and backward under autocast; on any error go back to eager."""
    moe = [m for m in model.modules() if type(m).__name__.endswith("TextMoe")]
    if not moe or name == "eager":
        return "eager"
    try:
        model.set_experts_implementation(name)
        block = moe[0]
        device = block.gate.weight.device
        x = torch.randn(2, 8, model.config.text_config.hidden_size, device=device, requires_grad=True)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=device.type == "cuda"):
            y = block(x)
        y.float().sum().backward()
        model.zero_grad(set_to_none=True)
        return name
    except Exception as exc:  # noqa: BLE001 - older transformers, unsupported dtype/device: keep eager
        print(f"experts implementation {name!r} unavailable ({type(exc).__name__}: {exc}); using eager", flush=True)
        model.set_experts_implementation("eager")
        return "eager"


VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "model.image_newline", "model.view_separator")


def copy_vision(model, folder) -> int:
    """Load the vision side (SAM + CLIP towers, projector, newline and separator embeddings) of a saved model
    folder into `model` (a fresh decoder, e.g. with another tokenizer, keeps a trained vision tower). Returns
    the number of tensors copied; raises if a shape differs."""
    from transformers import UnlimitedOcrForConditionalGeneration

    saved = UnlimitedOcrForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)  # maps saved key names
    state = {k: v for k, v in saved.state_dict().items() if k.startswith(VISION_PREFIXES)}
    own = model.state_dict()
    for key, value in state.items():
        if key not in own or own[key].shape != value.shape:
            raise ValueError(f"{key}: {tuple(value.shape)} in {folder}, {tuple(own[key].shape) if key in own else None} here")
    model.load_state_dict(state, strict=False)
    return len(state)


# ---------------------------------------------------------------- forward
def image_embeddings(model, pixel_values: torch.Tensor, grad_vision: bool = True, return_tokens: bool = False):
    """[n_images * tokens_per_page, hidden]: what `get_image_features(...).pooler_output` returns (base mode),
    concatenated; the vision tower runs without gradients when `grad_vision` is False. return_tokens: also the
    projected vision tokens [N, q*q, hidden] (before the newline / separator entries)."""
    m = model.model
    with torch.set_grad_enabled(grad_vision and torch.is_grad_enabled()):
        vision = m.vision_tower(pixel_values).last_hidden_state
    feats = m.multi_modal_projector(vision)  # [N, q*q, D]
    n, qq, d = feats.shape
    q = int(qq ** 0.5)
    grid = torch.cat([feats.view(n, q, q, d), m.image_newline.to(feats.dtype).expand(n, q, 1, d)], dim=2)
    sep = m.view_separator.to(feats.dtype).expand(n, 1, d)
    flat = torch.cat([grid.reshape(n, q * (q + 1), d), sep], dim=1).reshape(-1, d)
    return (flat, feats) if return_tokens else flat


class CharHead(torch.nn.Module):
    """From each projected vision token (64 x 64 pixels) predict the character at each of the 4 x 8 cells
    (16 x 8 pixels) it covers, as logits [N, 4q, 8q, classes] aligned with `synth.doc.char_grid`."""

    def __init__(self, dim: int, n_classes: int, hidden: int = 64):
        super().__init__()
        self.hidden = hidden
        self.proj = torch.nn.Linear(dim, 32 * hidden)
        self.out = torch.nn.Linear(hidden, n_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [N, q*q, D] -> [N, 4q, 8q, classes]
        n, qq, _ = tokens.shape
        q = int(qq ** 0.5)
        h = F.gelu(self.proj(tokens)).view(n, q, q, 4, 8, self.hidden)
        return self.out(h).permute(0, 1, 3, 2, 4, 5).reshape(n, 4 * q, 8 * q, -1)


class AuxHeads(torch.nn.Module):
    """Auxiliary training heads, not part of the saved model: "which character is where" (`synth.doc.char_grid`,
    16 x 8-pixel cells) predicted (1) from the SAM tower's last layer, each 16-pixel patch giving its two cells,
    and (2) from each projected vision token, giving its 4 x 8 cells. They give the vision tower a direct, local
    signal from the first step, instead of only what trickles back through a decoder that is still learning the
    text prior (that alone collapsed the features: docs/demo_model.md). On CPU probes the patch-level loss taught
    the tower to recognise glyphs several times faster than the token-level one alone."""

    def __init__(self, model, n_classes: int):
        super().__init__()
        sam = model.model.vision_tower.sam_encoder
        self.n_classes = n_classes
        self.patch = torch.nn.Linear(sam.config.hidden_size, 2 * n_classes)
        self.token = CharHead(model.config.text_config.hidden_size, n_classes)
        q = model.config.vision_config.sam_config.image_size // 64
        self.where = torch.nn.Linear(model.config.text_config.hidden_size, 2 * q)  # row and column of a token
        self.active = False
        self._sam_out = None
        self._handle = sam.layers[-1].register_forward_hook(self._capture)

    def _capture(self, module, inputs, output):
        if self.active:
            self._sam_out = output[0] if isinstance(output, tuple) else output

    def loss(self, tokens: torch.Tensor, grids: torch.Tensor, empty_share: float = 0.1) -> torch.Tensor:
        """Cross-entropy over the cells holding a character plus a random `empty_share` of the empty ones."""
        h, self._sam_out = self._sam_out, None
        n, rows, cols, _ = h.shape
        patch_logits = self.patch(h).view(n, rows, cols, 2, -1).reshape(n, rows, 2 * cols, self.n_classes)
        token_logits = self.token(tokens)
        keep = (grids > 0) | ((grids == 0) & (torch.rand(grids.shape, device=grids.device) < empty_share))
        target = grids.masked_fill(~keep, -100).reshape(-1)
        total = 0.0
        for logits in (patch_logits, token_logits):
            total = total + F.cross_entropy(logits.float().reshape(-1, self.n_classes), target, ignore_index=-100)
        return total + self.position_loss(tokens)

    def position_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each projected vision token says its own row and column (linearly): keys the decoder can aim at
        (`AlignLoss`) need the position in the features, not only in the 1-D RoPE index."""
        n, qq, _ = tokens.shape
        q = int(qq ** 0.5)
        logits = self.where(tokens).float().view(n, q, q, 2, q)
        rows = torch.arange(q, device=tokens.device).view(1, q, 1).expand(n, q, q)
        cols = torch.arange(q, device=tokens.device).view(1, 1, q).expand(n, q, q)
        return (F.cross_entropy(logits[..., 0, :].reshape(-1, q), rows.reshape(-1))
                + F.cross_entropy(logits[..., 1, :].reshape(-1, q), cols.reshape(-1)))

    def remove(self) -> None:
        self._handle.remove()


class AlignLoss(torch.nn.Module):
    """Guided attention, training only (nothing is added to the model). Each spec (layer, heads, look) asks the
    first `heads` heads of decoder layer `layer` to attend, among the image slots, to the vision token that
    shows a word token (`synth.doc.char_slots`, targets from `demo_data.make_batch`): look="next" - the token
    this position predicts; look="here" - the token this position holds (the word just read). "here" in an
    early layer lets the model find where it is by matching what it just wrote against the page; "next" in
    later layers then only has to step from there (the vision tokens say their own row and column, see
    `AuxHeads.position_loss`).

    Why: trained with the auxiliary character heads alone, the vision tokens came to encode the characters while
    the decoder still did not read: its attention on the right vision token stayed at the uniform level in every
    layer and head. Learning where to look from the language loss alone is the slow part; this loss teaches it directly
    (guided attention, as used to speed up alignment in sequence-to-sequence speech models).

    The logits are recomputed from the layer input captured by a pre-hook (same q/k projections and RoPE as
    the layer), over image keys only, so the loss is a distribution over slots independent of how much the
    head attends to text."""

    def __init__(self, model, specs: list[tuple[int, int, str]]):
        super().__init__()
        text = model.model.language_model
        self.specs = [(int(layer), int(heads), look) for layer, heads, look in specs]
        if any(look not in ("next", "here") for _, _, look in self.specs):
            raise ValueError(f"look must be 'next' or 'here': {self.specs}")
        cfg = text.config
        for layer, heads, _ in self.specs:
            if not (0 <= layer < cfg.num_hidden_layers and 1 <= heads <= cfg.num_attention_heads):
                raise ValueError(f"guided heads {layer}:{heads}: the decoder has {cfg.num_hidden_layers} layers "
                                 f"of {cfg.num_attention_heads} heads")
        self.attn = {layer: text.layers[layer].self_attn for layer, _, _ in self.specs}
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.active = False
        self._captured: dict[int, tuple] = {}
        self._handles = [a.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, a in self.attn.items()]

    @staticmethod
    def parse(text: str) -> list[tuple[int, int, str]]:
        """"1:2:here,2:2:next,3:2:next" -> [(1, 2, "here"), (2, 2, "next"), (3, 2, "next")]."""
        out = []
        for part in text.split(","):
            if part.strip():
                layer, heads, look = part.strip().split(":")
                out.append((int(layer), int(heads), look))
        return out

    def _hook(self, i: int):
        def capture(module, args, kwargs):
            if self.active:
                h = args[0] if args else kwargs["hidden_states"]
                self._captured[i] = (h, kwargs["position_embeddings"])
        return capture

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def loss(self, targets: torch.Tensor | None, n_keys: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean cross-entropy over the specs, mean share of target positions whose argmax is the target).
        targets: [B, T], at each query position the sequence position of the image slot showing the token it
        predicts, -1 elsewhere ("here" uses the same targets one position later); None when no position has one.
        n_keys: 1 + the number of image slots (keys are positions 1 .. n_keys - 1); None reads it off the targets
        (a host sync: the training loop passes it)."""
        captured, self._captured = self._captured, {}
        zero = torch.zeros((), device=targets.device if targets is not None else "cpu")
        if targets is None or not captured:
            return zero, zero
        if n_keys is None:
            if not (targets >= 0).any():
                return zero, zero
            n_keys = int(targets.max()) + 1
        here = torch.full_like(targets, -1)
        here[:, 1:] = targets[:, :-1]
        total, hits = zero, zero
        for layer, heads, look in self.specs:
            tg = targets if look == "next" else here
            valid = tg >= 0
            h, (cos, sin) = captured[layer]
            attn = self.attn[layer]
            B, T, _ = h.shape
            hd = attn.head_dim
            q = attn.q_proj(h).view(B, T, -1, hd)[:, :, :heads].float()
            kv_heads = sorted({j // self.groups for j in range(heads)})
            k = attn.k_proj(h[:, 1:n_keys]).view(B, n_keys - 1, -1, hd)[:, :, kv_heads].float()
            c, s_ = cos.float()[:, :, None], sin.float()[:, :, None]
            q = self._rope(q, c, s_)
            k = self._rope(k, c[:, 1:n_keys], s_[:, 1:n_keys])
            k = k[:, :, [kv_heads.index(j // self.groups) for j in range(heads)]]
            logits = torch.einsum("bthd,bkhd->bhtk", q, k) * attn.scaling  # [B, heads, T, keys]
            sel = logits.permute(0, 2, 1, 3)[valid]  # [M, heads, keys]
            want = (tg[valid] - 1)[:, None].expand(-1, heads)
            total = total + F.cross_entropy(sel.reshape(-1, sel.shape[-1]), want.reshape(-1))
            hits = hits + (sel.argmax(-1) == want).float().mean()
        return total / len(self.specs), hits / len(self.specs)

    def remove(self) -> None:
        for hd in self._handles:
            hd.remove()


def pixels_from_uint8(pages: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """uint8 [N, S, S] grayscale squares -> processor-normalised [N, 3, S, S] ((x / 255 - 0.5) / 0.5)."""
    x = pages.to(dtype) * (2.0 / 255.0) - 1.0
    return x[:, None].expand(-1, 3, -1, -1)


def score(model, input_ids: torch.Tensor, pixel_values: torch.Tensor, prefix_len: int, window: int,
          grad_vision: bool = True, keep: int | None = None, return_tokens: bool = False):
    """Logits of a right-padded batch under the R-SWA mask: every query sees the prefix (positions < prefix_len,
    identical for the batch) and the last `window` positions. keep: only the last `keep` positions' logits.
    return_tokens: (logits, projected vision tokens)."""
    embeds = model.get_input_embeddings()(input_ids)
    image_mask = input_ids == model.config.image_token_id
    image_mask[:, prefix_len:] = False  # only prefix `<image>` ids are image slots (a generated one is a token)
    image_mask = image_mask[..., None]
    feats, tokens = image_embeddings(model, pixel_values, grad_vision, return_tokens=True)
    embeds = embeds.masked_scatter(image_mask, feats.to(embeds.dtype))
    mask = rswa_mask(prefix_len, input_ids.shape[1], window, device=input_ids.device)
    out = model(inputs_embeds=embeds, attention_mask=mask, logits_to_keep=keep or 0, use_cache=False)
    return (out.logits, tokens) if return_tokens else out.logits


def prompt_ids(tokenizer, n_pages: int, tpp: int) -> list[int]:
    """BOS + `<image>` x tokens a page x pages + the official prompt text (what the processor produces)."""
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    text = PROMPTS["single" if n_pages == 1 else "multi"]
    return [tokenizer.bos_token_id] + [image_id] * (tpp * n_pages) + tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- save
def processor_dict(image_size: int) -> dict:
    """processor_config.json as UnlimitedOcrProcessor.save_pretrained writes it (base mode by default)."""
    return {"downsample_ratio": 4, "image_processor": {
        "background_color": [127, 127, 127], "crop_to_patches": False, "do_convert_rgb": True, "do_normalize": True,
        "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "UnlimitedOcrImageProcessor", "image_std": [0.5, 0.5, 0.5], "max_patches": 32,
        "maximum_pad_value": 640, "min_patches": 2, "resample": 3, "rescale_factor": 1 / 255,
        "size": {"height": image_size, "width": image_size}, "tile_size": 640},
        "patch_size": 16, "processor_class": "UnlimitedOcrProcessor"}


def save_processor(folder: Path, tokenizer, image_size: int) -> None:
    try:
        from transformers import UnlimitedOcrImageProcessor, UnlimitedOcrProcessor

        image_processor = UnlimitedOcrImageProcessor(size={"height": image_size, "width": image_size},
                                                     crop_to_patches=False)
        UnlimitedOcrProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    except Exception:  # noqa: BLE001 - no torchvision here: write the same files by hand
        tokenizer.save_pretrained(folder)
        cfg_path = Path(folder) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["processor_class"] = "UnlimitedOcrProcessor"
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
        (Path(folder) / "processor_config.json").write_text(json.dumps(processor_dict(image_size), indent=2))


def save_model(model, tokenizer, folder: Path, image_size: int, shard_bytes: int = 15_000_000,
               dtype=torch.bfloat16) -> list[Path]:
    """A folder that engine.model.load.load_model loads like the real checkpoint: config, safetensors (bf16, shards
    below 16 MiB), generation config (greedy, no_repeat_ngram_size=35, window 128), tokenizer, processor."""
    import copy

    from transformers import GenerationConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    out = copy.deepcopy(model).to("cpu", dtype=dtype)
    for module in out.modules():  # training-time hooks (auxiliary heads) do not belong to the saved model
        module._forward_hooks.clear()
        module._forward_pre_hooks.clear()
    for name, module in out.named_modules():  # MoE routers stay fp32 (as the model keeps them when loading)
        if type(module).__name__.endswith("TopkRouter"):
            module.weight.data = dict(model.named_modules())[name].weight.detach().to("cpu", torch.float32).clone()
    out.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False, no_repeat_ngram_size=35,
        no_repeat_ngram_window_size=128)
    out.save_pretrained(folder, max_shard_size=shard_bytes)
    save_processor(folder, tokenizer, image_size)
    return sorted(p for p in folder.iterdir() if p.is_file())


# ---------------------------------------------------------------- metrics
def cer(pred: str, ref: str) -> float:
    """Character error rate: edit distance / reference length (texts already normalised)."""
    return Levenshtein.distance(pred, ref) / max(1, len(ref))
