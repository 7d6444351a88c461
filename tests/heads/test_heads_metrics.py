"""mh.heads.metrics and label: known values on hand-built patterns, TransformerLens' relation, no mutation."""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from heads_helpers import hand_capture, minilm, previous_token


def _row(cap, **kw):
    return mh.heads.metrics(cap, **kw)[0]


def test_a_pure_previous_token_pattern_scores_one() -> None:
    r = _row(hand_capture(previous_token(6)[None, None]))
    assert r.previous_token == 1.0 and r.next_token == 0.0
    assert r.entropy == 0.0 and r.distance == pytest.approx(5 / 6)  # row 0 sits on itself


def test_a_uniform_row_has_normalised_entropy_one_and_the_mean_distance() -> None:
    s = 5
    r = _row(hand_capture(torch.full((1, 1, s, s), 1 / s, dtype=torch.float64)))
    assert r.entropy == pytest.approx(1.0, abs=1e-12)
    # mean over i of (1/S) Σ_j |i − j|
    expected = sum(abs(i - j) for i in range(s) for j in range(s)) / s / s
    assert r.distance == pytest.approx(expected)
    assert r.diagonal == pytest.approx(1 / s) and r.first_token == pytest.approx(1 / s)


def test_a_first_token_pattern_has_sink_score_one() -> None:
    a = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    a[..., 0] = 1.0
    r = _row(hand_capture(a))
    assert r.first_token == 1.0 and r.diagonal == pytest.approx(1 / 4)


def test_padding_queries_and_keys_are_excluded() -> None:
    # Sequence 1 is left-padded by two; its pad rows/keys hold junk that must not count.
    good = previous_token(4)
    a = torch.zeros(2, 1, 6, 6, dtype=torch.float64)
    a[0, 0] = previous_token(6)
    a[1, 0, 2:, 2:] = good
    a[1, 0, :2, :] = 1 / 6  # pad queries: uniform junk
    a[1, 0, 2:, 0] = 0.0
    key_mask = torch.tensor([[True] * 6, [False, False] + [True] * 4])
    r = _row(hand_capture(a), key_mask=key_mask)
    assert r.previous_token == 1.0 and r.entropy == 0.0
    tokens = [["[CLS]", "a", ".", "b", "c", "[SEP]"], ["[PAD]", "[PAD]", "[CLS]", "x", ",", "[SEP]"]]
    r = _row(hand_capture(a), key_mask=key_mask, tokens=tokens)
    # keys: seq 0 rows 0..5 -> [CLS] [CLS] a . b c ; seq 1 real rows -> [CLS] [CLS] x ,
    specials = [1, 1, 0, 0, 0, 0] + [1, 1, 0, 0]  # per real row: is its key special?
    puncts = [0, 0, 0, 1, 0, 0] + [0, 0, 0, 1]
    assert r.special_tokens == pytest.approx(sum(specials) / 10)
    assert r.punctuation == pytest.approx(sum(puncts) / 10)


def test_a_padded_batch_gives_the_token_weighted_scores_of_its_sequences() -> None:
    _, patched, batch, tok = minilm()
    with torch.no_grad(), mh.heads.capture(patched, layers=[0, 3]) as cap:
        patched(**batch)
    rows = mh.heads.metrics(cap, key_mask=batch["attention_mask"])
    parts, counts = [], []
    for b in range(3):
        n = int(batch["attention_mask"][b].sum())
        one = {k: v[b:b + 1, :n] for k, v in batch.items()}
        with torch.no_grad(), mh.heads.capture(patched, layers=[0, 3]) as c1:
            patched(**one)
        parts.append(mh.heads.metrics(c1))
        counts.append(n)
    for i, r in enumerate(rows):
        expected = sum(p[i].entropy * n for p, n in zip(parts, counts)) / sum(counts)
        assert r.entropy == pytest.approx(expected, abs=1e-5)
        expected = sum(p[i].diagonal * n for p, n in zip(parts, counts)) / sum(counts)
        assert r.diagonal == pytest.approx(expected, abs=1e-5)


def test_transformerlens_head_detector_scores_are_m_over_n_times_ours() -> None:
    from transformer_lens.head_detector import (compute_head_attention_similarity_score,
                                                get_induction_head_detection_pattern,
                                                get_previous_token_head_detection_pattern)

    torch.random.default_generator.manual_seed(1)
    t = 6
    ids = torch.cat([torch.tensor([0]), torch.randperm(50)[:t] + 10, torch.zeros(0, dtype=torch.long)])
    ids = torch.cat([ids, ids[1:]])  # [BOS] r r
    n = ids.numel()
    for causal in (True, False):
        logits = torch.randn(1, 1, n, n, dtype=torch.float64) * 3
        if causal:
            logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        a = logits.softmax(-1).float()
        cap = hand_capture(a, causal=causal)
        r = _row(cap, tokens=ids[None], induction=True)
        for pattern, ours, m in ((get_previous_token_head_detection_pattern(ids[None]), r.previous_token, n - 1),
                                 (get_induction_head_detection_pattern(ids[None]), r.induction, t)):
            theirs = compute_head_attention_similarity_score(a[0, 0].clone(), pattern, exclude_bos=False,
                                                             exclude_current_token=False, error_measure="mul")
            assert theirs == pytest.approx(m / n * ours, rel=1e-5, abs=1e-7)


