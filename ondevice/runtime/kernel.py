"""The CPU kernel behind the verifier's linear products on Linux: oneDNN's matmul through ctypes.

Why: a speculative round verifies several tokens in one pass, which pays only if that pass costs
little more than a one-token pass. MLX's CPU products go to a BLAS (MKL here, runtime/blas.py),
whose small-M float32 GEMM grows with every token of the pass. oneDNN's matmul with bfloat16
weights and bfloat16 dot products (AVX512-BF16, chosen by CPU feature, not vendor) reads each
weight once for all the tokens of a pass and is bound by memory up to about 16 tokens, so a pass
over 8 tokens costs little more than one, and the weights take half the memory of float32
(docs/benchmarks.md, "issue 26: pass cost").

How it is wired, so that the model code stays one copy: `serve(model)` swaps each `nn.Linear`
of an MLX transformer (and the embedding, and a tied head) for a `KernelLinear` that runs the
product in oneDNN on its input's buffer and hands the result back (see "Glue"). Products that share
their input (q/k/v, gate/up) become one (`KernelPart`), so a pass makes four a layer plus the
head; the glue still avoids per-product work: weights are converted once at load, one
primitive is built per (K, N) and reused, and each thread keeps fixed input/output buffers.
The layers' weights are reordered once, at load, into the blocked layout oneDNN's matmul
prefers (`_OneDNN.pack`; bf16 and int8 alike; not where AMX reads them row-major, "AMX at a
few rows" below): read in MLX's row-major layout, oneDNN reorders blocks on every call, which
made a bf16 product of an 8960 x 1536 weight take 2.13 ms instead of 1.12 ms on the AMD Zen VMs here (the int8 one a quarter more on Intel). A verifier's head
(a tied embedding too) is blocked as well (`_pack`); its rows are read in place where the
layout puts them (`_OneDNN.offsets`, `KernelLinear.rows`). An int8 draft's bf16 head stays row-major
beside its int8 one (`_draft_head`).

Glue: everything between the products of a served model's pass runs in numpy on the calling
thread: the norms (`KernelNorm`), the rotary embedding (`KernelRoPE`), attention (`attention`),
the MLP's gating (`silu_gate`) and the residual sums (the model code's own `+`, on numpy
arrays), from the embedding's rows (`KernelEmbedding.numpy_rows`) to the head's logits, which
the model hands back as MLX (`transformer.as_mlx`), and the KV cache's buffers (models/cache.py
keeps numpy ones where it is fed numpy keys). Each MLX evaluation hands the work to MLX's
stream thread and waits for it: 14-60 us for one small op here, 70-100 us right after a product
(the OpenMP workers still spin on the other core), against 1-2 us for the same op in numpy, and
a layer made three such evaluations. With the glue in numpy the 0.5B draft's step took 25-31 ms
instead of 36-41 and a 512-token prompt 6.5 s instead of 14-17; with the cache in numpy too,
20.5-24 ms (docs/benchmarks.md, "Issue 26, session 8"). A served module follows its
input: given MLX arrays (a tool's call outside the pass, a model whose products are not all the
kernel's) it returns MLX arrays.

Threads: oneDNN runs on OpenMP (libgomp), which keeps a pool of threads for each thread that
calls it, and once a process holds more of its threads than it has cores, every pool stops
spinning between parallel regions (libgomp's "throttled" spin: about a thousand iterations), so
each product waits for its workers to be woken: on the 2-core VMs here an int8 product of the
draft's took 116 us from a second thread against 39 us, and the draft's step 180 ms against
61. So the products run on one thread: the model's generation thread (`api.Generator`), where
pass costs are measured too; loading reorders weights on the loading thread with one OpenMP
thread (`reorder`), which starts no pool. Each product runs on as many threads as the process
may use (its CPU affinity) unless `ONDEVICE_KERNEL_THREADS` says otherwise: a one-token product
is bound by memory, and one core alone does not draw the machine's bandwidth (docs/benchmarks.md,
"Issue 26, session 3", measured idle). A product whose weight is smaller than
`ONE_THREAD_BYTES` runs on one thread all the same: it reads its weight in tens of
microseconds, about what waking and joining the other thread costs (the 0.5B draft's q/k/v and
o products, 1.0 and 0.8 MB in int8: its step 35.7 ms against 37.2; the 1.5B verifier's 4.7 MB
o product lost on one thread: docs/benchmarks.md, "Issue 26, session 24"). On a machine shared
with other busy jobs, each of a pass's ~100 products is a fork/join that waits for a preempted
thread, and one thread per product (`ONDEVICE_KERNEL_THREADS=1`) measured better there;
`ONDEVICE_KERNEL_THREADS` sets every product's threads, small ones too. Machines without the
wheel (Linux arm64) or with `ONDEVICE_KERNEL=mlx` keep MLX's products; the Mac never uses this
module (MLX on Metal).

Batch invariance: a row's result must not depend on how many tokens share the pass (plain and
speculative decoding must give bitwise-identical greedy tokens), but a library may pick
another blocking for another M. A product of a pass over M <= `ROWS` tokens (decoding,
verification, trees) runs at its own M only where that gives every row exactly what the
product padded to `ROWS` rows gives: checked once per shape and M, on the first input, by
running both (`KernelLinear._invariant`); elsewhere it runs padded to `ROWS`. oneDNN's bf16
and int8 kernels passed that check at every M here (one kernel, whose sums run in the same
order at every M), and a one-token product then reads its 8960 x 1536 bf16 weight in 0.87 ms
instead of padded 16 rows' 1.18 ms. A longer pass (a prompt, a large tree) runs in chunks of
`PREFILL_ROWS`, where the product is bound by compute and the larger blocks pay, its last
chunk in the smallest plan of `CHUNKS` that holds it (32, 64 or 128 rows): a 20-node tree
pass of the 1.5B verifier, padded to 128 rows, cost 0.75 s against 0.25 at 16 nodes, and AMX
multiplies 32 rows in 1.1-1.25x the time of 16 (docs/benchmarks.md, "Issue 26, session 18").
Each such plan too is used only where its rows equal the `ROWS` plan's (`_invariant`, which
runs the `ROWS` plan over them in turn; elsewhere the chunk runs `ROWS` at a time).
Attention's products go through MLX's BLAS, so `serve` also swaps in `attention`, whose
products have one shape per row whatever the pass; a served model then declares
`batch_invariant` (runtime/engines.py).

Prompts apart (an option): on a CPU with AMX (Intel Xeon since Sapphire Rapids) oneDNN picks
AMX's tiles for bf16 products at any row count. AMX is flat to 16 rows and four times faster
than AVX512-BF16's dot products at a prompt's 128-row chunks, but reads weights at about 20 GB/s
here against AVX512-BF16's 25-27 at one to four rows: the 1.5B verifier's one-token pass takes
about 185 ms against 140, its 8-token pass 200 against 235 (docs/benchmarks.md, "Issue 26,
session 18"). The two never give a row the same bits, so one product cannot take one at one
row and the other at eight. `ONDEVICE_KERNEL_DECODE=avx512` gives every decoding pass (plain,
verification, trees) AVX512-BF16's and keeps AMX's for passes inside `prefill` (rules/engine.py,
`in_prompt`): each is batch-invariant, so plain and speculative decoding still give the same
tokens and a prompt's rows are the same whichever way it was split. A decoded row is then not
a prompt's, so the prompt cache keeps only the rows prompt passes wrote (`MLXEngine.reusable`):
the next turn of a conversation prefills the last answer again and gets exactly the rows an
uncached request would. A decoding pass over more than `ROWS` tokens runs in chunks of `ROWS`,
as its own passes do. Plain decoding runs a third faster that way, speculative decoding about
as fast (its rounds shrink to the dearer multi-token passes), and a conversation pays the
answer's prefill at its next turn, so the default keeps one implementation for every pass.
(Since products are transposed on AMX, below, the default's one-token pass is about 182 ms
against the option's 165, its 8-token pass 205 against 259: "Issue 26, session 21".)
A draft that is the verifier itself (method `self`) needs no such agreement, its rounding
changing only how often its guesses are accepted: it reads the verifier's weights through
AVX512-BF16 wherever the CPU has AMX (`one_row_reading`), nothing copied, except those the
verifier reads transposed (below), which AMX reads faster that way on their row-major buffer.

AMX at a few rows: oneDNN's AMX matmul multiplies a pass's rows (the left operand, at most 16
per tile) by weights it reads as the right one, and at one to a few rows it reads them more
slowly than AVX512-BF16 does. Taken the other way round, `W @ x.T`, the row-major weight is the
left operand (thousands of rows) and the pass's tokens the right one's few columns: a 17,920 x
1,536 product (the joined gate and up) took 2.2-2.5 ms over 1 to 16 rows against 2.9-3.0 ms the
usual way, the tied head 19.5 ms against 29 at one row, with every output bitwise the same as
the usual product's at every row count (AMX's tiles sum each output's K in the same order
either way). Products whose inputs are wider than their outputs (the down projection) lose
that way (5 ms against 1.6), and at a prompt's 128-row chunks the usual way is faster (6.8 ms
against 23). So where oneDNN's bf16 products run on AMX (`transposes`), a product with at least
as many outputs as inputs and no bias (for a bias per output row oneDNN offers only its
reference loops) takes its passes of up to `ROWS` rows transposed
(`KernelLinear.transposed`) and its prompt chunks the usual way, both reading the weight
row-major: on AMX the blocked layout gains nothing (row-major 2.8 ms against blocked 3.0 at 16
rows, 6.8 against 10.7 at 128), so these weights are not reordered. A transposed plan too is
used only where its rows equal the `ROWS` plan's (`_invariant`), which they did at every size
here (docs/benchmarks.md, "Issue 26, session 21").

Memory: a loader that is told `weight_dtype()` (`ondevice.load` does) rounds each linear weight
and the embedding to bfloat16 as it reads it (models/weights.py), so no float32 copy of the
model exists; an untied embedding's looked-up rows are widened to float32 (`KernelEmbedding`).

int8: each weight row is rounded to int8 with its own scale (its largest magnitude maps to 127)
and reordered once, at load, into the blocked layout (above). Each input row is rounded the
same way at run time, the products sum in int32 and the result is scaled back. Integer sums are
exact, so any blocking gives the same rows: int8 is batch-invariant by construction. A
one-token pass reads half the bytes of bf16's, but rounding every input row to 256 levels moves
a model's distribution further from its float32 one than bf16 does (docs/benchmarks.md,
"int8"), so the verifier gets int8 only when asked (`ONDEVICE_KERNEL=int8`). A draft's rounding
changes how often its guesses are accepted, never a token of the output (greedy or, with a
seed, sampled: the sequential and the pipelined decoder agree whatever the draft computes), so
by default an MLX draft gets int8 wherever the CPU has int8 dot products (`draft_choice`): its
step costs a fifth less. The head and the embedding stay bf16 (`_to_int8`).

int8 at a few rows: where AMX is oneDNN's first choice for int8 products (Intel Xeon since
Sapphire Rapids), AVX512-VNNI's kernel reads the same weights faster at one to four rows (the
0.5B draft's joined gate/up 0.40 against 0.47 ms at one row, its down projection 0.20 against
0.26, its head 2.7 against 2.9) and slower from eight. VNNI's blocked layout is AMX's with
the sums for its unsigned-input correction after it, so one buffer in VNNI's layout serves
both (`_OneDNN.few_rows_layout`, checked per shape): products of up to `FEW_ROWS` rows (a
draft's steps) run on VNNI, prompts on AMX, and integer sums make their rows the same
(`_invariant` checks it as for every plan; docs/benchmarks.md, "Issue 26, session 22").

The draft's head: a draft's head is about a quarter of its step (the 0.5B draft's tied head is
151,936 x 896). An int8 draft gets an int8 head over the first `DRAFT_VOCAB` token ids only
(`_draft_head`): BPE vocabularies number their tokens in merge order, the commonest first, and
65,536 ids hold 98.9% of the default verifier's tokens on Spec-Bench dev (32,768: 96%). The
draft then scores only those ids (its `draft_vocab_size`, as a distilled FR-Spec draft's); a
token past them is one the draft never proposes, which the verifier's own rule takes from its
residual: the output is exactly the verifier's either way. Measured: the 0.5B draft's step 63 ms
with its bf16 head, 50 ms with this one (docs/benchmarks.md, "Issue 26, session 5").

`ONDEVICE_KERNEL` chooses: `auto` (the default: bf16 where the CPU has AVX512-BF16, else
float32, and an int8 draft as above; MLX's own products where oneDNN cannot be loaded), `bf16`,
`int8`, `f32` (through oneDNN, for both models) or `mlx` (MLX's own products, MKL or OpenBLAS:
the path before this kernel).

Which tokens: the kernel serves by default wherever it can (Linux x86_64 with the
`onednn-cpu-gomp` wheel loadable, MLX on the CPU). With bf16 weights and bf16 dot products a
model's logits are not those of the same weights in float32, so a near-tied greedy token may
differ from mlx-lm's (which computes in float32 on the CPU) or from a float32 reference. What
stays exact is the project's contract: plain, speculative, tree and pipelined decoding of one
loaded pair give bitwise-identical greedy tokens, because every product is the kernel's and is
batch-invariant. Comparisons with mlx-lm's float32 tokens (`ondevice bench --peers mlx-lm`, the
tests that check them) use `ONDEVICE_KERNEL=mlx`, or compare with this kernel's plain decoding.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import os
import re
import sys
import threading
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ondevice.rules.engine import in_prompt
from ondevice.runtime.memory import release

ENV = "ONDEVICE_KERNEL"
CHOICES = ("auto", "bf16", "int8", "f32", "mlx")
DEFAULT = "auto"  # see "Which tokens" above
DIST = "onednn-cpu-gomp"  # oneDNN's CPU build with GNU OpenMP: needs only libgomp
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # transformer.py's
DRAFT_VOCAB = 65536  # an int8 draft scores this many ids at most (see "The draft's head")
ROWS = 16  # a product over up to this many rows runs at its own M or padded to this...
PREFILL_ROWS = 128  # ...or, in a pass over more than ROWS tokens (a prompt), in chunks of this
CHUNKS = (ROWS, 2 * ROWS, 4 * ROWS, PREFILL_ROWS)  # ...the last at the first of these that holds it
KEY_BLOCK = 128  # attention reads the keys in blocks of this many (see `attention`)
# elementwise glue (the MLP's gating, rounding a product's input) walks a prompt's rows this many
# at a time: a slab of the 1.5B's 8,960-wide rows stays in cache between its numpy passes, where
# whole (400, 8960) arrays streamed through memory once a pass (gating 9.6 -> 5.1 ms, rounding
# 8.2 -> 2.2 ms: docs/benchmarks.md, "Issue 26, session 18")
SLAB = 8
REVISION = 6  # in profiles' names: raised when a change of this module changes pass costs
THREADS_ENV = "ONDEVICE_KERNEL_THREADS"  # OpenMP threads per product (default: all usable)
ONE_THREAD_BYTES = 2 << 20  # a smaller weight's products run on one thread (see "Threads")
DECODE_ENV = "ONDEVICE_KERNEL_DECODE"  # bf16 decoding passes: `prompt` (as prompts) or `avx512`
DECODE_CHOICES = ("prompt", "avx512")
AVX512_BF16 = "brg:avx512_core_bf16"  # oneDNN's name for its AVX512-BF16 matmul
AMX = "brg:avx512_core_amx"  # ...for its AMX matmul
VNNI = "brg:avx512_core_vnni"  # ...for its AVX512-VNNI matmul
FEW_ROWS = 4  # int8 products of up to this many rows run on VNNI beside AMX ("int8 at a few rows")

# oneDNN C API constants (dnnl_types.h, oneDNN 3.x)
_F32, _BF16, _S8 = 3, 2, 5  # dnnl_data_type_t
_FORMAT_ANY = 1  # dnnl_format_tag_any: the primitive chooses the weights' layout
_CPU = 1  # dnnl_cpu
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS, _ARG_BIAS = 1, 17, 33, 41
_QUERY_IMPL_INFO = 8  # dnnl_query_impl_info_str
_QUERY_WEIGHTS_MD = 131  # dnnl_query_weights_md
_QUERY_STRIDES, _QUERY_INNER_NBLKS = 14, 263  # dnnl_query_strides, dnnl_query_inner_nblks_s32
_QUERY_INNER_BLKS, _QUERY_INNER_IDXS = 264, 265  # dnnl_query_inner_blks, dnnl_query_inner_idxs
_NP_KINDS = {np.int8: _S8, np.uint16: _BF16}  # a packed weight's numpy dtype (bf16 as uint16)
_Dims = ctypes.c_int64 * 12  # dnnl_dims_t


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


def _library() -> Path | None:
    try:
        files = metadata.files(DIST) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libdnnl.so"):
            path = Path(str(f.locate())).resolve()
            if path.exists():
                return path
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split()[2:])
    except OSError:
        pass
    return set()


def cpu_has_int8() -> bool:
    """Whether this CPU computes int8 dot products natively (AVX512-VNNI, AVX-VNNI or AMX)."""
    return bool(_cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 dot products natively (AVX512-BF16 or AMX)."""
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


