"""How long a model's forward pass takes as a function of how many tokens it scores.

Sequoia's hardware-aware idea: a bigger tree accepts more tokens but costs more per pass, and the
trade-off depends on the device (on a GPU a pass of 32 tokens costs about as much as one; on a
CPU with quantized weights it can cost many times more). So the cost is measured once per device
and model, cached as JSON under `cache_dir()/profiles`, and proposers size their trees with it.

Sizes chosen from a cached profile depend only on that file, on accepted counts and on the
context (a tree decoder prices each round at the committed sequence's length, `CostProfile.at`),
never on the clock during generation. A generation that must give the same tokens every time (a
seeded sample: `proposers.resources.reproducible`) reads the costs as measured, without a stale
mark's scaling (below), which the clock wrote; so a seed gives the same tokens on a machine.

Identity. A profile is named and checked by what determines the cost: the device (processor,
MLX's device, the BLAS that serves MLX's CPU products and its threads, `device_name`) and the
engine (`engine_key`: architecture and sizes, the dtypes of its weights, and which kernel serves
its linear products, `runtime/kernel.py`, with its threads). A profile measured under MKL is
never read for a model whose products oneDNN serves, nor one of another model or machine.

Staleness. The cost of a pass also changes with what the file cannot name (an upgraded library,
a machine that got slower). The decoders that time verifier passes (tree, chain, pipelined: each
through `DecoderBase.timed_pass`; the pipelined one divides a pass that ran beside drafting by
the contention it measured) tell a `CostWatch` over the verifier's cached profile, which
compares them with it; a chain decoder, which sizes nothing by it, never has it measured. Once a generation has made `DRIFT_PASSES` timed passes (after
`DRIFT_WARMUP`), the median of their ratios to the profile is judged: outside
[1 / DRIFT_FACTOR, DRIFT_FACTOR] it is a strike, written into the file with the ratio;
`DRIFT_STRIKES` generations in a row mark the profile stale, and one within the factor clears
the strikes and the mark.

Re-measuring. A measurement takes up to `measure`'s budget (tens of seconds on a large model),
so it never happens inside a generation, where it would stall a request with no word (what
llama.cpp or Ollama users never see mid-session), nor in the background, where it would slow
the requests it measures beside. A stale profile is used as it is measured, its costs scaled by
the live ratio the watch recorded (`CostProfile.scale`), so proposals are sized for what passes
take now; the first use in a process says so on stderr. It is measured again at the next
`ondevice.load` (`remeasure_stale`: one line on stderr first, where a wait is expected), or at
once by deleting the file (`ondevice doctor` lists where). A profile that was never measured is
measured at its first use, announced the same way. The watch always judges live passes against
the measured costs, not the scaled ones, so a machine that recovers clears the mark. Nothing
changes a profile in memory while a generation runs: its sizes depend only on the file it
started with and on accepted counts. A profile written by hand (no measurement time) is never
judged.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from ondevice.rules.engine import Engine
from ondevice.rules.token_tree import TokenTree, ancestry

# Small sizes finely (on a CPU the choice between 1, 2 and 3 drafts hinges on them), large ones
# coarsely (only a GPU, where a pass costs about the same up to dozens of tokens, reaches them).
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
# A second, longer context the costs are measured at, for fewer sizes: attention's work per token
# grows with the keys before it, so on a CPU a pass over 8 tokens after 480 cost 1.20x one token
# where after 256 it cost 1.12x (docs/benchmarks.md, "Issue 26, session 24"), and trees sized by
# the short context's costs bought branches a long prompt's passes charged more for
LONG_CONTEXT = 1024
LONG_SIZES = (1, 4, 8, 16)
LONG_REPEATS = 4
# Sizes a tree pass whose rows branch is timed at too (`CostProfile.branched`): attention lays
# each branched row's keys out as a pass over its path would (`kernel._path_layout`, which
# keeps rows batch-invariant), work a causal pass does not do. Measured on the default pair
# (Zen 4, docs/benchmarks.md, "session 31"), a pass of 8-16 tokens in two branches cost up to
# 16% more than a causal one for the verifier (more after a long prompt) and 13-28% more for
# the draft, so trees priced as causal passes bought branches that did not pay.
TREE_SIZES = (4, 8, 16)
# 2: the engine's key names the kernel serving its products; 3: costs at a long context too;
# 4: branched tree passes too
FORMAT = 4  # measured, strikes
# live passes this much slower or faster than the profile: a strike (not less: other work on a
# shared machine moves passes by some tens of percent, and a profile re-measured on each such
# swing would cost a measurement in the middle of someone's requests)
DRIFT_FACTOR = 2.0
DRIFT_WARMUP = 2  # a generation's first timed passes are not judged (caches, allocation)
DRIFT_PASSES = 8  # timed passes after the warm-up whose median ratio is judged, once a generation
DRIFT_STRIKES = 2  # generations in a row with a strike mark the profile stale
BUDGET_S = 30.0  # seconds a measurement may take (at least three rounds of sizes)


@dataclass
class CostProfile:
    """Seconds of one forward pass over n new tokens (after a context of `context` tokens)."""

    sizes: list[int]
    seconds: list[float]
    device: str = ""
    model: str = ""
    context: int = 0
    measured: float = 0.0  # when (seconds since the epoch; 0: unknown)
    strikes: int = 0  # generations in a row whose live passes disagreed (see the module)
    stale: bool = False  # live passes disagree: costs scaled by live_ratio, measured at next load
    live_ratio: float = 0.0  # the last judged generation's live / profiled pass time
    kernel: str = ""  # what served the products, for people (`kernel.products`; in `model`'s key)
    # the same passes after `long_context` tokens, at `long_sizes` (0: not measured; see `at`)
    long_context: int = 0
    long_sizes: list[int] = field(default_factory=list)
    long_seconds: list[float] = field(default_factory=list)
    # tree passes of `tree_sizes` tokens in two branches, at `context` (empty: not measured,
    # an engine without tree passes; `branched` prices them as causal ones then)
    tree_sizes: list[int] = field(default_factory=list)
    tree_seconds: list[float] = field(default_factory=list)
    path: Path | None = field(default=None, compare=False, repr=False)  # the file it came from
    # the context the costs are asked for now (a tree decoder sets it each round: the committed
    # sequence's length); 0 or up to `context`: the costs as measured at `context`
    at: int = field(default=0, compare=False, repr=False)

    @property
    def scale(self) -> float:
        """What the costs are multiplied by: the live ratio of a stale profile, else 1."""
        return self.live_ratio if self.stale and self.live_ratio > 0 else 1.0

    def as_measured(self) -> CostProfile:
        """This profile with its costs as measured (a stale mark's scaling not applied)."""
        return replace(self, stale=False) if self.stale else self

    def __call__(self, n: int | np.ndarray) -> np.ndarray | float:
        """Estimated cost of n tokens now: the measured cost times `scale`."""
        return self.measured_cost(n) * self.scale

    def branched(self, n: int | np.ndarray) -> np.ndarray | float:
        """Estimated cost of a tree pass over n tokens whose rows branch (a tree that is not a
        path; a draft expanding several frontier nodes at once): the causal cost plus what
        such a pass measured beyond it, from nothing at one token (the module's
        `TREE_SIZES`)."""
        n_arr = np.asarray(n, np.float64)
        out = np.asarray(self.measured_cost(n_arr), np.float64)
        if self.tree_sizes:
            out = out + _interp([1, *self.tree_sizes], [0.0, *self._branch_excess], n_arr)
        out = out * self.scale
        return float(out) if np.ndim(n) == 0 else out

    @cached_property
    def _branch_excess(self) -> list[float]:
        """Per tree size, what a branched pass cost beyond a causal one of its size (never
        less than 0, nor less than a smaller size's: timing noise)."""
        sizes = np.asarray(self.tree_sizes, np.float64)
        causal = _interp(self.sizes, self.seconds, sizes)
        excess = np.maximum(np.asarray(self.tree_seconds, np.float64) - causal, 0.0)
        return np.maximum.accumulate(excess).tolist()

    def measured_cost(self, n: int | np.ndarray) -> np.ndarray | float:
        """Interpolated measured cost of n tokens at the context `at`; linear extrapolation
        beyond the largest size.

        Past `context`, what an n-token pass costs beyond a one-token pass grows by the share
        of the way to `long_context` (linearly beyond it: attention reads every key before a
        token) of what that excess grew by between the two measured contexts. Only the excess:
        both contexts' one-token passes were measured in one process but minutes apart, and the
        choices the costs make (how many tokens a round verifies, a speculating candidate
        against plain steps) hinge on what more tokens cost. A context up to `context` is
        priced as measured."""
        n_arr = np.asarray(n, np.float64)
        out = _interp(self.sizes, self.seconds, n_arr)
        if self.long_context > self.context and self.at > self.context and self.long_sizes:
            share = (self.at - self.context) / (self.long_context - self.context)
            out = out + share * _interp(self.long_sizes, self._growth, n_arr)
        return float(out) if np.ndim(n) == 0 else out

    @cached_property
    def _growth(self) -> list[float]:
        """Per long size, how much more its excess over a one-token pass cost at `long_context`
        than at `context` (never less than 0, nor less than a smaller size's: timing noise).
        Derived once: the measured fields do not change, and a round's sizing asks the costs
        many times."""
        long = np.asarray(self.long_seconds, np.float64)
        short = _interp(self.sizes, self.seconds, np.asarray(self.long_sizes, np.float64))
        grew = np.maximum((long - long[0]) - (short - short[0]), 0.0)
        return np.maximum.accumulate(grew).tolist()

    def to_json(self) -> dict:
        return {"format": FORMAT, **{k: v for k, v in asdict(self).items() if k not in _LIVE}}

    @classmethod
    def from_json(cls, d: dict) -> CostProfile:
        if d.get("format") != FORMAT:
            raise ValueError("unknown profile format")
        names = {f.name for f in fields(cls)} - _LIVE
        p = cls(**{k: v for k, v in d.items() if k in names})
        pairs = (p.sizes, p.seconds), (p.long_sizes, p.long_seconds), (p.tree_sizes, p.tree_seconds)
        for sizes, seconds in pairs:
            if len(sizes) != len(seconds) or sorted(sizes) != sizes:
                raise ValueError("malformed profile")
        if not p.sizes or (p.long_sizes and p.long_sizes[0] != 1) or 1 in p.tree_sizes:
            raise ValueError("malformed profile")
        return p

    def matches(self, device: str, model: str) -> bool:
        """Whether this profile was measured for `device` and `model` (an empty field, as in a
        profile written by hand, matches anything)."""
        return self.device in ("", device) and self.model in ("", model)

    def describe(self) -> str:
        """One line for people: the model, its kernel, a few costs, the age and any strikes."""
        costs = ", ".join(
            f"{n}: {self.measured_cost(n) * 1000:.0f}" for n in (1, 4, 8) if n <= self.sizes[-1]
        )
        if self.long_context > self.context and self.long_sizes:
            long = replace(self, at=self.long_context)
            costs += f"}} after {self.context} tokens, {{" + ", ".join(
                f"{n}: {long.measured_cost(n) * 1000:.0f}" for n in (1, 4, 8)
            )
            costs += f"}} after {self.long_context}"
        else:
            costs += "}"
        if self.tree_sizes:
            costs += ", branched trees {" + ", ".join(
                f"{n}: {self.as_measured().branched(n) * 1000:.0f}" for n in (4, 8)
            )
            costs += "}"
        age = (
            f"measured {time.strftime('%Y-%m-%d %H:%M', time.localtime(self.measured))}"
            if self.measured
            else "measured at an unknown time"
        )
        state = (
            f"; stale (live passes {self.live_ratio:.2f}x the profile): used scaled by that, "
            "measured again at the next load"
            if self.stale
            else f"; live passes {self.live_ratio:.2f}x it in {self.strikes} generation(s)"
            if self.strikes
            else ""
        )
        kernel = f" ({self.kernel})" if self.kernel else ""
        return f"{self.model}{kernel}: ms per pass over n tokens {{{costs}, {age}{state}"


_LIVE = {"path", "at"}  # a profile's fields that belong to its use, not to its file


def _interp(sizes: Sequence[int], seconds: Sequence[float], n: np.ndarray) -> np.ndarray:
    """`seconds` at `sizes` interpolated at n, extrapolated linearly (never down) beyond."""
    x = np.asarray(sizes, np.float64)
    y = np.asarray(seconds, np.float64)
    out = np.interp(n, x, y)
    if len(x) > 1:
        slope = max((y[-1] - y[-2]) / (x[-1] - x[-2]), 0.0)
        out = np.where(n > x[-1], y[-1] + slope * (n - x[-1]), out)
    return out


def device_name() -> str:
    """A name for the hardware and the compute path that determine pass costs."""
    cpu = platform.processor() or platform.machine()
    if platform.system() == "Darwin":
        try:
            import subprocess

            cpu = (
                subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True
                ).stdout.strip()
                or cpu
            )
        except OSError:
            pass
    else:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    try:
        import mlx.core as mx

        backend = str(mx.default_device())
    except ImportError:  # pragma: no cover - mlx is a dependency
        backend = "?"
    # On Linux the BLAS behind MLX's CPU backend changes costs several-fold (see DESIGN.md):
    # the one ondevice opened (`runtime/blas.py`) or the one the user preloaded.
    from ondevice.runtime import blas as blas_lib

    opened = blas_lib.enable() or os.environ.get("LD_PRELOAD", "").split(":")[0]
    blas = Path(opened).name if opened else ""
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if blas and threads:
        blas += f" x{threads}"
    return " | ".join(
        x for x in (platform.system(), cpu, backend, blas, f"{os.cpu_count()} cpus") if x
    )


