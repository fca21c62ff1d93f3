"""The demo-model training code on a tiny config (CPU): loss goes down, the training forward equals the
model's own, R-SWA scoring reproduces generate(), and the saved folder loads like the real model."""

from __future__ import annotations

import json

import pytest
import torch

from scripts.train import demo_model as dm
from scripts.train.demo_checks import overfit, rswa_agreement, tiny_setup, word_pages

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pages():
    return word_pages(dm.PRESETS["tiny"]["image_size"], seeds=range(4))


@pytest.fixture(scope="module")
def tiny(pages):
    return tiny_setup([lbl for _, lbl in pages])


def test_training_steps_lower_the_loss(pages):
    model, tokenizer = tiny_setup([lbl for _, lbl in pages], seed=1)
    losses = overfit(model, tokenizer, pages, steps=12, freeze_steps=6)
    assert losses[-1] < 0.9 * losses[0] and sum(losses[-3:]) < sum(losses[:3]), losses
    assert all(x == x for x in losses)  # no NaN


def test_training_forward_matches_the_model_forward(tiny, pages):
    model, tokenizer = tiny
    model.eval()
    size = dm.PRESETS["tiny"]["image_size"]
    pixels = dm.pixels_from_uint8(torch.stack([torch.from_numpy(a) for a, _ in pages[:2]]))
    with torch.no_grad():
        mine = dm.image_embeddings(model, pixels)
        ref = torch.cat(model.model.get_image_features(pixels).pooler_output)
        assert torch.allclose(mine, ref, atol=1e-6)
        prompt = dm.prompt_ids(tokenizer, 2, dm.tokens_per_page(size))
        ids = torch.tensor([prompt + tokenizer.encode("<PAGE>abc def", add_special_tokens=False)])
        mask = dm.rswa_mask(len(prompt), ids.shape[1], 4)
        ref_logits = model(input_ids=ids, pixel_values=pixels, attention_mask=mask).logits
        assert torch.allclose(dm.score(model, ids, pixels, len(prompt), 4), ref_logits, atol=1e-5)


def test_rswa_scoring_reproduces_generate(pages):
    model, tokenizer = tiny_setup([lbl for _, lbl in pages], text_init=0.2, window=8)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
    model.eval()
    assert rswa_agreement(model, tokenizer, dm.PRESETS["tiny"]["image_size"], new_tokens=30) == 90


