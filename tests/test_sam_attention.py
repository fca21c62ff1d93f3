"""SAM's attention with its relative-position bias in a fused kernel (engine.model.sam_attention): on the CPU in fp32
the fused paths (FlexAttention's reference path, SDPA with the bias as a mask) give the model's own features, and the
engine's default there is the model's own code."""

from __future__ import annotations

import pytest
import torch

from engine.model import sam_attention
from engine.model.load import load_model
from engine.model.sam_attention import fused_sam_attention, resolve, sam_attention_layers
from engine.model.vision import image_features


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("layers", ["global", "all"])
def test_fused_sam_attention_equals_the_models_own_code(tiny_model_dir, layers):
    loaded = load_model(str(tiny_model_dir), "cpu", "float32")
    model = loaded.model
    torch.manual_seed(0)
    swapped = sam_attention_layers(model, layers)
    assert swapped and (layers == "all") == (len(swapped) == len(sam_attention_layers(model, "all")) > 1)
    for attn in sam_attention_layers(model, "all"):  # a bias that matters (the tiny model starts with zeros)
        attn.rel_pos_h.data.normal_(0, 0.5)
        attn.rel_pos_w.data.normal_(0, 0.5)
    size = model.config.vision_config.sam_config.image_size
    pixels = torch.randn(3, 3, size, size)
    own = image_features(model, pixels, group=2, pad_groups=False)
    for kind in ("sdpa", "flex"):
        with fused_sam_attention(model, kind, layers):
            fused = image_features(model, pixels, group=2, pad_groups=False)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(own, fused)), kind
    assert not sam_attention._flex_failed  # the flex path ran (eager, the reference path, on the CPU)
    assert all("forward" not in vars(attn) for attn in swapped)  # the model's own code again after the with
    assert resolve("auto", "cpu") == "model" and resolve("auto", "cuda:0", torch.bfloat16) == "flex"
    assert resolve("auto", "cuda:0", torch.float32) == "model"  # fp32: the exactness reference keeps the model's code
    with pytest.raises(ValueError):
        resolve("fast", "cpu")


def test_the_engine_on_the_cpu_runs_the_models_own_attention(tiny_model_dir):
    from engine.batch.engine import BatchEngine

    engine = BatchEngine(load_model(str(tiny_model_dir), "cpu", "float32"), "plain", max_batch=1)
    assert engine.vision_attention == "model"
