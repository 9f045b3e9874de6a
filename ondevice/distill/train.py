"""Train a small draft to imitate its verifier (knowledge distillation with MLX).

The student starts as a slice of the teacher: its token embeddings (frozen, so the draft reads
and scores tokens exactly as it learnt to), a subset of its layers and its final norm. Its loss is
the cross-entropy to the teacher's top-k next-token distribution (the KL up to a constant),
renormalised over the draft's output vocabulary. With `vocab` set, the draft scores only the
first `vocab` token ids (FR-Spec: byte-level BPE gives the earliest merges, the commonest tokens,
the smallest ids), which makes the per-token output layer several times cheaper.

Training packs conversations into rows of `seq_len` tokens with a block-diagonal causal mask,
so no compute goes to padding and no conversation sees another. RoPE depends only on relative
positions, so a conversation's offset inside its row does not matter.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ondevice.distill.data import Shard
from ondevice.distill.export import replace_folder
from ondevice.distill.teacher import Teacher
from ondevice.errors import OndeviceError
from ondevice.models.transformer import Model

CHECKPOINT = "checkpoint"


@dataclass
class TrainConfig:
    layers: list[int]  # teacher layers the student starts from, in order
    vocab: int | None = None  # draft output vocabulary: the first `vocab` ids (None: all)
    seq_len: int = 256
    batch_size: int = 8
    learning_rate: float = 5e-4
    warmup_steps: int = 20
    steps: int = 1000  # schedule length; training stops earlier when `minutes` run out
    minutes: float | None = None
    embed_bits: int | None = 4  # quantize the frozen embedding before training (shipped as is)
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 50
    extra: dict[str, Any] = field(default_factory=dict)


def default_layers(n_teacher: int, n: int) -> list[int]:
    """First half from the bottom of the teacher, the rest from the top.

    The bottom layers turn embeddings into the residual stream the upper layers expect, and the
    top layers turn it into next-token logits; the middle is what a draft can skip.
    """
    if not 1 <= n <= n_teacher:
        raise OndeviceError(f"--layers must be between 1 and {n_teacher} (the verifier's layers).")
    low = (n + 1) // 2
    return list(range(low)) + list(range(n_teacher - (n - low), n_teacher))


# -- the student ---------------------------------------------------------------------------------


def build_student(teacher: Teacher, cfg: TrainConfig) -> Model:
    from ondevice.models.weights import build_model

    tcfg = teacher.config
    bad = [i for i in cfg.layers if not 0 <= i < tcfg.num_hidden_layers]
    if bad:
        raise OndeviceError(
            f"layer {bad[0]} does not exist: the verifier has {tcfg.num_hidden_layers} layers."
        )
    if cfg.vocab is not None and not 1 <= cfg.vocab <= tcfg.vocab_size:
        raise OndeviceError(f"--vocab must be between 1 and {tcfg.vocab_size}.")
    scfg = copy.deepcopy(tcfg)
    scfg.num_hidden_layers = len(cfg.layers)
    w: dict[str, mx.array] = {}
    for name, v in teacher.weights.items():
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            rest = name.split(".", 3)[3]
            for j, src in enumerate(cfg.layers):
                if src == i:
                    w[f"model.layers.{j}.{rest}"] = v
        else:
            w[name] = v
    if cfg.embed_bits:
        E = w["model.embed_tokens.weight"]
        group = 64 if E.shape[-1] % 64 == 0 else 32
        # Train against exactly the values the shipped (quantized) embedding will hold.
        w["model.embed_tokens.weight"] = mx.dequantize(
            *mx.quantize(E, group, cfg.embed_bits), group, cfg.embed_bits
        )
    student = build_model(scfg, w, dtype="float32", source="student")
    student.model.embed_tokens.freeze()
    if not scfg.tie_word_embeddings:
        student.lm_head.freeze()
    return student


def draft_logits(model: Model, x: mx.array, mask: mx.array | str, vocab: int | None) -> mx.array:
    """Logits over the draft's vocabulary (the first `vocab` ids) for a batch of rows."""
    h = model.model.embed_tokens(x)
    for layer in model.model.layers:
        h = layer(h, mask, None, None)
    h = model.model.norm(h)
    W = (
        model.model.embed_tokens.weight
        if model.config.tie_word_embeddings
        else model.lm_head.weight
    )
    if vocab is not None:
        W = W[:vocab]
    return h @ W.T


