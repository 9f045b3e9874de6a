"""Train Medusa heads for a verifier (Medusa-1: the verifier frozen, only the heads learn).

The recipe (`distill_heads`):

1. **Text.** A share of `tokens` (`chat_fraction`) is the verifier's own chat answers
   (`chat_shards`: conversations it writes itself, the Magpie method of the draft's data, with
   its hidden states recorded as it writes); the rest are documents from `--data` files (read
   as `read_texts` reads them) and the documentation and source shipped in the installed
   packages (`local_documents`: .md, .rst, .txt and .py files under site-packages), cut into
   pieces of `seq_len` tokens. Every `HELD_OUT_EVERY`-th conversation batch and about one
   document token in `HELD_OUT_EVERY` (whole documents) are held out.
2. **Hidden states, once**, from the verifier as generation serves it on this machine
   (`kernel.load_served`: on a CPU its bf16 products, so the heads learn from the very states
   they will read, three times faster than a float32 copy). Documents are prefilled in large
   batches; at every position its last hidden state (after the final norm, float16) and its
   top-k next-token log-probabilities are stored in shards (`WORK/hidden/*.npz`, each written
   whole or not at all), so a stopped run resumes with the shards it has, and training never
   runs the verifier again.
3. **Heads.** K residual blocks (`proposers.medusa.MedusaHeads`), initialised to the identity
   (W = 0, b = 0: head k then says what the verifier's head says, as Medusa initialises). Head k
   at position t learns the verifier's distribution for token t+k+1, the teacher's top-k at
   position t+k, by cross-entropy to it renormalised over the first `vocab_subset` ids through
   the verifier's frozen output matrix (`OutputRows`, read once from the served head; the
   draft's loss `soft_cross_entropy`). AdamW, the draft's schedule, one compiled step over
   `batch` random positions.
4. **Checkpoints and export.** The draft trainer's checkpoint (`train.save_checkpoint`:
   weights, Adam state, step, atomic) every `checkpoint_every` steps, and the heads folder
   re-exported each time (`save_heads`, atomic), with the held-out greedy agreement of each
   head in heads.json.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from ondevice.distill.data import (
    HELD_OUT_EVERY,
    Shard,
    answers_only,
    chat_turn_tokens,
    magpie_batch,
    read_texts,
    save_npz,
)
from ondevice.distill.export import fitting_bits, quant_group, replace_folder
from ondevice.distill.teacher import topk_logprobs
from ondevice.distill.train import (
    CHECKPOINT,
    TrainConfig,
    checkpoint_config,
    load_checkpoint,
    progress_bar,
    save_checkpoint,
    schedule,
    soft_cross_entropy,
    work_folder,
)
from ondevice.errors import OndeviceError
from ondevice.models import LoadedModel
from ondevice.models.transformer import Model, _head_rows
from ondevice.models.weights import quantized_entries
from ondevice.proposers.medusa import (
    HEAD_KINDS,
    META,
    WEIGHTS,
    Heads,
    HeadsInfo,
    embed_tokens,
    heads_cache_path,
    load_heads,
    verifier_fingerprint,
)
from ondevice.runtime.kernel import load_served

SUFFIXES = (".md", ".rst", ".txt", ".py")
MAX_FILE_BYTES = 200_000  # long generated files (tables, vendored data) say little per byte
ROWS_PER_SHARD = 32
PIECES_PER_DOCUMENT = 4  # a long file says less per token than a new one
CHAT_FRACTION = 0.75  # of the training tokens, the verifier's own answers (the rest: documents)
GEN_BATCH = 64  # conversations written at once (docs/distill.md, "Writing the answers faster")
# The system prompts the self-written conversations are written under, by the shards' name: what
# a user turn asks follows the system prompt (Magpie's task-specific system prompts, Xu et al.
# 2024). Under the template's own default a coding model writes few coding questions (a fifth
# of its answers hold a code block; docs/distill.md, "eighth run"), so a share of the answers
# (`code_share`) is written under a programming assistant's.
TOPICS: dict[str, str | None] = {
    "chat": None,
    "code": "You are a programming assistant. The user asks you to write, explain, fix or "
    "review code in a programming language; you answer with working code and a short explanation.",
}


def local_documents() -> list[Path]:
    """Text files shipped in the installed packages (site-packages of this Python), in a fixed
    order that mixes packages: documentation and source the machine has without the internet."""
    import hashlib
    import site

    roots = [Path(p) for p in site.getsitepackages() if Path(p).is_dir()]
    files = [
        f
        for root in roots
        for f in root.rglob("*")
        if f.suffix in SUFFIXES and f.is_file() and 200 < f.stat().st_size <= MAX_FILE_BYTES
    ]
    return sorted(files, key=lambda f: hashlib.sha256(str(f).encode()).hexdigest())


def save_heads(heads: Heads, info: HeadsInfo, out: Path, max_bytes: int | None = None) -> None:
    """Write a heads folder whole, replacing `out`: float16 weights, or, where they would not
    fit in `max_bytes`, the heads' matrices quantized with the most bits that fit (MLX's
    group-wise affine quantization, recorded in heads.json as `bits` and `group_size`;
    `load_heads` restores float weights), and heads.json."""
    out = Path(out)
    params = dict(tree_flatten(heads.parameters()))
    matrices = sum(v.size for v in params.values() if v.ndim == 2)
    fixed = sum(v.size * 2 for v in params.values() if v.ndim != 2) + (64 << 10)  # + heads.json
    group = quant_group(info.hidden_size)
    bits = fitting_bits(fixed, matrices, max_bytes, group, "the heads (use fewer --num-heads)")
    weights: dict[str, mx.array] = {}
    for k, v in params.items():
        if bits and v.ndim == 2:
            weights.update(quantized_entries(k.removesuffix(".weight"), v, group, bits))
        else:
            weights[k] = v.astype(mx.float16)
    doc = {k: v for k, v in info.to_json().items() if k not in ("bits", "group_size")}
    if bits:
        doc.update(bits=bits, group_size=group)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / WEIGHTS), weights)
    (tmp / META).write_text(json.dumps(doc, indent=1))
    replace_folder(tmp, out)


def identity_heads(hidden_size: int, num_heads: int, kind: str = "medusa") -> Heads:
    """Heads of `kind` (`HEAD_KINDS`) that start as the identity (W = 0, b = 0): each says what
    the verifier's own head says."""
    heads = HEAD_KINDS[kind](hidden_size, num_heads)
    heads.update(tree_map(mx.zeros_like, heads.parameters()))
    return heads


