"""The CPU kernel behind the verifier's linear products (runtime/kernel.py): close to MLX's own
products, batch-invariant (a row's logits do not depend on how many tokens share the pass), and
greedy speculative decoding with it gives exactly plain decoding's tokens."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from support.engines import TimedEngine
from support.kernel import decode_apart

import ondevice
from ondevice.decoders.chain import ChainDecoder
from ondevice.models import load_model, transformer, weights
from ondevice.models.config import ModelConfig
from ondevice.models.weights import save_model
from ondevice.rules.engine import prefill
from ondevice.rules.sampling import SamplingParams
from ondevice.runtime import blas, kernel
from ondevice.runtime.engines import MLXEngine, MLXTreeEngine

pytestmark = pytest.mark.skipif(
    not kernel.available(), reason=f"no CPU kernel here: {kernel._unavailable or 'not on the CPU'}"
)
UNDER_MKL = "ONDEVICE_TEST_UNDER_MKL"
KINDS = [k for k in ("bf16", "int8", "f32") if k == "f32" or kernel.cpu_has_bf16()]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 5, 16, 37])
def test_products_match_mlx(kind, rows):
    lin = nn.Linear(64, 200, bias=True)
    mx.eval(lin.parameters())
    x = mx.random.normal((1, rows, 64), key=mx.random.key(rows))
    if kind == "int8":  # int8 rows times int8 weight rows, each with its own scale, summed exactly
        ref = mx.array(_int8_product(np.array(x[0]), np.array(lin.weight)))[None] + lin.bias
    elif kind == "bf16":
        ref = (x.astype(mx.bfloat16) @ lin.weight.astype(mx.bfloat16).T).astype(mx.float32)
        ref = ref + lin.bias
    else:
        ref = lin(x)
    got = kernel.KernelLinear(lin.weight, lin.bias, kind)(x)
    assert got.shape == (1, rows, 200) and got.dtype == mx.float32
    tol = {"f32": 1e-5, "int8": 1e-5}.get(kind, 2e-2)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=tol, atol=tol)
    if kind == "int8":  # and int8 is what it claims: far from the float product at this size
        assert not np.allclose(np.array(got), np.array(lin(x)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_a_products_checked_plan_is_kept_for_its_size_and_never_serves_a_changed_module(
    kind, monkeypatch
):
    """A product of M rows that one checked plan served whole runs it again without looking
    plans up (`KernelLinear.product`'s `_ready`: the glue between a pass's products is kept
    short), and a module changed in place (its weight packed, or made int8) gets a plan of its
    own: a plan kept for the row-major weight would read the new buffer as garbage."""
    w = mx.random.normal((300, 96), key=mx.random.key(3))
    lin = kernel.KernelLinear(w, None, kind)
    x = mx.random.normal((3, 96), key=mx.random.key(4))
    first = np.array(lin(x))
    lookups = []
    plan = kernel._dnnl.plan
    monkeypatch.setattr(kernel._dnnl, "plan", lambda *a, **k: lookups.append(a) or plan(*a, **k))
    assert np.array_equal(np.array(lin(x)), first) and not lookups
    assert np.array_equal(np.array(lin(x[:2])), first[:2]) and lookups  # another size: looked up
    if kind == "bf16":
        lin.pack()
        ref = (x.astype(mx.bfloat16) @ w.astype(mx.bfloat16).T).astype(mx.float32)
        np.testing.assert_allclose(np.array(lin(x)), np.array(ref), rtol=2e-2, atol=2e-2)
    if kind == "f32":
        lin.to_int8()
        ref = _int8_product(np.array(x), np.array(w))
        np.testing.assert_allclose(np.array(lin(x)), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_small_weights_products_run_on_one_thread_unless_threads_are_asked(kind, monkeypatch):
    """A product whose weight is below ONE_THREAD_BYTES reads it in about the time waking the
    other OpenMP thread takes, so its plans run on one thread; a larger one's on every usable
    core; ONDEVICE_KERNEL_THREADS (or a module's own `threads`) sets both. The rows are the
    same either way (int8 sums exactly; bf16 sums each output on one thread in one order)."""
    monkeypatch.delenv(kernel.THREADS_ENV, raising=False)
    per_row = 2 if kind == "bf16" else 1  # bytes of a weight
    N_small, N_large = 64, kernel.ONE_THREAD_BYTES // (256 * per_row) + 16
    small = kernel.KernelLinear(mx.random.normal((N_small, 256), key=mx.random.key(5)), None, kind)
    large = kernel.KernelLinear(mx.random.normal((N_large, 256), key=mx.random.key(6)), None, kind)
    assert small._np_weight.nbytes < kernel.ONE_THREAD_BYTES <= large._np_weight.nbytes
    x = mx.random.normal((2, 256), key=mx.random.key(7))

    def plan_threads(lin):
        lin.__dict__.pop("_ready", None)
        out = np.array(lin(x))
        (plan,) = lin.__dict__["_ready"].values()
        return plan.threads, out

    cores = kernel.default_threads()
    (one, small_rows), (many, large_rows) = plan_threads(small), plan_threads(large)
    assert (one, many) == (1, cores)
    monkeypatch.setenv(kernel.THREADS_ENV, "2")
    assert plan_threads(small)[0] == plan_threads(large)[0] == 2
    assert np.array_equal(plan_threads(small)[1], small_rows)
    assert np.array_equal(plan_threads(large)[1], large_rows)
    monkeypatch.delenv(kernel.THREADS_ENV)
    small.threads = 3
    assert plan_threads(small)[0] == 3


@pytest.mark.parametrize("kind", KINDS)
def test_a_product_runs_at_its_own_rows_only_where_they_are_the_padded_products(kind, monkeypatch):
    """A pass over M < ROWS tokens runs at M rows where that plan gives every row what the
    product padded to ROWS gives (checked once, on its first input), and padded where it does
    not: here a plan at M rows is made to differ in one last bit, and the product must then
    be the padded one's, bit for bit."""
    lin = kernel.KernelLinear(mx.random.normal((300, 96), key=mx.random.key(1)), None, kind)
    if kind == "bf16":
        lin.pack()
    x = mx.random.normal((3, 96), key=mx.random.key(2))
    want = np.array(lin(mx.concatenate([x, mx.zeros((kernel.ROWS - 3, 96))]))[:3])
    few = kind == "int8" and kernel._dnnl.few_rows_layout(96, 300, kernel._S8) is not None
    impl = kernel.VNNI if few else None  # see "int8 at a few rows"
    plan = kernel._dnnl.plan(96, 300, lin._dtype, False, 3, lin._threads(), lin._packed, impl)
    plan.invariant = None
    assert np.array_equal(np.array(lin(x)), want)
    assert plan.invariant is True  # oneDNN's kernels: the same sums at every M (here)
    run = kernel._Plan.run

    def off_by_a_bit(self, weight_ptr, bias_ptr):  # a kernel whose sums differ at M = 3
        run(self, weight_ptr, bias_ptr)
        if self.src.shape[0] == 3:
            self.dst.view(np.uint32)[0, 0] ^= 1

    monkeypatch.setattr(kernel._Plan, "run", off_by_a_bit)
    plan.invariant = None
    assert np.array_equal(np.array(lin(x)), want)
    assert plan.invariant is False


@pytest.mark.parametrize("kind", KINDS)
def test_a_long_passs_last_chunk_runs_in_the_smallest_plan_that_gives_the_same_rows(
    kind, monkeypatch
):
    """A pass over more than ROWS tokens runs in chunks of PREFILL_ROWS, its last chunk in the
    smallest of `CHUNKS` that holds it; every row equals the row computed alone, whatever the
    pass's size. A plan made to differ in one last bit is found out and its chunk runs ROWS
    rows at a time instead, with the same result."""
    lin = kernel.KernelLinear(mx.random.normal((300, 96), key=mx.random.key(3)), None, kind)
    lin.pack()
    x = np.array(mx.random.normal((300, 96), key=mx.random.key(4)))
    alone = np.concatenate([np.array(lin(mx.array(x[i : i + 1]))) for i in range(len(x))])
    for M in (17, 40, 64, 100, 128, 150, 300):
        assert np.array_equal(np.array(lin(mx.array(x[:M]))), alone[:M]), M
    sizes = {
        p.src.shape[0]
        for p in kernel._dnnl._local.plans.values()
        if p.key[:3] == (96, 300, lin._dtype)
    }
    assert {32, 64, 128} <= sizes  # 40 -> 64, 17 -> 32, 150 -> 128 + 32
    run = kernel._Plan.run

    def off_by_a_bit(self, weight_ptr, bias_ptr):
        run(self, weight_ptr, bias_ptr)
        if self.src.shape[0] == 64:
            self.dst.view(np.uint32)[0, 0] ^= 1

    monkeypatch.setattr(kernel._Plan, "run", off_by_a_bit)
    plan = kernel._dnnl.plan(96, 300, lin._dtype, False, 64, lin._threads(), lin._packed)
    plan.invariant = None
    assert np.array_equal(np.array(lin(mx.array(x[:40]))), alone[:40])
    assert plan.invariant is False


@pytest.mark.skipif("bf16" not in KINDS, reason="no bf16 dot products on this CPU")
@pytest.mark.parametrize("bias", [False, True])
def test_a_transposed_product_gives_every_row_the_usual_products_bits(bias, monkeypatch):
    """A product taken as `W @ x.T` (`KernelLinear.transposed`, see "AMX at a few rows") gives
    every row of a pass of up to ROWS rows bitwise what the usual product gives it, and a
    longer pass (a prompt's chunks) runs the usual way; a transposed plan made to differ in
    one last bit is found out and its pass runs padded to ROWS the usual way instead."""
    w = mx.random.normal((300, 96), key=mx.random.key(7))
    b = mx.random.normal((300,), key=mx.random.key(8)) if bias else None
    usual, wide = kernel.KernelLinear(w, b, "bf16"), kernel.KernelLinear(w, b, "bf16")
    wide.transposed = True
    x = mx.random.normal((1, 40, 96), key=mx.random.key(9))
    for M in (1, 2, 3, 5, 8, 13, 16, 17, 40):
        assert np.array_equal(np.array(wide(x[:, :M])), np.array(usual(x[:, :M]))), M
    plans = [
        p
        for p in kernel._dnnl._local.plans.values()
        if p.transposed and p.key[:4] == (96, 300, kernel._BF16, bias)
    ]
    assert {p.rows for p in plans} == {1, 2, 3, 5, 8, 13, 16}  # a pass of 17 or 40: chunks
    # oneDNN's reference loops (correct but far slower) are never used: with a bias per output
    # row it offers only those here, and such products are not transposed (`serve`)
    assert not any(p.invariant and p.impl.startswith("ref") for p in plans)
    if not bias:
        assert all(p.invariant for p in plans)  # oneDNN's sums: the same order either way
    run = kernel._Plan.run

    def off_by_a_bit(self, weight_ptr, bias_ptr):
        run(self, weight_ptr, bias_ptr)
        if self.transposed:
            self.dst.view(np.uint32)[0, 0] ^= 1

    monkeypatch.setattr(kernel._Plan, "run", off_by_a_bit)
    plan = next(p for p in plans if p.rows == 3)
    plan.invariant = None
    assert np.array_equal(np.array(wide(x[:, :3])), np.array(usual(x[:, :3])))
    assert plan.invariant is False
    plan.invariant = None  # checked again by the next product of this shape


def test_the_elementwise_glue_gives_every_row_its_own_values_slab_by_slab():
    """The MLP's gating and the rounding of a product's input walk a prompt's rows `SLAB` at a
    time: every row is what it is alone (a row's values never depend on the pass), the gating
    is MLX's SiLU(gate) * up, and the rounding is MLX's own float32 -> bfloat16 (to nearest,
    ties to even), bit for bit, over rows that span several slabs and a partial last one."""
    rng = np.random.default_rng(5)
    rows = 3 * kernel.SLAB + 3
    g = rng.standard_normal((rows, 300), dtype=np.float32) * 20
    u = rng.standard_normal((rows, 300), dtype=np.float32)
    gated = kernel.silu_gate(g, u)
    alone = np.concatenate([kernel.silu_gate(g[i : i + 1], u[i : i + 1]) for i in range(rows)])
    assert np.array_equal(gated, alone)
    want = np.array(nn.silu(mx.array(g)) * mx.array(u))
    np.testing.assert_allclose(gated, want, rtol=1e-5, atol=1e-6)
    assert gated.shape == (rows, 300)
    assert kernel.silu_gate(g.reshape(1, rows, 300), u.reshape(1, rows, 300)).shape == (
        1,
        rows,
        300,
    )
    bits = kernel._round_bf16(g)
    assert np.array_equal(bits, np.array(mx.array(g).astype(mx.bfloat16).view(mx.uint16)))
    assert np.array_equal(bits[5], kernel._round_bf16(g[5:6])[0])


def _int8_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T the way the int8 kernel defines it (runtime/kernel.py, "int8")."""

    def rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scale = np.maximum(np.abs(a).max(axis=1, keepdims=True), 1e-30) / np.float32(127)
        return np.rint(a / scale).astype(np.int64), scale.astype(np.float32)

    (qx, sx), (qw, sw) = rows(x.astype(np.float32)), rows(w.astype(np.float32))
    return (qx @ qw.T).astype(np.float32) * sw[:, 0] * sx


def _named(kind):
    """A served model's kernel as profiles name it (`kernel.products`): a bf16 model's
    decoding passes where they take other instructions than its prompts'."""
    apart = kind.startswith("bf16") and kernel.decode_impl()
    decode = f" decode-{kernel.decode_impl()}" if apart else ""
    return f"onednn-{kind} x{kernel.default_threads()} r{kernel.REVISION}{decode}"


def _bf16_layout():
    """How a bf16 model's weights are kept, as profiles name it: blocked (`pack`), the head
    too, except where products are transposed (`kernel.transposes`: those whose inputs are no
    wider than their outputs, the head among them, are kept row-major)."""
    return "-blocked-transposed" if kernel.transposes() else "-blocked-head"


def _served(path, kind):
    loaded = load_model(path, dequantize=True)
    assert kernel.serve(loaded.model, kind) == kind
    assert isinstance(loaded.model.layers[0].mlp.down_proj, kernel.KernelLinear)
    return loaded.model


@pytest.mark.parametrize(("arch", "tie"), [(a, a != "qwen2") for a in tiny.ARCH_DEFAULTS])
def test_a_served_model_computes_what_mlx_does(tmp_path, arch, tie):
    path = tiny.write_model(tmp_path / arch, arch=arch, tie=tie, scale=1.5)
    tokens = mx.array([5, 9, 14, 3, 22, 7, 11, 40])
    want = load_model(path, dequantize=True).model(tokens)
    got = _served(path, "f32")(tokens)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("arch", "tie"), [(a, a == "qwen2") for a in tiny.ARCH_DEFAULTS])