def distill_loss(
    model: Model,
    x: mx.array,
    mask: mx.array,
    ids: mx.array,
    logp: mx.array,
    weight: mx.array,
    vocab: int | None,
) -> tuple[mx.array, mx.array]:
    """Mean cross-entropy to the teacher's top-k (renormalised over the draft's vocabulary),
    and the fraction of positions where the student's argmax is the teacher's top token."""
    return soft_cross_entropy(draft_logits(model, x, mask, vocab), ids, logp, weight, vocab)


def soft_cross_entropy(
    logits: mx.array,
    ids: mx.array,
    logp: mx.array,
    weight: mx.array,
    vocab: int | None,
    per_head: bool = False,
) -> tuple[mx.array, mx.array]:
    """The distillation loss over logits (..., V) of the first `vocab` ids: the mean (by
    `weight` (...,)) cross-entropy to the teacher's top-k (`ids`, `logp` (..., k)) renormalised
    over those ids, and the weighted share of positions where the argmax is the teacher's top
    token (with `per_head`, per last axis of `weight` (P, K): one share per Medusa head)."""
    ls = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.exp(logp.astype(mx.float32))
    if vocab is not None:
        inside = ids < vocab
        p = p * inside
        ids = mx.where(inside, ids, 0)
    p = p / mx.maximum(p.sum(-1, keepdims=True), 1e-9)
    ce = -(p * mx.take_along_axis(ls, ids, axis=-1)).sum(-1)
    n = mx.maximum(weight.sum(), 1.0)
    hit = (mx.argmax(logits, axis=-1) == ids[..., 0]) * weight
    agree = hit.sum(0) / mx.maximum(weight.sum(0), 1.0) if per_head else hit.sum() / n
    return (ce * weight).sum() / n, agree


# -- batches -------------------------------------------------------------------------------------


class Batches:
    """Rows of `seq_len` packed tokens with the teacher's targets, in a seeded order per epoch."""

    def __init__(
        self, data: Shard, seq_len: int, batch_size: int, seed: int, pad: bool = False
    ) -> None:
        if pad and len(data.tokens) % seq_len:  # keep the tail (held-out data): pad the last row
            n = seq_len - len(data.tokens) % seq_len
            data = Shard(
                np.concatenate([data.tokens, np.zeros(n, np.int32)]),
                np.concatenate([data.ids, np.zeros((n, data.ids.shape[1]), np.int32)]),
                np.concatenate([data.logp, np.zeros((n, data.logp.shape[1]), data.logp.dtype)]),
                np.concatenate([data.mask, np.zeros(n, bool)]),
                np.append(data.starts, len(data.tokens)),
            )
        n_rows = len(data.tokens) // seq_len
        if n_rows < batch_size:
            raise OndeviceError(
                f"not enough training data: {len(data.tokens)} tokens make {n_rows} rows of "
                f"{seq_len}, fewer than one batch of {batch_size}. Generate more (--tokens) or "
                "lower --seq-len / --batch-size."
            )
        cut = n_rows * seq_len
        self.data, self.seq_len, self.batch_size, self.seed = data, seq_len, batch_size, seed
        doc = np.zeros(len(data.tokens), np.int32)
        doc[data.starts[1:]] = 1
        self.doc = np.cumsum(doc)[:cut].reshape(n_rows, seq_len)
        self.n_rows = n_rows
        self.per_epoch = n_rows // batch_size

    def get(self, step: int) -> tuple[mx.array, ...]:
        epoch, i = divmod(step, self.per_epoch)
        order = np.random.default_rng((self.seed, epoch)).permutation(self.n_rows)
        rows = order[i * self.batch_size : (i + 1) * self.batch_size]
        return self.rows(rows)

    def rows(self, rows: np.ndarray) -> tuple[mx.array, ...]:
        L = self.seq_len
        idx = rows[:, None] * L + np.arange(L)[None]
        d = self.data
        doc = self.doc[rows]
        causal = np.tril(np.ones((L, L), bool))
        visible = (doc[:, :, None] == doc[:, None, :]) & causal
        attn = np.where(visible, 0.0, -np.inf).astype(np.float32)[:, None]
        return (
            mx.array(d.tokens[idx]),
            mx.array(attn),
            mx.array(d.ids[idx]),
            mx.array(d.logp[idx]),
            mx.array(d.mask[idx].astype(np.float32)),
        )