def engine_key(engine: Engine) -> str:
    """What determines an engine's pass cost: its architecture, the dtypes of its weights and
    which kernel serves its linear products (`kernel.products`; not the weight values), or for
    non-MLX engines their kind, vocabulary and context."""
    from ondevice.runtime.engines import innermost

    engine = innermost(engine)  # a draft window costs what its engine does
    model = getattr(engine, "model", None)
    cfg = getattr(model, "config", None)
    if cfg is not None and is_dataclass(cfg):
        import mlx.core as mx
        from mlx.utils import tree_flatten

        from ondevice.runtime.kernel import products

        dtypes = sorted(
            {str(v.dtype) for _, v in tree_flatten(model.parameters()) if isinstance(v, mx.array)}
        )
        desc = json.dumps(
            {"config": asdict(cfg), "dtypes": dtypes, "products": products(model)},
            sort_keys=True,
            default=str,
        )
    else:
        import platform

        path = getattr(engine, "path", None)
        if path is not None:  # a package draft: its contents (compression, kv mode) and the OS
            from ondevice.runtime.coreml_engines import package_digest

            path = [str(path), package_digest(path), platform.mac_ver()[0]]
        desc = json.dumps([engine.name, engine.vocab_size, engine.context_length, path or ""])
    return f"{engine.name}-{hashlib.sha256(desc.encode()).hexdigest()[:16]}"


