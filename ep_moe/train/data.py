"""Training data: the built-in synthetic topic corpus and a text-file dataset.

Both hand out whole global batches as a pure function of ``(seed, split, step)``: every rank builds the
same ``[global_batch_size, seq_length + 1]`` token block and takes its own rows. So the data position is
just the step (a resumed run, or one at another rank count, sees exactly the same sequences), and the
loss of a step does not depend on how the batch is split over ranks.

Synthetic corpus
----------------
``num_topics`` topics, each an order-``order`` Markov chain over the ``V - num_topics`` *body* tokens
(``V`` = ``model.vocab_size``). Token ``k < num_topics`` is topic ``k``'s tag. A document is: its tag,
then body tokens from that topic's chain, started in the chain's stationary distribution. In every chain
each state has ``branching`` distinct successors (one of them on a random cycle through all states, so the
chain is irreducible) with probabilities drawn from a Dirichlet(``concentration``). Topics share the body
vocabulary but not the transitions, so the next token depends on the topic, which only the tag at position
0 reveals: a model must carry it forward through attention, and experts can specialise per topic.

The entropy floor (the loss of the Bayes-optimal predictor, in nats per predicted token) is exact: the tag
fixes the topic, the first ``order`` body tokens are a draw from the stationary state distribution
``pi`` (joint entropy ``H(pi)``), and each later token has the chain's entropy rate
``h = sum_s pi(s) H(P(. | s))``. With ``S`` predicted tokens per sequence (labels are the inputs shifted by
one), ``floor = mean over topics of (H(pi) + (S - order) h) / S``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch

SPLITS = {"train": 0, "valid": 1}


def _rng(seed: int, split: str, step: int, salt: int = 0) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, salt, SPLITS[split], step])))


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=axis)


@dataclass
class MarkovTopic:
    """One topic: an order-k chain over ``num_body`` tokens. States are the last k body tokens,
    encoded ``s = t_{-k} * B^(k-1) + ... + t_{-1}``."""

    successors: np.ndarray   # [num_states, branching] int64 body-token ids
    cdf: np.ndarray          # [num_states, branching] float64 cumulative successor probabilities
    probs: np.ndarray        # [num_states, branching] float64
    stationary: np.ndarray   # [num_states] float64
    num_body: int
    order: int

    @property
    def entropy_rate(self) -> float:
        return float(np.dot(self.stationary, _entropy(self.probs)))

    @property
    def state_entropy(self) -> float:
        return float(_entropy(self.stationary))


def _stationary(topic_successors: np.ndarray, probs: np.ndarray, num_body: int, order: int) -> np.ndarray:
    """Stationary distribution by power iteration on the sparse transitions (float64)."""
    num_states = num_body ** order
    states = np.arange(num_states)[:, None]
    nxt = (states * num_body + topic_successors) % num_states
    pi = np.full(num_states, 1.0 / num_states)
    for _ in range(20000):
        new = np.bincount(nxt.ravel(), weights=(pi[:, None] * probs).ravel(), minlength=num_states)
        # A lazy step (average with the previous iterate) converges for periodic chains too and has the
        # same fixed point.
        new = 0.5 * (new + pi)
        if np.abs(new - pi).sum() < 1e-14:
            return new / new.sum()
        pi = new
    raise RuntimeError("synthetic corpus: the stationary distribution did not converge")


class SyntheticCorpus:
    """The topic Markov corpus (see the module docstring). Deterministic from ``seed``.

    Args:
        vocab_size: V; tokens ``0..num_topics-1`` are tags, the rest body tokens.
        seq_length: S, tokens fed to the model per sequence (``S + 1`` are sampled: the tag and S body tokens).
    """

    def __init__(self, vocab_size: int, seq_length: int, num_topics: int = 4, order: int = 1, branching: int = 4,
                 concentration: float = 1.0, seed: int = 1234):
        if vocab_size - num_topics < 2:
            raise ValueError(f"SyntheticCorpus: argument 'num_topics' must leave >= 2 body tokens in "
                             f"vocab_size={vocab_size}, got {num_topics}")
        if order not in (1, 2):
            raise ValueError(f"SyntheticCorpus: argument 'order' must be 1 or 2, got {order}")
        num_body = vocab_size - num_topics
        if not 1 <= branching <= num_body:
            raise ValueError(f"SyntheticCorpus: argument 'branching' must be in [1, {num_body}], got {branching}")
        if seq_length <= order:
            raise ValueError(f"SyntheticCorpus: argument 'seq_length' must be > order={order}, got {seq_length}")
        self.vocab_size, self.seq_length, self.num_topics = vocab_size, seq_length, num_topics
        self.order, self.branching, self.seed, self.num_body = order, branching, seed, num_body
        gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x5E7])))
        num_states = num_body ** order
        self.topics: list[MarkovTopic] = []
        for _ in range(num_topics):
            cycle = gen.permutation(num_body)
            cycle_next = np.empty(num_body, dtype=np.int64)
            cycle_next[cycle] = np.roll(cycle, -1)
            successors = np.empty((num_states, branching), dtype=np.int64)
            for s in range(num_states):
                first = cycle_next[s % num_body]  # the cycle edge keeps every chain irreducible
                others = gen.choice(np.delete(np.arange(num_body), first), size=branching - 1, replace=False)
                successors[s] = np.concatenate([[first], others])
            probs = gen.dirichlet(np.full(branching, concentration), size=num_states)
            cdf = np.cumsum(probs, axis=1)
            cdf[:, -1] = 1.0
            pi = _stationary(successors, probs, num_body, order)
            self.topics.append(MarkovTopic(successors, cdf, probs, pi, num_body, order))
        self._successors = np.stack([t.successors for t in self.topics])   # [topics, states, branching]
        self._cdf = np.stack([t.cdf for t in self.topics])
        stationary_cdf = np.cumsum(np.stack([t.stationary for t in self.topics]), axis=1)
        self._stationary_cdf = stationary_cdf / stationary_cdf[:, -1:]

    @property
    def entropy_floor(self) -> float:
        """Nats per predicted token of the Bayes-optimal predictor (exact; see the module docstring)."""
        s = self.seq_length
        per_topic = [(t.state_entropy + (s - self.order) * t.entropy_rate) / s for t in self.topics]
        return float(np.mean(per_topic))

    def describe(self) -> str:
        return (f"synthetic corpus: {self.num_topics} topics x order-{self.order} Markov chains over "
                f"{self.num_body} body tokens (branching {self.branching}); entropy floor "
                f"{self.entropy_floor:.4f} nats/token")

    def true_nll(self, tokens: torch.Tensor) -> float:
        """Mean nats per predicted token of the generating process on ``tokens [B, S + 1]`` (a batch of
        this corpus): an unbiased Monte-Carlo estimate of `entropy_floor`."""
        x = tokens.numpy()
        topic_of, body = x[:, 0], x[:, 1:] - self.num_topics
        k, nb = self.order, self.num_body
        state = np.zeros(len(x), dtype=np.int64)
        for j in range(k):
            state = state * nb + body[:, j]
        nll = -np.log(np.stack([t.stationary for t in self.topics])[topic_of, state])
        for t in range(k, body.shape[1]):
            succ = self._successors[topic_of, state]                     # [B, branching]
            hit = succ == body[:, t, None]
            if not hit.any(axis=1).all():
                raise ValueError("SyntheticCorpus.true_nll: tokens are not from this corpus")
            probs = np.stack([tp.probs for tp in self.topics])[topic_of, state]
            nll = nll - np.log((probs * hit).sum(axis=1))
            state = (state * nb + body[:, t]) % (nb ** k)
        return float(nll.mean() / body.shape[1])

    def batch(self, split: str, step: int, batch_size: int) -> torch.Tensor:
        """``[batch_size, seq_length + 1]`` int64 tokens of ``(split, step)``: tag, then body tokens."""
        gen = _rng(self.seed, split, step)
        s, k, nb = self.seq_length, self.order, self.num_body
        topic_of = gen.integers(0, self.num_topics, size=batch_size)
        start_u = gen.random(batch_size)
        step_u = gen.random((batch_size, s - k))
        out = np.empty((batch_size, s + 1), dtype=np.int64)
        out[:, 0] = topic_of
        cdf_pi = self._stationary_cdf[topic_of]                      # [B, num_states]
        state = np.minimum((start_u[:, None] > cdf_pi).sum(axis=1), cdf_pi.shape[1] - 1)
        for j in range(k):  # the first `order` body tokens are the digits of the stationary state
            out[:, 1 + j] = (state // nb ** (k - 1 - j)) % nb
        for t in range(s - k):
            cdf = self._cdf[topic_of, state]                           # [B, branching]
            choice = (step_u[:, t, None] > cdf).sum(axis=1).clip(max=self.branching - 1)
            token = self._successors[topic_of, state, choice]
            out[:, 1 + k + t] = token
            state = (state * nb + token) % (nb ** k)
        out[:, 1:] += self.num_topics
        return torch.from_numpy(out)


class TextDataset:
    """Character- or byte-level language modelling on one text file.

    The file is split by position: the first ``split[0]`` fraction trains, the next ``split[1]`` validates.
    A batch is ``batch_size`` windows of ``seq_length + 1`` tokens at offsets drawn from ``(seed, split,
    step)``. Character vocabulary: the file's distinct characters in code-point order (ids 0..n-1).
    """

    def __init__(self, path: str, seq_length: int, vocab_size: int, tokenizer: str = "char",
                 split: tuple[float, float] = (0.95, 0.05), seed: int = 1234):
        if not os.path.isfile(path):
            raise ValueError(f"dataset.path: no such file {path!r} (for the Shakespeare recipe pass "
                             f"dataset.path=../shared/data/shakespeare.txt from the project root)")
        with open(path, "rb") as f:
            raw = f.read()
        self.path, self.seq_length, self.tokenizer, self.seed = path, seq_length, tokenizer, seed
        self.sha256 = hashlib.sha256(raw).hexdigest()
        if tokenizer == "byte":
            tokens = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
            self.chars: list[str] | None = None
            needed = 256
        elif tokenizer == "char":
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"dataset.path: {path!r} is not UTF-8 ({exc}); use dataset.tokenizer=byte") from None
            codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            uniq, tokens = np.unique(codes, return_inverse=True)
            self.chars = [chr(c) for c in uniq]
            tokens = tokens.astype(np.int64)
            needed = len(uniq)
        else:
            raise ValueError(f"dataset.tokenizer: expected 'char' or 'byte', got {tokenizer!r}")
        if needed > vocab_size:
            raise ValueError(f"model.vocab_size: the {tokenizer}-level vocabulary of {path!r} has {needed} "
                             f"tokens, more than model.vocab_size={vocab_size}")
        self.vocab_used = needed
        total = split[0] + split[1]
        n_train = int(len(tokens) * split[0] / total)
        n_valid = int(len(tokens) * split[1] / total)
        self.parts = {"train": tokens[:n_train], "valid": tokens[n_train:n_train + n_valid]}
        for name, part in self.parts.items():
            if part.size and part.size < seq_length + 1:
                raise ValueError(f"dataset.split: the {name} part of {path!r} has {part.size} tokens, fewer than "
                                 f"model.seq_length + 1 = {seq_length + 1}")
        if self.parts["train"].size == 0:
            raise ValueError(f"dataset.split: the train part of {path!r} is empty")

    @property
    def entropy_floor(self) -> float | None:
        return None  # unknown for real text

    def describe(self) -> str:
        unit = "characters" if self.tokenizer == "char" else "bytes"
        return (f"text {os.path.basename(self.path)}: {self.parts['train'].size:,} train / "
                f"{self.parts['valid'].size:,} validation {unit}, vocabulary {self.vocab_used}")

    def batch(self, split: str, step: int, batch_size: int) -> torch.Tensor:
        """``[batch_size, seq_length + 1]`` int64 windows of ``(split, step)``."""
        part = self.parts[split]
        if part.size == 0:
            raise ValueError(f"dataset.split: the {split} part is empty")
        gen = _rng(self.seed, split, step, salt=1)
        starts = gen.integers(0, part.size - self.seq_length, size=batch_size)
        idx = starts[:, None] + np.arange(self.seq_length + 1)[None, :]
        return torch.from_numpy(part[idx])


def build_dataset(recipe) -> SyntheticCorpus | TextDataset:
    """The dataset a `Recipe` asks for."""
    d, m = recipe.dataset, recipe.model
    seed = recipe.rng.seed if d.seed is None else d.seed
    if d.type == "synthetic":
        return SyntheticCorpus(m.vocab_size, m.seq_length, d.num_topics, d.order, d.branching, d.concentration,
                               seed)
    return TextDataset(recipe.resolve_path(d.path), m.seq_length, m.vocab_size, d.tokenizer,
                       (d.split[0], d.split[1]), seed)


def rank_slice(global_batch: torch.Tensor, rank: int, world_size: int, micro_batch_size: int,
               micro_step: int) -> torch.Tensor:
    """Rank ``rank``'s micro-batch ``micro_step`` of a global batch.

    Micro-batch ``i`` of rank ``r`` holds rows ``[(i * W + r) * m, (i * W + r + 1) * m)``, so the set of
    rows processed in micro-step ``i`` over all ranks is contiguous.
    """
    first = (micro_step * world_size + rank) * micro_batch_size
    return global_batch[first:first + micro_batch_size]
