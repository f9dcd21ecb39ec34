"""The trainer's datasets: the synthetic topic corpus (determinism, exact entropy floor) and text files."""

from __future__ import annotations

import math
import os

import locations
import numpy as np
import pytest
import torch

from ep_moe.train.data import SyntheticCorpus, TextDataset, rank_slice

SHAKESPEARE = str(locations.SHAKESPEARE)


@pytest.mark.parametrize("order", [1, 2])
def test_entropy_floor_matches_the_generating_process(order):
    corpus = SyntheticCorpus(vocab_size=40, seq_length=64, num_topics=4, order=order, branching=3, seed=7)
    # The mean true NLL over many sampled sequences estimates the floor without bias.
    estimates = [corpus.true_nll(corpus.batch("train", step, 256)) for step in range(8)]
    sem = np.std(estimates) / math.sqrt(len(estimates))
    assert abs(np.mean(estimates) - corpus.entropy_floor) < max(5 * sem, 2e-3)
    assert 0.0 < corpus.entropy_floor < math.log(3)  # below uniform over the branching


def test_synthetic_batches_are_deterministic_and_well_formed():
    a = SyntheticCorpus(64, 32, num_topics=4, seed=1)
    b = SyntheticCorpus(64, 32, num_topics=4, seed=1)
    x = a.batch("train", 5, 16)
    assert x.shape == (16, 33) and x.dtype == torch.int64
    assert torch.equal(x, b.batch("train", 5, 16))
    assert not torch.equal(x, a.batch("train", 6, 16))
    assert not torch.equal(x, a.batch("valid", 5, 16))
    assert not torch.equal(x, SyntheticCorpus(64, 32, num_topics=4, seed=2).batch("train", 5, 16))
    assert ((x[:, 0] >= 0) & (x[:, 0] < 4)).all()             # topic tag first
    assert ((x[:, 1:] >= 4) & (x[:, 1:] < 64)).all()           # then body tokens only
    assert len(set(x[:, 0].tolist())) > 1


def test_topics_have_different_transitions():
    corpus = SyntheticCorpus(64, 32, num_topics=3, seed=3)
    succ = [t.successors for t in corpus.topics]
    assert not np.array_equal(succ[0], succ[1]) and not np.array_equal(succ[1], succ[2])
    for t in corpus.topics:
        assert np.allclose(t.probs.sum(1), 1.0) and abs(t.stationary.sum() - 1.0) < 1e-12


def test_synthetic_argument_errors():
    with pytest.raises(ValueError, match="num_topics"):
        SyntheticCorpus(5, 16, num_topics=4)
    with pytest.raises(ValueError, match="order"):
        SyntheticCorpus(64, 16, order=3)
    with pytest.raises(ValueError, match="branching"):
        SyntheticCorpus(10, 16, num_topics=4, branching=7)


def test_rank_slices_cover_the_global_batch_once():
    batch = torch.arange(24).view(24, 1)
    world, micro, accum = 3, 2, 4
    rows = [rank_slice(batch, r, world, micro, i) for i in range(accum) for r in range(world)]
    assert torch.equal(torch.cat(rows), batch)  # micro-step major, then rank: row order


def test_text_dataset_char_and_byte(tmp_path):
    path = tmp_path / "t.txt"
    text = "hello wörld, " * 200
    path.write_text(text, encoding="utf-8")
    ds = TextDataset(str(path), seq_length=16, vocab_size=32, tokenizer="char", split=(0.9, 0.1), seed=0)
    assert ds.chars == sorted(set(text)) and ds.vocab_used == len(set(text))
    x = ds.batch("train", 0, 4)
    assert x.shape == (4, 17)
    decoded = "".join(ds.chars[i] for i in x[0].tolist())
    assert decoded in text + text
    assert torch.equal(x, ds.batch("train", 0, 4)) and not torch.equal(x, ds.batch("train", 1, 4))
    assert ds.parts["train"].size + ds.parts["valid"].size <= len(text)
    byte = TextDataset(str(path), seq_length=16, vocab_size=256, tokenizer="byte", seed=0)
    assert byte.batch("valid", 0, 2).max() < 256 and byte.vocab_used == 256
    with pytest.raises(ValueError, match="model.vocab_size"):
        TextDataset(str(path), seq_length=16, vocab_size=5, tokenizer="char")
    with pytest.raises(ValueError, match="dataset.path: no such file"):
        TextDataset(str(tmp_path / "nope.txt"), 16, 64)
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe" * 100)
    with pytest.raises(ValueError, match="tokenizer=byte"):
        TextDataset(str(tmp_path / "bin.txt"), 16, 64)


@pytest.mark.skipif(not os.path.isfile(SHAKESPEARE), reason="../shared/data/shakespeare.txt is not here")
def test_shakespeare_fits_the_recipe_vocabulary():
    ds = TextDataset(SHAKESPEARE, seq_length=128, vocab_size=96, tokenizer="char")
    assert ds.vocab_used == 84 and ds.parts["valid"].size > 100_000
