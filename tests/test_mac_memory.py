"""Memory on a Mac, checked on Linux (issue 27): MLX's wired and cache limits sized from the GPU's
working set and the models (as mlx-lm does), the process's peak beside MLX's in the stats, and
quantized GGUF models computing in float16 on the GPU instead of float32."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten

import ondevice
from ondevice.models import load_model
from ondevice.runtime import memory

GB = 1 << 30


def test_limits_follow_the_working_set_and_the_models():
    roomy = memory.metal_limits(working_set=5 * GB, model_bytes=1 * GB)
    assert roomy.wired == 5 * GB and roomy.cache == GB and roomy.warning is None
    tight = memory.metal_limits(working_set=5 * GB, model_bytes=int(4.8 * GB))
    assert tight.cache < 0.1 * GB and "close to this Mac's recommended GPU working set" in (
        tight.warning or ""
    )
    assert memory.metal_limits(5 * GB, 6 * GB).cache == 0


def test_a_generator_on_metal_sets_the_limits(pair, monkeypatch, capsys):
    calls = {}
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 8 * GB})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: calls.setdefault("wired", n))
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: calls.setdefault("cache", n))
    gen = ondevice.load(pair[0], pair[1], draft_backend="mlx")
    models = sum(memory.param_bytes(m) for m in (gen.verifier.model, gen.draft.model))
    assert calls == {"wired": 8 * GB, "cache": int(0.25 * (8 * GB - models))}
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": models})
    calls.clear()
    ondevice.load(pair[0], pair[1], draft_backend="mlx")
    assert "warning: the models need" in capsys.readouterr().err


def test_no_limits_off_metal(pair, monkeypatch):
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: pytest.fail("set on the CPU"))
    assert memory.apply_metal_limits(1 << 20) is None


def test_stats_report_the_process_peak_beside_mlxs(gen):
    stats = gen.generate("hello", max_tokens=3).stats
    assert stats["process_peak_bytes"] >= stats["peak_memory_bytes"] > 0


@pytest.mark.parametrize("quant", ["Q4_1", "Q4_K"])
def test_a_quantized_gguf_computes_in_float16_on_the_gpu(tmp_path, monkeypatch, quant):
    """A GGUF file's norms are float32; before, every float of a quantized GGUF model (norms,
    scales, biases, and so the activations and the KV cache) was float32 on the GPU."""
    sizes = {"hidden_size": 256, "intermediate": 512} if quant.endswith("_K") else {}
    path, _ = tiny.write_gguf(tmp_path / "m.gguf", quant=quant, tie=False, **sizes)
    cpu = load_model(path)  # the CPU keeps float32 (its quantized products want it)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    gpu = load_model(path)
    assert gpu.config.quantization
    floats = {
        k: v.dtype
        for k, v in tree_flatten(gpu.model.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
    }
    assert set(floats.values()) == {mx.float16}, floats
    assert {v.dtype for _, v in tree_flatten(cpu.model.parameters())} >= {mx.float32}
    toks = [5, 70, 80, 90, 100, 110, 6, 7]
    a = np.array(cpu.model(mx.array([toks])).astype(mx.float32))
    b = np.array(gpu.model(mx.array([toks])).astype(mx.float32))
    assert np.abs(a - b).max() < 0.02 * np.abs(a).max()