# -- hidden states, computed once ----------------------------------------------------------------


def _pieces(teacher: LoadedModel, files: list[str] | None, tokens: int, seq_len: int) -> tuple[
    list[np.ndarray], list[np.ndarray], list[str]
]:  # fmt: skip
    """(train pieces, held-out pieces, sources used): documents (their first
    PIECES_PER_DOCUMENT pieces) cut into `seq_len` tokens until `tokens` train tokens, whole
    documents held out to keep about one token in HELD_OUT_EVERY; --data files first, then
    local documents."""
    tok = teacher.tokenizer
    train: list[np.ndarray] = []
    held: list[np.ndarray] = []
    have = 0
    used: list[str] = []

    def docs():
        if files:
            for d in read_texts(files, tok):
                yield "data", d
        for f in local_documents():
            try:
                yield str(f), f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    held_have = 0
    for name, text in docs():
        if have >= tokens and held_have * HELD_OUT_EVERY >= tokens:
            break
        ids = tok.encode(text, add_special_tokens=False)[: PIECES_PER_DOCUMENT * seq_len]
        cut = [np.array(ids[i : i + seq_len], np.int32) for i in range(0, len(ids), seq_len)]
        cut = [c for c in cut if len(c) >= 8]
        if not cut:
            continue
        used.append(name)
        n = sum(len(c) for c in cut)
        if held_have * HELD_OUT_EVERY < have:  # about one token in HELD_OUT_EVERY held out
            held += cut
            held_have += n
        else:
            train += cut
            have += n
    if not train or not held:
        raise OndeviceError(
            "not enough text to train heads on (at least two documents of 8 tokens); pass more "
            "--data files."
        )
    return train, held, used


