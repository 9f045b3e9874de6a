"""Training data for distillation: token sequences with the teacher's top-k next-token distributions.

Without outside data the verifier writes its own (the Magpie method): fed only the chat template's
prefix of a user turn, an instruct model writes a plausible user request; closing the turn and
opening the assistant's makes it answer. Every sampled position's logits are the teacher's
distribution at that position, so its top-k is recorded during generation and the teacher never
has to be run again.

Conversations of one batch advance in lockstep (one token each per step, so one shared KV cache
serves them all); the chat-template tokens between the turns are forced in place of samples.

Data lives in shards (`shard-00000.npz`, ...), one per generation batch, each holding flat arrays:
`tokens` (N,), `ids` (N, k) and `logp` (N, k) = the teacher's top-k after each token, `mask` (N,)
= which positions carry a valid teacher distribution to learn from, `starts` = the index where
each conversation begins.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ondevice.distill.teacher import score_sequences, topk_logprobs
from ondevice.errors import OndeviceError
from ondevice.models import Tokenizer
from ondevice.models.transformer import Model
from ondevice.rules.sampling import SamplingParams, probabilities, sample

# every HELD_OUT_EVERY-th conversation (or batch of them) and about one document token in as many
# are held out for the acceptance estimate
HELD_OUT_EVERY = 20
_MARK = "\u2063MAGPIE\u2063"  # a string no template contains, to split a rendered turn


@dataclass
class Shard:
    tokens: np.ndarray  # (N,) int32
    ids: np.ndarray  # (N, k) int32: teacher's top-k ids for the token after each position
    logp: np.ndarray  # (N, k) float16: their log-probabilities
    mask: np.ndarray  # (N,) bool: learn at this position
    starts: np.ndarray  # (C,) int64: first index of each conversation
    # (N, d) float16: the teacher's last hidden state after each position (Medusa heads' input;
    # only `magpie_batch(..., hidden=True)` records it, and only in memory)
    hidden: np.ndarray | None = None

    @property
    def n_targets(self) -> int:
        return int(self.mask.sum())

    def save(self, path: Path) -> None:
        save_npz(
            path, tokens=self.tokens, ids=self.ids, logp=self.logp, mask=self.mask,
            starts=self.starts,
        )  # fmt: skip

    @classmethod
    def load(cls, path: Path) -> Shard:
        with np.load(path) as z:
            return cls(z["tokens"], z["ids"].astype(np.int32), z["logp"], z["mask"], z["starts"])

    @classmethod
    def concat(cls, shards: list[Shard]) -> Shard:
        offsets = np.cumsum([0] + [len(s.tokens) for s in shards[:-1]])
        return cls(
            np.concatenate([s.tokens for s in shards]),
            np.concatenate([s.ids for s in shards]),
            np.concatenate([s.logp for s in shards]),
            np.concatenate([s.mask for s in shards]),
            np.concatenate([s.starts + o for s, o in zip(shards, offsets)]),
        )


def save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Write a shard of arrays whole: a stopped run never leaves a half-written one."""
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def chat_turn_tokens(
    tokenizer: Tokenizer, system: str | None = None
) -> tuple[list[int], list[int]]:
    """Token ids that open a user turn (incl. `system`, or else any default system prompt), and
    those that close the user turn and open the assistant's answer, both taken from the chat
    template."""
    turns = [{"role": "system", "content": system}] if system is not None else []
    text = tokenizer.apply_chat_template(
        [*turns, {"role": "user", "content": _MARK}], add_generation_prompt=True
    )
    if _MARK not in text:
        raise OndeviceError("the chat template does not render the user message; use --data.")
    prefix, suffix = text.split(_MARK, 1)
    pre = tokenizer.encode(prefix, add_special_tokens=True)
    suf = tokenizer.encode(suffix, add_special_tokens=False)
    if not pre or not suf:
        raise OndeviceError("the chat template has an empty user or assistant prefix; use --data.")
    return pre, suf


