"""Decoding passes computed apart from prompts (runtime/kernel.py, "Prompts apart") on any CPU
the bf16 kernel serves."""

from __future__ import annotations

import pytest

from ondevice.runtime import kernel


def decode_apart(mp: pytest.MonkeyPatch) -> tuple[str, str]:
    """Ask for decoding passes apart (`ONDEVICE_KERNEL_DECODE=avx512`): on a CPU with AMX they
    take AVX512-BF16's implementation; elsewhere oneDNN's first choice is named for them, which
    computes what prompts do but runs the same bookkeeping. Returns (the implementation
    decoding passes ask for, oneDNN's first choice for prompts)."""
    mp.setenv(kernel.DECODE_ENV, "avx512")
    first = kernel._dnnl.plan(64, 64, kernel._BF16, False, 1, packed=True).impl  # type: ignore[union-attr]
    if kernel.decode_impl() is None:
        mp.setattr(kernel, "decode_impl", lambda: first)
    impl = kernel.decode_impl()
    assert impl is not None
    return impl, first