@pytest.mark.parametrize("key_block", [8, kernel.KEY_BLOCK])
def test_a_rows_logits_do_not_depend_on_the_pass_size(
    tmp_path, arch, tie, kind, key_block, monkeypatch
):
    # blocks of 8 keys make the passes below span one to four blocks
    if os.environ.get(UNDER_MKL):
        assert blas.enable() is not None, "MKL should serve MLX's own products here"
    monkeypatch.setattr(kernel, "KEY_BLOCK", key_block)
    model = _served(tiny.write_model(tmp_path / arch, arch=arch, tie=tie, scale=1.5), kind)
    assert kernel.batch_invariant(model) and MLXEngine(model).batch_invariant
    # the embedding is the kernel's too (a tied one is the head), and hands out numpy rows
    assert isinstance(model.model.embed_tokens, kernel.KernelEmbedding)
    assert model.model.embed_tokens.numpy_rows
    prompt = mx.array([5, 9, 14, 3, 22, 7, 11, 40])
    tokens = [int(t) for t in np.random.default_rng(0).integers(5, 90, 24)]
    ref = None
    for sizes in ([1] * 24, [2] * 12, [4, 3, 5, 8, 4], [8, 16], [16, 8], [24]):
        cache = model.make_cache()
        mx.eval(model(prompt, cache, last_only=True))
        rows, at = [], 0
        for n in sizes:
            rows.append(np.array(model(mx.array(tokens[at : at + n]), cache)[0]))
            at += n
        logits = np.concatenate(rows)
        if ref is None:
            ref = logits
        else:
            assert np.array_equal(logits, ref), (arch, sizes)