def profiles_dir() -> Path:
    """The folder of this machine's measured profiles (pass costs, skip sets, Medusa heads)."""
    from ondevice.sources.hub import cache_dir

    return cache_dir() / "profiles"


def profile_path(device: str, key: str) -> Path:
    dev = hashlib.sha256(device.encode()).hexdigest()[:12]
    return profiles_dir() / f"{key}-{dev}.json"


def measure(
    engine: Engine,
    sizes: tuple[int, ...] = SIZES,
    *,
    context: int = 256,
    repeats: int = 7,
    budget_s: float = BUDGET_S,
) -> CostProfile:
    """Time `engine.feed` of n tokens after a `context`-token prefix (median of `repeats`, or of
    at least 3 when the repeats would take longer than `budget_s`: a large model on a small CPU
    takes seconds per round of sizes), then `LONG_SIZES` after `LONG_CONTEXT` tokens where the
    engine's context holds twice `context` or more (`CostProfile.at` prices contexts by both).

    Sizes are interleaved within each repeat, so a change in load during the measurement (other
    processes on the machine) affects every size alike instead of skewing some of them."""
    return measure_together([engine], sizes, context=context, repeats=repeats, budget_s=budget_s)[0]


def measure_together(
    engines: Sequence[Engine],
    sizes: tuple[int, ...] = SIZES,
    *,
    context: int = 256,
    repeats: int = 7,
    budget_s: float = BUDGET_S,
) -> list[CostProfile]:
    """`measure` of several engines at once: each repeat times every engine's sizes in turn,
    so a change in load during the measurement moves every engine's costs alike, and what the
    decoders weigh against each other (a draft step against a verifier pass) keeps its ratio.
    Measured one after the other, a verifier measured in a slow spell of a shared machine and
    its draft after it put a draft step at 0.37 of a pass where the same code measured 0.29-0.35
    minutes later (docs/benchmarks.md, "Issue 26, session 8")."""
    runs = []
    for engine in engines:
        ctx = max(1, min(context, engine.context_length - max(sizes) - 1))
        rng = np.random.default_rng(0)
        toks = rng.integers(0, engine.vocab_size, max(ctx + max(sizes), _long(engine))).tolist()
        engine.reset()
        engine.feed(toks[:ctx], last_only=True)
        runs.append((engine, ctx, toks, {n: [] for n in sizes}))
    _time_rounds(runs, sizes, repeats, budget_s * len(engines))
    # branched tree passes at the same context, for engines that have tree passes
    from ondevice.runtime.engines import tree_engine

    tree_sizes = [n for n in TREE_SIZES if n <= max(sizes)]
    wrapped = [tree_engine(engine) for engine, *_ in runs]
    trees = {
        i: (tree, ctx, toks, {n: [] for n in tree_sizes})
        for i, (tree, (_, ctx, toks, _)) in enumerate(zip(wrapped, runs))
        if hasattr(tree, "feed_masked")
    }
    _time_rounds(list(trees.values()), tree_sizes, repeats, budget_s, _branched_pass)
    # then at the long context: each engine's cache grown to it once, its sizes timed as above
    longs: list[tuple[Engine, int, list[int], dict[int, list[float]]]] = []
    for engine, ctx, toks, _ in runs:
        end = _long(engine) - max(LONG_SIZES)
        if end >= 2 * ctx:  # (a context little longer than the first says little beyond noise)
            # in passes of the first context's size: a prompt's pass holds memory for its
            # rows, and a measurement should need no more than the first context did
            for i in range(ctx, end, ctx):
                engine.feed(toks[i : min(i + ctx, end)], last_only=True)
            longs.append((engine, end, toks, {n: [] for n in LONG_SIZES}))
    _time_rounds(longs, LONG_SIZES, LONG_REPEATS)
    long_of = {id(engine): (end, times) for engine, end, _, times in longs}
    profiles = []
    for i, (engine, ctx, _, times) in enumerate(runs):
        engine.reset()
        end, long_times = long_of.get(id(engine), (0, {}))
        branched = tree_sizes if i in trees else []
        profiles.append(
            CostProfile(
                list(sizes),
                _medians(times, sizes),
                device_name(),
                engine_key(engine),
                ctx,
                time.time(),
                kernel=_kernel_name(engine),
                long_context=end,
                long_sizes=list(LONG_SIZES) if end else [],
                long_seconds=_medians(long_times, LONG_SIZES) if end else [],
                tree_sizes=branched,
                tree_seconds=_medians(trees[i][3], branched) if branched else [],
            )  # fmt: skip
        )
    return profiles


