"""Benchmark prompts in Spec-Bench's JSONL format: one object per line with `question_id`,
`category` and `turns` (a list of user messages; multi-turn entries come from MT-Bench).

Every problem is reported with the file and line it was found on, so a hand-edited prompt file
can be fixed without guessing.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ondevice.errors import OndeviceError


@dataclass(frozen=True)
class BenchPrompt:
    question_id: str
    category: str
    text: str  # the selected turn, sent as one user message through the chat template


def builtin_prompts_path() -> Path:
    """The prompt set shipped with ondevice (`Package.resources/prompts.jsonl`)."""
    from importlib.resources import files

    return Path(str(files("ondevice.resources").joinpath("prompts.jsonl")))


def read_prompts(path: str | Path, turn: int = 1) -> tuple[list[BenchPrompt], int]:
    """The prompts in `path` using their `turn`-th turn (1-based), and how many entries were
    skipped because they have fewer turns."""
    path = Path(path).expanduser()
    if turn < 1:
        raise OndeviceError(f"--turn must be 1 or more, got {turn}.")
    if not path.is_file():
        raise OndeviceError(
            f"{path}: no such prompts file. Pass a Spec-Bench-format JSONL file (one "
            '{"question_id", "category", "turns"} object per line) or omit --prompts to use '
            "the built-in set."
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise OndeviceError(f"{path}: not UTF-8 text ({e.reason}).") from None
    prompts: list[BenchPrompt] = []
    seen: set[tuple[str, str]] = set()
    skipped = 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise OndeviceError(f"{where}: not valid JSON ({e.msg} at column {e.colno}).") from None
        if not isinstance(obj, dict):
            raise OndeviceError(f"{where}: expected a JSON object, got {type(obj).__name__}.")
        qid, cat, turns = obj.get("question_id"), obj.get("category"), obj.get("turns")
        if qid is None or isinstance(qid, (dict, list, bool)):
            raise OndeviceError(f"{where}: needs a 'question_id' (a string or number).")
        if not isinstance(cat, str) or not cat.strip():
            raise OndeviceError(f"{where}: needs a 'category' (a non-empty string).")
        if (
            not isinstance(turns, list)
            or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)
        ):
            raise OndeviceError(f"{where}: 'turns' must be a non-empty list of non-empty strings.")
        key = (cat, str(qid))
        if key in seen:
            raise OndeviceError(f"{where}: question_id {qid!r} appears twice in '{cat}'.")
        seen.add(key)
        if len(turns) < turn:
            skipped += 1
            continue
        prompts.append(BenchPrompt(str(qid), cat.strip(), turns[turn - 1]))
    if not prompts:
        has = "no prompts" if not skipped else f"no prompt with {turn} turns"
        raise OndeviceError(f"{path}: {has}; nothing to benchmark.")
    return prompts, skipped


def select(
    prompts: Sequence[BenchPrompt],
    per_category: int | None = None,
    categories: Sequence[str] | None = None,
) -> list[BenchPrompt]:
    """The first `per_category` prompts of each wanted category, in file order."""
    if per_category is not None and per_category < 1:
        raise OndeviceError(f"--per-category must be 1 or more, got {per_category}.")
    present = Counter(p.category for p in prompts)
    if categories:
        unknown = [c for c in categories if c not in present]
        if unknown:
            raise OndeviceError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                f"the prompts file has: {', '.join(sorted(present))}."
            )
    wanted = set(categories) if categories else set(present)
    taken: Counter[str] = Counter()
    out = []
    for p in prompts:
        if p.category in wanted and (per_category is None or taken[p.category] < per_category):
            taken[p.category] += 1
            out.append(p)
    return out