@pytest.mark.skipif("bf16" not in KINDS, reason="no bf16 dot products on this CPU")
def test_prompts_and_decoding_passes_each_take_their_own_implementation(tmp_path, monkeypatch):
    """Where decoding passes ask for another implementation than prompts (`decode_impl` with
    ONDEVICE_KERNEL_DECODE=avx512: on a CPU with AMX, AVX512-BF16's; elsewhere oneDNN's first
    choice, named, which runs the same bookkeeping), every product of a decoding pass runs it
    and every product inside `prefill` oneDNN's first choice; each is batch-invariant on its
    own (a prompt split anywhere gives the same cache, a decoding pass any size the same
    rows), and the engine counts only a prompt pass's rows as reusable by a later prompt (the
    prompt cache)."""
    impl, first = decode_apart(monkeypatch)
    path = tiny.write_model(tmp_path / "m", tie=True, scale=1.5)
    model = _served(path, "bf16")
    for _, m in model.named_modules():
        if isinstance(m, kernel.KernelLinear):
            assert m.decode_impl == impl  # what `serve` asked for
    assert kernel.prompts_apart(model) and impl in kernel.products(model)
    engine = MLXEngine(model)
    assert engine.prompts_apart
    tree = MLXTreeEngine(engine)
    prompt = [int(t) for t in np.random.default_rng(1).integers(5, 90, 40)]
    toks = [int(t) for t in np.random.default_rng(2).integers(5, 90, 20)]

    def keys(e: MLXEngine) -> np.ndarray:
        return np.concatenate([np.array(k) for k, _ in e.cache.prefix(e.length)])

    kernel._dnnl._local.plans.clear()
    prefill(engine, prompt)
    prompt_plans = list(kernel._dnnl._local.plans.values())
    assert prompt_plans and all(p.key[-1] is None for p in prompt_plans)  # oneDNN's choice
    if impl != first:
        assert impl not in {p.impl for p in prompt_plans}
    assert engine.reusable == len(prompt)
    whole = keys(engine)
    engine.reset()
    prefill(engine, prompt[:13])
    prefill(engine, prompt, resume=True)  # split elsewhere: the same rows
    assert np.array_equal(keys(engine), whole) and engine.reusable == len(prompt)

    kernel._dnnl._local.plans.clear()
    rows = np.stack([engine.feed([t])[-1] for t in toks])
    assert {(p.key[-1], p.impl) for p in kernel._dnnl._local.plans.values()} == {(impl, impl)}
    assert engine.length == len(prompt) + len(toks) and engine.reusable == len(prompt)
    engine.trim(len(toks))
    assert np.array_equal(engine.feed(toks), rows)  # 20 rows: in chunks of ROWS, the same
    engine.trim(len(toks) + 5)
    assert engine.reusable == len(prompt) - 5  # a trim below the prompt's rows shortens them
    prefill(engine, prompt, resume=True)
    assert engine.reusable == len(prompt) and np.array_equal(keys(engine), whole)
    n = 3
    tree.feed_masked(toks[:n], range(len(prompt), len(prompt) + n), np.tri(n, dtype=bool))
    tree.keep(n + 2, [0, 1])  # a kept path reaching into the prompt's rows cuts them there
    assert engine.reusable == len(prompt) - 2
    engine.reset()
    assert engine.reusable == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_tree_pass_gives_plain_decodings_logits(tmp_path, kind):
    """The tree decoder scores every round with explicit positions under a mask; its rows must
    be plain decoding's bit for bit (int8 turns a last-bit difference in a layer's input into
    another int8 step, and so into a visibly different logit)."""
    model = _served(tiny.write_model(tmp_path / "m", tie=True, scale=1.5), kind)
    engine = MLXEngine(model)
    tree = MLXTreeEngine(engine)
    prompt, toks = [5, 9, 14, 3, 22, 7, 11, 40], [31, 8, 77, 12, 50]
    engine.feed(prompt, last_only=True)
    plain = np.stack([engine.feed([t])[-1] for t in toks])
    engine.trim(len(toks))
    n = len(toks)
    got = tree.feed_masked(toks, range(len(prompt), len(prompt) + n), np.tri(n, dtype=bool))
    assert np.array_equal(got, plain)


def test_a_rows_logits_do_not_depend_on_the_pass_size_where_mkl_serves_mlx():
    """The test above in a process where `import ondevice` opened MKL before MLX (in this one
    MLX may already use its reference BLAS): MKL's products, attention's included, give a
    row other numbers in another pass size (~1e-5 here) unless the kernel fixes their shapes."""
    if blas._wheel_file("mkl", "libmkl_rt.so") is None:
        pytest.skip("the mkl wheel is not installed")
    code = (
        "import sys, ondevice, pytest; "
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-k', "
        "'test_a_rows_logits_do_not_depend_on_the_pass_size and not mkl', sys.argv[1]]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, __file__],
        env={**os.environ, UNDER_MKL: "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "L", "S"), [(4, 2, 1, 9), (4, 4, 5, 20), (6, 2, 7, 7)]
)
@pytest.mark.parametrize("mask", [None, "causal", "tree", "per-head", "bool"])
def test_attention_computes_what_mlx_does(heads, kv_heads, L, S, mask, monkeypatch):
    monkeypatch.setattr(kernel, "KEY_BLOCK", 8)
    r = np.random.default_rng(L * S)
    q, k, v = (
        mx.array(r.standard_normal(shape).astype(np.float32))
        for shape in ((1, heads, L, 16), (1, kv_heads, S, 16), (1, kv_heads, S, 16))
    )
    m: mx.array | str | None = None if mask is None else "causal"
    if mask in ("tree", "per-head", "bool"):  # an arbitrary pattern; every row sees a key
        seen = r.random((heads if mask == "per-head" else 1, L, S)) < 0.5
        seen[..., 0] = True
        m = mx.array(seen) if mask == "bool" else mx.array(np.where(seen, 0.0, -np.inf), mx.float32)
        m = m[None] if mask == "per-head" else m[0]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
    got = kernel.attention(q, k, v, scale=0.25, mask=m)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("prefix", "nodes"), [(140, 6), (120, 20), (250, 12)])
