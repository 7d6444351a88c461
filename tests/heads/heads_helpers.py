"""Shared pieces of the heads tests: the bundled MiniLM (loaded once) and hand-built captures."""

from __future__ import annotations

import functools

import torch

import multihead as mh
from multihead.heads.capture import Capture, LayerInfo

TEXTS = ("The cat sat on the mat.", "Attention heads, each on its own, look at different things!",
         "Short one.")


@functools.lru_cache(maxsize=1)
def minilm() -> tuple[object, object, dict[str, torch.Tensor], object]:
    """(eager HF model, patched copy, padded batch, tokenizer); never modify them in a test."""
    import copy

    from multihead import models

    path = models.bundled_model_dir()
    model = models.load_model(path)
    model.set_attn_implementation("eager")
    tok = models.load_tokenizer(path)
    batch = {k: v for k, v in tok(list(TEXTS), padding=True, return_tensors="pt").items()
             if k in ("input_ids", "attention_mask", "token_type_ids")}
    patched = mh.hf.patch(copy.deepcopy(model))
    return model, patched, batch, tok


def hand_capture(weights: torch.Tensor, *, causal: bool = False) -> Capture:
    """A one-layer Capture holding ``weights`` (B, H, S, S), as if recorded."""
    b, h, s, _ = weights.shape
    cap = Capture(("weights",), None, 1 << 30)
    cap.layers = ["layer"]
    cap.info["layer"] = LayerInfo("layer", h, h, 4, causal, None, tuple(range(h)))
    cap.weights["layer"] = weights
    return cap


def previous_token(s: int) -> torch.Tensor:
    """(S, S): each query on the token before it; the first query on itself."""
    a = torch.zeros(s, s, dtype=torch.float64)
    a[0, 0] = 1.0
    a[torch.arange(1, s), torch.arange(0, s - 1)] = 1.0
    return a