def _draw(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """A token from softmax(logits / temperature), the most likely one at temperature 0."""
    return sample(probabilities(logits, SamplingParams(temperature=float(temperature))), rng)


def magpie_batch(
    model: Model,
    tokenizer: Tokenizer,
    *,
    batch: int,
    k: int,
    max_tokens: int = 320,
    max_user_tokens: int = 64,
    user_temperature: float = 1.0,
    answer_temperature: float = 0.4,
    stop_fraction: float = 0.8,
    seed: int = 0,
    on_token: Callable[[int], None] | None = None,
    hidden: bool = False,
    system: str | None = None,
) -> Shard:
    """`batch` self-written conversations (user turn + answer) with the teacher's top-k (and
    with `hidden`, its last hidden state after the final norm, from the same pass). `system`:
    the system prompt the conversations are written under (the template's default where None),
    which steers what the user turns ask, as Magpie's task-specific system prompts do.

    The batch stops when `stop_fraction` of its conversations have finished (or at
    `max_tokens`): waiting for the longest answer would spend most steps on a few rows.
    """
    prefix, suffix = chat_turn_tokens(tokenizer, system)
    end_user = suffix[0]  # the template's end-of-turn token: the model closes its user turn
    eos = set(tokenizer.eos_token_ids) | {end_user}
    rng = np.random.default_rng(seed)
    P = len(prefix)
    if P + len(suffix) + 8 > max_tokens:
        raise OndeviceError(
            f"a conversation's opening (the chat template with its system prompt) is {P} tokens, "
            f"too long for conversations of --max-tokens {max_tokens}; raise --max-tokens."
        )
    max_user = min(max_user_tokens, max_tokens // 3)  # short conversations still get answers
    toks = np.zeros((batch, max_tokens), np.int32)
    toks[:, :P] = prefix
    ids = np.zeros((batch, max_tokens, k), np.int32)
    logp = np.zeros((batch, max_tokens, k), np.float16)
    mask = np.zeros((batch, max_tokens), bool)
    phase = np.zeros(batch, np.int8)  # 0 user turn, 1 forced template tokens, 2 answer, 3 done
    forced: list[list[int]] = [[] for _ in range(batch)]
    start_answer = np.zeros(batch, np.int32)
    length = np.full(batch, max_tokens, np.int32)
    states = np.zeros((batch, max_tokens, model.config.hidden_size), np.float16) if hidden else None

    def step(x: np.ndarray) -> mx.array:
        """The logits after the last of `x`'s tokens (its hidden state into `states`)."""
        out = model(mx.array(x), cache, last_only=True, hidden=hidden)
        if states is None:
            return out[:, -1]
        logits, h = out
        states[:, cache.offset - 1] = np.array(h[:, -1].astype(mx.float16))
        return logits[:, -1]

    cache = model.make_cache()
    logits = step(toks[:, :P])
    for pos in range(P, max_tokens):
        # logits predict the token at `pos`; their top-k is the teacher's record for pos - 1.
        logits_np = np.asarray(logits.astype(mx.float32))
        top_i, top_v = topk_logprobs(logits_np, k)
        temps = np.where(phase == 0, user_temperature, answer_temperature)
        nxt_np = np.array(  # (rows past their answer or in the forced template tokens: no draw)
            [_draw(r, t, rng) if f in (0, 2) else 0 for r, t, f in zip(logits_np, temps, phase)],
            np.int32,
        )
        ids[:, pos - 1], logp[:, pos - 1] = top_i, top_v.astype(np.float16)
        for b in range(batch):
            if phase[b] == 3:
                nxt_np[b] = toks[b, pos - 1]  # keep feeding something; masked out
                continue
            mask[b, pos - 1] = True
            if phase[b] == 0 and (nxt_np[b] == end_user or pos - P >= max_user):
                phase[b], forced[b] = 1, list(suffix)
            if phase[b] == 1:
                nxt_np[b] = forced[b].pop(0)
                if not forced[b]:
                    phase[b], start_answer[b] = 2, pos + 1
            elif phase[b] == 2 and nxt_np[b] in eos:
                phase[b], length[b] = 3, pos + 1
        toks[:, pos] = nxt_np
        if on_token is not None:
            on_token(int((phase != 3).sum()))
        if (phase == 3).mean() >= stop_fraction or pos == max_tokens - 1:
            length = np.minimum(length, pos + 1)
            break
        logits = step(nxt_np[:, None])

    keep = [b for b in range(batch) if start_answer[b] and length[b] > start_answer[b] + 2]
    seq_tokens, seq_ids, seq_logp, seq_mask = [], [], [], []
    for b in keep:
        n = int(length[b])
        m = mask[b, :n].copy()
        m[n - 1] = False  # the distribution after the last kept token has no place in the data
        seq_tokens.append(toks[b, :n])
        seq_ids.append(ids[b, :n])
        seq_logp.append(logp[b, :n])
        seq_mask.append(m)
    shard = _pack(seq_tokens, seq_ids, seq_logp, seq_mask, k)
    if states is not None:
        d = states.shape[-1]
        rows = [states[b, : int(length[b])] for b in keep]
        shard.hidden = np.concatenate(rows) if rows else np.zeros((0, d), np.float16)
    return shard


def _pack(tokens, ids, logp, mask, k: int) -> Shard:
    if not tokens:
        return Shard(
            np.zeros(0, np.int32),
            np.zeros((0, k), np.int32),
            np.zeros((0, k), np.float16),
            np.zeros(0, bool),
            np.zeros(0, np.int64),
        )
    starts = np.cumsum([0] + [len(t) for t in tokens[:-1]]).astype(np.int64)
    return Shard(
        np.concatenate(tokens).astype(np.int32),
        np.concatenate(ids).astype(np.int32),
        np.concatenate(logp).astype(np.float16),
        np.concatenate(mask),
        starts,
    )


# -- outside data (--data) ----------------------------------------------------------------------


def read_texts(files: Iterable[str | Path], tokenizer: Tokenizer) -> list[str]:
    """Documents from .txt files (one per file) and .jsonl files (one per line).

    A JSONL line may hold `text`, `messages` (chat, rendered with the chat template) or
    `turns` (Spec-Bench style: the first turn becomes a user message).
    """
    docs: list[str] = []
    for f in map(Path, files):
        if not f.exists():
            raise OndeviceError(f"{f}: data file not found.")
        if f.suffix == ".jsonl":
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise OndeviceError(f"{f}:{n}: not valid JSON ({e}).") from None
                if isinstance(row, dict) and isinstance(row.get("text"), str):
                    docs.append(row["text"])
                elif isinstance(row, dict) and isinstance(row.get("messages"), list):
                    docs.append(tokenizer.apply_chat_template(row["messages"], False))
                elif isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
                    docs.append(
                        tokenizer.apply_chat_template(
                            [{"role": "user", "content": row["turns"][0]}]
                        )
                    )
                else:
                    raise OndeviceError(
                        f"{f}:{n}: expected an object with 'text', 'messages' or 'turns'."
                    )
        else:
            docs.append(f.read_text())
    if not docs:
        raise OndeviceError("the --data files hold no documents.")
    return docs


def score_texts(
    model: Model, tokenizer: Tokenizer, docs: list[str], *, k: int, max_tokens: int = 320
) -> Shard:
    """Tokenize documents into pieces of at most `max_tokens` and record the teacher's top-k."""
    seqs: list[np.ndarray] = []
    for d in docs:
        t = tokenizer.encode(d, add_special_tokens=True)
        for i in range(0, len(t), max_tokens):
            if len(t[i : i + max_tokens]) >= 2:
                seqs.append(np.array(t[i : i + max_tokens], np.int32))
    if not seqs:
        raise OndeviceError("the --data files are too short to learn from.")
    scored = score_sequences(model, seqs, k)
    masks = []
    for s in seqs:
        m = np.ones(len(s), bool)
        m[-1] = False
        masks.append(m)
    return _pack(seqs, [a for a, _ in scored], [b for _, b in scored], masks, k)


def list_shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("shard-*.npz"))


def answers_only(shard: Shard, suffix: list[int]) -> Shard:
    """Learn only where the assistant answers: the draft never has to guess user turns, and
    those (sampled hot, high-entropy) positions would take capacity from the answers."""
    mask = shard.mask.copy()
    ends = np.append(shard.starts[1:], len(shard.tokens))
    n = len(suffix)
    for a, b in zip(shard.starts, ends):
        conv = shard.tokens[a:b]
        first = b  # no assistant turn found: nothing to learn from this conversation
        for i in range(len(conv) - n + 1):
            if conv[i] == suffix[0] and conv[i : i + n].tolist() == suffix:
                first = a + i + n - 1  # this position predicts the answer's first token
                break
        mask[a:first] = False
    return Shard(shard.tokens, shard.ids, shard.logp, mask, shard.starts, shard.hidden)