def test_a_tree_nodes_attention_is_bitwise_a_pass_over_its_path_alone(prefix, nodes):
    """A token tree's node attends to its ancestors, which sit among the pass's other nodes; its
    row must be bitwise the row of a pass that fed only its path (where they sit side by side),
    or a tree verification can flip a near-tied greedy token against plain decoding (it did on
    Spec-Bench: the 1.5B verifier's humanities answer 156 at token 93). The 1.5B's attention
    shapes (12 heads over 2 key heads of 128), the real key block, trees that cross a block;
    two sequences under one mask."""
    r = np.random.default_rng(prefix)
    H, KV, D = 12, 2, 128
    parents = (
        [-1, 0, 0, 2, 1, 3]
        if nodes == 6
        else [-1] + [int(r.integers(0, i)) for i in range(1, nodes)]
    )
    sees = np.zeros((nodes, nodes), bool)
    for i in range(nodes):
        j = i
        while j >= 0:
            sees[i, j], j = True, parents[j]
    cached_k, cached_v, own_k, own_v = (
        r.standard_normal((2, KV, n, D)).astype(np.float32) for n in (prefix, prefix, nodes, nodes)
    )
    q = r.standard_normal((2, H, nodes, D)).astype(np.float32)
    k, v = np.concatenate([cached_k, own_k], 2), np.concatenate([cached_v, own_v], 2)
    mask = np.where(sees, 0.0, -np.inf).astype(np.float32)
    mask = np.concatenate([np.zeros((nodes, prefix), np.float32), mask], 1)
    tree = kernel.attention(q, k, v, scale=D**-0.5, mask=mask)
    branched = 0
    for i, b in itertools.product(range(nodes), range(2)):
        path = np.nonzero(sees[i])[0]
        branched += b == 0 and path.tolist() != list(range(len(path)))
        alone = kernel.attention(
            q[b : b + 1, :, i : i + 1],
            np.concatenate([cached_k[b : b + 1], own_k[b : b + 1, :, path]], 2),
            np.concatenate([cached_v[b : b + 1], own_v[b : b + 1, :, path]], 2),
            scale=D**-0.5,
            mask=None,
        )
        np.testing.assert_array_equal(tree[b, :, i], alone[0, :, 0], err_msg=f"node {i}, row {b}")
    assert branched >= 3  # the rows that differed before the fix: ancestors with gaps


@pytest.mark.parametrize("kind", KINDS)
def test_a_served_pass_runs_on_numpy_from_the_lookup_to_the_head(tmp_path, kind):
    """Between its products a served model's pass makes no MLX op: the embedding hands out
    numpy rows and each layer returns numpy ones; the model returns MLX logits. A served module
    given MLX arrays returns MLX arrays (its callers outside the pass)."""
    path = tiny.write_model(tmp_path / "m", arch="qwen3", tie=False, scale=1.5)
    model = _served(path, kind)
    tokens = mx.array([[5, 9, 14, 3]])
    h = model.model.embed_tokens(tokens)
    assert isinstance(h, np.ndarray) and h.dtype == np.float32
    cache = model.make_cache()
    out = model.layers[0](h, "causal", cache[0], None)
    assert isinstance(out, np.ndarray) and out.shape == h.shape
    attn = model.layers[1].self_attn
    assert isinstance(model.layers[1].input_layernorm, kernel.KernelNorm)
    assert isinstance(attn.rope, kernel.KernelRoPE) and isinstance(attn.q_norm, kernel.KernelNorm)
    assert attn.rope is model.layers[0].self_attn.rope  # one table for the model, not per layer
    logits, hidden = model(tokens, hidden=True)
    assert isinstance(logits, mx.array) and isinstance(hidden, mx.array)
    x = mx.array(h)
    assert isinstance(model.layers[0].mlp(x), mx.array)
    assert isinstance(model.layers[0].input_layernorm(x), mx.array)
    # numpy and MLX inputs give the same rows
    np.testing.assert_array_equal(np.array(model.layers[0].mlp(x)), model.layers[0].mlp(h))
    # and a model whose products are not all the kernel's keeps MLX's glue
    loaded = load_model(path, dequantize=True).model
    nn.quantize(loaded, group_size=32, bits=8, class_predicate=lambda p, m: p.endswith("o_proj"))
    kernel.serve(loaded, kind)
    assert not kernel.batch_invariant(loaded)
    assert type(loaded.layers[0].input_layernorm) is nn.RMSNorm
    assert not loaded.model.embed_tokens.numpy_rows
    want = np.array(loaded(tokens))
    assert np.isfinite(want).all()


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
    ],
)
@pytest.mark.parametrize("positions", [None, (7,), (2, 7)])
def test_the_kernels_rotary_embedding_computes_what_mlx_does(traditional, scaling, positions):
    cfg = tiny.make_config("llama")
    cfg.update(rope_scaling=scaling, rope_theta=500000.0, head_dim=32)
    rope = transformer.RoPE(ModelConfig.from_dict(cfg))
    rope.traditional = traditional
    r = np.random.default_rng(3)
    x = mx.array(r.standard_normal((2, 3, 7, 32)).astype(np.float32))
    pos = None if positions is None else mx.array(r.integers(0, 900, positions), mx.int32)
    want = np.array(rope(x, 40, pos))
    ours = kernel.KernelRoPE(rope)
    got = ours(np.array(x), 40, pos)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # a position's rotation does not depend on the table's size or on the other positions
    one = ours(np.array(x)[:, :, 3:4], 43, None if pos is None else pos[..., 3:4])
    assert np.array_equal(one, got[:, :, 3:4])


def test_the_rotary_embedding_looks_positions_up_once_a_pass_and_never_reuses_stale_ones():
    """Every layer's q and k of a pass share its positions, so they are looked up once; a new
    offset, length or positions array (a tree pass's, even with the same span) looks up anew."""
    rope = transformer.RoPE(ModelConfig.from_dict(tiny.make_config("llama")))
    r = np.random.default_rng(4)
    x = r.standard_normal((1, 2, 3, rope.dims)).astype(np.float32)
    ours = kernel.KernelRoPE(rope)
    calls = [(5, None), (5, None), (6, None), (5, mx.array([5, 6, 6])), (5, mx.array([5, 6, 7]))]
    calls += [(5, None), (9, None)]
    for offset, pos in calls:
        fresh = kernel.KernelRoPE(rope)(x, offset, pos)
        assert np.array_equal(ours(x, offset, pos), fresh), (offset, pos)


