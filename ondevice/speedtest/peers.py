"""Peers: other implementations run on the very same weights, prompts and K, for comparison.

`mlx-lm` is the reference MLX implementation. It is given ondevice's own loaded weights, saved
with `save_model` to a temporary folder, so it runs exactly the same (possibly quantized)
tensors whatever the source was: a bundle, an HF folder, or a GGUF file mlx_lm cannot read.
Its token loop (`generate_step`, `speculative_generate_step`) is driven directly, with ondevice's
EOS set and max_tokens, and its tokens pass through ondevice's detokenizer like ondevice's own.
Where the CPU kernel serves ondevice's products (Linux, runtime/kernel.py), mlx-lm gets the
kernel's bf16 weights widened to float32 and computes in float32 with MLX's products, so its
greedy tokens may part from ondevice's at a near tie; its speculative tokens still must equal
its plain ones.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from ondevice.errors import OndeviceError

PEERS = ("mlx-lm",)

Steps = Iterator[tuple[list[int], list[bool]]]


SPEC = "mlx-lm-spec"


def spec_k(method: str) -> int | None:
    """K of an "mlx-lm-spec:K" run (None for "mlx-lm-spec", whose K the runner chooses)."""
    _, _, k = method.partition(":")
    return int(k) if k else None


class MlxLmPeer:
    """mlx_lm's plain ("mlx-lm") and speculative ("mlx-lm-spec") generation; with `ks`, one
    speculative run per fixed K ("mlx-lm-spec:3", "mlx-lm-spec:5", ...) instead."""

    def __init__(self, verifier_model, draft_model=None, ks: Sequence[int] = ()) -> None:
        try:
            from mlx_lm.generate import generate_step, speculative_generate_step
            from mlx_lm.utils import load_model
        except ImportError:
            raise OndeviceError(
                "--peers mlx-lm needs the mlx-lm package: pip install mlx-lm"
            ) from None
        from ondevice.models.weights import save_model
        from ondevice.runtime.kernel import serves

        # mlx-lm computes with MLX's own products: ondevice too, unless the CPU kernel serves
        self.same_products = not serves(verifier_model)
        self._plain_step = generate_step
        self._spec_step = speculative_generate_step
        self.ks = tuple(dict.fromkeys(ks))
        with tempfile.TemporaryDirectory(prefix="ondevice-bench-") as tmp:
            self.model = _load(save_model, load_model, verifier_model, Path(tmp) / "verifier")
            self.draft = (
                _load(save_model, load_model, draft_model, Path(tmp) / "draft")
                if draft_model is not None
                else None
            )

    @property
    def methods(self) -> list[str]:
        if self.draft is None:
            return ["mlx-lm"]
        return ["mlx-lm", *([f"{SPEC}:{k}" for k in self.ks] or [SPEC])]

    def steps(
        self,
        method: str,
        ids: Sequence[int],
        max_tokens: int,
        eos: frozenset[int],
        temperature: float = 0.0,
        seed: int = 0,
        num_draft_tokens: int = 3,
    ) -> Steps:
        """Yield ([token], [from_draft]) per token until EOS (not yielded) or max_tokens."""
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        mx.random.seed(seed)
        sampler = make_sampler(temp=temperature)
        prompt = mx.array(list(ids), mx.uint32)
        if method == "mlx-lm":
            it = (
                (t, False)
                for t, _ in self._plain_step(
                    prompt, self.model, max_tokens=max_tokens, sampler=sampler
                )
            )
        elif method.startswith(SPEC) and self.draft is not None:
            it = (
                (t, d)
                for t, _, d in self._spec_step(
                    prompt,
                    self.model,
                    self.draft,
                    num_draft_tokens=num_draft_tokens,
                    max_tokens=max_tokens,
                    sampler=sampler,
                )
            )
        else:
            raise OndeviceError(f"unknown mlx-lm method {method!r}.")
        n = 0
        for tok, from_draft in it:
            tok = int(tok)
            if tok in eos or n >= max_tokens:
                break
            n += 1
            yield [tok], [bool(from_draft)]
        it.close()  # lets the generator rewind its caches


def _load(save_model, load_model, model, path: Path):
    from ondevice.runtime.kernel import plain_parameters

    save_model(model, path, plain_parameters(model))  # the CPU kernel's too, in MLX's layout
    try:
        loaded, _ = load_model(path)
    except Exception as e:  # a layout mlx_lm does not know: say which, skip nothing silently
        raise OndeviceError(
            f"mlx_lm could not load the weights ondevice saved for it ({type(e).__name__}: {e}); "
            "run without --peers mlx-lm."
        ) from None
    return loaded


def mlx_lm_rounds(from_draft: Sequence[bool], max_tokens: int, k: int) -> tuple[int, int]:
    """(rounds, drafted) of a speculative_generate_step run, rebuilt from its per-token flags.

    Each round drafts min(k, tokens still allowed) tokens and ends with one verifier token, so
    a round is a run of draft tokens closed by a non-draft one (or by the end of the output).
    """
    rounds = drafted = produced = 0
    i = 0
    while i < len(from_draft):
        rounds += 1
        drafted += min(k, max_tokens - produced)
        while i < len(from_draft) and from_draft[i]:
            i += 1
            produced += 1
        if i < len(from_draft):  # the verifier's own token closes the round
            i += 1
            produced += 1
    return rounds, drafted