def test_saved_folder_loads_like_the_real_model(tiny, tmp_path):
    from engine.model.load import load_model

    model, tokenizer = tiny
    files = dm.save_model(model, tokenizer, tmp_path / "demo", dm.PRESETS["tiny"]["image_size"])
    assert len(files) <= 8 and all(f.stat().st_size < 16 * 2**20 for f in files)
    generation = json.loads((tmp_path / "demo" / "generation_config.json").read_text())
    assert generation["no_repeat_ngram_size"] == 35 and generation["no_repeat_ngram_window_size"] == 128
    assert json.loads((tmp_path / "demo" / "processor_config.json").read_text()) == \
        json.loads(json.dumps(dm.processor_dict(dm.PRESETS["tiny"]["image_size"])))
    loaded = load_model(str(tmp_path / "demo"), device="cpu", dtype="float32")
    tok = loaded.tokenizer
    assert (loaded.bos_token_id, loaded.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert loaded.page_sep_id == tok.convert_tokens_to_ids("<PAGE>") and loaded.sliding_window == 128
    assert loaded.tokens_per_page == 21
    for special in ["<image>", "<|det|>", "<|/det|>", "<|ref|>", "<|/ref|>", "<|grounding|>", "<td>", "</td>", "<PAGE>"]:
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_demo_tokenizer_makes_every_box_coordinate_one_token():
    tokenizer = dm.build_tokenizer(dm.tokenizer_corpus(200), dm.PRESETS["demo"]["vocab"])
    assert len(tokenizer) == dm.PRESETS["demo"]["vocab"]
    assert all(len(tokenizer.encode(str(i), add_special_tokens=False)) == 1 for i in range(1000))
    assert tokenizer.encode("document parsing.")[0] == tokenizer.bos_token_id


def _char_grid_pages(tokenizer, size: int) -> list[tuple]:
    """Two word pages as training items: (pixels, label ids, character grid)."""
    from ingest.synth.documents import page_arrays
    from scripts.train.demo_data import char_tensor

    items = [it for s in range(2) for it in page_arrays(s, 1, size, kind="words", chars=True)]
    return [(torch.from_numpy(a), torch.tensor(tokenizer.encode(lbl, add_special_tokens=False)), char_tensor(g, size))
            for a, lbl, g in items]


def test_auxiliary_character_losses_reach_the_vision_tower(tiny):
    from ingest.synth.text import N_CHAR_CLASSES
    from scripts.train.demo_data import make_batch
    from scripts.train.demo_loss import loss_fn

    model, tokenizer = tiny
    size = dm.PRESETS["tiny"]["image_size"]
    pages = _char_grid_pages(tokenizer, size)
    prompt = dm.prompt_ids(tokenizer, 1, dm.tokens_per_page(size))
    ids, lengths, pixels, grids, targets = make_batch(pages, 1, prompt, 11, 1, 2, "cpu")
    assert grids.shape == (2, size // 16, size // 8) and (grids > 0).any() and targets is None
    heads = dm.AuxHeads(model, N_CHAR_CLASSES)
    model.train()
    model.zero_grad(set_to_none=True)
    res = loss_fn(model, ids, lengths, pixels, len(prompt), 128, True, torch.float32, heads, grids)
    loss, aux = res["loss"], res["aux"]
    (loss + aux).backward()
    assert torch.isfinite(aux) and aux > 0
    assert model.model.vision_tower.sam_encoder.patch_embed.projection.weight.grad.abs().sum() > 0
    heads.remove()
    model.zero_grad(set_to_none=True)
    model.eval()


def test_char_slots_point_at_the_vision_token_showing_each_character():
    from ingest.synth.documents import page_arrays
    from ingest.synth.text import CHAR_INDEX, N_CHAR_CLASSES

    checked = agree = 0
    for _arr, label, grid, slots in page_arrays(800_000, 2, 1024, chars=True, slots=True):
        assert slots.shape == (len(label),)
        assert (slots[[i for i, ch in enumerate(label) if ch.isspace()]] == -1).all()
        assert label.startswith("<|det|>") and (slots[: label.index("<|/det|>") + 8] == -1).all()  # markup: none
        for j, s in enumerate(slots):
            if s < 0:
                continue
            r, c = divmod(int(s), 17)  # 16 tokens a row + the newline slot
            assert 0 <= r < 16 and 0 <= c < 16
            checked += 1
            agree += CHAR_INDEX.get(label[j], N_CHAR_CLASSES - 1) in grid[4 * r : 4 * r + 4, 8 * c : 8 * c + 8]
    assert checked > 500 and agree / checked > 0.95


def hits(rate, of: int) -> int:
    """The count behind a hit rate over ``of`` positions (a whole number, or the rate was not one over them)."""
    count = float(rate) * of
    assert abs(count - round(count)) < 1e-3 and 0 <= round(count) <= of, (float(rate), of)
    return round(count)


def test_alignment_loss_targets_image_slots_and_trains_the_guided_heads(tiny):
    from ingest.synth.documents import page_arrays
    from scripts.train.demo_data import make_batch, token_slots
    from scripts.train.demo_loss import loss_fn

    model, tokenizer = tiny
    size = dm.PRESETS["tiny"]["image_size"]
    tpp = dm.tokens_per_page(size)
    pages = []
    for a, lbl, g, sl in page_arrays(3, 2, size, chars=True, slots=True):
        enc = tokenizer(lbl, add_special_tokens=False, return_offsets_mapping=True)
        pages.append((torch.from_numpy(a), torch.tensor(enc["input_ids"]), torch.from_numpy(g.astype("int16")),
                      token_slots(enc["offset_mapping"], sl)))
    prompt = dm.prompt_ids(tokenizer, 2, tpp)
    ids, lengths, pixels, grids, targets = make_batch(pages, 2, prompt, 11, 1, 2, "cpu", tpp)
    aimed = targets[targets >= 0]
    assert len(aimed) > 0 and (ids[0, aimed] == model.config.image_token_id).all()  # every target is an image slot
    assert (aimed > tpp).any()  # the second page's tokens aim at the second image
    assert dm.AlignLoss.parse("1:1:next, 0:2:here") == [(1, 1, "next"), (0, 2, "here")]
    align = dm.AlignLoss(model, [(1, 1, "next")])
    model.train()
    model.zero_grad(set_to_none=True)
    res = loss_fn(model, ids, lengths, pixels, len(prompt), 128, True, torch.float32, align=align,
                  align_targets=targets)
    assert torch.isfinite(res["align"]) and res["align"] > 0
    # the n_image_slots hint (no host sync) naming the slots the targets reach: the very same loss and hits
    last = int(targets.max())
    assert last < 2 * tpp  # the last page's last slots are not aimed at, so all slots are more keys than that
    same = loss_fn(model, ids, lengths, pixels, len(prompt), 128, True, torch.float32, align=align,
                   align_targets=targets, n_image_slots=last)
    assert torch.equal(same["align"], res["align"]) and torch.equal(same["align_acc"], res["align_acc"])
    # the hint naming all image slots: the same targets among more keys, so a larger loss and no more hits
    hinted = loss_fn(model, ids, lengths, pixels, len(prompt), 128, True, torch.float32, align=align,
                     align_targets=targets, n_image_slots=2 * tpp)
    assert torch.isfinite(hinted["align"]) and hinted["align"] > res["align"]
    assert hits(hinted["align_acc"], len(aimed)) <= hits(res["align_acc"], len(aimed))
    # word starts: page tokens whose previous token is not on the page; their accuracy is among all page tokens'
    starts = (targets[:, len(prompt) - 1:] >= 0) & ~(targets[:, len(prompt) - 2:-1] >= 0)
    assert 0 < starts.sum() < (targets >= 0).sum()
    assert hits(res["first_acc"], int(starts.sum())) <= hits(res["word_acc"], len(aimed))  # word starts: a subset
    res["align"].backward()
    q = model.model.language_model.layers[1].self_attn.q_proj.weight.grad
    hd = model.model.language_model.layers[1].self_attn.head_dim
    assert q[:hd].abs().sum() > 0 and q[hd:].abs().sum() == 0  # only the guided head's query is trained
    align.remove()
    model.zero_grad(set_to_none=True)
    model.eval()


def test_tokenizer_can_cap_token_length_to_a_few_glyphs():
    tokenizer = dm.build_tokenizer(dm.tokenizer_corpus(60), 4096, max_token_length=4)
    special = set(tokenizer.all_special_tokens)
    assert max(len(t) for t in tokenizer.get_vocab() if t not in special) <= 4
    assert all(len(tokenizer.encode(str(i), add_special_tokens=False)) == 1 for i in range(1000))
    assert tokenizer.convert_tokens_to_ids("<PAGE>") == 11


def test_a_fresh_decoder_can_start_from_a_saved_vision_tower(tiny, tmp_path):
    model, tokenizer = tiny
    dm.save_model(model, tokenizer, tmp_path / "saved", dm.PRESETS["tiny"]["image_size"], dtype=torch.float32)
    other_tok = dm.build_tokenizer(dm.tokenizer_corpus(30), dm.PRESETS["tiny"]["vocab"], max_token_length=4)
    fresh = dm.new_model(dm.make_config(other_tok, "tiny"), seed=7)
    assert dm.copy_vision(fresh, tmp_path / "saved") == sum(k.startswith(dm.VISION_PREFIXES) for k in fresh.state_dict())
    a, b = model.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b if k.startswith(dm.VISION_PREFIXES))
    assert not torch.equal(a["model.language_model.layers.0.self_attn.q_proj.weight"],
                           b["model.language_model.layers.0.self_attn.q_proj.weight"])


def test_character_tokenizer_gives_one_token_per_glyph_and_keeps_numbers_whole():
    from ingest.synth.documents import layout_labels

    tokenizer = dm.build_tokenizer(dm.tokenizer_corpus(60), 4096, max_token_length=1)
    label = layout_labels(800_001, 1)[0] + "\n汉字 • 2026"
    ids = tokenizer.encode(label, add_special_tokens=False)
    assert tokenizer.decode(ids) == label
    for piece in ("Interface", "a-b, (c)."):  # letters and punctuation of the corpus; others fall back to bytes
        assert len(tokenizer.encode(piece, add_special_tokens=False)) == len(piece)
    assert all(len(tokenizer.encode(str(i), add_special_tokens=False)) == 1 for i in range(1000))
    assert len(tokenizer.encode("12345", add_special_tokens=False)) == 2  # digit groups of at most 3
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<|det|>", "<|/det|>", "<PAGE>")] == [6, 7, 11]
    assert tokenizer.encode("<|det|>", add_special_tokens=False) == [6]


def test_vision_only_phase_trains_the_tower_and_leaves_the_decoder_alone(tiny):
    from ingest.synth.text import N_CHAR_CLASSES
    from scripts.train.demo_data import make_batch
    from scripts.train.demo_loss import vision_loss

    model, tokenizer = tiny
    size = dm.PRESETS["tiny"]["image_size"]
    pages = _char_grid_pages(tokenizer, size)
    _, _, pixels, grids, _ = make_batch(pages, 1, dm.prompt_ids(tokenizer, 1, dm.tokens_per_page(size)), 11, 1, 2, "cpu")
    heads = dm.AuxHeads(model, N_CHAR_CLASSES)
    model.train()
    model.zero_grad(set_to_none=True)
    res = vision_loss(model, pixels, torch.float32, heads, grids)
    assert res["loss"] == 0 and torch.isfinite(res["aux"]) and res["aux"] > 0
    res["aux"].backward()
    assert model.model.vision_tower.sam_encoder.patch_embed.projection.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.model.language_model.parameters())
    heads.remove()
    model.zero_grad(set_to_none=True)
    model.eval()


