"""mh.hf.pack_padding: a patched BERT-family encoder runs its padded batches on the real tokens only.

Oracle: the same transformers model, unpatched and padded. Real tokens equal within 1e-5 on
right-padded, left-padded and nearly-all-padding batches; the MLP sees N rows, not B·S; what
packing would change the shape of is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (BertConfig, BertModel, ElectraConfig, ElectraModel, GPT2Config, GPT2Model, RobertaConfig,
                          RobertaModel, XLMRobertaConfig, XLMRobertaModel)

import multihead as mh

TINY = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=64)
FAMILIES = {
    "bert": (BertConfig, BertModel),
    "roberta": (RobertaConfig, RobertaModel),
    "xlm-roberta": (XLMRobertaConfig, XLMRobertaModel),
    "electra": (ElectraConfig, ElectraModel),
}
MASKS = {
    "right-padded": [[1] * 10, [1] * 7 + [0] * 3, [1] * 4 + [0] * 6],
    "one real token": [[1] * 10, [1] + [0] * 9, [1] * 3 + [0] * 7],
    "left-padded": [[1] * 10, [0] * 3 + [1] * 7, [0] * 8 + [1] * 2],
}


def _model(family: str) -> torch.nn.Module:
    torch.random.default_generator.manual_seed(0)
    config_cls, model_cls = FAMILIES[family]
    return model_cls(config_cls(**TINY)).eval()


def _batch(mask: list[list[int]]) -> dict[str, torch.Tensor]:
    torch.random.default_generator.manual_seed(1)
    attention = torch.tensor(mask)
    return {"input_ids": torch.randint(5, 120, attention.shape), "attention_mask": attention}


@pytest.mark.parametrize("masks", list(MASKS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_encoder_equals_the_padded_model(family: str, masks: str) -> None:
    model, batch = _model(family), _batch(MASKS[masks])
    with torch.no_grad():
        want = model(**batch).last_hidden_state
    handle = mh.hf.pack_padding(mh.hf.patch(model))
    rows: list[tuple[int, ...]] = []
    hook = model.encoder.layer[0].intermediate.register_forward_hook(lambda m, a, o: rows.append(tuple(a[0].shape)))
    with torch.no_grad():
        got = model(**batch).last_hidden_state
    hook.remove()
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert (got[~real] == 0).all()  # padding rows: zeros (HF's values there are masked out by any pooling)
    assert rows == [(1, int(real.sum()), TINY["hidden_size"])]  # the MLP ran on the real tokens only
    handle.remove()
    with torch.no_grad():
        again = model(**batch).last_hidden_state
    torch.testing.assert_close(again[real], want[real], atol=1e-5, rtol=1e-5)
    assert not (again[~real] == 0).all()  # padded again: HF's own padding rows


def test_an_unpadded_batch_runs_as_it_is() -> None:
    model = mh.hf.patch(_model("bert"))
    mh.hf.pack_padding(model)
    batch = _batch([[1] * 10, [1] * 10])
    rows: list[tuple[int, ...]] = []
    model.encoder.layer[0].intermediate.register_forward_hook(lambda m, a, o: rows.append(tuple(a[0].shape)))
    with torch.no_grad():
        model(**batch)
    assert rows == [(2, 10, TINY["hidden_size"])]


def test_bundled_model_embeddings_equal_sentence_transformers() -> None:
    from sentence_transformers import SentenceTransformer

    texts = ["A short one.", "A much longer sentence, with several clauses, that pads the others a lot.", "Hi"]
    st = SentenceTransformer(str(mh.models.bundled_model_dir()), device="cpu")
    want = torch.from_numpy(st.encode(texts, convert_to_numpy=True))
    model, tokenizer = mh.models.load_model(), mh.models.load_tokenizer()
    mh.hf.pack_padding(mh.hf.patch(model))
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        got = mh.models.mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
    cosine = torch.nn.functional.cosine_similarity(got, want)
    assert cosine.min() > 1 - 1e-5


@pytest.mark.parametrize("ask", ["output_hidden_states", "output_attentions"])
def test_what_packing_would_reshape_is_refused(ask: str) -> None:
    model = mh.hf.patch(_model("bert"))
    mh.hf.pack_padding(model)
    with pytest.raises(ValueError, match=f"pack_padding: a packed encoder cannot give {ask}"):
        model(**_batch(MASKS["right-padded"]), **{ask: True})


def test_a_capture_of_a_packed_encoder_is_refused() -> None:
    model = mh.hf.patch(_model("bert"))
    mh.hf.pack_padding(model)
    with pytest.raises(ValueError, match="a layer is watched"), mh.heads.capture(model):
        model(**_batch(MASKS["right-padded"]))


def test_models_it_cannot_pack_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"encoder.layer.0.attention is BertAttention, not patched"):
        mh.hf.pack_padding(_model("bert"))
    with pytest.raises(ValueError, match="expected one BERT-family encoder"):
        mh.hf.pack_padding(GPT2Model(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        mh.hf.pack_padding("bert")  # type: ignore[arg-type]
