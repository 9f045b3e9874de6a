"""Train Medusa heads for a verifier (Medusa-1: the verifier frozen, only the heads learn).

The recipe (`distill_heads`):

1. **Text.** Documents from `--data` files (read as `read_texts` reads them) and, to make up
   `tokens`, the documentation and source shipped in the installed packages (`local_documents`:
   .md, .rst, .txt and .py files under site-packages), every `HELD_OUT_EVERY`-th document held
   out; cut into pieces of `seq_len` tokens.
2. **Hidden states, once.** The verifier (float32, `load_teacher`) prefills the pieces in large
   batches; at every position its last hidden state (after the final norm, float16) and its
   top-k next-token log-probabilities are stored in shards (`WORK/hidden/{train,held}-*.npz`,
   each written whole or not at all), so a stopped run resumes with the shards it has, and
   training never runs the verifier again.
3. **Heads.** K residual blocks (`proposers.medusa.MedusaHeads`), initialised to the identity
   (W = 0, b = 0: head k then says what the verifier's head says, as Medusa initialises). Head k
   at position t learns the verifier's distribution for token t+k+1, the teacher's top-k at
   position t+k, by cross-entropy to it renormalised over the first `vocab_subset` ids through
   the verifier's frozen output matrix (`soft_cross_entropy`, the draft's loss). AdamW, the
   draft's schedule, one compiled step over `batch` random positions.
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
from mlx.utils import tree_flatten

from ondevice.distill.data import read_texts, save_npz
from ondevice.distill.export import replace_folder
from ondevice.distill.teacher import Teacher, load_teacher, topk_logprobs
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
from ondevice.proposers.medusa import (
    META,
    WEIGHTS,
    HeadsInfo,
    MedusaHeads,
    head_logits,
    heads_cache_path,
    verifier_fingerprint,
)

HELD_OUT_EVERY = 20  # about one token in 20 is held out (whole documents) to estimate acceptance
SUFFIXES = (".md", ".rst", ".txt", ".py")
MAX_FILE_BYTES = 200_000  # long generated files (tables, vendored data) say little per byte
ROWS_PER_SHARD = 32
PIECES_PER_DOCUMENT = 4  # a long file says less per token than a new one


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


def save_heads(heads: MedusaHeads, info: HeadsInfo, out: Path) -> None:
    """Write a heads folder (float16 weights and heads.json) whole, replacing `out`."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(heads.parameters())}
    mx.save_safetensors(str(tmp / WEIGHTS), weights)
    (tmp / META).write_text(json.dumps(info.to_json(), indent=1))
    replace_folder(tmp, out)


def identity_heads(hidden_size: int, num_heads: int) -> MedusaHeads:
    """Heads that start as the identity (W = 0, b = 0)."""
    heads = MedusaHeads(hidden_size, num_heads)
    heads.update(
        {"heads": [{"weight": mx.zeros((hidden_size, hidden_size)), "bias": mx.zeros((hidden_size,))}
                   for _ in range(num_heads)]}
    )  # fmt: skip
    return heads


# -- hidden states, computed once ----------------------------------------------------------------


