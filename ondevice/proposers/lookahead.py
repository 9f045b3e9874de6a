"""Lookahead decoding: no model; a Jacobi window of guesses rides along in the verifier pass,
its outputs feed an n-gram pool, and pool n-grams starting with the last token are verified."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ondevice.proposers.base import Verification, not_beside_a_draft
from ondevice.rules.noise import PositionNoise
from ondevice.rules.token_tree import TokenTree
from ondevice.runtime.pass_costs import CostProfile

if TYPE_CHECKING:
    from ondevice.proposers.resources import Resources, Speculation


class Lookahead:
    """Lookahead decoding: a 2-D Jacobi window plus an n-gram pool, verified in the same pass.

    The window has `ngram - 1` rows of `window` guesses. Row 0 is a chain after the root (guesses
    for the next `window` positions); column j hangs below row-0 cell j a chain of rows 1.., so
    cell (r, j) sits at depth j + r + 1 and its verifier output predicts the position after it.
    Each column with that output is an n-gram; n-grams go into the pool keyed by their first
    token, as do the n-grams of the committed text. Pool entries starting with the last committed
    token are verified as tree branches. Then the window moves: rows shift up (and left by the
    extra tokens accepted), and the outputs of the last row become the new last row.
    """

    def __init__(
        self,
        *,
        window: int = 4,
        ngram: int = 4,
        candidates: int = 4,
        pool_size: int = 8,
        seed: int = 0,
        name: str = "lookahead",
    ):
        if window < 1 or ngram < 2:
            raise ValueError("lookahead needs window >= 1 and ngram >= 2")
        self.name = name
        self.W, self.N, self.G = window, ngram, candidates
        self.pool_size = pool_size
        self.seed = seed
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.grid: list[list[int]] = []
        self._indexed = 0
        self._cells: dict[tuple[int, int], int] = {}

    def reset(self, prompt: Sequence[int]) -> None:
        self.pool, self._indexed = {}, 0
        # Initial guesses: tokens of the prompt, chosen with a fixed seed (the paper's choice;
        # any guesses are lossless, these at least belong to the text's vocabulary).
        g = np.random.default_rng(self.seed)
        self._fill = lambda: int(prompt[int(g.integers(len(prompt)))])
        self.grid = [[self._fill() for _ in range(self.W)] for _ in range(self.N - 1)]

    def _add(self, gram: Sequence[int]) -> None:
        key, cont = int(gram[0]), tuple(int(t) for t in gram[1:])
        lst = self.pool.setdefault(key, [])
        if cont in lst:
            lst.remove(cont)
        lst.insert(0, cont)
        del lst[self.pool_size :]

    def _index(self, seq: Sequence[int]) -> None:
        for end in range(max(self._indexed, self.N), len(seq) + 1):
            self._add(seq[end - self.N : end])
        self._indexed = max(self._indexed, len(seq))

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        self._index(seq)
        tree = TokenTree.root(seq[-1])
        for cont in self.pool.get(int(seq[-1]), [])[: self.G]:
            tree.add_path(cont[:max_depth])
        self._cells = {}
        parent = 0
        for j in range(self.W):
            if j + 1 > max_depth:
                break
            parent = self._cells[0, j] = tree.add(parent, self.grid[0][j])
            below = parent
            for r in range(1, self.N - 1):
                if j + r + 1 > max_depth:
                    break
                below = self._cells[r, j] = tree.add(below, self.grid[r][j])
        return tree

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        path, token, target = verdict.path, verdict.token, verdict.target
        last = self.N - 2
        for j in range(self.W):
            cell = self._cells.get((last, j))
            if cell is not None:
                self._add([self.grid[r][j] for r in range(self.N - 1)] + [int(target[cell])])
        shift = len(path)  # extra tokens committed beyond one: the window slides further
        new_last = [
            int(target[self._cells[last, j]]) if (last, j) in self._cells else self._fill()
            for j in range(self.W)
        ]
        rows = self.grid[1:] + [new_last]
        self.grid = [
            row[shift:] + [self._fill() for _ in range(min(shift, self.W))] for row in rows
        ]
        self._index([*seq, *(tree.tokens[n] for n in path), token])


def build(res: Resources, spec: Speculation) -> Lookahead:
    """The "lookahead" method: num_draft_tokens + 1 is the n-gram length (default 4). Not a
    candidate of `auto` beside a draft model: the draft's own guesses take its place."""
    not_beside_a_draft(res, spec)
    return Lookahead(**lookahead_size(res.verify_cost, spec.num_draft_tokens))


def lookahead_size(verify: CostProfile | None, k: int | None = None) -> dict[str, int]:
    """Window, n-gram and candidate counts for lookahead decoding. The pass carries
    1 + (window + candidates) * (ngram - 1) tokens; on hardware where a pass costs about the same
    whatever its size (GPUs) use a wide window, where cost grows with tokens (CPUs) spend at most
    about one extra pass's worth of time on guesses."""
    ngram = 4 if k is None else max(2, min(k, 6) + 1)
    for width in (8, 6, 4, 3, 2, 1):
        tokens = 1 + 2 * width * (ngram - 1)
        if verify is None or verify(tokens) <= 2.0 * verify(1) or width == 1:
            return {"window": width, "ngram": ngram, "candidates": width}
    raise AssertionError("unreachable")
