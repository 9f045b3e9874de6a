"""Draft distillation: train a small draft model to imitate its verifier (offline, with MLX).

`distill(...)` runs the whole recipe: build or read the data (with the teacher's top-k), train
the student with checkpoints, export the draft. A work folder next to the output keeps the data
shards and the checkpoint, so `resume=True` picks up where a stopped run ended.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ondevice.distill.data import (
    HELD_OUT_EVERY,
    Shard,
    answers_only,
    chat_turn_tokens,
    list_shards,
    magpie_batch,
    read_texts,
    score_texts,
)
from ondevice.distill.export import DRAFT_VOCAB_FIELD, draft_vocab_size, export_draft
from ondevice.distill.teacher import Teacher, load_teacher
from ondevice.distill.train import (
    TrainConfig,
    checkpoint_config,
    default_layers,
    train,
    work_folder,
)
from ondevice.errors import OndeviceError

__all__ = [
    "DRAFT_VOCAB_FIELD",
    "TrainConfig",
    "distill",
    "draft_vocab_size",
    "parse_layers",
]


def parse_layers(spec: str | int, n_teacher: int) -> list[int]:
    """'4' -> a default choice of 4 layers; '0,1,28,29' -> exactly those teacher layers."""
    s = str(spec).strip()
    try:
        if "," in s:
            return [int(x) for x in s.split(",") if x.strip()]
        return default_layers(n_teacher, int(s))
    except ValueError:
        raise OndeviceError(
            f"--layers {spec!r}: give a number of layers (e.g. 4) or teacher layer indices "
            "(e.g. 0,1,28,29)."
        ) from None


def make_data(
    teacher: Teacher,
    data_dir: Path,
    *,
    files: list[str] | None,
    tokens: int,
    k: int,
    batch: int,
    max_tokens: int,
    seed: int,
    progress: bool = True,
) -> Shard:
    """All data shards in `data_dir`, generating (Magpie) or scoring (--data) what is missing."""
    from tqdm import tqdm

    data_dir.mkdir(parents=True, exist_ok=True)
    if files:
        target = data_dir / "shard-files.npz"
        if not target.exists():
            docs = read_texts(files, teacher.tokenizer)
            if progress:
                print(f"scoring {len(docs)} documents with the verifier ...", flush=True)
            score_texts(teacher.model, teacher.tokenizer, docs, k=k, max_tokens=max_tokens).save(
                target
            )
        return Shard.load(target)
    shards = [Shard.load(p) for p in list_shards(data_dir)]
    have = sum(s.n_targets for s in shards)
    bar = tqdm(
        total=tokens,
        initial=min(have, tokens),
        unit="tok",
        desc="magpie data",
        disable=not progress,
    )
    while have < tokens:
        i = len(shards)
        shard = magpie_batch(
            teacher.model,
            teacher.tokenizer,
            batch=batch,
            k=k,
            max_tokens=max_tokens,
            seed=1000 + seed * 100003 + i,
            on_token=lambda live: bar.set_postfix(live=live, refresh=False),
        )
        shard.save(data_dir / f"shard-{i:05d}.npz")
        shards.append(shard)
        have += shard.n_targets
        bar.update(min(shard.n_targets, tokens - bar.n))
    bar.close()
    if not shards:
        raise OndeviceError("no training data: pass --tokens > 0 or --data FILES.")
    return answers_only(Shard.concat(shards), chat_turn_tokens(teacher.tokenizer)[1])


def split_held_out(data: Shard, every: int = HELD_OUT_EVERY) -> tuple[Shard, Shard]:
    """(train, held-out): every `every`-th conversation is held out (at least one)."""
    ends = np.append(data.starts[1:], len(data.tokens))
    convs = list(zip(data.starts, ends))
    held_idx = set(range(0, len(convs), every)) if len(convs) > 1 else set()
    if not held_idx:
        raise OndeviceError("need at least two conversations/documents to hold one out.")

    def pick(sel: list[int]) -> Shard:
        parts = [
            Shard(data.tokens[a:b], data.ids[a:b], data.logp[a:b], data.mask[a:b], np.array([0]))
            for a, b in (convs[i] for i in sel)
        ]
        return Shard.concat(parts)

    train_idx = [i for i in range(len(convs)) if i not in held_idx]
    return pick(train_idx), pick(sorted(held_idx))


def distill(
    verifier: str | Path,
    output: str | Path,
    *,
    data_files: list[str] | None = None,
    layers: str | int = 4,
    vocab: int | None = None,
    tokens: int = 100_000,
    resume: bool = False,
    steps: int = 2000,
    minutes: float | None = None,
    batch_size: int = 8,
    seq_len: int = 256,
    learning_rate: float = 5e-4,
    top_k: int = 20,
    gen_batch: int = 32,
    max_tokens: int = 288,
    embed_bits: int | None = 4,
    max_mb: float | None = 30.0,
    work_dir: str | Path | None = None,
    seed: int = 0,
    eval_every: int = 100,
    checkpoint_every: int = 50,
    progress: bool = True,
) -> dict[str, Any]:
    """Distill a draft for `verifier` into `output`; returns the run's summary."""
    output = Path(output)
    work = work_folder(output, work_dir, resume)
    t0 = time.time()
    teacher = load_teacher(verifier)
    layer_list = parse_layers(layers, teacher.config.num_hidden_layers)
    cfg = TrainConfig(
        layer_list, vocab, seq_len, batch_size, learning_rate, steps=steps, minutes=minutes,
        embed_bits=embed_bits, seed=seed, eval_every=eval_every, checkpoint_every=checkpoint_every,
    )  # fmt: skip
    if resume:
        _check_resumable(work, cfg)
    data = make_data(
        teacher, work / "data", files=data_files, tokens=tokens, k=top_k, batch=gen_batch,
        max_tokens=max_tokens, seed=seed, progress=progress,
    )  # fmt: skip
    data_time = time.time() - t0
    train_data, held = split_held_out(data)
    recipe = {
        "verifier": str(verifier),
        "layers": layer_list,
        "vocab": vocab,
        "data": "files" if data_files else "magpie",
        "train_targets": int(train_data.mask.sum()),
        "held_out_targets": int(held.mask.sum()),
        "top_k": top_k,
        "train": {k: v for k, v in asdict(cfg).items() if k != "extra"},
    }
    max_bytes = int(max_mb * 1e6) if max_mb else None
    on_checkpoint = _exporter(teacher, output, recipe, vocab, embed_bits, max_bytes)
    summary = train(
        teacher, train_data, held, cfg, work,
        resume=resume, on_checkpoint=on_checkpoint, progress=progress,
    )  # fmt: skip
    model = summary.pop("model")
    summary["data_time_s"] = round(data_time, 1)
    on_checkpoint(model, summary)
    (work / "summary.json").write_text(
        json.dumps({**recipe, **{k: v for k, v in summary.items() if k != "losses"}}, indent=1)
    )
    return {**recipe, **summary}