def test_metrics_never_modify_the_captured_tensors() -> None:
    a = torch.rand(2, 3, 5, 5).softmax(-1)
    cap = hand_capture(a.clone())
    before = cap.weights["layer"].clone()
    mh.heads.metrics(cap, tokens=[["[CLS]", "a", ",", "a", "[SEP]"]] * 2, key_mask=torch.tensor(
        [[True] * 5, [True] * 3 + [False] * 2]), induction=True)
    assert torch.equal(cap.weights["layer"], before)


def _planted_layer() -> tuple[mh.MultiHeadAttention, torch.Tensor]:
    """Head 0 attends to the previous token, head 1 to the first: x_i = one-hot position i."""
    s, e, d = 8, 16, 8
    layer = mh.MultiHeadAttention(e, 2, causal=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.zero_()
        shift = torch.zeros(d, e)
        shift[torch.arange(0, s - 1), torch.arange(1, s)] = 40.0  # q_i = 40·e_{i-1}
        layer.q_proj.weight[:d] = shift
        layer.k_proj.weight[:d, :s] = torch.eye(d)  # k_j = e_j (both heads)
        layer.k_proj.weight[d:, :s] = torch.eye(d)
        layer.q_proj.bias[d] = 40.0  # head 1: q = 40·e_0 whatever the token
        layer.v_proj.weight.copy_(torch.randn_like(layer.v_proj.weight))
        layer.o_proj.weight.copy_(torch.randn_like(layer.o_proj.weight))
    x = torch.eye(e)[:s][None]  # (1, S, E)
    return layer, x


def test_planted_previous_token_and_first_token_heads_are_labelled_so() -> None:
    layer, x = _planted_layer()
    with torch.no_grad(), mh.heads.capture(layer, what=("weights", "v")) as cap:
        layer(x)
    rows = mh.heads.label(mh.heads.metrics(cap), causal=True)
    assert [r.label for r in rows] == ["previous token", "first token"]
    assert rows[0].previous_token > 0.99 and rows[1].first_token > 0.99


def test_norm_weights_add_up_to_the_layer_output() -> None:
    layer = mh.MultiHeadAttention(24, 6, num_kv_heads=3)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    layer = layer.double()
    with torch.no_grad(), mh.heads.capture(layer, what=("weights", "v")) as cap:
        y = layer(x)
    # Σ_h Σ_j A_ij W_O^h v_j + b_O = y ; and N_ij = A_ij ‖W_O^h v_j‖ (Kobayashi)
    a, v, w_o = cap.weights[""], cap.v[""], layer.o_proj.weight.detach()
    f = torch.stack([v[:, h // 2] @ w_o[:, h * 4:(h + 1) * 4].T for h in range(6)], 1)  # (B, H, S, E)
    total = torch.einsum("bhij,bhje->bie", a, f) + layer.o_proj.bias.detach()
    torch.testing.assert_close(total, y, rtol=0, atol=1e-12)
    torch.testing.assert_close(mh.heads.norm_weights(cap, 0), a * f.norm(dim=-1)[:, :, None, :])
    rows = mh.heads.metrics(cap)
    assert rows[0].norm_weight == pytest.approx(float((a * f.norm(dim=-1)[:, :, None, :]).sum(-1)[:, 0].mean()))


def test_labels_of_the_bundled_model_are_stable_run_to_run() -> None:
    _, patched, batch, tok = minilm()
    tokens = [tok.convert_ids_to_tokens(r) for r in batch["input_ids"].tolist()]
    labels = []
    for _ in range(2):
        with torch.no_grad(), mh.heads.capture(patched) as cap:
            patched(**batch)
        rows = mh.heads.label(mh.heads.metrics(cap, tokens, batch["attention_mask"], special=tok.all_special_tokens))
        labels.append([r.label for r in rows])
        assert all(r.label in mh.heads.LABELS for r in rows)
    assert labels[0] == labels[1]
    assert labels[0][2] == "previous token"  # layer 0, head 2 of all-MiniLM-L6-v2


def test_table_and_json_carry_every_field() -> None:
    import json

    rows = mh.heads.label(mh.heads.metrics(hand_capture(previous_token(4)[None, None])))
    table = mh.heads.format_table(rows)
    assert table.splitlines()[0].split()[:3] == ["layer", "head", "label"] and "previous token" in table
    assert set(json.loads(mh.heads.to_json(rows))[0]) == {"layer", "head", "label", *mh.heads.METRIC_FIELDS}


def test_bad_metric_inputs_are_refused_with_the_expected_shape() -> None:
    cap = hand_capture(previous_token(4)[None, None])
    with pytest.raises(ValueError, match=r"tokens\[0\] must hold S=4 tokens"):
        mh.heads.metrics(cap, tokens=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"key_mask must have shape \[B, S\] = \[1, 4\]"):
        mh.heads.metrics(cap, key_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="induction=True needs tokens"):
        mh.heads.metrics(cap, induction=True)
    with pytest.raises(TypeError, match="Capture"):
        mh.heads.metrics({"weights": 1})
