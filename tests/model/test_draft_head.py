"""The draft head: save/load round-trips, a head for another target is refused, the fingerprint ignores the dtype,
its KV cache is exact under chunked feeding, and the unrolled training forward is the inference forward."""

from __future__ import annotations

import pytest
import torch

from specd.errors import ModelLoadError
from specd.model.attention import ForwardBatch
from specd.model.draft_head import DraftHead, target_fingerprint
from specd.testing import tiny_hf_config_dict, tiny_specd_model
from specd.training.trainer import unrolled_forward


@pytest.fixture(scope="module")
def target64():
    return tiny_specd_model(tiny_hf_config_dict(), seed=0, dtype=torch.float64)


def make_head(target, seed: int = 0, draft_vocab: int = 96) -> DraftHead:
    token_map = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    head = DraftHead.initialise(target, token_map, "tiny", seed=seed)
    with torch.no_grad():  # move away from the near-identity start so every weight matters
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.05)
    return head


def test_save_load_round_trip(tmp_path, target64) -> None:
    head = make_head(target64)
    head.save(tmp_path / "h", extra={"note": "test"})
    loaded = DraftHead.load(tmp_path / "h", target64)
    assert torch.equal(loaded.token_map, head.token_map)
    theirs = dict(loaded.named_parameters())
    for name, mine in head.named_parameters():
        if name.startswith("lm_head"):  # not saved: the target's rows, gathered again by the token map
            assert torch.equal(theirs[name], target64.embed_tokens.weight[head.token_map].float())
        else:  # saved in bfloat16: the loaded weight is the original rounded once
            assert torch.equal(theirs[name], mine.detach().to(torch.bfloat16).float()), name
    assert loaded.config == head.config


def test_head_for_another_target_is_refused(tmp_path, target64) -> None:
    make_head(target64).save(tmp_path / "h")
    other = tiny_specd_model(tiny_hf_config_dict(), seed=1, dtype=torch.float32)
    with pytest.raises(ModelLoadError, match=r"draft_model: .*trained for target 'tiny'"):
        DraftHead.load(tmp_path / "h", other)


def test_not_a_head_directory_is_refused(tmp_path, target64) -> None:
    with pytest.raises(ModelLoadError, match=r"draft_model: .* is not a draft-head directory"):
        DraftHead.load(tmp_path, target64)


def test_fingerprint_is_the_same_in_every_dtype() -> None:
    cfg = tiny_hf_config_dict()
    prints = {target_fingerprint(tiny_specd_model(cfg, seed=0, dtype=d)) for d in (torch.float32, torch.bfloat16)}
    assert len(prints) == 1
    assert target_fingerprint(tiny_specd_model(cfg, seed=2)) not in prints


def _target_features(target, ids: list[int]) -> torch.Tensor:  # [len(ids), hidden]: f_p of every position
    cache = target.make_cache(1, 64)
    cache.reserve(64)
    slot = cache.allocate()
    out = target.forward_with_hidden(ForwardBatch.build([ids], [slot], [0], [[len(ids) - 1]]), cache,
                                     hidden_layers=(-1,))
    assert out.hidden_states is not None
    return out.hidden_states


def _previous(features: torch.Tensor) -> torch.Tensor:  # row p reads f_{p - 1}; row 0 a zero feature
    return torch.cat([features.new_zeros(1, features.shape[1]), features[:-1]])


def test_kv_cache_is_exact_when_fed_in_chunks(target64) -> None:
    head = make_head(target64).to(torch.float64)
    ids = [5, 17, 99, 3, 250, 41, 8, 77, 123, 64]
    feats = _previous(_target_features(target64, ids))
    whole_cache, chunk_cache = head.make_cache(1, 32), head.make_cache(1, 32)
    for c in (whole_cache, chunk_cache):
        c.reserve(32)
        c.allocate()
    whole = head(ForwardBatch.build([ids], [0], [0], [list(range(len(ids)))]), whole_cache, feats)
    rows = []
    for lo, hi in ((0, 4), (4, 5), (5, 10)):
        out = head(ForwardBatch.build([ids[lo:hi]], [0], [lo], [list(range(hi - lo))]), chunk_cache, feats[lo:hi])
        rows.append(out.logits)
    assert torch.allclose(torch.cat(rows), whole.logits, atol=1e-10, rtol=0)


def test_unrolled_training_forward_is_the_drafting_forward(target64) -> None:
    """Depth 1 of the training forward equals the head over committed rows; depth 2 at row r equals drafting: rows
    < r with the target's features in the cache, then row r fed the head's own depth-1 output of row r - 1."""
    head = make_head(target64).to(torch.float64)
    ids = [5, 17, 99, 3, 250, 41, 8, 77]
    raw = _target_features(target64, ids)
    feats = _previous(raw)
    depth = unrolled_forward(head, torch.tensor([ids]), raw.unsqueeze(0), 3)
    n = len(ids)
    cache = head.make_cache(1, 32)
    cache.reserve(32)
    cache.allocate()
    committed = head(ForwardBatch.build([ids], [0], [0], [list(range(n))]), cache, feats)
    assert torch.allclose(depth[0][0], committed.hidden, atol=1e-10, rtol=0)
    for r in (3, 6):
        # Commit rows < r - 1 (the target's features), then draft from row r - 1 on, feeding the head's own output.
        cache.set_len(0, 0)
        head(ForwardBatch.build([ids[: r - 1]], [0], [0], [[r - 2]]), cache, feats[: r - 1])
        cache.set_len(0, r - 1)
        first = head(ForwardBatch.build([[ids[r - 1]]], [0], [r - 1], [[0]]), cache, feats[r - 1 : r])
        cache.set_len(0, r)
        second = head(ForwardBatch.build([[ids[r]]], [0], [r], [[0]]), cache, first.hidden)
        assert torch.allclose(second.hidden[0], depth[1][0, r], atol=1e-10, rtol=0)
        cache.set_len(0, r + 1)
        third = head(ForwardBatch.build([[ids[r + 1]]], [0], [r + 1], [[0]]), cache, second.hidden)
        assert torch.allclose(third.hidden[0], depth[2][0, r + 1], atol=1e-10, rtol=0)
