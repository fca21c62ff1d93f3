"""The official path on a tiny random Unlimited-OCR (CPU, fp32)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.model.files import ModelNotFound
from engine.model.load import LoadedModel, ModelLoadError, load_model
from engine.model.tiny import build_tiny_model, set_eos_scale
from engine.official import (
    official_generate,
    official_generation_config,
    official_inputs,
    parse_elements,
    rswa_mask,
    split_pages,
)
from tests.conftest import text_page as _page

WINDOW = 8  # the tiny model's R-SWA sliding window




@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(2)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", sliding_window=WINDOW, seed=0)


@pytest.fixture(scope="module")
def loaded(tiny_dir) -> LoadedModel:
    return load_model(str(tiny_dir), device="cpu", dtype="auto")


def _direct(loaded, images, kind, max_new_tokens, window):
    inputs = official_inputs(loaded, images, kind)
    with torch.inference_mode():
        out = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    no_repeat_ngram_size=35, no_repeat_ngram_window_size=window)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_load_model(loaded):
    tok = loaded.tokenizer
    assert loaded.device.type == "cpu" and loaded.dtype == torch.float32
    assert loaded.image_token_id == tok.convert_tokens_to_ids("<image>")
    assert (loaded.bos_token_id, loaded.eos_token_id) == (0, 1)
    assert loaded.page_sep_id == tok.convert_tokens_to_ids("<PAGE>")
    assert loaded.sliding_window == WINDOW and loaded.tokens_per_page == 21
    for special in ["<|det|>", "<|/det|>", "<|ref|>", "<|grounding|>", "<td>", "</td>"]:
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_single_page_matches_generate_and_is_long(loaded):
    image = _page(0)
    result = official_generate(loaded, [image], "single", max_new_tokens=132)
    assert result.prompt_ids[0] == loaded.bos_token_id
    assert result.prompt_ids.count(loaded.image_token_id) == loaded.tokens_per_page
    assert result.output_ids == _direct(loaded, [image], "single", 132, 128)
    assert len(result.output_ids) == 132 > 128 > 3 * WINDOW and result.finish_reason == "length"
    assert result.ngram_window == 128 and "<｜end▁of▁sentence｜>" not in result.text


def test_three_pages_match_generate(loaded):
    pages = [_page(i) for i in range(3)]
    result = official_generate(loaded, pages, "multi", max_new_tokens=40)
    assert result.prompt_ids.count(loaded.image_token_id) == 3 * loaded.tokens_per_page
    assert result.output_ids == _direct(loaded, pages, "multi", 40, 1024)
    assert result.n_pages == 3 and result.ngram_window == 1024
    with pytest.raises(ValueError):
        official_generate(loaded, pages, "single", max_new_tokens=4)


def test_official_rule_is_installed(loaded):
    from transformers.models.unlimited_ocr.generation_unlimited_ocr import (
        UnlimitedOcrSlidingWindowNoRepeatNgramLogitsProcessor as Rule,
    )

    for kind, window in [("single", 128), ("multi", 1024)]:
        config = official_generation_config(loaded, kind, 10)
        procs = loaded.model._get_logits_processor(config, input_ids_seq_length=5, device="cpu", model_kwargs={})
        rules = [p for p in procs if isinstance(p, Rule)]
        assert len(rules) == 1 and rules[0].ngram_size == 35 and rules[0].window_size == window


def test_eos_finish(tiny_dir):
    fresh = load_model(str(tiny_dir), device="cpu")
    set_eos_scale(fresh.model, 20.0)
    result = official_generate(fresh, [_page(1)], "single", max_new_tokens=30)
    assert result.finish_reason == "eos" and result.output_ids[-1] == fresh.eos_token_id


def test_plain_forward_is_full_causal_and_rswa_mask_matches(loaded):
    inputs = official_inputs(loaded, [_page(2)], "single")
    prefix = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        config = official_generation_config(loaded, "single", 24)
        config.return_dict_in_generate, config.output_logits = True, True
        gen = loaded.model.generate(**inputs, generation_config=config)
        seq = gen.sequences[:, :-1]
        logits = torch.stack(gen.logits, 1)[0]
        plain = loaded.model(input_ids=seq, pixel_values=inputs["pixel_values"]).logits[0, prefix - 1:]
        mask = rswa_mask(prefix, seq.shape[1], WINDOW)
        masked = loaded.model(input_ids=seq, pixel_values=inputs["pixel_values"], attention_mask=mask)
    torch.testing.assert_close(plain[: WINDOW + 1], logits[: WINDOW + 1])  # same while the window holds all
    assert (plain[WINDOW + 1:] - logits[WINDOW + 1:]).abs().max() > 1e-3  # full causal != R-SWA afterwards
    torch.testing.assert_close(masked.logits[0, prefix - 1:], logits, rtol=1e-4, atol=1e-4)


def test_model_not_found(tmp_path, monkeypatch):
    """One line saying what is missing where; the engine knows nothing of config files (uflash's worker adds where
    model.path came from and how to set it: ingest.worker.model_files)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match=f"^model not found at {tmp_path / 'missing'}: no such folder$"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFound, match="no such folder, and no hub id 'no_such_dir/demo' in the local Hugging"):
        load_model("no_such_dir/demo")  # relative folder that also looks like a hub id: cache miss
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="the folder has no config.json"):
        load_model(str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound, match=r"the folder has no weights \(\*.safetensors"):
        load_model(str(tmp_path / "empty"))


def test_corrupt_folder(tiny_dir, tmp_path):
    bad_config = shutil.copytree(tiny_dir, tmp_path / "bad_config")
    (bad_config / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError) as err:
        load_model(str(bad_config), device="cpu")
    assert "config.json" in str(err.value) and "\n" not in str(err.value)

    truncated = shutil.copytree(tiny_dir, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="cannot load weights") as err:
        load_model(str(truncated), device="cpu")
    assert "\n" not in str(err.value)

    other = shutil.copytree(tiny_dir, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ModelLoadError):
        load_model(str(other), device="cpu")


def test_split_pages_and_parse_elements():
    text = ("<PAGE><|det|>title [10, 20, 300, 40]<|/det|># Report\n<|det|>text [10, 50, 990, 120]<|/det|>"
            "First para.\n\n<PAGE><|det|>table [0, 0, 999, 999]<|/det|><table><tr><td>1</td></tr></table>")
    pages = split_pages(text)
    assert len(pages) == 2 and pages[1].startswith("<|det|>table")
    assert split_pages("only page") == ["only page"]
    assert split_pages("a<PAGE>b") == ["a", "b"]
    elements = parse_elements(pages[0])
    assert elements == [{"label": "title", "box": [10, 20, 300, 40], "text": "# Report"},
                        {"label": "text", "box": [10, 50, 990, 120], "text": "First para."}]
    assert parse_elements(pages[1])[0]["text"] == "<table><tr><td>1</td></tr></table>"
    assert parse_elements("no markup here") == []