# -- checkpoints ---------------------------------------------------------------------------------


def save_checkpoint(
    folder: Path, model: Model, opt: optim.Optimizer, step: int, elapsed: float, cfg: TrainConfig
) -> None:
    """Trainable weights, optimizer state and progress, replaced atomically."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(
        str(tmp / "weights.safetensors"), dict(tree_flatten(model.trainable_parameters()))
    )
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    meta = {"step": step, "elapsed_s": elapsed, "config": asdict(cfg)}
    (tmp / "progress.json").write_text(json.dumps(meta, indent=1))
    replace_folder(tmp, folder)


def load_checkpoint(folder: Path, model: Model, opt: optim.Optimizer) -> tuple[int, float]:
    if not (folder / "progress.json").exists():
        raise OndeviceError(f"{folder}: no checkpoint to resume from; run without --resume.")
    meta = json.loads((folder / "progress.json").read_text())
    model.load_weights(list(mx.load(str(folder / "weights.safetensors")).items()), strict=False)
    opt.state = tree_unflatten(list(mx.load(str(folder / "optimizer.safetensors")).items()))
    mx.eval(model.parameters(), opt.state)
    return int(meta["step"]), float(meta["elapsed_s"])


def work_folder(output: Path, work_dir: str | Path | None, resume: bool) -> Path:
    """The run's data and checkpoint folder (default OUTPUT.work); OndeviceError where a
    checkpoint of an earlier run is there and `resume` is not asked for."""
    work = Path(work_dir) if work_dir else output.with_name(output.name + ".work")
    if not resume and (work / CHECKPOINT).exists():
        raise OndeviceError(
            f"{work}: holds a checkpoint of an earlier run. Pass --resume to continue it, or "
            "delete the folder to start over."
        )
    return work


def checkpoint_config(folder: Path) -> dict[str, Any] | None:
    p = folder / "progress.json"
    return json.loads(p.read_text())["config"] if p.exists() else None


# -- the loop ------------------------------------------------------------------------------------


def schedule(cfg: TrainConfig, step: int, elapsed: float) -> float:
    """Linear warm-up, then cosine decay to a tenth over the run (steps or minutes)."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    done = step / max(cfg.steps, 1)
    if cfg.minutes:
        done = max(done, elapsed / (cfg.minutes * 60))
    done = min(done, 1.0)
    return cfg.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def evaluate(model: Model, held: Batches, vocab: int | None) -> tuple[float, float]:
    """Loss and greedy agreement with the teacher on held-out rows (the acceptance estimate)."""
    tot_l = tot_a = tot_n = 0.0
    step = 8
    for i in range(0, held.n_rows, step):
        x, attn, ids, logp, w = held.rows(np.arange(i, min(i + step, held.n_rows)))
        loss, agree = distill_loss(model, x, attn, ids, logp, w, vocab)
        n = float(w.sum())
        tot_l += float(loss) * n
        tot_a += float(agree) * n
        tot_n += n
    return tot_l / max(tot_n, 1), tot_a / max(tot_n, 1)