def _long(engine: Engine) -> int:
    """The tokens a measurement at `LONG_CONTEXT` feeds `engine` (its context allowing)."""
    return min(LONG_CONTEXT + max(LONG_SIZES), engine.context_length - 1)


def _time_rounds(
    runs: Sequence[tuple[Engine, int, list[int], dict[int, list[float]]]],
    sizes: Sequence[int],
    repeats: int,
    budget_s: float = float("inf"),
    feed: Callable[[Engine, list[int]], object] = lambda engine, toks: engine.feed(toks),
) -> None:
    """Time `repeats` rounds of every engine's passes over `sizes` after its context (its
    tokens up to `ctx`), engines in turn, each pass (by `feed`) trimmed off again; fewer rounds
    (at least 3) past `budget_s`."""
    start = time.perf_counter()
    for rep in range(repeats + 1):
        if rep > 3 and time.perf_counter() - start > budget_s:
            break
        for engine, ctx, toks, times in runs:
            for n in sizes:
                t = time.perf_counter()
                feed(engine, toks[ctx : ctx + n])
                if rep:  # the first round only warms up (compilation, allocation)
                    times[n].append(time.perf_counter() - t)
                engine.trim(n)


def _branched_pass(engine: Engine, tokens: list[int]) -> None:
    """A tree pass over `tokens` in two branches from the first: its first half a path, the
    rest a second path below the first token (what `CostProfile.branched` prices)."""
    n, base = len(tokens), engine.length
    half = (n + 1) // 2
    parents = [i - 1 for i in range(half)] + [0 if i == half else i - 1 for i in range(half, n)]
    own = ancestry(parents)
    visible = np.concatenate([np.ones((n, base), dtype=bool), own], axis=1)
    depths = own.sum(axis=1) - 1  # a node's ancestors
    engine.feed_masked(tokens, base + depths, visible)  # type: ignore[attr-defined]