def hidden_shards(
    teacher: LoadedModel,
    folder: Path,
    name: str,
    pieces: list[np.ndarray],
    *,
    k: int,
    batch_tokens: int = 2048,
    bar: Any = None,
) -> list[Path]:
    """Shards `folder/{name}-*.npz` of the verifier's hidden states (R, L, d) float16 and top-k
    (ids, log-probs) (R, L, k) over `pieces`, ROWS_PER_SHARD pieces each; existing shards are
    kept (a stopped run resumes), missing ones computed by batched prefill."""
    folder.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    if not pieces:  # --chat-fraction 1: no documents
        return paths
    L = max(len(p) for p in pieces)
    rows = max(1, batch_tokens // L)
    for s in range(0, len(pieces), ROWS_PER_SHARD):
        path = folder / f"{name}-{s // ROWS_PER_SHARD:05d}.npz"
        part = pieces[s : s + ROWS_PER_SHARD]
        paths.append(path)
        if path.exists():
            continue
        hid, ids, logp, nxt = [], [], [], []
        for b in range(0, len(part), rows):
            group = part[b : b + rows]
            x = np.zeros((len(group), L), np.int32)
            for r, p in enumerate(group):
                x[r, : len(p)] = p
            logits, h = teacher.model(mx.array(x), hidden=True)
            mx.eval(logits, h)  # one evaluation for both (lazy where MLX computes the model)
            top_i, top_v = topk_logprobs(logits, k)
            h16 = np.array(h.astype(mx.float16))
            for r, p in enumerate(group):
                hid.append(h16[r, : len(p)])
                ids.append(top_i[r, : len(p)])
                logp.append(top_v[r, : len(p)])
                nxt.append(np.append(p[1:], 0).astype(np.int32))
            if bar is not None:
                bar.update(sum(len(p) for p in group))
        save_rows(path, hid, ids, logp, nxt)
    return paths


def save_rows(path: Path, hidden: list[np.ndarray], ids: list[np.ndarray],
              logp: list[np.ndarray], tokens: list[np.ndarray]) -> None:  # fmt: skip
    """One shard of rows (a piece or a conversation's answer each): hidden (R, L, d) float16,
    top-k ids (R, L, k) int32 and log-probabilities (R, L, k) float16 of the token after each
    position, the text's token after each position (R, L) int32 (what the state at t was
    followed by: a sequential head's input), right-padded to the longest row, and each row's
    length; written whole."""
    L = max((len(h) for h in hidden), default=0)

    def padded(rows: list[np.ndarray], dtype: Any) -> np.ndarray:
        out = np.zeros((len(rows), L, *rows[0].shape[1:]), dtype) if rows else np.zeros((0, 0))
        for r, a in enumerate(rows):
            out[r, : len(a)] = a
        return out

    length = np.array([len(h) for h in hidden], np.int32)
    save_npz(path, hidden=padded(hidden, np.float16), ids=padded(ids, np.int32),
             logp=padded(logp, np.float16), tokens=padded(tokens, np.int32),
             length=length)  # fmt: skip


def chat_shards(
    teacher: LoadedModel,
    folder: Path,
    tokens: int,
    *,
    k: int,
    batch: int = GEN_BATCH,
    max_tokens: int = 288,
    seed: int = 0,
    bar: Any = None,
    topic: str = "chat",
) -> tuple[list[Path], list[Path]]:
    """(train shards, held-out shards) of the verifier's own chat answers with its hidden states:
    `folder/{topic}-*.npz`, one per batch of `batch` conversations it writes itself
    (`data.magpie_batch`: a user turn, then its answer; under the system prompt `TOPICS[topic]`),
    each answer a row from the position that predicts its first token. Batch i is held out
    where i % HELD_OUT_EVERY == 0 (the first is, so a short run has an estimate too). Batches
    are written until the train ones hold `tokens` positions; existing shards are kept (a
    stopped run resumes)."""
    folder.mkdir(parents=True, exist_ok=True)
    system = TOPICS[topic]
    suffix = chat_turn_tokens(teacher.tokenizer, system)[1]
    train: list[Path] = []
    held: list[Path] = []
    have, i, empty = 0, 0, 0
    while have < tokens:
        path = folder / f"{topic}-{i:05d}.npz"
        if not path.exists():
            shard = magpie_batch(teacher.model, teacher.tokenizer, batch=batch, k=k,
                                 max_tokens=max_tokens, seed=1000 + seed * 100003 + i,
                                 hidden=True, system=system)  # fmt: skip
            save_rows(path, *_answer_rows(answers_only(shard, suffix)))
        with np.load(path) as z:
            n = int(z["length"].sum())
        empty = 0 if n else empty + 1
        if empty >= 3:
            raise OndeviceError(
                f"{teacher.path}: three batches of self-written conversations held no answer "
                "(the verifier does not answer through its chat template); pass --data files "
                "and --chat-fraction 0."
            )
        (held if i % HELD_OUT_EVERY == 0 else train).append(path)
        have += n if i % HELD_OUT_EVERY else 0
        if bar is not None:
            bar.update(n)
        i += 1
    return train, held


def _answer_rows(shard: Shard) -> tuple[list[np.ndarray], ...]:
    """Each conversation's answer positions (those `answers_only` keeps: contiguous, from the
    one predicting the answer's first token) as (hidden, ids, log-probs, next tokens) rows."""
    assert shard.hidden is not None, "magpie_batch(..., hidden=True) records the states"
    hid, ids, logp, nxt = [], [], [], []
    ends = np.append(shard.starts[1:], len(shard.tokens))
    for a, b in zip(shard.starts, ends):
        kept = np.nonzero(shard.mask[a:b])[0]
        if len(kept) < 2:
            continue
        lo, hi = a + kept[0], a + kept[-1] + 1
        hid.append(shard.hidden[lo:hi])
        ids.append(shard.ids[lo:hi])
        logp.append(shard.logp[lo:hi])
        after = shard.tokens[lo + 1 : min(hi + 1, b)]  # the last answer token has none
        nxt.append(np.pad(after, (0, hi - lo - len(after))).astype(np.int32))
    return hid, ids, logp, nxt


class OutputRows:
    """The verifier's output layer over its first `vocab` ids as a float32 MLX product, read
    once from the model as it is served (multiplying the identity reads each row back: exactly
    for float and bf16 weights), so the heads' training differentiates through what `head_logits`
    computes at generation and keeps no verifier in memory."""

    def __init__(self, model: Model, vocab: int):
        d = model.config.hidden_size
        head = model.head
        bias = _head_rows(head, mx.zeros((1, d)), vocab)[0] if "bias" in head else None
        self.weight_t = _head_rows(head, mx.eye(d), vocab)  # (d, vocab)
        if bias is not None:
            self.weight_t = self.weight_t - bias
        self.bias = bias
        mx.eval(self.weight_t, *(() if bias is None else (bias,)))

    def __call__(self, states: mx.array) -> mx.array:
        out = states @ self.weight_t
        return out if self.bias is None else out + self.bias


class TokenEmbeddings:
    """The verifier's input embedding of every id, read once (float16, as numpy: 0.47 GB for
    151,936 x 1536), so that sequential heads train on the embeddings `embed_tokens` gives them
    at generation without keeping the verifier in memory."""

    def __init__(self, model: Model, chunk: int = 8192):
        n = model.config.vocab_size
        parts = [
            np.array(embed_tokens(model, np.arange(i, min(i + chunk, n))).astype(mx.float16))
            for i in range(0, n, chunk)
        ]
        self.table = np.concatenate(parts)

    def __call__(self, ids: np.ndarray) -> mx.array:
        return mx.array(self.table[ids].astype(np.float32))


class Positions:
    """Every position t of the shards with a target for each head (t + k < the piece's length
    for head k), gathered in batches: (hidden (P, d), the embeddings of the text's tokens at
    t+1..t+K (P, K, d) where `embeddings` is given (sequential heads' inputs; else None), ids
    (P, K, k), log-probs (P, K, k), weight (P, K))."""

    def __init__(self, paths: list[Path], num_heads: int,
                 embeddings: TokenEmbeddings | None = None):  # fmt: skip
        hid, ids, logp, length, toks = [], [], [], [], []
        for p in paths:
            with np.load(p) as z:
                if not len(z["length"]):
                    continue  # a batch of conversations that held no answer
                if embeddings is not None and "tokens" not in z:
                    raise OndeviceError(
                        f"{p}: written before heads read the text's tokens; delete "
                        f"{p.parent} (its states are computed again) or train --heads medusa."
                    )
                hid.append(z["hidden"]), ids.append(z["ids"]), logp.append(z["logp"])
                length.append(z["length"])
                if embeddings is not None:
                    toks.append(z["tokens"])
        if not hid:
            raise OndeviceError(f"no positions to train or check heads on in {paths[:1]} ...")
        L = max(h.shape[1] for h in hid)
        pad = lambda a: np.pad(a, [(0, 0), (0, L - a.shape[1])] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        self.hidden = np.concatenate([pad(h) for h in hid])
        self.ids = np.concatenate([pad(a) for a in ids])
        self.logp = np.concatenate([pad(a) for a in logp])
        self.tokens = np.concatenate([pad(a) for a in toks]) if toks else None
        self.length = np.concatenate(length)
        self.embeddings = embeddings
        self.K = num_heads
        r, t = np.nonzero(np.arange(L)[None] + 1 < self.length[:, None])  # head 1 has a target
        self.rows, self.cols = r, t
        self.n = len(r)

    def gather(self, sel: np.ndarray) -> tuple[mx.array | None, ...]:
        r, t = self.rows[sel], self.cols[sel]
        k = np.arange(1, self.K + 1)
        tt = t[:, None] + k[None]  # (P, K): the teacher's position for head k
        ok = tt < self.length[r][:, None]
        last = self.ids.shape[1] - 1
        tt = np.minimum(tt, last)
        embeds = None
        if self.embeddings is not None and self.tokens is not None:
            # the token at t+k: the one after position t+k-1
            embeds = self.embeddings(self.tokens[r[:, None], np.minimum(tt - 1, last)])
        return (
            mx.array(self.hidden[r, t].astype(np.float32)),
            embeds,
            mx.array(self.ids[r[:, None], tt]),
            mx.array(self.logp[r[:, None], tt]),
            mx.array(ok.astype(np.float32)),
        )

    def batch(self, step: int, size: int, seed: int) -> tuple[mx.array | None, ...]:
        per_epoch = max(1, self.n // size)
        epoch, i = divmod(step, per_epoch)
        order = np.random.default_rng((seed, epoch)).permutation(self.n)
        return self.gather(order[i * size : (i + 1) * size])


# -- training ------------------------------------------------------------------------------------


def heads_loss(
    heads: Heads,
    out: OutputRows,
    h: mx.array,
    embeds: mx.array | None,
    ids: mx.array,
    logp: mx.array,
    weight: mx.array,
    vocab: int,
) -> tuple[mx.array, mx.array]:
    """Mean cross-entropy of every head to its teacher distribution, and per head the share of
    positions where its argmax is the teacher's top token."""
    logits = out(heads(h, embeds))  # (P, K, vocab)
    return soft_cross_entropy(logits, ids, logp, weight, vocab, per_head=True)


def evaluate_heads(
    heads: Heads, out: OutputRows, held: Positions, vocab: int
) -> tuple[float, list[float]]:
    """Held-out loss and each head's greedy agreement with the verifier (head k's top token is
    the verifier's top token k+1 positions on: the acceptance estimate of a depth-k guess)."""
    tot_l, agree, n = 0.0, np.zeros(held.K), np.zeros(held.K)
    for i in range(0, held.n, 256):
        h, e, ids, logp, w = held.gather(np.arange(i, min(i + 256, held.n)))
        loss, a = heads_loss(heads, out, h, e, ids, logp, w, vocab)
        ws = np.array(w.sum(0))
        tot_l += float(loss) * float(ws.sum())
        agree += np.array(a) * ws
        n += ws
    return tot_l / max(float(n.sum()), 1.0), [round(float(x), 4) for x in agree / np.maximum(n, 1)]


def distill_heads(
    verifier: str | Path,
    output: str | Path,
    *,
    data_files: list[str] | None = None,
    num_heads: int = 4,
    kind: str = "hydra",
    vocab: int | None = 32768,
    tokens: int = 100_000,
    resume: bool = False,
    steps: int = 2000,
    minutes: float | None = None,
    batch_size: int = 256,
    seq_len: int = 512,
    learning_rate: float = 1e-3,
    top_k: int = 20,
    chat_fraction: float = CHAT_FRACTION,
    code_share: float = 0.0,
    gen_batch: int = GEN_BATCH,
    max_tokens: int = 288,
    work_dir: str | Path | None = None,
    seed: int = 0,
    eval_every: int = 100,
    checkpoint_every: int = 50,
    max_mb: float | None = 30.0,
    init: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train Medusa heads for `verifier` into the folder `output`; returns the run's summary.

    init: a heads folder for this verifier (the shipped heads, an earlier run's output) that
    training starts from instead of the identity, to train them on more answers; its kind,
    number of heads and vocabulary subset are the run's.

    chat_fraction: the share of `tokens` that are the verifier's own chat answers (conversations
    of at most `max_tokens`, `gen_batch` written at once); the rest are documents. code_share:
    the share of those answers written under a programming assistant's system prompt
    (`TOPICS["code"]`). max_mb: the folder's size limit (None: none), met by quantizing the
    heads' matrices as little as fits (`save_heads`; 30 MB is what `Package.resources` may
    ship)."""
    output, t0 = Path(output), time.time()
    if not 0.0 <= chat_fraction <= 1.0:
        raise OndeviceError(f"--chat-fraction must be between 0 and 1, not {chat_fraction}.")
    if not 0.0 <= code_share <= 1.0:
        raise OndeviceError(f"--code-share must be between 0 and 1, not {code_share}.")
    work = work_folder(output, work_dir, resume)
    teacher = load_served(verifier)
    tcfg = teacher.config
    vocab = min(vocab or tcfg.vocab_size, tcfg.vocab_size)
    if num_heads < 1:
        raise OndeviceError("--num-heads must be at least 1.")
    if kind not in HEAD_KINDS:
        raise OndeviceError(f"--heads must be one of {', '.join(HEAD_KINDS)}, not {kind!r}.")
    cfg = TrainConfig(
        [], vocab, seq_len, batch_size, learning_rate, steps=steps, minutes=minutes,
        embed_bits=None, seed=seed, eval_every=eval_every, checkpoint_every=checkpoint_every,
        extra={"heads": kind, "num_heads": num_heads, "top_k": top_k,
               "data": sorted(map(str, data_files or [])), "chat_fraction": chat_fraction,
               "code_share": code_share, "gen_batch": gen_batch, "max_tokens": max_tokens,
               "init": str(Path(init).resolve()) if init is not None else None},
    )  # fmt: skip
    if resume:
        _check_resume(work, cfg)
    start = _start_heads(init, teacher.model, kind, num_heads, vocab)  # checked before the data
    chat_tokens = round(tokens * chat_fraction)
    code_tokens = round(chat_tokens * code_share)
    train_pieces, held_pieces, used = [], [], []
    if tokens > chat_tokens:  # documents (--data files first) make up the rest
        train_pieces, held_pieces, used = _pieces(
            teacher, data_files, tokens - chat_tokens, seq_len
        )
    paths = _hidden_states(
        teacher, work / "hidden", train_pieces, held_pieces, top_k, progress,
        chat_tokens=chat_tokens - code_tokens, code_tokens=code_tokens, gen_batch=gen_batch,
        max_tokens=max_tokens, seed=seed,
    )  # fmt: skip
    data_time = time.time() - t0
    model = teacher.model
    embeddings = TokenEmbeddings(model) if kind == "hydra" else None
    train_pos = Positions(paths[0], num_heads, embeddings)
    held_pos = Positions(paths[1], num_heads, embeddings)
    recipe = _recipe(verifier, data_files, len(used), train_pos, held_pos, cfg)
    recipe["chat_answers"] = {"train": _rows(paths[2]), "held_out": _rows(paths[3])}
    info = HeadsInfo(verifier_fingerprint(model), tcfg.hidden_size, num_heads, vocab, kind=kind)
    cache_path = heads_cache_path(model)
    out_rows = OutputRows(model, vocab)
    del model, teacher  # training needs only the output rows: the verifier's memory goes back

    heads = start or identity_heads(tcfg.hidden_size, num_heads, kind)
    opt = optim.AdamW(learning_rate=learning_rate, weight_decay=0.0)
    opt.init(heads.trainable_parameters())
    step, elapsed = 0, 0.0
    summary: dict[str, Any] = {}
    if resume:
        step, elapsed = load_checkpoint(work / CHECKPOINT, heads, opt)  # type: ignore[arg-type]
    else:
        summary["held_out_loss_start"], summary["head_agreement_start"] = evaluate_heads(
            heads, out_rows, held_pos, vocab
        )

    def checkpoint(step: int, seconds: float) -> None:
        save_checkpoint(work / CHECKPOINT, heads, opt, step, seconds, cfg)  # type: ignore[arg-type]
        summary.update(step=step, train_time_s=round(seconds, 1))
        kept = {k: v for k, v in summary.items() if k != "losses"}
        info.extra = {**recipe, **kept, "data_time_s": round(data_time, 1)}
        save_heads(heads, info, output, round(max_mb * 1e6) if max_mb else None)

    step = _train_loop(heads, opt, out_rows, train_pos, held_pos, cfg, summary, checkpoint,
                       step=step, elapsed=elapsed, progress=progress)  # fmt: skip
    if "head_agreement" not in summary:
        summary["held_out_loss"], summary["head_agreement"] = evaluate_heads(
            heads, out_rows, held_pos, vocab
        )
    checkpoint(step, summary.get("train_time_s", elapsed))
    print(
        f"use them with heads={str(output)!r} (--heads {output}), or copy {output} to "
        f"{cache_path} where method 'medusa' finds them by itself",
        file=sys.stderr,
    )
    return {**recipe, **summary, "data_time_s": round(data_time, 1)}


def _start_heads(
    init: str | Path | None, model: Model, kind: str, num_heads: int, vocab: int
) -> Heads | None:
    """The heads of the folder `init` as training's start (None without one), checked against
    the verifier (`load_heads`) and the run's options, naming the field that differs."""
    if init is None:
        return None
    heads, info = load_heads(Path(init), model)
    meta = Path(init) / META
    for name, have, want in (("kind", info.kind, kind), ("num_heads", info.num_heads, num_heads),
                             ("vocab_subset", info.vocab_subset, vocab)):  # fmt: skip
        if have != want:
            raise OndeviceError(
                f"{meta}: {name} is {have!r} where this run trains {want!r}; pass the options "
                f"that match the heads to --init (--heads, --num-heads, --vocab), or leave out "
                "--init to start from the identity."
            )
    return heads


def _recipe(
    verifier: str | Path,
    data_files: list[str] | None,
    documents: int,
    train: Positions,
    held: Positions,
    cfg: TrainConfig,
) -> dict[str, Any]:
    """What the heads were trained on and how, as heads.json records it."""
    sources = ["self-written chat answers"] if cfg.extra["chat_fraction"] else []
    if sources and cfg.extra.get("code_share"):
        sources.append(f"a share of {cfg.extra['code_share']} of them under TOPICS['code']")
    if documents:
        sources += (["--data"] if data_files else []) + ["site-packages .md/.rst/.txt/.py"]
    return {
        "verifier": str(verifier),
        "data": sources,
        "documents": documents,
        "train_tokens": int(train.length.sum()),
        "held_out_tokens": int(held.length.sum()),
        "top_k": cfg.extra["top_k"],
        "train": {k: v for k, v in asdict(cfg).items() if k not in ("extra", "layers")},
        **({"init": cfg.extra["init"]} if cfg.extra.get("init") else {}),  # the heads it began as
    }


def _train_loop(
    heads: Heads,
    opt: optim.Optimizer,
    out_rows: OutputRows,
    train_pos: Positions,
    held_pos: Positions,
    cfg: TrainConfig,
    summary: dict[str, Any],
    checkpoint: Any,
    *,
    step: int,
    elapsed: float,
    progress: bool,
) -> int:
    """Train `heads` from `step` until `cfg`'s steps or minutes run out: one compiled AdamW step
    per batch, held-out agreement every `eval_every` steps into `summary`, `checkpoint(step,
    seconds)` every `checkpoint_every` and at the end. Returns the last step."""
    vocab, minutes = cfg.vocab, cfg.minutes
    loss_grad = nn.value_and_grad(heads, partial(heads_loss, out=out_rows, vocab=vocab))
    state = [heads.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(h, ids, logp, w, *e):  # e: the path's embeddings (sequential heads only)
        embeds = e[0] if e else None
        (loss, agree), grads = loss_grad(heads, h=h, embeds=embeds, ids=ids, logp=logp, weight=w)
        opt.update(heads, grads)
        return loss, agree

    start = time.time() - elapsed
    tbar = progress_bar(cfg, step, elapsed, progress)
    ema = None
    acc = summary.get("head_agreement_start")

    def finished() -> bool:
        return step >= cfg.steps or bool(minutes and time.time() - start >= minutes * 60)

    while not finished():
        opt.learning_rate = schedule(cfg, step, time.time() - start)
        h, e, ids, logp, w = train_pos.batch(step, cfg.batch_size, cfg.seed)
        loss, agree = train_step(h, ids, logp, w, *(() if e is None else (e,)))
        mx.eval(loss, agree, state)
        step += 1
        ema = float(loss) if ema is None else 0.9 * ema + 0.1 * float(loss)
        tbar.update(min(int(time.time() - start), tbar.total) - tbar.n if minutes else 1)
        if step % cfg.eval_every == 0 or finished():
            summary["held_out_loss"], acc = evaluate_heads(heads, out_rows, held_pos, vocab)
            summary["head_agreement"] = acc
        post = {"step": step, "loss": f"{ema:.3f}"}
        if acc is not None:
            post["agree"] = "/".join(f"{a:.2f}" for a in acc)
        tbar.set_postfix(post, refresh=False)
        if step % cfg.checkpoint_every == 0 or finished():
            checkpoint(step, time.time() - start)
        summary.setdefault("losses", []).append(round(float(loss), 4))
    tbar.close()
    return step


# what a resumed run may change: where its text comes from (more answers, other documents are
# how heads get better); the heads themselves and their targets must stay as they were
DATA_OPTIONS = ("data", "chat_fraction", "code_share", "gen_batch", "max_tokens")
RESUMED_FREELY = (*DATA_OPTIONS, "init")  # a resumed run starts from its checkpoint anyway


def _check_resume(work: Path, cfg: TrainConfig) -> None:
    """Refuse a --resume whose checkpoint was made with other heads or targets (or is missing);
    the text (`DATA_OPTIONS`) and --init may differ."""
    old = checkpoint_config(work / CHECKPOINT)
    if old is None:
        raise OndeviceError(f"{work}: no checkpoint to resume from; run without --resume.")

    def heads_options(c: dict) -> dict:
        extra = {k: v for k, v in c["extra"].items() if k not in RESUMED_FREELY}
        return {"vocab": c["vocab"], "seq_len": c["seq_len"], **extra}

    was, now = heads_options(old), heads_options(asdict(cfg))
    for key in sorted(was.keys() | now.keys()):
        if was.get(key) != now.get(key):
            raise OndeviceError(
                f"--resume: the checkpoint was made with {key}={was.get(key)!r}, not "
                f"{now.get(key)!r}; pass the same options (only the text may change: --data, "
                "--chat-fraction, --tokens)."
            )


def _hidden_states(
    teacher: LoadedModel,
    hidden: Path,
    train_pieces: list[np.ndarray],
    held_pieces: list[np.ndarray],
    top_k: int,
    progress: bool,
    *,
    chat_tokens: int,
    code_tokens: int,
    gen_batch: int,
    max_tokens: int,
    seed: int,
) -> tuple[list[Path], list[Path], list[Path], list[Path]]:
    """The verifier's hidden states and top-k targets, computed once into shards under `hidden`
    (a rerun starts where the last stopped), with a progress bar: `chat_tokens` and
    `code_tokens` positions of its own answers (`chat_shards`, under the template's default
    system prompt and under the coding one) and the documents' pieces. Returns (train shards,
    held shards, the answers among them: train, held)."""
    from tqdm import tqdm

    n_chat = sum(n + n // (HELD_OUT_EVERY - 1) for n in (chat_tokens, code_tokens))  # held too
    n_tok = n_chat + sum(len(p) for p in train_pieces) + sum(len(p) for p in held_pieces)
    bar = tqdm(total=n_tok, unit="tok", desc="verifier states", disable=not progress,
               dynamic_ncols=True)  # fmt: skip
    chat_train: list[Path] = []
    chat_held: list[Path] = []
    for topic, n in (("chat", chat_tokens), ("code", code_tokens)):
        if n:
            train, held = chat_shards(teacher, hidden, n, k=top_k, batch=gen_batch,
                                      max_tokens=max_tokens, seed=seed, bar=bar, topic=topic)  # fmt: skip
            chat_train, chat_held = chat_train + train, chat_held + held
    if chat_tokens or code_tokens:
        bar.n = min(bar.n, n_chat)  # the last batch may overshoot the estimate
    done = sum(len(p) for p in _done_pieces(hidden, "train", train_pieces))
    done += sum(len(p) for p in _done_pieces(hidden, "held", held_pieces))
    bar.update(done)
    train_paths = hidden_shards(teacher, hidden, "train", train_pieces, k=top_k, bar=bar)
    held_paths = hidden_shards(teacher, hidden, "held", held_pieces, k=top_k, bar=bar)
    bar.close()
    return chat_train + train_paths, chat_held + held_paths, chat_train, chat_held


def _rows(paths: list[Path]) -> int:
    """Positions in row shards."""
    total = 0
    for p in paths:
        with np.load(p) as z:
            total += int(z["length"].sum())
    return total


def _done_pieces(folder: Path, name: str, pieces: list[np.ndarray]) -> list[np.ndarray]:
    """The pieces whose shard already exists (resume: the progress bar starts there)."""
    out: list[np.ndarray] = []
    for s in range(0, len(pieces), ROWS_PER_SHARD):
        if (folder / f"{name}-{s // ROWS_PER_SHARD:05d}.npz").exists():
            out += pieces[s : s + ROWS_PER_SHARD]
    return out