def test_attention_reads_a_caches_key_blocks_in_place_with_the_same_numbers():
    """A numpy KV cache keeps the rows past its offset zero (after appends, rollbacks and a
    tree's keep), so attention reads its whole key blocks in place; the numbers are those of
    zero-padded copies, bit for bit. A buffer whose next rows are not zero is copied."""
    from ondevice.models.cache import LayerCache

    r = np.random.default_rng(5)
    H, KV, D, blk = 6, 2, 16, 8

    def kv(n):
        return [r.standard_normal((1, KV, n, D)).astype(np.float32) for _ in range(2)]

    cache = LayerCache()
    cache.update_and_fetch(*kv(13))
    cache.trim(4)  # a rejected tail
    cache.update_and_fetch(*kv(5))
    cache.keep(5, [0, 2, 3])  # a tree's accepted path
    k, v = cache.update_and_fetch(*kv(1))
    S = cache.offset
    assert S == 13 and not cache.keys[:, :, S:].any() and not cache.values[:, :, S:].any()
    rows = -(-S // blk) * blk
    assert np.shares_memory(kernel._key_blocks(k, rows), cache.keys)
    q = r.standard_normal((1, H, 1, D)).astype(np.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel, "KEY_BLOCK", blk)
        want = kernel.attention(q, k.copy(), v.copy(), scale=0.25, mask=None)
        assert np.array_equal(kernel.attention(q, k, v, scale=0.25, mask=None), want)
        # rows after the keys that are not zero (any buffer's) are never read as padding
        cache.keys[:, :, S:], cache.values[:, :, S:] = np.nan, 1e30
        assert not np.shares_memory(kernel._key_blocks(k, rows), cache.keys)
        assert np.array_equal(kernel.attention(q, k, v, scale=0.25, mask=None), want)


def test_the_kernels_norm_computes_what_mlx_does():
    norm = nn.RMSNorm(48, eps=1e-5)
    norm.weight = mx.array(np.random.default_rng(1).standard_normal(48).astype(np.float32))
    x = np.random.default_rng(2).standard_normal((1, 5, 48)).astype(np.float32) * 3
    got = kernel.KernelNorm(norm)(x)
    np.testing.assert_allclose(got, np.array(norm(mx.array(x))), rtol=1e-5, atol=1e-5)
    assert np.array_equal(kernel.KernelNorm(norm)(x[:, 2:3]), got[:, 2:3])


@pytest.mark.parametrize("tie", [True, False])
def test_a_truncated_head_is_served_by_the_kernel(tmp_path, tie):
    path = tiny.write_model(tmp_path / "m", tie=tie, scale=1.5)
    loaded = load_model(path, dequantize=True)
    loaded.model.config.draft_vocab_size = 40
    want = loaded.model(mx.array([5, 9, 14]))
    kernel.serve(loaded.model, "f32")
    assert kernel.batch_invariant(loaded.model)
    got = loaded.model(mx.array([5, 9, 14]))
    assert got.shape == (1, 3, 40)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_a_served_models_plain_parameters_are_its_values_in_mlxs_layout(tmp_path, kind):
    """What `--peers mlx-lm` is handed: nn.Linear's names, the kernel's weights widened."""
    path = tiny.write_model(tmp_path / "m", arch="qwen2", tie=False, scale=1.5)
    original = dict(tree_flatten(load_model(path, dequantize=True).model.parameters()))
    got = kernel.plain_parameters(_served(path, kind))
    assert got.keys() == original.keys()
    for name, want in original.items():
        if kind in ("bf16", "int8") and weights.is_product_weight(name):
            want = want.astype(mx.bfloat16).astype(mx.float32)
        if kind == "int8" and name.endswith("_proj.weight"):  # the layers' rows in int8
            w = np.array(want)
            scale = np.maximum(np.abs(w).max(axis=1, keepdims=True), 1e-30) / np.float32(127)
            want = mx.array(np.rint(w / scale).astype(np.int8).astype(np.float32) * scale)
        assert got[name].dtype == mx.float32 and np.array_equal(np.array(got[name]), np.array(want))


@pytest.fixture(scope="module")
def served_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("kpair")
    v = tiny.write_model(d / "v", layers=2, scale=1.5)
    return v, tiny.perturbed_copy(v, d / "d", noise=0.1)


def test_products_run_on_one_openmp_pool(served_pair, monkeypatch):
    """libgomp keeps a pool of threads for each thread that calls it and, with more of its
    threads than cores, stops spinning between products, which then wait for their workers to
    be woken (3x on a draft's step here): loading reorders weights with one OpenMP thread (no
    pool on the loading thread), and a Generator measures pass costs on its generation thread,
    where every product of a generation runs."""
    threads_set = []
    real = kernel._dnnl.set_threads
    monkeypatch.setattr(kernel._dnnl, "set_threads", lambda n: (threads_set.append(n), real(n)))
    kernel._dnnl.pack(np.ones((70, 40), np.int8))
    assert threads_set[-1] == 1
    import ondevice.api

    measured_on = []
    monkeypatch.setattr(
        ondevice.api,
        "remeasure_stale",
        lambda engine: measured_on.append(threading.current_thread().name),
    )
    gen = ondevice.load(*served_pair)
    assert measured_on == ["ondevice-generate"] * 2  # the verifier's and the draft's
    gen.close()


def test_load_serves_the_verifier_and_the_draft_through_the_kernel(served_pair, monkeypatch):
    monkeypatch.delenv(kernel.ENV, raising=False)  # by default, where oneDNN loads
    gen = ondevice.load(*served_pair)
    assert gen.verifier.batch_invariant
    verifier, draft = gen._pair.verifier.model, gen._pair.draft.model
    for model in (verifier, draft):
        assert isinstance(model.layers[0].self_attn.o_proj, kernel.KernelLinear)
    # by default an MLX draft rounds to int8 where the CPU has int8 dot products (it changes
    # how often the draft is accepted, never a token); a kind named in ONDEVICE_KERNEL serves both
    want = "int8" if kernel.choice() == "bf16" and kernel.cpu_has_int8() else kernel.choice()
    assert kernel.draft_choice() == want
    blocked = _bf16_layout() if kernel.choice() == "bf16" else ""  # its weights (`pack`)
    assert kernel.products(verifier) == _named(f"{kernel.choice()}{blocked}")
    assert kernel.products(draft) == _named(want)
    monkeypatch.setenv(kernel.ENV, kernel.choice())
    gen = ondevice.load(*served_pair)
    for model in (gen._pair.verifier.model, gen._pair.draft.model):
        assert kernel.products(model) == _named(f"{kernel.choice()}{blocked}")
    monkeypatch.setenv(kernel.ENV, "mlx")
    gen = ondevice.load(*served_pair)
    assert type(gen._pair.verifier.model.layers[0].self_attn.q_proj) is nn.Linear


@pytest.mark.parametrize("k", [None, 1, 3, 7])
def test_greedy_speculative_equals_plain_with_the_kernel(served_pair, k, monkeypatch):
    monkeypatch.delenv(kernel.ENV, raising=False)
    gen = ondevice.load(*served_pair)
    for prompt in ("hello world", "the quick brown fox", "mixed CASE"):
        plain = gen.generate(prompt, max_tokens=32, speculative=False)
        spec = gen.generate(prompt, max_tokens=32, num_draft_tokens=k)
        assert spec.tokens == plain.tokens, (prompt, k)


def test_without_onednn_the_default_keeps_mlxs_products(served_pair, monkeypatch):
    """Where the wheel is missing (Linux arm64, say) the default falls back, and says why."""
    from ondevice.apps import doctor

    monkeypatch.delenv(kernel.ENV, raising=False)
    monkeypatch.setattr(kernel, "_dnnl", None)
    monkeypatch.setattr(kernel, "_unavailable", None)
    monkeypatch.setattr(kernel, "_library", lambda: None)
    assert kernel.choice() == "mlx" and kernel.weight_dtype() is None
    gen = ondevice.load(*served_pair)
    assert type(gen._pair.verifier.model.layers[0].self_attn.q_proj) is nn.Linear
    assert not gen.verifier.batch_invariant
    assert (
        f"kernel      mlx (MLX's own products: oneDNN is not installed (pip install {kernel.DIST}))"
        in (doctor.render(doctor.collect()))
    )


def test_bad_choices_are_named(monkeypatch):
    monkeypatch.setenv(kernel.ENV, "fast")
    with pytest.raises(ValueError, match="ONDEVICE_KERNEL='fast'"):
        kernel.choice()
    monkeypatch.setenv(kernel.THREADS_ENV, "many")
    with pytest.raises(ValueError, match="ONDEVICE_KERNEL_THREADS='many'"):
        kernel.default_threads()
    monkeypatch.setenv(kernel.THREADS_ENV, "2")
    assert kernel.default_threads() == 2
    monkeypatch.setenv(kernel.DECODE_ENV, "amx-please")
    with pytest.raises(ValueError, match="ONDEVICE_KERNEL_DECODE='amx-please'"):
        kernel.decode_impl()
    monkeypatch.setenv(kernel.DECODE_ENV, "prompt")
    assert kernel.decode_impl() is None
    monkeypatch.delenv(kernel.DECODE_ENV)
    assert kernel.decode_impl() is None  # the default: every pass as prompts


@pytest.mark.parametrize("served", [True, False])
def test_the_draft_catches_up_in_one_call_per_round_where_it_is_batch_invariant(
    served_pair, served
):
    v, d = (load_model(p, dequantize=True).model for p in served_pair)
    if served:
        kernel.serve(v, "f32")
        kernel.serve(d, "f32")
    draft = TimedEngine(MLXEngine(d))
    assert draft.batch_invariant is served
    greedy = SamplingParams(temperature=0.0)
    dec = ChainDecoder(MLXEngine(v), draft, greedy, num_draft_tokens=1)
    rounds = list(dec.run([5, 9, 14, 3, 22, 7], 24))
    full = sum(r.accepted == r.drafted == 1 for r in rounds)
    assert full > 0  # rounds that catch up on two tokens: the accepted draft and the bonus
    # one call to prefill, then per drafting round one (batch-invariant) or one per token
    # caught up (two after a fully accepted block: its last draft and the bonus token)
    calls = 1 + sum(r.drafted > 0 for r in rounds)
    assert draft.calls == calls if served else draft.calls > calls
    plain = ChainDecoder(MLXEngine(v), None, greedy)
    tokens = [t for r in rounds for t in r.tokens]
    assert tokens == [t for r in plain.run([5, 9, 14, 3, 22, 7], 24) for t in r.tokens]


def test_doctor_names_the_kernel(monkeypatch):
    from ondevice.apps import doctor

    monkeypatch.delenv(kernel.ENV, raising=False)  # the default serves where it can
    monkeypatch.setenv(kernel.DECODE_ENV, "avx512")
    if "bf16" in KINDS and kernel.decode_impl():  # a CPU with AMX: decoding asked elsewhere
        apart = " (decoding on AVX512-BF16, prompts on AMX)"
        assert "serves the verifier" + apart in doctor.render(doctor.collect())
    monkeypatch.delenv(kernel.DECODE_ENV)
    line = "kernel      oneDNN bf16 weights, bf16 dot products, serves the verifier"
    if "bf16" not in KINDS:
        line = "kernel      oneDNN f32 weights, float32, serves the verifier"
    if kernel.draft_choice() == "int8" != kernel.choice():
        line += "; int8 weights, int8 dot products, serve an MLX draft"
    assert line + " (the default)" in doctor.render(doctor.collect())
    text = doctor.render(doctor.collect())
    few = "; passes of a few tokens: AMX, the weight as the left operand where N >= K"
    assert (few in text) == ("bf16" in KINDS and kernel.transposes())
    vnni = {"amx_int8", "avx512_vnni"} <= kernel._cpu_flags() and "int8" in KINDS
    assert (f"int8 at up to {kernel.FEW_ROWS} rows on AVX512-VNNI\n" in text) == vnni
    monkeypatch.setenv(kernel.ENV, "auto")
    assert line + " (ONDEVICE_KERNEL=auto)" in doctor.render(doctor.collect())
    monkeypatch.setenv(kernel.ENV, "bf16" if "bf16" in KINDS else "f32")
    assert "serves the verifier (ONDEVICE_KERNEL=" in doctor.render(doctor.collect())
    monkeypatch.setenv(kernel.ENV, "mlx")
    report = doctor.collect()
    assert report["kernel"] == {"kernel": "mlx", "env": "mlx", "reason": "ONDEVICE_KERNEL=mlx"}
    assert "kernel      mlx (MLX's own products: ONDEVICE_KERNEL=mlx)" in doctor.render(report)


K_QUANT_SIZES = {"hidden_size": 256, "intermediate": 512}  # K-quant rows are 256-value blocks


@pytest.mark.skipif("bf16" not in KINDS, reason="no AVX512-BF16 here")
@pytest.mark.parametrize("source", ["Q4_K", "Q6_K-tied", "Q8_0", "mlx-4bit", "float32"])
def test_weights_read_in_the_kernels_dtype_compute_what_converted_ones_do(
    tmp_path, source, monkeypatch
):
    """The loader rounds each product weight to bfloat16 as it reads it (no float32 copy of the
    whole model), expanding quantized matrices a few rows at a time: the served model is
    bitwise the one converted after a float32 load in one piece."""
    if source.startswith(("Q4_K", "Q6_K", "Q8_0")):
        quant = source.split("-")[0]
        sizes = K_QUANT_SIZES if quant != "Q8_0" else {}
        path, _ = tiny.write_gguf(tmp_path / "m.gguf", quant=quant, tie="tied" in source, **sizes)
    else:
        # qwen2: q/k/v biases beside the quantized weights' scales and biases
        path = tiny.write_model(tmp_path / "st", arch="qwen2", tie=False, scale=1.5)
        if source == "mlx-4bit":
            save_model(load_model(path, quantize=4).model, tmp_path / "q")
            shutil.copy(path / "tokenizer.json", tmp_path / "q")
            path = tmp_path / "q"
    converted = load_model(path, dequantize=True).model
    kernel.serve(converted, "bf16")
    monkeypatch.setattr(weights, "EXPAND_BYTES", 4096)  # a few rows per piece
    loaded = load_model(path, dequantize=True, product_dtype="bfloat16").model
    layer = loaded.layers[0]
    assert layer.mlp.down_proj.weight.dtype == mx.bfloat16
    assert layer.input_layernorm.weight.dtype == mx.float32
    assert loaded.model.norm.weight.dtype == mx.float32
    # the embedding too, tied or not: its rows are widened to float32 when looked up
    assert loaded.model.embed_tokens.weight.dtype == mx.bfloat16
    kernel.serve(loaded, "bf16")
    assert isinstance(loaded.model.embed_tokens, kernel.KernelEmbedding)
    assert kernel.batch_invariant(loaded)
    tokens = mx.array([5, 9, 14, 3, 22, 7, 11, 40])
    assert np.array_equal(np.array(loaded(tokens)), np.array(converted(tokens)))


def test_a_bfloat16_checkpoint_keeps_mlxs_products(tmp_path):
    """A checkpoint that computes in a 16-bit type keeps MLX's products (as before the kernel)."""
    path = tiny.write_model(tmp_path / "st", tie=False)
    model = load_model(path, dtype="bfloat16").model
    assert kernel.serve(model, "bf16") == "bf16" and not kernel.serves(model)


@pytest.mark.parametrize("tie", [True, False])
def test_an_int8_models_profiles_are_named_by_its_layers(tmp_path, tie):
    """Its head (untied or tied) stays bf16, blocked where it verifies (not a draft's, whose
    own head is `int8_rows`); its pass costs are int8 layers' and that head's costs."""
    path = tiny.write_model(tmp_path / "m", tie=tie, scale=1.5)
    model = _served(path, "int8")
    assert model.head.weight.dtype == mx.bfloat16 and model.head._packed
    assert kernel.products(model) == _named("int8-head")
    draft = load_model(path, dequantize=True).model
    kernel.serve(draft, "int8", draft=True)
    assert not draft.head._packed
    assert kernel.products(draft) == _named("int8")


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "f32"])
def test_a_packed_weights_padding_is_zero(kind):
    """The blocked layout pads a weight to whole blocks. Those bytes are part of the weight's
    buffer, which fingerprints sample: left as they were allocated, a prompt cache saved by one
    load of a draft was refused by the next (its padding differed)."""
    dtype = np.int8 if kind == "int8" else np.uint16
    w = np.zeros((5, 7), dtype)
    for _ in range(3):
        junk = np.full(1 << 14, 0xFF, np.uint8)  # freed memory a new buffer may reuse
        del junk
        packed = kernel._dnnl.pack(w)
        assert packed.size > w.size and not packed.any()