def _medians(times: dict[int, list[float]], sizes: Sequence[int]) -> list[float]:
    """Each size's median time; a profile must not decrease with size (timing noise): the tree
    sizer assumes it."""
    return np.maximum.accumulate([float(np.median(times[n])) for n in sizes]).tolist()


def _kernel_name(engine: Engine) -> str:
    """What serves the engine's products (`kernel.products` for an MLX model), for people."""
    from ondevice.runtime.engines import innermost

    model = getattr(innermost(engine), "model", None)
    if hasattr(model, "named_modules"):
        from ondevice.runtime.kernel import products

        return products(model)
    return engine.name


def load_profile(
    engine: Engine,
    *,
    sizes: tuple[int, ...] = SIZES,
    measure_if_missing: bool = True,
    path: Path | None = None,
) -> CostProfile | None:
    """The cached profile of `engine` on this device, measured (announced on stderr, and
    cached) if missing or if it was measured for another device or engine (None then without
    `measure_if_missing`). A stale one is returned as it is, its costs scaled (see the module:
    it is measured again by `remeasure_stale`, never here)."""
    device, key = device_name(), engine_key(engine)
    path = path or profile_path(device, key)
    found = _read(path)
    if found is not None and found.matches(device, key):
        if found.stale and path not in _ANNOUNCED:
            _ANNOUNCED.add(path)
            _say(
                f"the pass costs in {path} are stale: live passes took "
                f"{found.live_ratio:.2f}x them; using them scaled by that until they are "
                "measured again at the next load"
            )
        return found
    if not measure_if_missing:
        return None
    _announce(path, BUDGET_S)
    return _measure_into(engine, sizes, path)


