"""PaliGemma's prefix-LM mask on the patch route: the image tokens and the prompt (token type 0)
see one another both ways, the suffix (token type 1) is causal, and the padded rows of a batch
see nothing. Its attention modules patch with the registered SigLIP and Gemma wrappers, which
take the mask transformers builds for the prefix.

Notation: B batch, S tokens.

Oracle: the same tiny model run eagerly by transformers: logits of a left-padded batch with an
image per row, and greedy tokens through ``generate``. The prefix must matter: the same model
with every token of type 1 (causal everywhere) gives other logits, so a route that ignored the
prefix would fail. Compared with the text layers bidirectional (PaliGemma's default) and causal.

Runtime: about 3 s on 2 shared cores.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import multihead as mh

tf = pytest.importorskip("transformers")

IMAGE_TOKEN = 299
PATCHES = 4  # (28 / 14)² image tokens per row


def _model(**text_fields: Any) -> torch.nn.Module:
    """Tiny PaliGemma; ``text_fields`` set on its Gemma config."""
    torch.manual_seed(0)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=28, patch_size=14, projection_dim=32)
    text = tf.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=300, **text_fields)
    config = tf.PaliGemmaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                image_token_index=IMAGE_TOKEN, projection_dim=32)
    config.text_config.vocab_size = 300
    config.vision_config.projection_dim = 32
    model = tf.PaliGemmaForConditionalGeneration(config).eval()
    for c in (model.config, model.config.text_config, model.config.vision_config):
        c._attn_implementation = "eager"
    return model


def _inputs() -> dict[str, torch.Tensor]:
    """A left-padded batch of 2: image tokens, a prompt (type 0), then a suffix (type 1)."""
    ids = torch.tensor([[IMAGE_TOKEN] * PATCHES + [5, 6, 7, 8, 9, 10],
                        [0, 0] + [IMAGE_TOKEN] * PATCHES + [11, 12, 13, 14]])
    mask = torch.tensor([[1] * (PATCHES + 6), [0, 0] + [1] * (PATCHES + 4)])
    types = torch.tensor([[0] * (PATCHES + 3) + [1] * 3, [0, 0] + [0] * (PATCHES + 2) + [1] * 2])
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "pixel_values": pixels}


@pytest.mark.parametrize("causal_layers", [False, True], ids=["bidirectional layers", "causal layers"])
def test_paligemma_prefix_lm_patched_equals_eager(causal_layers: bool) -> None:
    """By default PaliGemma's text layers are bidirectional (``use_bidirectional_attention`` unset reads
    True: ``is_causal`` False) and HF's mask is their whole rule; set False, they are causal and the
    prefix's mask lets queries see later keys, which the wrappers then attend with HF's mask alone."""
    model, inputs = _model(use_bidirectional_attention=False) if causal_layers else _model(), _inputs()
    layers = [m for name, m in model.named_modules() if name.endswith("language_model.layers.0.self_attn")]
    assert [m.is_causal for m in layers] == [causal_layers]
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        want = model(**inputs).logits
        causal = model(**{**inputs, "token_type_ids": torch.ones_like(inputs["token_type_ids"])}).logits
        tokens = model.generate(**inputs, max_new_tokens=5, do_sample=False)
        routes = mh.hf.patch(model, report=True)
        got = model(**inputs).logits
        patched_tokens = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert {r.route for r in routes} == {"wrapper"}, routes
    scale = want[real].abs().max()
    assert (got - want)[real].abs().max() <= 1e-5 * scale
    assert (causal - want)[real].abs().max() > 1e-3 * scale  # the prefix changes the result
    assert torch.equal(patched_tokens, tokens)