@pytest.mark.skipif("bf16" not in KINDS, reason="no bf16 dot products on this CPU")
@pytest.mark.parametrize("tie", [True, False])
def test_a_bf16_models_weights_are_blocked_and_read_by_row_in_place(tmp_path, tie, monkeypatch):
    """Layer weights and the head (a tied embedding too) reordered once into oneDNN's blocked
    layout (flat buffers; their values are checked by the plain-parameters test); the
    embedding's lookups and a truncated head's first rows read the packed buffer in place and
    give exactly what the row-major weights give; profiles name the blocked kernel, so older
    ones are remeasured."""
    monkeypatch.setattr(kernel, "transposes", lambda: False)  # as on a CPU without AMX
    path = tiny.write_model(tmp_path / "m", tie=tie, scale=1.5)
    model = _served(path, "bf16")
    layers = kernel._layer_products(model)
    assert layers and all(m._packed and m.weight.ndim == 1 for m in layers)
    head = model.head
    assert head._packed and head.weight.ndim == 1
    assert kernel.products(model) == _named("bf16-blocked-head")
    dense = head.dense()  # via oneDNN's own reorder back to row-major
    ids = np.array([[0, 7, 3], [head.out_features - 1, 1, 7]])
    assert np.array_equal(np.array(head.rows(ids).astype(mx.float32)), np.array(dense)[ids])
    embedded = model.model.embed_tokens(mx.array(ids))
    own = load_model(path, dequantize=True, product_dtype="bfloat16").model.model.embed_tokens
    assert np.array_equal(np.array(embedded), np.array(own(mx.array(ids)).astype(mx.float32)))
    h = mx.random.normal((1, 2, model.config.hidden_size))
    first = model.head.first_rows(h, 7)
    assert first.shape == (1, 2, 7)
    full = kernel.KernelLinear.__call__(head, h)  # the logits (a tied head: `as_linear`)
    assert np.array_equal(np.array(first), np.array(full)[..., :7])  # rows are independent