def load_profiles(engines: Sequence[Engine]) -> list[CostProfile]:
    """`load_profile` of each engine (a verifier and its draft), those that must be measured
    measured together (`measure_together`), each announced and cached in its own file."""
    found = [load_profile(e, measure_if_missing=False) for e in engines]
    missing = [i for i, p in enumerate(found) if p is None]
    paths = [profile_path(device_name(), engine_key(engines[i])) for i in missing]
    for path in paths:
        _announce(path, BUDGET_S * len(paths))
    if missing:
        measured = measure_together([engines[i] for i in missing])
        for i, path, prof in zip(missing, paths, measured):
            found[i] = _keep(prof, path)
    return found  # type: ignore[return-value]


def remeasure_stale(engine: Engine) -> CostProfile | None:
    """Measure `engine`'s cached profile again, at the same sizes, if live passes marked it
    stale (one line on stderr first); for `ondevice.load`, where a wait is expected. The
    profile, or None where none is cached."""
    device, key = device_name(), engine_key(engine)
    path = profile_path(device, key)
    found = _read(path)
    if found is None or not found.matches(device, key) or not found.stale:
        return found
    _say(
        f"measuring the pass costs in {path} again (up to about {BUDGET_S:.0f} s): live "
        f"passes took {found.live_ratio:.2f}x them"
    )
    return _measure_into(engine, tuple(found.sizes), path)


