"""Stand-in engines: objects with the engine protocol (`ondevice.rules.engine.Engine`)
whose answers a test knows exactly, or gets cheaply.

- `TableEngine` stands in for a language model with a known law: numpy only, the logits after
  a token looked up in a table by that token and the one before it. Fast enough for the tens of
  thousands of generations of a chi-square test (`support.stats.exact_joint` gives its exact
  law), and it counts its passes and fed tokens, to check a caller's bookkeeping exactly. It
  has chain passes only, as a Core ML draft does; `TreeTableEngine` adds tree passes.
- `MemoEngine` stands in for a real MLX model when a test needs tens of thousands of
  generations from it: the model's logits, memoised per context, with tree passes.

All three feed each token with the output after the tokens it can see (every earlier one in a
chain pass; its visible path in a tree pass), through `row(context)`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ondevice.models.transformer import Model
from ondevice.rules.engine import Engine
from ondevice.runtime.engines import _Wrapper


class _ContextEngine:
    """The engine protocol over `row(context)`, the logits after a context: the cache is just
    the list of tokens it holds (`tokens`); `passes` and `fed` count the calls and tokens."""

    name = "stand-in"
    vocab_size: int
    context_length: int

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.passes = 0
        self.fed = 0

    def row(self, context: Sequence[int]) -> np.ndarray:
        raise NotImplementedError

    @property
    def length(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []

    def trim(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n :]

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        self.passes += 1
        self.fed += len(tokens)
        rows = []
        for t in tokens:
            self.tokens.append(int(t))
            rows.append(self.row(self.tokens))
        return rows[-1].copy() if last_only else np.stack(rows)


class _TreePasses(_ContextEngine):
    """Tree passes over `row`: each token gets the logits after the tokens it can see."""

    def feed_masked(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        visible: np.ndarray,
        hidden: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        self.passes += 1
        self.fed += len(tokens)
        n_old, L = len(self.tokens), len(tokens)
        if visible.shape[1] == L:  # over the new tokens only: the cached prefix is visible
            visible = np.concatenate([np.ones((L, n_old), bool), visible], 1)
        allseq = self.tokens + [int(t) for t in tokens]
        rows = []
        for i in range(L):
            ctx = [allseq[j] for j in np.flatnonzero(visible[i])]
            assert len(ctx) - 1 == positions[i], "positions disagree with the visible path"
            rows.append(self.state(ctx) if hidden else self.row(ctx))
        self.tokens = allseq
        if hidden:  # (logits, the last hidden states), as `MLXTreeEngine` gives them
            return np.stack([r for r, _ in rows]), np.stack([h for _, h in rows])
        return np.stack(rows)

    def state(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The logits and the last hidden state after a context (engines that have one)."""
        raise NotImplementedError

    def last_hidden(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens` and return the last one's hidden state, as `MLXTreeEngine` does
        for a prompt."""
        self.feed(tokens, last_only=True)
        return self.state(self.tokens)[1]

    def keep(self, n_recent: int, indices: Sequence[int]) -> None:
        tail = self.tokens[len(self.tokens) - n_recent :]
        self.tokens = self.tokens[: len(self.tokens) - n_recent] + [tail[i] for i in indices]


class TableEngine(_ContextEngine):
    """A language model with a known law: the logits after a context are `table[prev, last]`
    (prev = 0 at the start), a random table unless one is given. Chain passes only."""

    name = "table"

    def __init__(
        self,
        vocab: int = 12,
        seed: int = 0,
        scale: float = 1.5,
        table: np.ndarray | None = None,
        context_length: int = 4096,
    ) -> None:
        super().__init__()
        if table is None:
            table = np.random.default_rng(seed).standard_normal((vocab, vocab, vocab)) * scale
        self.table = table.astype(np.float32)
        self.vocab_size = self.table.shape[-1]
        self.context_length = context_length

    @classmethod
    def cycle(
        cls,
        cycle: Sequence[int] = (5, 6, 7, 8),
        vocab: int = 12,
        sharp: float = 4.0,
        context_length: int = 200,
    ) -> TableEngine:
        """A model that predicts the next token of `cycle` (after any other token, the next
        id), with logit `sharp`, and the token 3 ids on with half of it; the last token alone
        decides."""
        nxt = dict(zip(cycle, [*cycle[1:], cycle[0]]))
        rows = np.zeros((vocab, vocab), np.float32)
        for t in range(vocab):
            rows[t, nxt.get(t, (t + 1) % vocab)] = sharp
            rows[t, (t + 3) % vocab] = sharp / 2
        return cls(
            table=np.broadcast_to(rows, (vocab, vocab, vocab)), context_length=context_length
        )

    def perturbed(self, noise: float, seed: int = 1, **kw) -> TableEngine:
        """A draft that resembles this engine: the same table plus Gaussian noise."""
        rng = np.random.default_rng(seed)
        table = self.table + noise * rng.standard_normal(self.table.shape)
        return type(self)(table=table, **kw)

    def row(self, context: Sequence[int]) -> np.ndarray:
        return self.table[context[-2] if len(context) > 1 else 0, context[-1]]


class TreeTableEngine(_TreePasses, TableEngine):
    """A `TableEngine` with tree passes and keep-subset, as an MLX engine has."""


class MemoEngine(_TreePasses):
    """A real MLX model whose answers are memoised per context: the decoder under test runs
    unchanged, and the model is never asked twice about the same tokens (one pass answers every
    prefix of its input). A tree pass gives each token the model's output after the tokens it
    can see, in cache order, which is what a real tree pass computes (test_tree checks that
    against sequential passes)."""

    name = "memo"
    returns_hidden = True  # its hidden states too, for proposers that read them (Medusa)

    def __init__(self, model: Model, context_length: int = 512) -> None:
        super().__init__()
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.context_length = context_length
        self.memo: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def state(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        key = tuple(context)
        if key not in self.memo:
            logits, hidden = self.model(mx.array([list(key)]), hidden=True)
            rows = np.array(logits[0].astype(mx.float32))
            states = np.array(hidden[0].astype(mx.float32))
            for i in range(len(key)):
                self.memo.setdefault(key[: i + 1], (rows[i], states[i]))
        return self.memo[key]

    def row(self, context: Sequence[int]) -> np.ndarray:
        return self.state(context)[0]

    # test_speculative's `_exact_joint` (left to the rewrite of the acceptance-rule tests)
    # reads `_row`; remove this alias once it reads `row`.
    _row = row


class TimedEngine(_Wrapper):
    """Wraps an engine and accumulates the wall time spent in its calls (for tests that slow
    an engine down or count its passes)."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.seconds = 0.0
        self.calls = 0

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        t = time.perf_counter()
        out = self.engine.feed(tokens, last_only)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out