def _pieces(teacher: Teacher, files: list[str] | None, tokens: int, seq_len: int) -> tuple[
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
    teacher: Teacher,
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
    paths = []
    L = max(len(p) for p in pieces)
    rows = max(1, batch_tokens // L)
    for s in range(0, len(pieces), ROWS_PER_SHARD):
        path = folder / f"{name}-{s // ROWS_PER_SHARD:05d}.npz"
        part = pieces[s : s + ROWS_PER_SHARD]
        paths.append(path)
        if path.exists():
            continue
        hid, ids, logp = [], [], []
        for b in range(0, len(part), rows):
            group = part[b : b + rows]
            x = np.zeros((len(group), L), np.int32)
            for r, p in enumerate(group):
                x[r, : len(p)] = p
            logits, h = teacher.model(mx.array(x), hidden=True)
            top_i, top_v = topk_logprobs(logits, k)
            mx.eval(h, top_i, top_v)
            hid.append(np.array(h.astype(mx.float16)))
            ids.append(np.array(top_i).astype(np.int32))
            logp.append(np.array(top_v).astype(np.float16))
            if bar is not None:
                bar.update(sum(len(p) for p in group))
        length = np.array([len(p) for p in part], np.int32)
        save_npz(path, hidden=np.concatenate(hid), ids=np.concatenate(ids),
                 logp=np.concatenate(logp), length=length)  # fmt: skip
    return paths


class Positions:
    """Every position t of the shards with a target for each head (t + k < the piece's length
    for head k), gathered in batches: (hidden (P, d), ids (P, K, k), log-probs (P, K, k), weight
    (P, K))."""

    def __init__(self, paths: list[Path], num_heads: int):
        hid, ids, logp, length = [], [], [], []
        for p in paths:
            with np.load(p) as z:
                hid.append(z["hidden"]), ids.append(z["ids"]), logp.append(z["logp"])
                length.append(z["length"])
        L = max(h.shape[1] for h in hid)
        pad = lambda a: np.pad(a, [(0, 0), (0, L - a.shape[1])] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        self.hidden = np.concatenate([pad(h) for h in hid])
        self.ids = np.concatenate([pad(a) for a in ids])
        self.logp = np.concatenate([pad(a) for a in logp])
        self.length = np.concatenate(length)
        self.K = num_heads
        r, t = np.nonzero(np.arange(L)[None] + 1 < self.length[:, None])  # head 1 has a target
        self.rows, self.cols = r, t
        self.n = len(r)

    def gather(self, sel: np.ndarray) -> tuple[mx.array, ...]:
        r, t = self.rows[sel], self.cols[sel]
        k = np.arange(1, self.K + 1)
        tt = t[:, None] + k[None]  # (P, K): the teacher's position for head k
        ok = tt < self.length[r][:, None]
        tt = np.minimum(tt, self.ids.shape[1] - 1)
        return (
            mx.array(self.hidden[r, t].astype(np.float32)),
            mx.array(self.ids[r[:, None], tt]),
            mx.array(self.logp[r[:, None], tt]),
            mx.array(ok.astype(np.float32)),
        )

    def batch(self, step: int, size: int, seed: int) -> tuple[mx.array, ...]:
        per_epoch = max(1, self.n // size)
        epoch, i = divmod(step, per_epoch)
        order = np.random.default_rng((seed, epoch)).permutation(self.n)
        return self.gather(order[i * size : (i + 1) * size])


# -- training ------------------------------------------------------------------------------------


def heads_loss(
    heads: MedusaHeads,
    teacher: Any,
    h: mx.array,
    ids: mx.array,
    logp: mx.array,
    weight: mx.array,
    vocab: int,
) -> tuple[mx.array, mx.array]:
    """Mean cross-entropy of every head to its teacher distribution, and per head the share of
    positions where its argmax is the teacher's top token."""
    logits = head_logits(teacher, heads(h), vocab)  # (P, K, vocab)
    return soft_cross_entropy(logits, ids, logp, weight, vocab, per_head=True)


def evaluate_heads(
    heads: MedusaHeads, teacher: Any, held: Positions, vocab: int
) -> tuple[float, list[float]]:
    """Held-out loss and each head's greedy agreement with the verifier (head k's top token is
    the verifier's top token k+1 positions on: the acceptance estimate of a depth-k guess)."""
    tot_l, agree, n = 0.0, np.zeros(held.K), np.zeros(held.K)
    for i in range(0, held.n, 256):
        h, ids, logp, w = held.gather(np.arange(i, min(i + 256, held.n)))
        loss, a = heads_loss(heads, teacher, h, ids, logp, w, vocab)
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
    vocab: int | None = 32768,
    tokens: int = 100_000,
    resume: bool = False,
    steps: int = 2000,
    minutes: float | None = None,
    batch_size: int = 256,
    seq_len: int = 512,
    learning_rate: float = 1e-3,
    top_k: int = 20,
    work_dir: str | Path | None = None,
    seed: int = 0,
    eval_every: int = 100,
    checkpoint_every: int = 50,
    progress: bool = True,
) -> dict[str, Any]:
    """Train Medusa heads for `verifier` into the folder `output`; returns the run's summary."""
    output, t0 = Path(output), time.time()
    work = work_folder(output, work_dir, resume)
    teacher = load_teacher(verifier)
    tcfg = teacher.config
    vocab = min(vocab or tcfg.vocab_size, tcfg.vocab_size)
    if num_heads < 1:
        raise OndeviceError("--num-heads must be at least 1.")
    cfg = TrainConfig(
        [], vocab, seq_len, batch_size, learning_rate, steps=steps, minutes=minutes,
        embed_bits=None, seed=seed, eval_every=eval_every, checkpoint_every=checkpoint_every,
        extra={"heads": "medusa", "num_heads": num_heads, "top_k": top_k,
               "data": sorted(map(str, data_files or []))},
    )  # fmt: skip
    if resume:
        _check_resume(work, cfg)
    train_pieces, held_pieces, used = _pieces(teacher, data_files, tokens, seq_len)
    train_paths, held_paths = _hidden_states(
        teacher, work / "hidden", train_pieces, held_pieces, top_k, progress
    )
    data_time = time.time() - t0
    train_pos, held_pos = Positions(train_paths, num_heads), Positions(held_paths, num_heads)
    model = teacher.model
    model.freeze()
    recipe = _recipe(verifier, data_files, len(used), train_pieces, held_pieces, cfg)
    info = HeadsInfo(verifier_fingerprint(model), tcfg.hidden_size, num_heads, vocab)

    heads = identity_heads(tcfg.hidden_size, num_heads)
    opt = optim.AdamW(learning_rate=learning_rate, weight_decay=0.0)
    opt.init(heads.trainable_parameters())
    step, elapsed = 0, 0.0
    summary: dict[str, Any] = {}
    if resume:
        step, elapsed = load_checkpoint(work / CHECKPOINT, heads, opt)  # type: ignore[arg-type]
    else:
        summary["held_out_loss_start"], summary["head_agreement_start"] = evaluate_heads(
            heads, model, held_pos, vocab
        )

    def checkpoint(step: int, seconds: float) -> None:
        save_checkpoint(work / CHECKPOINT, heads, opt, step, seconds, cfg)  # type: ignore[arg-type]
        summary.update(step=step, train_time_s=round(seconds, 1))
        kept = {k: v for k, v in summary.items() if k != "losses"}
        info.extra = {**recipe, **kept, "data_time_s": round(data_time, 1)}
        save_heads(heads, info, output)

    step = _train_loop(heads, opt, model, train_pos, held_pos, cfg, summary, checkpoint,
                       step=step, elapsed=elapsed, progress=progress)  # fmt: skip
    if "head_agreement" not in summary:
        summary["held_out_loss"], summary["head_agreement"] = evaluate_heads(
            heads, model, held_pos, vocab
        )
    checkpoint(step, summary.get("train_time_s", elapsed))
    print(
        f"use them with heads={str(output)!r} (--heads {output}), or copy {output} to "
        f"{heads_cache_path(model)} where method 'medusa' finds them by itself",
        file=sys.stderr,
    )
    return {**recipe, **summary, "data_time_s": round(data_time, 1)}


def _recipe(
    verifier: str | Path,
    data_files: list[str] | None,
    documents: int,
    train_pieces: list[np.ndarray],
    held_pieces: list[np.ndarray],
    cfg: TrainConfig,
) -> dict[str, Any]:
    """What the heads were trained on and how, as heads.json records it."""
    return {
        "verifier": str(verifier),
        "data": (["--data"] if data_files else []) + ["site-packages .md/.rst/.txt/.py"],
        "documents": documents,
        "train_tokens": int(sum(len(p) for p in train_pieces)),
        "held_out_tokens": int(sum(len(p) for p in held_pieces)),
        "top_k": cfg.extra["top_k"],
        "train": {k: v for k, v in asdict(cfg).items() if k not in ("extra", "layers")},
    }


def _train_loop(
    heads: MedusaHeads,
    opt: optim.Optimizer,
    model: Any,
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
    loss_grad = nn.value_and_grad(heads, partial(heads_loss, teacher=model, vocab=vocab))
    state = [heads.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(h, ids, logp, w):
        (loss, agree), grads = loss_grad(heads, h=h, ids=ids, logp=logp, weight=w)
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
        loss, agree = train_step(*train_pos.batch(step, cfg.batch_size, cfg.seed))
        mx.eval(loss, agree, state)
        step += 1
        ema = float(loss) if ema is None else 0.9 * ema + 0.1 * float(loss)
        tbar.update(min(int(time.time() - start), tbar.total) - tbar.n if minutes else 1)
        if step % cfg.eval_every == 0 or finished():
            summary["held_out_loss"], acc = evaluate_heads(heads, model, held_pos, vocab)
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


def _check_resume(work: Path, cfg: TrainConfig) -> None:
    """Refuse a --resume whose checkpoint was made with other options (or is missing)."""
    old = checkpoint_config(work / CHECKPOINT)
    if old is None:
        raise OndeviceError(f"{work}: no checkpoint to resume from; run without --resume.")
    for key in ("vocab", "seq_len", "extra"):
        if old[key] != asdict(cfg)[key]:
            raise OndeviceError(
                f"--resume: the checkpoint was made with {key}={old[key]!r}, not "
                f"{asdict(cfg)[key]!r}; pass the same options."
            )


def _hidden_states(
    teacher: Any,
    hidden: Path,
    train_pieces: list[np.ndarray],
    held_pieces: list[np.ndarray],
    top_k: int,
    progress: bool,
) -> tuple[list[Path], list[Path]]:
    """The verifier's hidden states and top-k targets over both splits, computed once into
    shards under `hidden` (a rerun starts where the last stopped), with a progress bar."""
    from tqdm import tqdm

    n_tok = sum(len(p) for p in train_pieces) + sum(len(p) for p in held_pieces)
    bar = tqdm(total=n_tok, unit="tok", desc="verifier states", disable=not progress,
               dynamic_ncols=True)  # fmt: skip
    done = sum(len(p) for p in _done_pieces(hidden, "train", train_pieces))
    done += sum(len(p) for p in _done_pieces(hidden, "held", held_pieces))
    bar.update(done)
    train_paths = hidden_shards(teacher, hidden, "train", train_pieces, k=top_k, bar=bar)
    held_paths = hidden_shards(teacher, hidden, "held", held_pieces, k=top_k, bar=bar)
    bar.close()
    return train_paths, held_paths


def _done_pieces(folder: Path, name: str, pieces: list[np.ndarray]) -> list[np.ndarray]:
    """The pieces whose shard already exists (resume: the progress bar starts there)."""
    out: list[np.ndarray] = []
    for s in range(0, len(pieces), ROWS_PER_SHARD):
        if (folder / f"{name}-{s // ROWS_PER_SHARD:05d}.npz").exists():
            out += pieces[s : s + ROWS_PER_SHARD]
    return out