class _Plan:
    """One primitive for a (K, N, dtype, bias) product at `rows` rows, with its memory objects and
    its input/output buffers; owned by one thread (data handles are set per call). `wei_md`: the
    weights' layout where the kernel reordered them at load (int8, `_OneDNN.packed_layout`);
    None for MLX's own row-major (N, K) buffer. `transposed`: the product taken as
    `W @ x.T`, the row-major weight as the left operand (see "AMX at a few rows" above);
    its input buffer then holds the rows as columns (`feed`) and its output the results as
    columns (`result`)."""

    def __init__(
        self,
        dnnl: _OneDNN,
        K: int,
        N: int,
        dtype: int,
        bias: bool,
        rows: int,
        threads: int,
        wei_md: ctypes.c_void_p | None = None,
        impl: str | None = None,
        transposed: bool = False,
    ):
        lib = dnnl.lib
        self.lib, self.stream = lib, dnnl.stream
        # shape, kind, weights' layout and the implementation asked for
        self.key = (K, N, dtype, bias, wei_md is not None, impl)
        self.rows, self.transposed = rows, transposed
        self.invariant: bool | None = None  # rows as the padded product's (`_invariant`)
        # OpenMP's thread count is per calling thread: set it for the creation (oneDNN sizes
        # its blocking by it) and for every run of this plan.
        self.threads = threads
        self.set_threads = dnnl.set_threads
        self.set_threads(self.threads)
        np_dtype = {_BF16: np.uint16, _S8: np.int8}.get(dtype, np.float32)
        own_wei = wei_md is None
        if transposed:  # (N, K) weight @ (K, rows) input columns -> (N, rows) output columns
            assert own_wei, "a transposed product reads the row-major weight"
            self.src = np.zeros((K, rows), np_dtype)
            self.dst = np.zeros((N, rows), np.float32)
            wei_md = dnnl.md((N, K), dtype, (K, 1))  # oneDNN's src: the weight
            src_md = dnnl.md((K, rows), dtype, (rows, 1))  # oneDNN's weights: the input
            dst_md = dnnl.md((N, rows), _F32, (rows, 1))
            bias_md = dnnl.md((N, 1), _F32, (1, 1)) if bias else None
            pd = dnnl.matmul(wei_md, src_md, bias_md, dst_md)
        else:
            self.src = np.zeros((rows, K), np_dtype)
            self.dst = np.zeros((rows, N), np.float32)
            src_md = dnnl.md((rows, K), dtype, (K, 1))
            if own_wei:
                wei_md = dnnl.md((K, N), dtype, (1, K))  # MLX's (N, K) weight read as K x N
            dst_md = dnnl.md((rows, N), _F32, (N, 1))
            bias_md = dnnl.md((1, N), _F32, (N, 1)) if bias else None
            pd = dnnl.matmul(src_md, wei_md, bias_md, dst_md)
        self.impl = dnnl.impl(pd)
        while impl is not None and self.impl != impl:  # oneDNN's next choice, best first
            if lib.dnnl_primitive_desc_next_impl(pd):  # none left: this machine lacks it
                lib.dnnl_primitive_desc_destroy(pd)
                raise RuntimeError(f"oneDNN offers no {impl} matmul for a {K}x{N} product")
            self.impl = dnnl.impl(pd)
        prim = ctypes.c_void_p()
        dnnl.check(lib.dnnl_primitive_create(ctypes.byref(prim), pd), "matmul primitive")
        lib.dnnl_primitive_desc_destroy(pd)
        self.prim = prim
        self.wei = dnnl.memory(wei_md, None)
        self.bias = dnnl.memory(bias_md, None) if bias_md is not None else None
        # the weight's memory (oneDNN's src where transposed) gets its buffer at each run
        data_arg, wei_arg = (_ARG_WEIGHTS, _ARG_SRC) if transposed else (_ARG_SRC, _ARG_WEIGHTS)
        args = [
            (data_arg, dnnl.memory(src_md, self.src.ctypes.data)),
            (wei_arg, self.wei),
            (_ARG_DST, dnnl.memory(dst_md, self.dst.ctypes.data)),
        ]
        if self.bias is not None:
            args.append((_ARG_BIAS, self.bias))
        self.nargs = len(args)
        self.args = (_ExecArg * len(args))(*[_ExecArg(a, m.value) for a, m in args])
        for md in (src_md, wei_md if own_wei else None, dst_md, bias_md):
            if md is not None:
                lib.dnnl_memory_desc_destroy(md)

    def feed(self, rows: np.ndarray) -> None:
        """The input rows (n, K), n <= the plan's rows, into the plan's input buffer."""
        if self.transposed:
            self.src[:, : len(rows)] = rows.T
        else:
            self.src[: len(rows)] = rows

    def result(self, n: int) -> np.ndarray:
        """The first n rows' results (n, N): a view of the plan's output buffer, valid until
        its next run (transposed: a strided view of its columns)."""
        return self.dst[:, :n].T if self.transposed else self.dst[:n]

    def run(self, weight_ptr: int, bias_ptr: int | None) -> None:
        lib = self.lib
        self.set_threads(self.threads)
        lib.dnnl_memory_set_data_handle(self.wei, weight_ptr)
        if self.bias is not None:
            lib.dnnl_memory_set_data_handle(self.bias, bias_ptr)
        status = lib.dnnl_primitive_execute(self.prim, self.stream, self.nargs, self.args)
        if status:
            raise RuntimeError(f"oneDNN matmul failed (status {status})")