def _check_resumable(work: Path, cfg: TrainConfig) -> None:
    """OndeviceError unless `work` holds a checkpoint trained with `cfg`'s shape of draft."""
    old = checkpoint_config(work / "checkpoint")
    if old is None:
        raise OndeviceError(f"{work}: no checkpoint to resume from; run without --resume.")
    for key in ("layers", "vocab", "embed_bits"):
        if old[key] != getattr(cfg, key):
            raise OndeviceError(
                f"--resume: the checkpoint was trained with {key}={old[key]!r}, not "
                f"{getattr(cfg, key)!r}; pass the same options."
            )


def _exporter(
    teacher: Teacher,
    output: Path,
    recipe: dict[str, Any],
    vocab: int | None,
    embed_bits: int | None,
    max_bytes: int | None,
) -> Callable[[Any, dict[str, Any]], None]:
    """The checkpoint callback: export the draft as trained so far into `output`, with the
    recipe and the run's figures, so a stopped run still leaves a usable draft."""

    def on_checkpoint(model: Any, summary: dict[str, Any]) -> None:
        info = {**recipe, **{k: v for k, v in summary.items() if k not in ("losses", "model")}}
        export_draft(
            model, teacher.tokenizer, output,
            vocab=vocab, embed_bits=embed_bits, max_bytes=max_bytes, info=info,
        )  # fmt: skip

    return on_checkpoint