@pytest.mark.skipif("bf16" not in KINDS, reason="no bf16 dot products on this CPU")
@pytest.mark.parametrize(("arch", "tie"), [("qwen2", True), ("llama", False)])
def test_a_model_served_transposed_computes_the_usual_models_logits(
    tmp_path, arch, tie, monkeypatch
):
    """Where bf16 products run on AMX (`kernel.transposes`), the products whose inputs are no
    wider than their outputs and have no bias (gate/up, o, the head) keep row-major weights
    and take passes of up to ROWS tokens transposed, the others stay blocked: the logits of
    every pass, one token to a prompt's, are bitwise the usual model's, the embedding's rows
    and a truncated head's too, and profiles name the layout (so older ones are remeasured)."""
    path = tiny.write_model(tmp_path / "m", arch=arch, tie=tie, scale=1.5)
    served = {}
    for wide in (False, True):
        monkeypatch.setattr(kernel, "transposes", lambda wide=wide: wide)
        served[wide] = _served(path, "bf16")
    model = served[True]
    for m in [*kernel._layer_products(model), model.head]:
        want = m.out_features >= m.in_features and "bias" not in m
        assert m.transposed == want and m._packed != want, (m.out_features, m.in_features)
        assert m.weight.ndim == (2 if want else 1)
    assert model.head.transposed and model.layers[0].mlp.gate_proj._joint.transposed
    assert not model.layers[0].mlp.down_proj.transposed  # 4x wider inputs than outputs
    assert kernel.products(model) == _named("bf16-blocked-transposed")
    assert kernel.batch_invariant(model)
    prompt = mx.array([5, 9, 14, 3, 22, 7, 11, 40] * 3)
    tokens = [int(t) for t in np.random.default_rng(1).integers(5, 90, 24)]
    for sizes in ([1] * 6, [4, 3, 16], [24]):
        logits = []
        for m in (served[False], model):
            cache = m.make_cache()
            rows = [np.array(m(prompt, cache))]
            at = 0
            for n in sizes:
                rows.append(np.array(m(mx.array(tokens[at : at + n]), cache)))
                at += n
            logits.append(np.concatenate(rows, axis=1))
        assert np.array_equal(*logits), sizes
    ids = mx.array([[0, 7, 3], [model.head.out_features - 1, 1, 7]])
    assert np.array_equal(
        np.array(model.model.embed_tokens(ids)), np.array(served[False].model.embed_tokens(ids))
    )
    h = mx.random.normal((1, 2, model.config.hidden_size))
    assert np.array_equal(
        np.array(model.head.first_rows(h, 7)), np.array(served[False].head.first_rows(h, 7))
    )


@pytest.mark.skipif("bf16" not in KINDS, reason="no bf16 dot products on this CPU")
def test_a_packed_weights_first_rows_are_read_in_place_where_its_layout_keeps_them_first():
    """`prefix`: the first N outputs of a packed weight as a product over the same buffer (no
    copy) where the blocked layout keeps them as a packed (N, K) weight would be, giving what
    a packed copy of those rows gives; a truncated head's `first_rows` goes through it."""
    lin = kernel.KernelLinear(mx.random.normal((300, 96), key=mx.random.key(5)), None, "bf16")
    lin.pack()
    x = mx.random.normal((1, 3, 96), key=mx.random.key(6))
    full = np.array(lin(x))
    read = 0
    for N in (7, 64, 128, 200):
        first = lin.prefix(N)
        if first is None:
            continue
        read += 1
        copied = lin.top(N, "bf16")
        copied.pack()
        assert first._weight_ptr == lin._weight_ptr and first.out_features == N
        got = np.array(first(x))
        assert np.array_equal(got, np.array(copied(x))) and np.array_equal(got, full[..., :N])
        assert np.array_equal(np.array(lin.first_rows(x, N)), got)
        assert lin._first._weight_ptr == lin._weight_ptr  # the truncated head: in place
    if kernel.one_row_impl() is not None:  # Intel with AMX: outputs blocked by 64, outermost
        assert read == 4