def test_batch_prefetcher_follows_the_plan_and_hands_errors_over():
    from scripts.train.demo_data import BatchPrefetcher

    class Pool:  # stands in for PagePool: numbered pages
        def __init__(self):
            self.n = 0

        def take(self, n, wait_min=0):
            self.n += n
            return list(range(self.n - n, self.n))

    plans = iter([(True, 1), (False, 3), (False, 2)])
    fetch = BatchPrefetcher(Pool(), lambda: next(plans), lambda pages, n: (n, pages), pages_per_step=6)
    assert fetch.next() == (True, 1, (1, [0, 1, 2, 3, 4, 5]))
    assert fetch.next() == (False, 3, (3, [6, 7, 8, 9, 10, 11]))  # 2 samples of 3 pages
    assert fetch.next() == (False, 2, (2, [12, 13, 14, 15, 16, 17]))
    with pytest.raises(StopIteration):  # the plan ran out: the thread's error reaches the training loop
        fetch.next()
    fetch.close()


def test_make_batch_decides_on_the_cpu_when_there_is_nothing_to_learn_from(tiny):
    from scripts.train.demo_data import make_batch

    _, tokenizer = tiny
    size = dm.PRESETS["tiny"]["image_size"]
    blank = torch.zeros(size, size, dtype=torch.uint8)
    ids = torch.tensor(tokenizer.encode("abc", add_special_tokens=False), dtype=torch.int32)
    no_cells = torch.full((size // 16, size // 8), -1, dtype=torch.int16)  # a scan-like page: no character grid
    no_slots = torch.full((len(ids),), -1, dtype=torch.int16)
    prompt = dm.prompt_ids(tokenizer, 1, dm.tokens_per_page(size))
    *_, grids, targets = make_batch([(blank, ids, no_cells, no_slots)] * 2, 1, prompt, 11, 1, 2, "cpu",
                                    dm.tokens_per_page(size))
    assert grids is None and targets is None