def train(
    teacher: Teacher,
    train_data: Shard,
    held_data: Shard,
    cfg: TrainConfig,
    work: Path,
    *,
    resume: bool = False,
    on_checkpoint=None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train, checkpointing into `work/checkpoint`; returns the run's summary.

    on_checkpoint(model, summary) is called after each checkpoint (e.g. to export the draft),
    so a stopped run still leaves a usable draft.
    """
    mx.random.seed(cfg.seed)
    model = build_student(teacher, cfg)
    batches = Batches(train_data, cfg.seq_len, cfg.batch_size, cfg.seed)
    held = Batches(held_data, cfg.seq_len, 1, 0, pad=True)
    opt = optim.AdamW(learning_rate=cfg.learning_rate, weight_decay=0.0)
    opt.init(model.trainable_parameters())
    ckpt = work / CHECKPOINT
    step, elapsed = 0, 0.0
    if resume:
        step, elapsed = load_checkpoint(ckpt, model, opt)

    train_step, state = _compiled_step(model, opt, cfg)
    summary: dict[str, Any] = {"step": step, "train_tokens_per_epoch": int(train_data.mask.sum())}
    if not resume:
        summary["held_out_loss_start"], summary["acceptance_estimate_start"] = evaluate(
            model, held, cfg.vocab
        )
    timed = bool(cfg.minutes)
    bar = progress_bar(cfg, step, elapsed, progress)
    ema = None
    start = time.time() - elapsed
    acc = summary.get("acceptance_estimate_start")

    def done() -> bool:
        return step >= cfg.steps or bool(cfg.minutes and time.time() - start >= cfg.minutes * 60)

    def checkpoint() -> None:
        save_checkpoint(ckpt, model, opt, step, time.time() - start, cfg)
        summary.update(step=step, train_time_s=round(time.time() - start, 1))
        if on_checkpoint is not None:
            on_checkpoint(model, summary)

    while not done():
        opt.learning_rate = schedule(cfg, step, time.time() - start)
        loss, agree = train_step(*batches.get(step))
        mx.eval(loss, agree, state)
        step += 1
        ema = float(loss) if ema is None else 0.9 * ema + 0.1 * float(loss)
        bar.update(min(int(time.time() - start), bar.total) - bar.n if timed else 1)
        if step % cfg.eval_every == 0 or done():
            summary["held_out_loss"], acc = evaluate(model, held, cfg.vocab)
            summary["acceptance_estimate"] = acc
        post = {"step": step, "loss": f"{ema:.3f}", "train_agree": f"{float(agree):.2f}"}
        if acc is not None:
            post["accept_est"] = f"{acc:.2f}"
        bar.set_postfix(post, refresh=False)
        if step % cfg.checkpoint_every == 0 or done():
            checkpoint()
        summary.setdefault("losses", []).append(round(float(loss), 4))
    bar.close()
    if "acceptance_estimate" not in summary:
        summary["held_out_loss"], summary["acceptance_estimate"] = evaluate(model, held, cfg.vocab)
    summary.update(step=step, train_time_s=round(time.time() - start, 1))
    summary["model"] = model
    return summary


def _compiled_step(model: Model, opt: optim.Optimizer, cfg: TrainConfig) -> tuple[Any, list]:
    """One optimizer step on a batch, compiled, and the state it updates (to evaluate)."""
    loss_grad = nn.value_and_grad(model, partial(distill_loss, vocab=cfg.vocab))
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(x, attn, ids, logp, w):
        (loss, agree), grads = loss_grad(model, x, attn, ids, logp, w)
        opt.update(model, grads)
        return loss, agree

    return train_step, state


def progress_bar(cfg: TrainConfig, step: int, elapsed: float, progress: bool) -> Any:
    """Steps, or with a time budget seconds (so the ETA is the budget's end)."""
    from tqdm import tqdm

    timed = bool(cfg.minutes)
    return tqdm(
        total=int(cfg.minutes * 60) if timed else cfg.steps,
        initial=int(elapsed) if timed else step,
        disable=not progress,
        unit="s" if timed else "step",
        dynamic_ncols=True,
    )