_ANNOUNCED: set[Path] = set()  # stale profiles this process has said it uses scaled


def _say(line: str) -> None:
    print(f"ondevice: {line}", file=sys.stderr, flush=True)


def _announce(path: Path, seconds: float) -> None:
    """The line said before a missing profile is measured into `path`."""
    _say(f"measuring pass costs on this machine, once, into {path} (up to about {seconds:.0f} s)")


def _measure_into(engine: Engine, sizes: tuple[int, ...], path: Path) -> CostProfile:
    return _keep(measure(engine, sizes), path)


def _keep(prof: CostProfile, path: Path) -> CostProfile:
    """A measured profile, cached in `path`."""
    save_profile(path, prof.to_json())
    prof.path = path
    _ANNOUNCED.discard(path)
    return prof


def _read(path: Path) -> CostProfile | None:
    """The profile in `path`, or None where it is missing, unreadable or of an old format."""
    try:
        prof = CostProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
        return None
    prof.path = path
    return prof


class CostWatch:
    """Judges a generation's live verifier passes against the measured costs of the profile it
    started with, and records a strike or a stale mark in the profile's file (see the module's
    "Staleness"). Nothing it does changes the profile the generation holds."""

    @classmethod
    def of(cls, engine: Engine) -> CostWatch | None:
        """A watch over `engine`'s cached profile (None: none is cached; nothing is measured),
        for decoders that time their passes without sizing anything by the profile."""
        prof = load_profile(engine, measure_if_missing=False)
        return cls(prof) if prof is not None else None

    def __init__(self, profile: CostProfile):
        self.profile = profile
        self.ratios: list[float] = []
        self.seen = 0
        self.judged = False

    def observe(self, n: int, seconds: float) -> None:
        """A verifier pass over n tokens took `seconds`."""
        self.seen += 1
        if self.judged or self.seen <= DRIFT_WARMUP:
            return
        self.ratios.append(seconds / max(float(self.profile.measured_cost(n)), 1e-12))
        if len(self.ratios) >= DRIFT_PASSES:
            self.judged = True
            self.judge(float(np.median(self.ratios)))

    def judge(self, ratio: float) -> None:
        path = self.profile.path
        disagrees = not 1 / DRIFT_FACTOR <= ratio <= DRIFT_FACTOR
        if path is None or not self.profile.measured:  # written by hand: what someone chose
            return
        now = _read(path)  # the file as it is now (another process may have re-measured it)
        if now is None or now.seconds != self.profile.seconds:
            return
        if not disagrees and not now.strikes:
            return
        now.strikes = now.strikes + 1 if disagrees else 0
        now.live_ratio = ratio
        now.stale = now.strikes >= DRIFT_STRIKES
        try:
            save_profile(path, now.to_json())
        except OSError:  # a read-only cache: the profile stays as it is
            pass


