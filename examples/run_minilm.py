"""Sentence embeddings from the bundled all-MiniLM-L6-v2, with multihead doing the attention.

    python examples/run_minilm.py ["a sentence" ...]

Loads the model offline, swaps its six BertAttention modules for multihead's layer,
embeds the sentences (mean pooling + normalisation, as sentence-transformers does) and
prints their cosine similarities. ``multihead run`` does the same with every check.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub

import torch  # noqa: E402

import multihead as mh  # noqa: E402
from multihead import models  # noqa: E402


def main(texts: list[str]) -> None:
    model, tokenizer = models.load_model(), models.load_tokenizer()
    mh.hf.patch(model)  # every BertAttention now runs multihead.MultiHeadAttention
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # (B, S, 384)
    emb = models.mean_pool(hidden, batch["attention_mask"])  # (B, 384), unit vectors
    sims = emb @ emb.T  # (B, B) cosines
    for i, text in enumerate(texts):
        print(f"{text!r:60.60}  " + "  ".join(f"{float(s):+.3f}" for s in sims[i]))
    mh.hf.unpatch(model)


if __name__ == "__main__":
    main(sys.argv[1:] or ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell today."])