class _OneDNN:
    """The library, its CPU engine and stream, and the plans built so far (per thread)."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        vp = ctypes.c_void_p
        sigs = {
            "dnnl_engine_create": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_size_t],
            "dnnl_stream_create": [ctypes.POINTER(vp), vp, ctypes.c_uint],
            "dnnl_memory_desc_create_with_strides": [
                ctypes.POINTER(vp),
                ctypes.c_int,
                _Dims,
                ctypes.c_int,
                _Dims,
            ],
            "dnnl_memory_desc_create_with_tag": [
                ctypes.POINTER(vp),
                ctypes.c_int,
                _Dims,
                ctypes.c_int,
                ctypes.c_int,
            ],
            "dnnl_memory_desc_clone": [ctypes.POINTER(vp), vp],
            "dnnl_memory_desc_destroy": [vp],
            "dnnl_reorder_primitive_desc_create": [ctypes.POINTER(vp), vp, vp, vp, vp, vp],
            "dnnl_matmul_primitive_desc_create": [ctypes.POINTER(vp), vp, vp, vp, vp, vp, vp],
            "dnnl_primitive_desc_query": [vp, ctypes.c_int, ctypes.c_int, vp],
            "dnnl_primitive_desc_destroy": [vp],
            "dnnl_primitive_desc_next_impl": [vp],
            "dnnl_primitive_create": [ctypes.POINTER(vp), vp],
            "dnnl_memory_create": [ctypes.POINTER(vp), vp, vp, vp],
            "dnnl_memory_destroy": [vp],
            "dnnl_primitive_destroy": [vp],
            "dnnl_memory_set_data_handle": [vp, vp],
            "dnnl_primitive_execute": [vp, vp, ctypes.c_int, vp],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        lib.dnnl_primitive_desc_query_md.argtypes = [vp, ctypes.c_int, ctypes.c_int]
        lib.dnnl_primitive_desc_query_md.restype = vp
        lib.dnnl_memory_desc_query.argtypes = [vp, ctypes.c_int, vp]
        lib.dnnl_memory_desc_query.restype = ctypes.c_int
        lib.dnnl_memory_desc_get_size.argtypes = [vp]
        lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        self.lib = lib
        self.engine, self.stream = vp(), vp()
        self.check(lib.dnnl_engine_create(ctypes.byref(self.engine), _CPU, 0), "CPU engine")
        # flags 0: the default stream (in-order; execution on the CPU returns when done)
        self.check(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, 1), "stream")
        self._local = threading.local()
        self._layouts: dict[tuple[int, int, int, str | None], ctypes.c_void_p] = {}
        self._few: dict[tuple[int, int, int], ctypes.c_void_p | None] = {}
        self._first: dict[tuple[int, int, int], str] = {}  # the implementation packed_layout's is
        self._offsets: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        omp = ctypes.CDLL("libgomp.so.1")  # oneDNN's OpenMP runtime, already loaded with it
        self.set_threads = omp.omp_set_num_threads
        self.set_threads.argtypes, self.set_threads.restype = [ctypes.c_int], None

    @staticmethod
    def check(status: int, what: str) -> None:
        if status:
            raise RuntimeError(f"oneDNN: could not create the {what} (status {status})")

    def impl(self, pd: ctypes.c_void_p) -> str:
        """The name of the implementation a primitive descriptor holds (`brg:avx512_core_amx`)."""
        info = ctypes.c_char_p()
        self.lib.dnnl_primitive_desc_query(pd, _QUERY_IMPL_INFO, 0, ctypes.byref(info))
        return (info.value or b"?").decode()

    def md(self, dims: tuple[int, ...], dtype: int, strides: tuple[int, ...]) -> ctypes.c_void_p:
        md = ctypes.c_void_p()
        self.check(
            self.lib.dnnl_memory_desc_create_with_strides(
                ctypes.byref(md), len(dims), _Dims(*dims), dtype, _Dims(*strides)
            ),
            "memory descriptor",
        )
        return md

    def memory(self, md: ctypes.c_void_p, handle: int | None) -> ctypes.c_void_p:
        m = ctypes.c_void_p()
        self.check(self.lib.dnnl_memory_create(ctypes.byref(m), md, self.engine, handle), "memory")
        return m

    def matmul(
        self,
        src_md: ctypes.c_void_p,
        wei_md: ctypes.c_void_p,
        bias_md: ctypes.c_void_p | None,
        dst_md: ctypes.c_void_p,
    ) -> ctypes.c_void_p:
        pd = ctypes.c_void_p()
        self.check(
            self.lib.dnnl_matmul_primitive_desc_create(
                ctypes.byref(pd), self.engine, src_md, wei_md, bias_md, dst_md, None
            ),
            "matmul primitive descriptor",
        )
        return pd

    def packed_layout(self, K: int, N: int, dtype: int, impl: str | None = None) -> ctypes.c_void_p:
        """The weights' layout oneDNN's matmul prefers at `ROWS` rows (blocked for its dot
        product instructions), chosen once per shape; every plan of that shape, the prompt's
        too, reads weights in this layout, so they are reordered once at load (`pack`).
        impl: the layout the implementation named asks for instead (`few_rows_layout`)."""
        key = (K, N, dtype, impl)
        if key not in self._layouts:
            lib = self.lib
            any_md = ctypes.c_void_p()
            self.check(
                lib.dnnl_memory_desc_create_with_tag(
                    ctypes.byref(any_md), 2, _Dims(K, N), dtype, _FORMAT_ANY
                ),
                "memory descriptor",
            )
            src_md = self.md((ROWS, K), dtype, (K, 1))
            dst_md = self.md((ROWS, N), _F32, (N, 1))
            self.set_threads(default_threads())
            pd = self.matmul(src_md, any_md, None, dst_md)
            if impl is None:
                self._first[key[:3]] = self.impl(pd)
            found = impl is None or self.impl(pd) == impl
            while not found and not lib.dnnl_primitive_desc_next_impl(pd):
                found = self.impl(pd) == impl
            chosen = ctypes.c_void_p()
            if found:
                lib.dnnl_memory_desc_clone(
                    ctypes.byref(chosen), lib.dnnl_primitive_desc_query_md(pd, _QUERY_WEIGHTS_MD, 0)
                )
            lib.dnnl_primitive_desc_destroy(pd)
            for md in (any_md, src_md, dst_md):
                lib.dnnl_memory_desc_destroy(md)
            if not found:
                raise RuntimeError(f"oneDNN offers no {impl} matmul for a {K}x{N} product")
            self._layouts[key] = chosen
        return self._layouts[key]

    def few_rows_layout(self, K: int, N: int, dtype: int) -> ctypes.c_void_p | None:
        """Where int8 products of up to `FEW_ROWS` rows run on AVX512-VNNI beside AMX (see
        "int8 at a few rows" above): VNNI's layout of a (K, N) weight, whose bytes begin with
        the `packed_layout` (AMX's) of the same weight, so that one buffer serves both: the
        same blocking (`blocking`), its extra sums after the data; None where the first choice
        is not AMX, VNNI is not offered or its layout is another."""
        key = (K, N, dtype)
        if key not in self._few:
            self._few[key] = None
            first = self.packed_layout(K, N, dtype)
            if dtype == _S8 and self._first[key] == AMX:
                try:
                    few = self.packed_layout(K, N, dtype, VNNI)
                except RuntimeError:
                    return None
                size = self.lib.dnnl_memory_desc_get_size
                if self.blocking(few) == self.blocking(first) and size(few) >= size(first):
                    self._few[key] = few
        return self._few[key]

    def reorder(
        self, src_md: ctypes.c_void_p, src: np.ndarray, dst_md: ctypes.c_void_p, dst: np.ndarray
    ) -> None:
        """Copy `src` (laid out as `src_md`) into `dst` (as `dst_md`)."""
        lib = self.lib
        pd, prim = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(
            lib.dnnl_reorder_primitive_desc_create(
                ctypes.byref(pd), src_md, self.engine, dst_md, self.engine, None
            ),
            "reorder",
        )
        self.check(lib.dnnl_primitive_create(ctypes.byref(prim), pd), "reorder primitive")
        lib.dnnl_primitive_desc_destroy(pd)
        self.set_threads(1)  # at load, on the loading thread: see "Threads" above
        mems = (self.memory(src_md, src.ctypes.data), self.memory(dst_md, dst.ctypes.data))
        args = (_ExecArg * 2)(_ExecArg(_ARG_SRC, mems[0].value), _ExecArg(_ARG_DST, mems[1].value))
        status = lib.dnnl_primitive_execute(prim, self.stream, 2, args)
        for m in mems:
            lib.dnnl_memory_destroy(m)
        lib.dnnl_primitive_destroy(prim)
        if status:
            raise RuntimeError(f"oneDNN reorder failed (status {status})")

    def pack(self, weight: np.ndarray) -> np.ndarray:
        """A row-major (N, K) int8 or bf16 (as uint16) weight in `packed_layout` (flat)."""
        N, K = weight.shape
        dtype = _NP_KINDS[weight.dtype.type]
        # where int8 products of a few rows run on VNNI, its layout: AMX's, then VNNI's extra
        layout = self.few_rows_layout(K, N, dtype) or self.packed_layout(K, N, dtype)
        size = self.lib.dnnl_memory_desc_get_size(layout) // weight.itemsize
        out = np.zeros(size, weight.dtype)  # its padding too: fingerprints read these bytes
        plain = self.md((K, N), dtype, (1, K))
        self.reorder(plain, np.ascontiguousarray(weight), layout, out)
        self.lib.dnnl_memory_desc_destroy(plain)
        by_n, by_k = self.offsets(K, N, dtype)  # checked: rows are read in place (`offsets`)
        some = np.unique(np.linspace(0, N - 1, 7).astype(np.int64))
        if not np.array_equal(out[by_n[some, None] + by_k], weight[some]):
            raise RuntimeError(f"oneDNN's packed layout for a {N}x{K} weight was misread")
        return out

    def offsets(self, K: int, N: int, dtype: int) -> tuple[np.ndarray, np.ndarray]:
        """Where a packed (N, K) weight keeps element (n, k) in its flat buffer: at
        `by_n[n] + by_k[k]`, so that single rows (an embedding's lookups, a truncated head's
        first rows) are read in place. A blocked layout (oneDNN's "blocking descriptor": strides
        between whole blocks, then nested inner blocks, each of one dimension) places an element
        at a sum of one term per dimension, read here from the layout's own description."""
        key = (K, N, dtype)
        if key not in self._offsets:
            strides, blks, idxs = self.blocking(self.packed_layout(K, N, dtype))
            nblks = len(blks)
            terms = []
            for dim, size in enumerate((K, N)):  # the layout's dims: (K, N)
                i = np.arange(size, dtype=np.int64)
                mine = [b for b in range(nblks) if idxs[b] == dim]
                whole = int(np.prod([blks[b] for b in mine], dtype=np.int64))
                term = (i // whole) * strides[dim]
                below = whole  # the span of this dim's blocks from block b inwards
                for b in mine:
                    below //= blks[b]
                    inner = int(np.prod(blks[b + 1 :], dtype=np.int64))  # elements per step
                    term += ((i % whole) // below % blks[b]) * inner
                terms.append(term)
            self._offsets[key] = (terms[1], terms[0])
        return self._offsets[key]

    def blocking(self, md: ctypes.c_void_p) -> tuple[list[int], list[int], list[int]]:
        """A blocked layout's description (oneDNN's "blocking descriptor"): the strides between
        whole blocks per dimension, and the nested inner blocks' sizes and dimensions."""
        dims = ctypes.POINTER(_Dims)

        def query(what: int, result: Any) -> Any:
            self.check(
                self.lib.dnnl_memory_desc_query(md, what, ctypes.byref(result)),
                "query of a weights layout",
            )
            return result

        nblks = query(_QUERY_INNER_NBLKS, ctypes.c_int32()).value
        strides = list(query(_QUERY_STRIDES, dims()).contents)
        blks = list(query(_QUERY_INNER_BLKS, dims()).contents)[:nblks]
        idxs = list(query(_QUERY_INNER_IDXS, dims()).contents)[:nblks]
        return strides, blks, idxs

    def unpack(self, packed: np.ndarray, N: int, K: int) -> np.ndarray:
        """`pack`'s inverse: the row-major (N, K) weight."""
        dtype = _NP_KINDS[packed.dtype.type]
        out = np.empty((N, K), packed.dtype)
        plain = self.md((K, N), dtype, (1, K))
        self.reorder(self.packed_layout(K, N, dtype), packed, plain, out)
        self.lib.dnnl_memory_desc_destroy(plain)
        return out

    def plan(
        self,
        K: int,
        N: int,
        dtype: int,
        bias: bool,
        rows: int = ROWS,
        threads: int = 0,
        packed: bool = False,
        impl: str | None = None,
        transposed: bool = False,
    ) -> _Plan:
        """The plan of a product (threads: 0 = `default_threads()`) whose weights are read in
        `packed_layout` (`packed`) or in MLX's row-major layout, by oneDNN's first choice of
        implementation or the one named (`impl`), as `x @ W.T` or as `W @ x.T` (`transposed`,
        row-major weights only)."""
        if threads <= 0:
            threads = default_threads()
        plans = getattr(self._local, "plans", None)
        if plans is None:
            plans = self._local.plans = {}
        key = (K, N, dtype, bias, rows, threads, packed, impl, transposed)
        p = plans.get(key)
        if p is None:
            layout = None
            if packed:
                few = impl == VNNI and self.few_rows_layout(K, N, dtype)
                layout = few or self.packed_layout(K, N, dtype)
            p = _Plan(self, K, N, dtype, bias, rows, threads, layout, impl, transposed)
            plans[key] = p
        return p


_dnnl: _OneDNN | None = None
_unavailable: str | None = None


def _open() -> _OneDNN | None:
    global _dnnl, _unavailable
    if _dnnl is not None or _unavailable is not None:
        return _dnnl
    if not sys.platform.startswith("linux"):
        _unavailable = "not Linux (MLX runs on the GPU)"
        return None
    path = _library()
    if path is None:
        _unavailable = f"oneDNN is not installed (pip install {DIST})"
        return None
    try:
        _dnnl = _OneDNN(path)
    except (OSError, RuntimeError, AttributeError) as e:
        _unavailable = f"oneDNN could not be loaded from {path}: {e}"
    return _dnnl


def default_threads() -> int:
    """OpenMP threads per product: `ONDEVICE_KERNEL_THREADS`, else the cores this process may
    use (see "Threads" above)."""
    return _asked_threads() or _usable_cores()


def _asked_threads() -> int | None:
    """The threads `ONDEVICE_KERNEL_THREADS` asks for every product (checked); None if unset."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    try:
        return max(1, int(raw)) if raw else None
    except ValueError:
        raise ValueError(f"{THREADS_ENV}={raw!r}: give a number of threads, e.g. 1 or 2.") from None


@functools.cache
def _usable_cores() -> int:
    """The cores this process may use (asked once: a pass makes about a hundred products)."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return max(1, len(usable) if usable else (os.cpu_count() or 1))


def _asked() -> str:
    """The kind `ONDEVICE_KERNEL` asks for (`DEFAULT` when unset), checked."""
    want = os.environ.get(ENV, DEFAULT).strip().lower() or DEFAULT
    if want not in CHOICES:
        raise ValueError(f"{ENV}={want!r}: choose one of {', '.join(CHOICES)}.")
    return want


def choice() -> str:
    """What serves the linear products on this machine: `bf16`, `f32` (oneDNN) or `mlx`."""
    want = _asked()
    if want == "mlx" or mx.default_device() != mx.cpu or _open() is None:
        return "mlx"
    if want == "auto":
        return "bf16" if cpu_has_bf16() else "f32"
    return want


def draft_choice() -> str:
    """What serves an MLX draft's products: by default (`auto`) int8 where the verifier gets bf16
    and the CPU has int8 dot products (see "int8" above); a kind named in `ONDEVICE_KERNEL`
    serves both models."""
    kind = choice()
    return "int8" if _asked() == "auto" and kind == "bf16" and cpu_has_int8() else kind


def decode_impl() -> str | None:
    """The oneDNN implementation bf16 products of decoding passes ask for where it is not the
    one prompts get (see "Prompts apart" above): AVX512-BF16's where `ONDEVICE_KERNEL_DECODE=
    avx512` asks and the CPU has AMX too; None (oneDNN's first choice, as for prompts) by
    default and wherever AVX512-BF16 is that choice anyway."""
    want = os.environ.get(DECODE_ENV, "prompt").strip().lower() or "prompt"
    if want not in DECODE_CHOICES:
        raise ValueError(f"{DECODE_ENV}={want!r}: choose one of {', '.join(DECODE_CHOICES)}.")
    return None if want == "prompt" else one_row_impl()


def one_row_impl() -> str | None:
    """The oneDNN implementation that reads bf16 weights fastest in passes of one to a few rows
    where it is not the one every pass gets: AVX512-BF16's on a CPU with AMX too (see "Prompts
    apart" above: 140 ms against 185 for the 1.5B verifier's one-token pass); None elsewhere."""
    return AVX512_BF16 if {"amx_bf16", "avx512_bf16"} <= _cpu_flags() else None


def transposes() -> bool:
    """Whether a bf16 product with at least as many outputs as inputs takes its passes of up to
    `ROWS` rows as `W @ x.T` (see "AMX at a few rows" above): where oneDNN's bf16 products run
    on AMX (the CPU has it) and decoding passes are not asked elsewhere (`decode_impl`)."""
    return "amx_bf16" in _cpu_flags() and decode_impl() is None


def prompts_apart(model: nn.Module) -> bool:
    """Whether this served model computes prompt passes with other instructions than decoding
    passes, so that a prompt's rows are not bitwise a decoded sequence's (see "Prompts apart"
    above; the prompt cache then keeps only rows a prompt pass wrote)."""
    return any(
        isinstance(m, KernelLinear) and m.decode_impl is not None and m._dtype == _BF16
        for _, m in model.named_modules()
    )


def status() -> dict[str, Any]:
    """For `ondevice doctor`: which kernel serves the verifier's linear products (and an MLX
    draft's: `draft`), and why."""
    kind = choice()
    out: dict[str, Any] = {"kernel": kind, "env": os.environ.get(ENV)}
    if kind == "mlx":
        if _asked() == "mlx":
            out["reason"] = f"{ENV}=mlx"
        elif mx.default_device() != mx.cpu:
            out["reason"] = "MLX runs on the GPU"
        else:
            out["reason"] = str(_unavailable)
    else:
        out["library"] = str(_library())
        out["bf16_dot_products"] = cpu_has_bf16()
        out["int8_dot_products"] = cpu_has_int8()
        out["draft"] = draft_choice()
        if kind == "bf16" and decode_impl() is not None:  # see "Prompts apart" above
            out["decode"], out["prompts"] = "AVX512-BF16", "AMX"
        few = []
        if kind == "bf16" and transposes():  # see "AMX at a few rows" above
            few.append("AMX, the weight as the left operand where N >= K")
        if "int8" in (kind, out["draft"]) and {"amx_int8", "avx512_vnni"} <= _cpu_flags():
            few.append(f"int8 at up to {FEW_ROWS} rows on AVX512-VNNI")  # "int8 at a few rows"
        if few:
            out["few_rows"] = "; ".join(few)
    return out


def available() -> bool:
    """Whether oneDNN can serve this machine's products (whether or not ONDEVICE_KERNEL asks)."""
    return mx.default_device() == mx.cpu and _open() is not None


def _np(x: mx.array | np.ndarray) -> np.ndarray:
    """`x` as float32 numpy: an MLX array is evaluated and its buffer read in place."""
    if isinstance(x, mx.array) and x.dtype != mx.float32:
        x = x.astype(mx.float32)
    return np.asarray(x, np.float32)


def _like(x: mx.array | np.ndarray, out: np.ndarray) -> mx.array | np.ndarray:
    """A served module's result in its input's kind: numpy on the numpy glue (see "Glue"
    above), else an (evaluated) MLX array in the input's dtype."""
    if isinstance(x, np.ndarray):
        return out
    y = mx.array(out)
    return y if x.dtype == mx.float32 else y.astype(x.dtype)


def _widen_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) as float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class KernelNorm(nn.Module):
    """`nn.RMSNorm` in numpy, row by row (so a row's values do not depend on the pass size);
    the weight stays the model's parameter."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self._w = np.array(norm.weight.astype(mx.float32))

    def __call__(self, x: mx.array | np.ndarray) -> mx.array | np.ndarray:
        a = _np(x)
        # np.mean's sum and division without its Python wrapper (the same float32 values)
        ms = np.add.reduce(np.square(a), axis=-1, keepdims=True)
        ms /= a.shape[-1]
        ms += np.float32(self.eps)
        out = a / np.sqrt(ms, out=ms)
        out *= self._w
        return _like(x, out)


class KernelRoPE(nn.Module):
    """`transformer.RoPE` in numpy: each position's cosines and sines come from a table
    computed once (in float64, rounded to float32) and grown as positions need, so a token's
    rotation depends on its position only."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.traditional = rope.traditional
        # the angle of pair i at position p: p * scale / wavelength_i (`rope_wavelengths`)
        self._step = float(rope._scale) / np.asarray(rope._freqs, np.float64)
        self._cos = self._sin = np.zeros((0, self._step.size), np.float32)
        self._last: tuple[Any, ...] = ((-1, 0), None)  # ((offset, L), positions, cos, sin)

    def _table(self, n: int) -> None:
        if n > len(self._cos):
            angles = np.arange(max(n, 2 * len(self._cos), 512), dtype=np.float64)[:, None]
            angles = angles * self._step
            self._cos, self._sin = (
                np.cos(angles).astype(np.float32),
                np.sin(angles).astype(np.float32),
            )

    def __call__(
        self, x: mx.array | np.ndarray, offset: int, positions: mx.array | None
    ) -> mx.array | np.ndarray:
        a = _np(x)  # (B, heads, L, D)
        L, half = a.shape[2], a.shape[3] // 2
        # every layer's q and k of a pass rotate by the same positions: looked up once a pass
        span = (offset, L)
        if self._last[0] != span or self._last[1] is not positions:
            if positions is None:
                pos = np.arange(offset, offset + L)[None]
            else:  # (L,) or (B, L)
                pos = np.asarray(positions).astype(np.int64).reshape(-1, L)
            self._table(int(pos.max()) + 1)
            # (B or 1, 1, L, half)
            self._last = (span, positions, self._cos[pos][:, None], self._sin[pos][:, None])
        cos, sin = self._last[2:]
        out = np.empty(a.shape, np.float32)
        if self.traditional:  # rotated pairs (x0, x1), (x2, x3), ...
            x1, x2, o1, o2 = a[..., 0::2], a[..., 1::2], out[..., 0::2], out[..., 1::2]
        else:  # x[i] with x[i + D/2]
            x1, x2 = a[..., :half], a[..., half:]
            o1, o2 = out[..., :half], out[..., half:]
        np.subtract(x1 * cos, x2 * sin, out=o1)
        np.add(x2 * cos, x1 * sin, out=o2)
        return _like(x, out)


def attention(
    q: mx.array | np.ndarray,
    k: mx.array | np.ndarray,
    v: mx.array | np.ndarray,
    *,
    scale: float,
    mask: mx.array | str | None = None,
) -> mx.array | np.ndarray:
    """`mx.fast.scaled_dot_product_attention` with rows that do not depend on the pass size.

    q: (B, heads, L, D); k, v: (B, kv_heads, S, D), the last L keys being the pass's own;
    mask: None, "causal" or an additive (or boolean) mask broadcastable to (B, heads, L, S).
    Returns (B, heads, L, D) as numpy where q is numpy (the served model's glue, `KernelNorm`),
    else as MLX.

    A BLAS product's rows depend on its shape (a BLAS picks another path for another M, K or
    N), and a row of attention is a product over every key so far. Here each product has one
    shape whatever the pass: one token's query heads (GQA: the heads sharing a key head) against
    one block of `KEY_BLOCK` keys, the last block padded and masked. The softmax's maximum is
    exact in any order; its sum and the values' weighted sum are taken per block and then over
    the blocks one after another, and a block past a row's last key adds exact zeros. So a row
    costs what it costs alone, and a pass over L tokens does L rows' work, not a padded pass's
    (a prompt's rows are taken a run of rows per key block, each over the blocks it reaches).

    All in numpy, on the calling thread: numpy's matmul makes one BLAS call per (token, block)
    matrix of a stack, as MLX's batched product did, and its `exp` is vectorised where MLX's CPU
    `exp` is scalar on x86 (about 11 ns an element here, numpy's 0.4), while each MLX evaluation
    hands the work to MLX's stream thread and waits for it (see "Glue" above). numpy's `exp`
    runs one vectorised loop over the contiguous scores, so an element's value does not depend
    on where in the array it sits.

    A token tree's pass: a node's own keys (its ancestors among the pass's tokens) are not the
    pass's first ones once the tree branches, and a block's sums over keys with masked ones
    between them are not the sums a pass that fed only the node's path takes over the same keys
    side by side (the additions associate differently: 0.04 apart in the 1.5B's logits, enough
    to flip a near-tied greedy token). Such rows' last blocks are taken again with their visible
    keys moved up behind the cached ones (`_path_layout`), as that pass lays them out.
    """
    qn, kn, vn = _np(q), _np(k), _np(v)
    B, H, L, D = qn.shape
    kv_heads, S, Dv = kn.shape[1], kn.shape[2], vn.shape[3]
    rep, blk = H // kv_heads, KEY_BLOCK
    nb = -(-S // blk)
    if isinstance(mask, str) and L > 1 and (S - L) // blk < nb - 1:
        # A prompt's rows span several key blocks: rows whose last key lies in block b need
        # no later block (it would add exact zeros), so each such run of rows is taken over
        # its own blocks only (a 400-token prompt computed 4 blocks a row where it needs 2.5).
        parts = []
        for b in range((S - L) // blk, nb):
            lo, hi = max(0, b * blk - (S - L)), min(L, (b + 1) * blk - (S - L))
            end = S - L + hi  # the run's last key
            parts.append(
                attention(qn[:, :, lo:hi], kn[:, :, :end], vn[:, :, :end], scale=scale, mask=mask)
            )
        return _like(q, np.concatenate(parts, axis=2))
    kp, vp = _key_blocks(kn, nb * blk), _key_blocks(vn, nb * blk)
    # (B, kv_heads, L, 1, rep, D) @ (B, kv_heads, 1, nb, D, blk): one (rep, D) x (D, blk)
    # product per token and block
    qs = (qn * np.float32(scale)).reshape(B, kv_heads, rep, L, D).transpose(0, 1, 3, 2, 4)
    qs = np.ascontiguousarray(qs)  # every (rep, D) matrix alike, whatever L
    s = qs[:, :, :, None] @ kp.reshape(B, kv_heads, 1, nb, blk, D).swapaxes(-1, -2)
    # s: (B, kv_heads, L, nb, rep, blk), a fresh contiguous array: changed in place below
    if isinstance(mask, str) and L > 1:
        # the padding, and the keys after each query's own (position S - L + l)
        keys = np.arange(nb * blk).reshape(nb, 1, blk)
        last = (S - L + np.arange(L)).reshape(L, 1, 1, 1)
        s += np.where(keys <= last, np.float32(0), np.float32(-np.inf))
    else:  # the padding only (a query's own key is the last): the same scores, one write
        s[..., nb - 1, :, S - (nb - 1) * blk :] = -np.inf
    if mask is not None and not isinstance(mask, str):
        m = np.asarray(mask)
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        if m.dtype == np.bool_:
            m = np.where(m, np.float32(0), np.float32(-np.inf))
        m = np.pad(m.astype(np.float32), [(0, 0)] * 3 + [(0, nb * blk - S)])  # `keys` masks it
        if m.shape[1] == H:  # per head: (B, kv_heads, rep, L, nb, blk) -> s's layout
            m = m.reshape(m.shape[0], kv_heads, rep, L, nb, blk).transpose(0, 1, 3, 4, 2, 5)
        else:
            m = m.reshape(m.shape[0], 1, L, nb, 1, blk)
        s += m
    s -= s.max(axis=(3, 5), keepdims=True)
    np.exp(s, out=s)
    sums = s.sum(axis=-1)  # (B, kv_heads, L, nb, rep): one block's keys each
    outs = s @ vp.reshape(B, kv_heads, 1, nb, blk, Dv)  # (B, kv_heads, L, nb, rep, Dv)
    if mask is not None and not isinstance(mask, str) and L > 1:
        _path_layout(mask, s, vp, sums, outs, S)
    total, out = sums[:, :, :, 0].copy(), outs[:, :, :, 0].copy()
    for b in range(1, nb):  # the blocks in order: a row's sums do not depend on nb
        total += sums[:, :, :, b]
        out += outs[:, :, :, b]
    out /= total[..., None]
    return _like(q, out.transpose(0, 1, 3, 2, 4).reshape(B, H, L, Dv))


def _key_blocks(a: np.ndarray, rows: int) -> np.ndarray:
    """Keys or values `a` (B, kv_heads, S, D) with zero rows after them up to `rows` (whole key
    blocks): read in place where `a` is the start of a float32 buffer whose next rows are
    already zeros (a KV cache's: models/cache.py keeps the rows past its offset zero), else a
    padded copy. The same numbers either way, and so the same products: each (key block, D)
    matrix has the same strides in both."""
    S, base = a.shape[2], a.base
    if (
        isinstance(base, np.ndarray)
        and base.dtype == np.float32
        and base.ndim == 4
        and base.shape[:2] == a.shape[:2]
        and base.shape[3] == a.shape[3]
        and base.shape[2] >= rows
        and base.strides == a.strides
        and base.ctypes.data == a.ctypes.data
        and not base[:, :, S:rows].any()
    ):
        return base[:, :, :rows]
    out = np.zeros((*a.shape[:2], rows, a.shape[3]), np.float32)
    out[:, :, :S] = a
    return out


_PATHS: list[Any] = [None, 0, 0, None]  # (a pass's mask, S, L, `_paths` of them): its layers


def _paths(mask: Any, S: int, L: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per batch row of `mask` (additive or boolean, broadcastable to (B, 1, L, S)): the rows
    whose visible keys among the pass's own L are not its first ones, and for each the key
    slots of its last blocks as a pass over its path alone lays them out (the cached keys from
    the block holding the first of the pass's own, then its visible own keys) with which of
    them are real: (rows (R,), slots (R, T), real (R, T)). Empty where no row is such (a causal
    pass, a chain, plain steps). Computed once per pass (every layer gets the same mask)."""
    if _PATHS[0] is mask and _PATHS[1:3] == [S, L]:
        return _PATHS[3]
    m = np.asarray(mask)
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    visible = m[..., S - L :] == 0 if m.dtype != np.bool_ else m[..., S - L :]
    if visible.shape[1] != 1:  # a mask per head: no tree pass makes one
        visible = visible.all(axis=1, keepdims=True) if (visible == visible[:, :1]).all() else None
    out = []
    for vis in [] if visible is None else visible[:, 0]:  # (L, L) per batch row
        first = np.cumsum(vis, axis=1) == np.arange(1, L + 1)  # visible keys 0..j all visible
        scattered = np.nonzero(vis.sum(1) != (first & vis).sum(1))[0]
        if not len(scattered):
            out.append((scattered, np.zeros((0, 0), np.int64), np.zeros((0, 0), bool)))
            continue
        base = S - L
        start = base // KEY_BLOCK * KEY_BLOCK
        own = [np.nonzero(vis[r])[0] for r in scattered]
        T = -(-(base - start + max(len(o) for o in own)) // KEY_BLOCK) * KEY_BLOCK
        slots = np.zeros((len(scattered), T), np.int64)
        real = np.zeros((len(scattered), T), bool)
        for i, o in enumerate(own):
            keys = np.concatenate([np.arange(start, base), base + o])
            slots[i, : len(keys)], real[i, : len(keys)] = keys, True
        out.append((scattered, slots, real))
    _PATHS[:] = [mask, S, L, out]
    return out


def _path_layout(
    mask: Any, p: np.ndarray, vp: np.ndarray, sums: np.ndarray, outs: np.ndarray, S: int
) -> None:
    """`attention`'s per-block sums and weighted values of a tree pass's branched rows (see
    `_paths`), taken again in place over their keys as a pass over their path lays them out:
    the blocks before the pass's own keys are the same in both; from the block holding the
    first of them on, each such row gets its keys gathered side by side (the weights `p` are
    elementwise, so gathering them is exact), summed and multiplied in blocks of the same shape
    as that pass's, and exact zeros for the blocks its path does not reach."""
    B, kv_heads, L, nb, rep, blk = p.shape
    b0 = (S - L) // blk
    paths = _paths(mask, S, L)
    for b in range(B if paths else 0):
        rows, slots, real = paths[b if len(paths) > 1 else 0]  # a mask may serve every row
        if not len(rows):
            continue
        R, T = slots.shape
        nt = T // blk
        # the weights of these rows, keys last: (kv_heads, R, rep, nb * blk)
        w = p[b][:, rows].transpose(0, 1, 3, 2, 4).reshape(kv_heads, R, rep, nb * blk)
        w = np.take_along_axis(w, slots[None, :, None, :], axis=-1)  # (kv_heads, R, rep, T)
        w *= real[None, :, None, :]
        blocks = np.ascontiguousarray(w.reshape(kv_heads, R, rep, nt, blk).transpose(0, 1, 3, 2, 4))
        vals = vp[b][:, slots]  # (kv_heads, R, T, Dv)
        vals[:, ~real] = 0
        Dv = vals.shape[-1]
        sums[b][:, rows, b0 : b0 + nt] = blocks.sum(axis=-1)
        sums[b][:, rows, b0 + nt :] = 0
        outs[b][:, rows, b0 : b0 + nt] = blocks @ vals.reshape(kv_heads, R, nt, blk, Dv)
        outs[b][:, rows, b0 + nt :] = 0


def silu_gate(gate: mx.array, up: mx.array) -> mx.array:
    """`transformer.silu_gate` in numpy, on the products' evaluated outputs (`KernelPart`):
    MLX's CPU sigmoid took 3.2 ms a layer over 16 tokens of the 1.5B verifier (8,960 wide) on
    the AMD VMs here, and numpy needs no MLX op (none wakes MLX's stream thread). Elementwise,
    so a row's values do not depend on the pass size."""
    g, u = _np(gate), _np(up)
    shape = g.shape
    g, u = g.reshape(-1, shape[-1]), u.reshape(-1, shape[-1])
    out = np.empty(g.shape, np.float32)
    e = np.empty((min(len(g), SLAB), g.shape[1]), np.float32)
    with np.errstate(over="ignore"):  # exp(-g) = inf: silu(g) = -0.0, as it should
        for i in range(0, len(g), SLAB):  # a prompt's rows a slab at a time: see `SLAB`
            gi, ei, oi = g[i : i + SLAB], e[: len(g) - i], out[i : i + SLAB]
            np.negative(gi, out=ei)
            np.exp(ei, out=ei)
            ei += 1
            np.multiply(gi, u[i : i + SLAB], out=oi)
            oi /= ei
    return _like(gate, out.reshape(shape))


class KernelLinear(nn.Module):
    """`y = x @ W.T (+ b)` by oneDNN; W kept in the kernel's dtype (bf16, int8 or float32).

    bf16/float32: `weight` stays an MLX array of shape (N, K), like nn.Linear's, so the module
    tree still holds the model's parameters; the kernel reads its buffer in place. A layer's
    bf16 weight is then reordered once into oneDNN's blocked layout (`pack`, a flat buffer):
    read row-major, oneDNN reorders blocks on every call, which halved bf16 products' speed on
    the AMD Zen VMs here (docs/benchmarks.md, "Issue 26, session 6").

    int8 (see "int8" above): `weight` is the int8 matrix reordered once into oneDNN's blocked
    layout (`_OneDNN.pack`, a flat buffer) and `scales` its rows' scales; each input row is
    rounded to int8 with its own scale, the product accumulates in int32 (exact, so any
    blocking gives the same sums) and the result is scaled back. `dense()` gives the float32
    (N, K) matrix it computes with.
    """

    threads = 0  # OpenMP threads per product (0: by its size, `_threads`)
    decode_impl: str | None = None  # a bf16 product's in decoding passes (`decode_impl()`)
    transposed = False  # passes of up to ROWS rows as `W @ x.T` (see "AMX at a few rows")

    def __init__(self, weight: mx.array, bias: mx.array | None, kind: str):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if bias is not None:
            self.bias = bias.astype(mx.float32)
        if kind == "int8":
            self.to_int8(weight)
            return
        self._dtype = _BF16 if kind == "bf16" else _F32
        self._packed = False
        self.weight = weight.astype(mx.bfloat16 if kind == "bf16" else mx.float32)
        self._pointers()

    def _pointers(self) -> None:
        mx.eval(self.parameters())
        bf16 = self._dtype == _BF16
        self._np_weight = np.asarray(self.weight.view(mx.uint16) if bf16 else self.weight)
        self._np_bias = np.asarray(self.bias) if "bias" in self else None
        self._np_scales = np.asarray(self.scales) if self._dtype == _S8 else None
        self._weight_ptr = self._np_weight.ctypes.data
        self._bias_ptr = self._np_bias.ctypes.data if self._np_bias is not None else None

    def to_int8(self, weight: mx.array | None = None) -> None:
        """Become an int8 product (in place: joint products' parts keep pointing here), from
        `weight` or from this product's own bf16/float32 weight."""
        w = (self.weight if weight is None else weight).astype(mx.float32)
        q, scale = _quantize_rows(np.asarray(w))
        del w
        self.scales = mx.array(scale.reshape(-1))
        self.weight = mx.array(_dnnl.pack(q))  # type: ignore[union-attr]
        self._dtype, self._packed = _S8, True
        self._pointers()

    def pack(self) -> None:
        """Keep a bf16 weight in oneDNN's blocked layout (in place, as `to_int8`); the weight
        becomes a flat bf16 buffer, which `dense()` reads back. Not a transposed product's,
        which reads the weight row-major (see "AMX at a few rows" above)."""
        if self._dtype != _BF16 or self._packed or self.transposed:
            return
        self.weight = mx.array(_dnnl.pack(self._np_weight)).view(mx.bfloat16)  # type: ignore[union-attr]
        self._packed = True
        self._pointers()

    def rows(self, ids: mx.array | np.ndarray) -> mx.array:
        """A bf16 or float32 weight's rows `ids` (any shape of token ids) as stored, read in
        place whether packed or not (an embedding's lookups, a head's first rows)."""
        assert self._dtype != _S8, "an int8 weight's rows are its int8 values"
        if not self._packed:
            return self.weight[ids if isinstance(ids, mx.array) else mx.array(ids)]
        return mx.array(self._stored_rows(np.asarray(ids))).view(mx.bfloat16)

    def _stored_rows(self, ids: np.ndarray) -> np.ndarray:
        """The rows `ids` as numpy, as stored (bf16: uint16 bit patterns), packed or not."""
        if not self._packed:
            return self._np_weight[ids]
        by_n, by_k = _dnnl.offsets(self.in_features, self.out_features, self._dtype)  # type: ignore[union-attr]
        return self._np_weight[by_n[ids][..., None] + by_k]

    def top(self, N: int, kind: str) -> KernelLinear:
        """A product of `kind` over this one's first N rows (and bias), on as many threads."""
        bias = self.bias[:N] if "bias" in self else None
        out = KernelLinear(self.rows(np.arange(N)), bias, kind)
        out.threads, out.decode_impl = self.threads, self.decode_impl
        return out

    def dense(self) -> mx.array:
        """The float32 (N, K) matrix the product computes with (exactly)."""
        if not self._packed:
            return self.weight.astype(mx.float32)
        q = _dnnl.unpack(self._np_weight, self.out_features, self.in_features)  # type: ignore[union-attr]
        if self._dtype == _BF16:
            return mx.array(q).view(mx.bfloat16).astype(mx.float32)
        return mx.array(q).astype(mx.float32) * self.scales[:, None]

    def __call__(self, x: mx.array) -> mx.array:
        return self.first_rows(x, self.out_features)

    def first_rows(self, x: mx.array, N: int) -> mx.array:
        """The outputs of W's first N rows only (a truncated-vocabulary head): a row-major
        (N, K) matrix's first rows are a prefix of its buffer; a packed one's are read in
        place where its layout keeps them as one (`prefix`), else copied once into a product
        of their own (a Medusa head's vocabulary subset)."""
        small = self.get("int8_rows")  # an int8 draft's head (`_draft_head`)
        if small is not None and N == small.out_features:
            return small(x)
        if self._packed and self._dtype == _BF16 and N < self.out_features:
            first = getattr(self, "_first", None)  # not a parameter (underscored)
            if first is None or first.out_features != N:
                first = self.prefix(N)
                if first is None:
                    first = self.top(N, "bf16")
                    first.pack()
                self._first = first
            return first(x)
        return _like(x, np.array(self.product(x, N)))  # a copy: the plan's buffer is reused

    def prefix(self, N: int) -> KernelLinear | None:
        """A product over this packed one's first N outputs that reads them in place: oneDNN's
        blocked layouts here keep whole blocks of outputs one after another, so the first N
        rows of an (N0, K) weight, N a multiple of the block, are laid out exactly as a packed
        (N, K) weight (checked on the layouts' own descriptions, `_OneDNN.offsets`); None
        where they are not (then `top` copies them)."""
        assert self._packed and N <= self.out_features
        K = self.in_features
        by_n, by_k = _dnnl.offsets(K, self.out_features, self._dtype)  # type: ignore[union-attr]
        mine_n, mine_k = _dnnl.offsets(K, N, self._dtype)  # type: ignore[union-attr]
        size = _dnnl.lib.dnnl_memory_desc_get_size(_dnnl.packed_layout(K, N, self._dtype))  # type: ignore[union-attr]
        if not (
            np.array_equal(by_k, mine_k)
            and np.array_equal(by_n[:N], mine_n)
            and size <= self._np_weight.nbytes
        ):
            return None
        return self.first_outputs(N)

    def first_outputs(self, N: int) -> KernelLinear:
        """A product over this one's first N outputs that reads its buffer in place: a
        row-major weight's first rows are a prefix of it (a packed one's where `prefix`
        says)."""
        out = _as_product(self)
        out.out_features = N
        if self._np_bias is not None:
            out.bias = self.bias[:N]
            out._pointers()
        out.pop("int8_rows", None)
        out.__dict__.pop("_first", None)
        return out

    def product(self, x: mx.array | np.ndarray, N: int) -> np.ndarray:
        """The product of `x` (..., K) with W's first N rows as numpy (..., N), possibly a view
        of the plan's buffer (valid until this thread's next product of that shape).

        The glue is numpy's, not MLX's: an evaluated input (an earlier product's output, the
        MLP's gating) is read in place without waking MLX's stream thread, and the rounding of
        the input rows (bf16: to nearest even, int8: `_quantize_rows`) costs no MLX ops.

        A pass's product of M rows that one plan served whole, checked, runs that plan again
        without looking it up (`_ready`): between two products, each of which streams tens of
        megabytes of weights through the caches, every line of Python and numpy the glue
        touches comes from memory again, so what runs there is kept short (docs/benchmarks.md,
        "Issue 26, session 23")."""
        K = self.in_features
        lead = x.shape[:-1]
        src = _np(x).reshape(-1, K)
        scale = None
        assert N == self.out_features or not self._packed, "packed rows are not a prefix"
        if self._dtype == _BF16:
            src = _round_bf16(src)
        elif self._dtype == _S8:
            src, scale = _int8_levels(src)  # the plan's buffer takes them as int8
        M = src.shape[0]
        # int8: the bias is added after scaling (oneDNN would add it to the integer sums)
        fused_bias = self._np_bias is not None and scale is None
        bias_ptr = self._bias_ptr if fused_bias else None
        # see "Prompts apart" above
        impl = self.decode_impl if self._dtype == _BF16 and not in_prompt() else None
        # everything the choice of plan depends on (a shallow copy of this module shares the
        # dictionary: a copy that differs in any of these has keys of its own)
        key = (M, N, self._dtype, self._packed, self.transposed, self.threads, impl, fused_bias)
        ready = self.__dict__.setdefault("_ready", {}).get((key, threading.get_ident()))
        if ready is not None and ready.invariant:  # (a test may make a plan be checked again)
            ready.feed(src)
            ready.run(self._weight_ptr, bias_ptr)
            full = ready.result(M)
        else:
            full = self._chunks(src, N, impl, fused_bias, key)
        if scale is not None:  # the int32 sums scaled back (in numpy, as the rounding), in
            full *= self._np_scales  # place: a draft's 65,536-id head allocated 256 KB twice
            full *= scale
            if self._np_bias is not None:
                full += self._np_bias
        return full.reshape(*lead, N)

    def _chunks(
        self, src: np.ndarray, N: int, impl: str | None, fused_bias: bool, key: tuple[Any, ...]
    ) -> np.ndarray:
        """`product`'s rows `src` (M, K), already rounded, through the plans that suit them: in
        chunks of PREFILL_ROWS (a decoding pass computed apart from prompts: of ROWS, as its
        own passes), the last one at the smallest plan that holds it (`CHUNKS`), each plan used
        only where it gives every row what the ROWS plan gives (`_invariant`); up to ROWS rows
        transposed where this product is (see "AMX at a few rows" above). A plan that served
        all M rows at once, the first choice, is kept for the next such product (`_ready`)."""
        K, M = self.in_features, src.shape[0]
        bias_ptr = self._bias_ptr if fused_bias else None
        plan_of = functools.partial(
            _dnnl.plan,  # type: ignore[union-attr]
            K,
            N,
            self._dtype,
            fused_bias,
            threads=self._threads(),
            packed=self._packed,
            impl=impl,
        )
        transposed = self.transposed and impl is None
        # int8 at up to FEW_ROWS rows: VNNI's kernel where the buffer holds its layout too
        few = self._dtype == _S8 and _dnnl.few_rows_layout(K, N, _S8) is not None  # type: ignore[union-attr]
        full = None
        i = 0
        while i < M:
            n = min(M - i, ROWS if impl is not None else PREFILL_ROWS)
            if few and n <= FEW_ROWS:
                plan = plan_of(n, impl=VNNI)
            elif n <= ROWS:
                plan = plan_of(n, transposed=transposed)
            else:
                plan = plan_of(next(c for c in CHUNKS if c >= n))
            if plan.invariant is None:
                plan.invariant = self._invariant(plan, src[i : i + n], bias_ptr, impl)
            first = plan.invariant
            if not first:
                n = min(n, ROWS)
                plan = plan_of(ROWS)
            plan.feed(src[i : i + n])
            plan.run(self._weight_ptr, bias_ptr)
            if n == M:
                if first:  # (a plan found wrong is asked again: a test may mend it)
                    self.__dict__["_ready"][(key, threading.get_ident())] = plan
                return plan.result(M)  # a view: valid until this thread's next such product
            if full is None:
                full = np.empty((M, N), np.float32)
            full[i : i + n] = plan.result(n)
            i += n
        assert full is not None
        return full

    def _threads(self) -> int:
        """OpenMP threads for this product's plans: `threads` where set, else what
        ONDEVICE_KERNEL_THREADS asks, else one for a weight smaller than `ONE_THREAD_BYTES` and
        every usable core for a larger one (see "Threads" above)."""
        asked = self.threads or _asked_threads()
        if asked:
            return asked
        return 1 if self._np_weight.nbytes < ONE_THREAD_BYTES else _usable_cores()

    def _invariant(
        self, plan: _Plan, src: np.ndarray, bias_ptr: int | None, impl: str | None
    ) -> bool:
        """Whether `plan` gives `src`'s rows (as many as the plan's or fewer) exactly what the
        product at `ROWS` rows by `impl` (the pass's: oneDNN's first choice, or `decode_impl`)
        gives them, `ROWS` at a time (see "Batch invariance" above): a kernel whose sums ran in
        another order at another M would differ in some of the N outputs' last bits."""
        K, N, dtype, bias, packed, own = plan.key
        if plan.rows == ROWS and not plan.transposed and own == impl:
            return True
        if plan.impl.startswith("ref"):  # oneDNN's reference loops: correct, but far slower
            return False
        M = src.shape[0]
        padded = _dnnl.plan(K, N, dtype, bias, ROWS, plan.threads, packed, impl)  # type: ignore[union-attr]
        want = np.empty((M, N), np.float32)
        for i in range(0, M, ROWS):
            n = min(ROWS, M - i)
            padded.feed(src[i : i + n])
            padded.run(self._weight_ptr, bias_ptr)
            want[i : i + n] = padded.result(n)
        plan.feed(src)
        plan.run(self._weight_ptr, bias_ptr)
        return bool(np.array_equal(plan.result(M), want))


def _round_bf16(rows: np.ndarray) -> np.ndarray:
    """float32 rows (M, K) rounded to bfloat16 (to nearest, ties to even), as uint16 bit
    patterns: each value plus 0x7FFF and its 17th bit, whose upper half is the rounded value,
    `SLAB` rows at a time. A decoding pass's rows (at most `SLAB`) come back as a view of those
    32-bit sums, uncopied (a product's input buffer copies them)."""
    u = np.ascontiguousarray(rows).view(np.uint32)  # no copy where already contiguous
    t = np.empty((min(len(u), SLAB), u.shape[1]), np.uint32)
    few = len(u) <= SLAB
    out = t.view(np.uint16)[:, _UPPER::2] if few else np.empty(u.shape, np.uint16)
    for i in range(0, len(u), SLAB):
        ui = u[i : i + SLAB]
        ti = t[: len(ui)]
        np.right_shift(ui, 16, out=ti)
        ti &= 1
        ti += ui
        ti += 0x7FFF
        if not few:
            out[i : i + SLAB] = ti.view(np.uint16)[:, _UPPER::2]
    return out


# the upper 16 bits of a uint32 viewed as two uint16s (`_round_bf16`)
_UPPER = 1 if sys.byteorder == "little" else 0


def _quantize_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of a (M, K) float32 matrix as int8 with its own scale (shape (M, 1)), its largest
    magnitude mapping to 127: a weight's rows at load (`_int8_levels` as int8)."""
    levels, scale = _int8_levels(rows)
    return levels.astype(np.int8), scale


def _int8_levels(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_quantize_rows`'s int8 values still as float32 (whole numbers in [-127, 127], which a
    plan's int8 input buffer takes exactly) and the scales: a pass's input rows at run time,
    row by row (a row's values do not depend on the other rows of the pass), in place where
    numpy allows (six calls a product, a draft's step makes about a hundred)."""
    scale = np.abs(rows).max(axis=1, keepdims=True)
    np.maximum(scale, np.float32(1e-30), out=scale)
    scale /= np.float32(127)
    levels = rows / scale
    return np.rint(levels, out=levels), scale


class KernelPart(nn.Module):
    """One of several products of the same input (q/k/v, gate/up), computed as one product over
    the rows of all their weights: a pass makes 4 products per layer instead of 7. The first
    part holds the joint `KernelLinear` (so the parameters stay in the module tree); the first
    call with an input computes it, the others with the same input slice the result."""

    def __init__(self, joint: KernelLinear, lo: int, hi: int, owner: bool):
        super().__init__()
        if owner:
            self.joint = joint
        self._joint, self._lo, self._hi = joint, lo, hi

    def __call__(self, x: mx.array) -> mx.array:
        j = self._joint
        last = j.__dict__  # not the module's tree (nn.Module's __setattr__ costs a call here)
        if last.get("_last_x") is not x:  # a copy: the plan's buffer is reused
            last["_last_x"], last["_last_y"] = x, np.array(j.product(x, j.out_features))
        return _like(x, last["_last_y"][..., self._lo : self._hi])  # evaluated: no MLX op


class KernelEmbedding(KernelLinear):
    """The embedding in the kernel's dtype: MLX looks tokens up in it and widens the rows to
    float32 (exact), and where the head is tied to it the kernel computes the logits over the
    same buffer (`as_linear`), so a tied matrix is kept once. An untied bf16 embedding takes
    half the memory of a float32 one; plain and speculative decoding look up the same rows."""

    numpy_rows = False  # lookups as numpy rows: set where the model runs on the numpy glue

    def __init__(self, weight: mx.array, kind: str):
        super().__init__(weight, None, kind)

    def __call__(self, tokens: mx.array) -> mx.array | np.ndarray:
        if not self.numpy_rows:
            return self.rows(tokens).astype(mx.float32)
        rows = self._stored_rows(np.asarray(tokens))
        return _widen_bf16(rows) if self._dtype == _BF16 else rows.astype(np.float32)

    def as_linear(self, x: mx.array) -> mx.array:
        return KernelLinear.__call__(self, x)


def _join(module: nn.Module, names: tuple[str, ...], kind: str) -> None:
    """Replace the linears `names` of `module` (same input) by `KernelPart`s of one product."""
    parts = [module[n] for n in names]
    sizes = [p.weight.shape[0] for p in parts]
    weight = mx.concatenate([p.weight for p in parts])
    bias = None
    if any("bias" in p for p in parts):  # a missing bias adds zeros: exact
        bias = mx.concatenate([p.get("bias", mx.zeros((n,))) for p, n in zip(parts, sizes)])
    del parts
    for n in names:
        del module[n]
    joint = KernelLinear(weight, bias, kind)
    del weight, bias
    lo = 0
    for i, (n, size) in enumerate(zip(names, sizes)):
        module[n] = KernelPart(joint, lo, lo + size, owner=i == 0)
        lo += size


def plain_parameters(model: nn.Module) -> dict[str, mx.array]:
    """A model's parameters under `nn.Linear`'s names: for tools that read the model's own
    layout (mlx-lm, `--peers mlx-lm`). A served model's joint products are split back into their
    parts and the kernel's bf16 weights widened to float32 (exactly): the very values it
    computes with, in the layout and precision MLX's own CPU products take. Any other model's
    parameters are its own."""

    def kernels_own(path: str) -> bool:
        """A joint product (`KernelPart`, split below) or a draft's int8 head (`_draft_head`)."""
        return any(part in ("joint", "_joint", "int8_rows") for part in path.split("."))

    out = {k: v for k, v in tree_flatten(model.parameters()) if not kernels_own(k)}
    for path, m in model.named_modules():
        if kernels_own(path):
            continue
        if isinstance(m, KernelPart):
            j = m._joint
            out[f"{path}.weight"] = j.dense()[m._lo : m._hi]
            if "bias" in j:
                out[f"{path}.bias"] = j.bias[m._lo : m._hi]
        elif isinstance(m, KernelLinear):
            out[f"{path}.weight"] = m.dense()
            out.pop(f"{path}.scales", None)
    return out


def weight_dtype(kind: str | None = None) -> str | None:
    """The dtype a loader should give the linear weights and the embedding, so that `serve`
    finds them converted (`bfloat16`) and no float32 copy of the whole model is ever made;
    None where they stay float32 (or the kernel does not serve)."""
    return "bfloat16" if (kind or choice()) in ("bf16", "int8") else None


def _computes_f32(model: nn.Module) -> bool:
    norm = getattr(getattr(model, "model", None), "norm", None)
    return norm is not None and norm.weight.dtype == mx.float32


def serves(model: nn.Module) -> bool:
    """Whether `serve` swapped this model's products for the kernel."""
    return any(isinstance(m, KernelLinear) for _, m in model.named_modules())


def products(model: nn.Module) -> str:
    """Which kernel serves a model's linear products, as pass-cost profiles name it: `mlx`
    (MLX's own, through its BLAS) or this kernel's dtype, its weights' layout where they are
    blocked (`pack`: another cost, so profiles measured before are not reused), its threads and
    `REVISION` (`onednn-bf16-blocked-head x2 r2`)."""
    served = [m for _, m in model.named_modules() if isinstance(m, KernelLinear)]
    if not served:
        return "mlx"
    dtypes = {m.weight.dtype for m in served}  # an int8 model's head and embedding stay bf16
    kind = "int8" if mx.int8 in dtypes else "bf16" if mx.bfloat16 in dtypes else "f32"
    if kind == "bf16" and any(m._packed for m in served):
        kind = "bf16-blocked"
    if getattr(model.head, "_packed", False):  # type: ignore[union-attr]
        kind += "-head"
    if any(m.transposed for m in served):
        kind += "-transposed"
    decode = f" decode-{served[0].decode_impl}" if prompts_apart(model) else ""
    return f"onednn-{kind} x{served[0].threads or default_threads()} r{REVISION}{decode}"


def revision(products_name: str) -> int | None:
    """The `REVISION` a `products` name was given (None: MLX's own products, `mlx`, which no
    revision of this module changes): a profile measured under another one is no longer used."""
    found = re.search(r" r(\d+)(?: |$)", products_name)
    return int(found.group(1)) if found else None


def batch_invariant(model: nn.Module) -> bool:
    """Whether a row's logits do not depend on how many tokens share the pass: every product
    of the model is the kernel's (a layer left quantized keeps MLX's) and so is attention."""
    modules = [m for _, m in model.named_modules()]
    return (
        serves(model)
        and not any(type(m) in (nn.Linear, nn.QuantizedLinear) for m in modules)
        and all(m.attend is attention for m in modules if hasattr(m, "attend"))
        and (
            isinstance(getattr(model, "lm_head", None), KernelLinear)
            or isinstance(model.model.embed_tokens, KernelEmbedding)  # type: ignore[union-attr]
        )
    )


def serve(
    model: nn.Module, kind: str | None = None, threads: int = 0, *, draft: bool = False
) -> str:
    """Swap the linear products of an MLX transformer (`models.transformer.Model`) for the CPU
    kernel where it serves this machine; returns the kind in use (`mlx`: nothing changed).

    Only float32 layers (or bfloat16 ones rounded by the loader, `weight_dtype`) are swapped:
    quantized ones keep MLX's quantized products. threads: OpenMP threads per product (0:
    `default_threads()`). draft: the model only drafts (an int8 draft's head too is int8, over
    its first `DRAFT_VOCAB` ids: see "The draft's head" above)."""
    kind = kind or choice()
    if kind == "mlx":
        return kind
    if _open() is None:
        raise RuntimeError(_unavailable or "oneDNN is unavailable")
    _swap(model, "bf16" if kind == "int8" else kind, threads)
    if kind == "int8" and serves(model):
        _to_int8(model)
        if draft:
            _draft_head(model)
        else:
            _pack(model)  # the (bf16) head
    elif kind == "bf16":
        impl = decode_impl()  # see "Prompts apart" above
        wide = transposes()  # see "AMX at a few rows" above
        for _, m in model.named_modules():
            if isinstance(m, KernelLinear):
                m.decode_impl = impl
                m.transposed = wide and m.out_features >= m.in_features and "bias" not in m
        _pack(model)
    return kind


def serve_pair(verifier: nn.Module, draft: nn.Module | None) -> None:
    """Serve a verifier and its draft as `ondevice.load` does on the CPU: the verifier by
    `choice()`, the draft by `draft_choice()` (a draft's rounding changes no output token)."""
    serve(verifier)
    if draft is not None:
        serve(draft, draft_choice(), draft=True)


def load_served(name: str | Path) -> Any:
    """A model (`models.LoadedModel`) as `ondevice.load` serves a verifier on this machine: on a
    CPU dequantized, its weights read in the kernel's dtype and its products the kernel's (MLX's
    quantized products on a CPU are several times slower); elsewhere as loaded (MLX on Metal).
    What a tool that runs a verifier outside `ondevice.load` uses, so that what it sees (hidden
    states, pass costs, acceptance) is what generation will see."""
    from ondevice.models import load_model

    if mx.default_device() != mx.cpu:
        return load_model(name)
    loaded = load_model(name, dequantize=True, product_dtype=weight_dtype())
    serve(loaded.model)
    return loaded


def _swap(model: nn.Module, kind: str, threads: int) -> None:
    """`serve`'s swap of every product for a `KernelLinear` of `kind` (bf16 or f32)."""
    # float32 weights, or bfloat16 ones the loader rounded for this kernel (`weight_dtype`) in a
    # model that computes in float32 (not a bfloat16 checkpoint's)
    ours = (mx.float32, mx.bfloat16) if kind == "bf16" and _computes_f32(model) else (mx.float32,)
    # Products that share their input become one product (a list of their parents only, so
    # each float32 weight is freed as soon as it is joined).
    groups = [
        (m, names)
        for _, m in model.named_modules()
        for names in SHARED_INPUT
        if all(type(m.get(n)) is nn.Linear and m[n].weight.dtype in ours for n in names)
    ]
    for module, names in groups:
        _join(module, names, kind)
        release()
    del groups
    # The embedding too: tied, it is the head; in bf16 it takes half the memory; and its lookups
    # start the numpy glue (below).
    # Paths first, then one layer at a time, so that each float32 weight is freed as soon as
    # its replacement exists (peak memory: the model plus one layer, not two models).
    paths = [
        p
        for p, m in model.named_modules()
        if type(m) in (nn.Linear, nn.Embedding) and m.weight.dtype in ours
    ]
    for path in paths:
        *parents, last = path.split(".")
        parent: Any = model
        for key in parents:
            parent = parent[int(key)] if isinstance(parent, list) else getattr(parent, key)
        old = getattr(parent, last)
        if type(old) is nn.Embedding:
            new: nn.Module = KernelEmbedding(old.weight, kind)
        else:
            new = KernelLinear(old.weight, old.get("bias"), kind)
        del old
        setattr(parent, last, new)
    for _, m in model.named_modules():
        if isinstance(m, KernelLinear):
            m.threads = threads
        if hasattr(m, "attend"):
            m.attend = attention
        if hasattr(m, "gating"):
            m.gating = silu_gate
    if batch_invariant(model):  # every product is the kernel's: the glue runs on numpy too
        _numpy_glue(model)
    release()


def _numpy_glue(model: nn.Module) -> None:
    """Swap a served model's norms and rotary embeddings for numpy ones and have its embedding
    hand out numpy rows, so that a pass runs from the lookup to the head on numpy arrays and
    the kernel's products, with no MLX op (see "Glue" above)."""
    model.model.embed_tokens.numpy_rows = True  # type: ignore[union-attr]
    rope = None  # one table for every layer (the layers' rotations are the same)
    for _, m in list(model.named_modules()):
        for name, child in list(m.children().items()):
            if type(child) is nn.RMSNorm:
                m[name] = KernelNorm(child)
        if hasattr(m, "rope") and not isinstance(m.rope, KernelRoPE):
            rope = KernelRoPE(m.rope) if rope is None else rope  # (a module is an empty dict)
            m.rope = rope


def _layer_products(model: nn.Module) -> list[KernelLinear]:
    """A served model's products in its layers, each once (by identity: a joint product is
    reached through each of its parts). Not the head or the embedding (an int8 model keeps
    them bf16: the head's products are the logits themselves)."""
    head = model.head  # type: ignore[union-attr]
    return list(
        {
            id(m): m
            for _, m in model.named_modules()
            if isinstance(m, KernelLinear) and not isinstance(m, KernelEmbedding) and m is not head
        }.values()
    )


def _to_int8(model: nn.Module) -> None:
    """Turn a bf16-served model's layers into int8 products (the head and embedding stay bf16)."""
    for m in _layer_products(model):
        if m._dtype == _BF16:
            m.to_int8()
            release()


def _pack(model: nn.Module) -> None:
    """Reorder a bf16-served model's layer weights and its head (a tied embedding too: its
    lookups read rows in place, `KernelLinear.rows`) into oneDNN's blocked layout, one at a
    time. The 1.5B verifier's tied 151,936-row head: 28.5 -> 15.9 ms over 16 rows here."""
    for m in [*_layer_products(model), model.head]:  # type: ignore[union-attr]
        if isinstance(m, KernelLinear):
            m.pack()
            release()


def _draft_head(model: nn.Module) -> None:
    """An int8 draft's head: int8 products over the first `DRAFT_VOCAB` token ids (or those its
    config already names, `draft_vocab_size`), which become the draft's vocabulary. It is kept
    beside the bf16 head (`int8_rows`), which stays the model's own parameter (and, tied, its
    embedding, looked up by row); `plain_parameters` leaves it out."""
    cfg = model.config  # type: ignore[union-attr]
    rows = min(cfg.draft_vocab_size or cfg.vocab_size, DRAFT_VOCAB, cfg.vocab_size)
    head = model.head  # type: ignore[union-attr]
    if not isinstance(head, KernelLinear) or head._dtype != _BF16:
        return
    small = head.top(rows, "int8")
    if rows < cfg.vocab_size:
        cfg.draft_vocab_size = rows
    head.int8_rows = small
    release()


def int8_copy(module: nn.Module, rows: int | None = None) -> nn.Module | None:
    """An int8 reading of a served module: a copy whose bf16 or float32 products are int8
    copies (`KernelLinear.top`), sharing every other part (norms, rotary tables, attention), or
    None where the kernel does not serve it in bf16 or float32 (MLX on Metal, an int8 model).
    For a draft that is the model itself (method `self`): its step reads half the bytes, in
    memory of its own (about a byte per weight).

    rows: for a head (a `KernelLinear`, or the tied embedding), its first `rows` outputs only,
    as an int8 draft's head (`_draft_head`)."""
    if isinstance(module, KernelLinear):
        if module._dtype == _S8:
            return None
        return module.top(min(rows or module.out_features, module.out_features), "int8")
    return _copy_products(
        module,
        lambda m: m._dtype != _S8,
        lambda m: m.top(m.out_features, "int8") if m._dtype != _S8 else m,
    )


def one_row_reading(module: nn.Module, rows: int | None = None) -> nn.Module | None:
    """A reading of a served module's bf16 products by `one_row_impl()` in decoding passes:
    the very same weights (nothing is copied; a tied embedding is read as the head it is), a
    different instruction set, so other rounding. For a draft that is the model itself (method
    `self`): a draft's rounding changes how often its guesses are accepted, never a token of
    the output, so it may read the verifier's weights by whatever reads them fastest. None
    where there is no such implementation or the kernel does not serve the module in bf16.

    rows: for a head, its first `rows` outputs only (as an int8 draft's head, `_draft_head`)
    where they are read in place (a row-major weight's first rows are a prefix of its buffer,
    a packed one's where `KernelLinear.prefix` says); else all of them."""
    impl = one_row_impl()
    if impl is None:
        return None

    def read(m: KernelLinear) -> KernelLinear:
        if m._dtype != _BF16:
            return m
        out = _as_product(m)  # the same weights, another implementation...
        if not m.transposed:  # ...but where the verifier's own reading is the faster one
            out.decode_impl = impl  # (AMX transposed, on a row-major weight: "AMX at a few rows")
        return out

    if isinstance(module, KernelLinear):
        if module._dtype != _BF16:
            return None
        if rows is not None and rows < module.out_features:
            if not module._packed:  # a transposed head (AMX): row-major
                return read(module.first_outputs(rows))
            first = module.prefix(rows)
            if first is not None:  # already its own copy
                first.decode_impl = impl
                return first
        return read(module)
    return _copy_products(module, lambda m: m._dtype == _BF16, read)


def first_rows_in_place(module: nn.Module, rows: int) -> KernelLinear | None:
    """A served head's products over its first `rows` outputs that read its own buffer
    (nothing copied; a tied embedding is read as the head it is): a row-major weight's first
    rows always, a packed one's where `KernelLinear.prefix` finds them laid out as one. None
    where the head has no more rows than that, is int8, or is not the kernel's."""
    if not isinstance(module, KernelLinear) or module._dtype == _S8:
        return None
    if rows >= module.out_features:
        return None
    return module.prefix(rows) if module._packed else module.first_outputs(rows)


def _as_product(m: KernelLinear) -> KernelLinear:
    """A shallow copy of `m` (the same weight buffer, pointers and bias) that is a plain
    `KernelLinear`: a tied embedding's copy computes the head's products, not lookups."""
    out = copy.copy(m)
    out.__class__ = KernelLinear
    return out


def _copy_products(
    module: nn.Module,
    wanted: Callable[[KernelLinear], bool],
    make: Callable[[KernelLinear], KernelLinear],
) -> nn.Module | None:
    """A copy of `module` whose `KernelLinear`s are `make(m)` (a joint product's parts follow
    their product), sharing every module without one (norms, rotary tables, attention); None
    where no product is `wanted(m)`."""
    if not any(isinstance(m, KernelLinear) and wanted(m) for _, m in module.named_modules()):
        return None
    memo: dict[int, Any] = {}

    def copy_of(m: Any) -> Any:
        if not isinstance(m, nn.Module):
            return [copy_of(x) for x in m] if isinstance(m, list) else m
        if id(m) not in memo:
            if isinstance(m, KernelPart):
                memo[id(m)] = KernelPart(copy_of(m._joint), m._lo, m._hi, owner="joint" in m)
            elif isinstance(m, KernelLinear):
                memo[id(m)] = make(m)
            elif not any(isinstance(x, KernelLinear) for _, x in m.named_modules()):
                memo[id(m)] = m  # nothing to copy: shared
            else:
                new = copy.copy(m)  # the same attributes, its own children
                for key, child in m.items():
                    if isinstance(child, (nn.Module, list)) and not key.startswith("_"):
                        new[key] = copy_of(child)
                memo[id(m)] = new
        return memo[id(m)]

    out = copy_of(module)
    release()
    return out