def save_profile(path: Path, doc: dict) -> None:
    """Write a cached profile (pass costs, skip set) whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)  # atomic: a crash never leaves half a profile


def pass_cost(profile: CostProfile, tree: TokenTree) -> float:
    """Estimated seconds of a verification pass over `tree`: a causal pass where it is a path
    (a chain's, a plain step's), else a branched one (`CostProfile.branched`)."""
    n = len(tree)
    path = all(p == i - 1 for i, p in enumerate(tree.parents))
    return float(profile(n) if path else profile.branched(n))


def best_rate(
    values: np.ndarray,
    verify: CostProfile,
    fixed: float = 0.0,
    per_node: float = 0.0,
    *,
    branched: bool = False,
) -> tuple[int, float]:
    """How many proposals to verify, and the tokens per second that gives: values[i] is the
    (estimated) probability that the i-th best proposal is accepted, so verifying the best n
    yields 1 + sum(values[:n]) tokens per pass on average, at cost fixed + per_node * n
    (drafting) + verify(n + 1) (`verify.branched(n + 1)` with `branched`: a tree whose rows
    branch). Returns the n that maximises tokens per second, and that rate."""
    vals = np.sort(np.asarray(values, np.float64))[::-1]
    n = np.arange(len(vals) + 1)
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(vals)])
    cost = fixed + per_node * n + np.asarray((verify.branched if branched else verify)(n + 1))
    rate = gain / np.maximum(cost, 1e-12)
    best = int(np.argmax(rate))
    return best, float(rate[best])


def best_size(
    values: np.ndarray, verify: CostProfile, fixed: float = 0.0, per_node: float = 0.0
) -> int:
    """The n of `best_rate`."""
    return best_rate(values, verify, fixed, per_node)[0]


# -- skip sets (method "self", `proposers/layer_skip.py`), cached beside the pass costs ----------

# 2: the search's cumulative drops go on down to its minimum agreement; 3: the draft's reading
# 4: agreement as a draft over the verifier's own cache computes it (`layer_skip.SharedCacheState`)
SKIP_SET_FORMAT = 4


@dataclass
class SkipSet:
    """The layers a self-draft skips, and what the search measured.

    agreement: the share of positions where the draft's greedy token is the verifier's.
    reach: per step j of a chain, the share of positions where the draft's first j + 1 greedy
        tokens are all the verifier's (reach[0] is `agreement`).
    draft_fraction: a draft pass's cost as a share of a verifier pass (the kept share of the
        weights read, or measured where the draft reads int8 copies).
    reading: `shared` (the draft computes with the verifier's own products), `head-prefix`
        (those, with the head's first rows only, read in place), `one-row` (the verifier's
        weights through the CPU kernel's one-row implementation) or `int8` (int8 copies of the
        kept layers and of the head's first rows), as searched
        (`layer_skip.self_reading`).
    speedup: the predicted tokens per second over plain decoding of a draft chain that reaches
        as far (the best chain length the search tried; below 1: none pays). tried: [skip,
        agreement, speedup] of every set scored, in order. tokens: chains compared.
    """

    skip: list[int]
    layers: int
    agreement: float
    draft_fraction: float
    speedup: float
    tokens: int = 0
    tried: list[list] = field(default_factory=list)
    cost_profile: bool = True
    model: str = ""  # which model, for people (architecture and sizes)
    reading: str = "shared"  # see above
    reach: list[float] = field(default_factory=list)

    @property
    def keep(self) -> list[int]:
        return [i for i in range(self.layers) if i not in set(self.skip)]

    def to_json(self) -> dict:
        return {"format": SKIP_SET_FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> SkipSet:
        if d.get("format") != SKIP_SET_FORMAT:
            raise ValueError("unknown skip-set format")
        d = {k: v for k, v in d.items() if k != "format"}
        s = cls(**d)
        if not all(0 <= i < s.layers for i in s.skip) or len(s.skip) >= s.layers:
            raise ValueError("malformed skip set")
        return s

    def describe(self) -> str:
        copies = {
            "int8": ", int8 copies of the kept layers",
            "one-row": ", the verifier's weights read by the kernel's one-row implementation",
            "head-prefix": ", the head's first rows only",
        }.get(self.reading, "")
        return (
            f"{self.model + ': ' if self.model else ''}skips {len(self.skip)} of {self.layers} "
            f"layers {self.skip}{copies}: greedy agreement "
            f"{self.agreement:.3f} over {self.tokens} tokens, draft pass {self.draft_fraction:.2f}"
            f" of a verifier pass, predicted {self.speedup:.2f}x plain"
        )


def cached_profiles() -> list[CostProfile]:
    """Every pass-cost profile cached on this machine (for `ondevice doctor`)."""
    paths = sorted(profiles_dir().glob("*.json"))
    found = (_read(p) for p in paths if not p.name.startswith("skip-"))
    return [p for p in found if p is not None]


def cached_skip_sets() -> list[tuple[Path, SkipSet]]:
    """Every skip set cached on this machine (for `ondevice doctor`)."""
    out = []
    for path in sorted(profiles_dir().glob("skip-*.json")):
        try:
            out.append((path, SkipSet.from_json(json.loads(path.read_text()))))
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
            continue
    return out