def test_packed_offsets_read_every_element_where_onednn_put_it():
    """`offsets` reads the blocked layout's description (strides, inner blocks); every element
    of a packed weight is where it says, for shapes with and without whole blocks."""
    rng = np.random.default_rng(0)
    kinds = [(np.uint16, kernel._BF16)] if "bf16" in KINDS else []
    kinds += [(np.int8, kernel._S8)] if "int8" in KINDS else []
    if not kinds:
        pytest.skip("no packed kernel on this CPU")
    for dtype, dnnl_type in kinds:
        for N, K in [(53, 37), (128, 64), (300, 896)]:
            w = rng.integers(1, 100, size=(N, K)).astype(dtype)
            packed = kernel._dnnl.pack(w)
            by_n, by_k = kernel._dnnl.offsets(K, N, dnnl_type)
            assert np.array_equal(packed[by_n[:, None] + by_k], w)


@pytest.mark.skipif("int8" not in KINDS, reason="int8 is tested where the CPU has bf16 and int8")
def test_an_int8_product_of_a_few_rows_reads_the_same_buffer_on_vnni(monkeypatch):
    """Where AMX is oneDNN's first int8 choice (see "int8 at a few rows"), passes of up to
    FEW_ROWS rows run on AVX512-VNNI from the one buffer, whose bytes begin with AMX's layout,
    and give every row bitwise what AMX's padded ROWS plan gives (a prompt's chunks still run
    on AMX); a VNNI plan made to differ in one last bit is found out and its pass runs padded
    to ROWS on AMX instead. Elsewhere every pass runs on oneDNN's first choice: all of them on
    VNNI where that is VNNI (a CPU without AMX: AMD's Zen 4), none where it is another."""
    K, N = 96, 300
    w = mx.random.normal((N, K), key=mx.random.key(3))
    x = mx.random.normal((1, 40, K), key=mx.random.key(4))
    lin = kernel.KernelLinear(w, None, "int8")
    few = kernel._dnnl.few_rows_layout(K, N, kernel._S8)
    first = kernel._dnnl._first[(K, N, kernel._S8)]
    assert (few is not None) == (first == kernel.AMX and "avx512_vnni" in kernel._cpu_flags())
    got = {M: np.array(lin(x[:, :M])) for M in (1, 2, 3, 4, 5, 8, 16, 17, 40)}
    plans = [p for p in kernel._dnnl._local.plans.values() if p.key[:2] == (K, N)]
    vnni = {p.rows for p in plans if p.impl == kernel.VNNI}
    if few is not None:
        assert vnni == {1, 2, 3, 4}
    else:
        assert vnni == ({p.rows for p in plans} if first == kernel.VNNI else set())
    assert all(p.invariant is not False for p in plans)
    # the same product where the buffer holds AMX's layout alone: the same bits at every M
    monkeypatch.setitem(kernel._dnnl._few, (K, N, kernel._S8), None)
    alone = kernel.KernelLinear(w, None, "int8")
    assert alone._np_weight.nbytes <= lin._np_weight.nbytes
    for M, rows in got.items():
        assert np.array_equal(np.array(alone(x[:, :M])), rows), M
    if few is None:
        return
    monkeypatch.undo()
    run = kernel._Plan.run

    def off_by_a_bit(self, weight_ptr, bias_ptr):
        run(self, weight_ptr, bias_ptr)
        if self.impl == kernel.VNNI:
            self.dst.view(np.uint32)[0, 0] ^= 1

    monkeypatch.setattr(kernel._Plan, "run", off_by_a_bit)
    plan = next(p for p in plans if p.impl == kernel.VNNI and p.rows == 3)
    plan.invariant = None
    assert np.array_equal(np.array(lin(x[:, :3])), got[3])
    assert plan.invariant is False
    plan.invariant = None  # checked again by the next product of this shape


@pytest.mark.skipif("int8" not in KINDS, reason="int8 is tested where the CPU has bf16 and int8")
@pytest.mark.parametrize("tie", [True, False])
def test_an_int8_drafts_head_scores_only_its_first_ids_in_int8(tmp_path, monkeypatch, tie):
    """A draft's head in int8 over the first DRAFT_VOCAB ids: the draft's vocabulary becomes
    those ids, its logits are the int8 product of those rows, its own weights unchanged."""
    monkeypatch.setattr(kernel, "DRAFT_VOCAB", 60)
    path = tiny.write_model(tmp_path / "m", tie=tie, scale=1.5)
    vocab = tiny.make_config()["vocab_size"]
    ref = _served(path, "bf16")
    loaded = load_model(path, dequantize=True)
    kernel.serve(loaded.model, "int8", draft=True)
    model = loaded.model
    assert model.config.draft_vocab_size == 60 < vocab
    small = model.head.int8_rows
    assert small.out_features == 60 and small._dtype == kernel._S8
    logits = model(mx.array([5, 9, 14]))
    assert logits.shape == (1, 3, 60)
    # the int8 product of the bf16 head's first 60 rows
    full = ref(mx.array([5, 9, 14]))[..., :60]
    assert np.allclose(np.array(logits), np.array(full), atol=0.1 * float(mx.abs(full).max()))
    assert not np.array_equal(np.array(logits), np.array(full))  # rounded: not the bf16 head's
    served = _served(path, "int8")
    at = "model.embed_tokens" if tie else "lm_head"
    names = {k for k, _ in tree_flatten(model.parameters())}
    int8 = {k for k, _ in tree_flatten(served.parameters())}
    assert names == int8 | {f"{at}.int8_rows.weight", f"{at}.int8_rows.scales"}
    # tools that read the model's own layout (mlx-lm) get the model's own weights
    plain = kernel.plain_parameters(model)
    assert set(plain) == set(kernel.plain_parameters(served))
    assert plain[f"{at}.weight"].shape == (vocab, model.config.hidden_size)


@pytest.mark.skipif("int8" not in KINDS, reason="int8 is tested where the CPU has bf16 and int8")
def test_a_draft_with_fewer_ids_changes_no_token(served_pair, monkeypatch):
    """Greedy and seeded sampled output with an int8 draft that scores only the first ids: the
    verifier's own (a token past those ids comes from the verifier's rule)."""
    monkeypatch.delenv(kernel.ENV, raising=False)
    monkeypatch.setattr(kernel, "DRAFT_VOCAB", 60)
    gen = ondevice.load(*served_pair)
    assert gen._pair.draft.model.config.draft_vocab_size == 60
    plain = gen.generate("hello world", max_tokens=40, speculative=False)
    assert any(t >= 60 for t in plain.tokens)  # the verifier says tokens the draft cannot
    spec = gen.generate("hello world", max_tokens=40, num_draft_tokens=3)
    assert spec.tokens == plain.tokens and spec.stats["accepted"] > 0
    args = dict(max_tokens=40, num_draft_tokens=3, temperature=0.8, seed=5)
    sampled = gen.generate("hello world", **args)
    assert sampled.tokens == gen.generate("hello world", pipeline=True, **args).tokens
