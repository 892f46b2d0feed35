"""backend="triton" (kernels, here in Triton's interpreter) against backend="torch" on patched tiny models."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE, build_model, sqnr, teacher_forced_logits

import kvarn_mla
from kvarn_mla.backends import resolve_backend

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
# The interpreter computes the kernels' dots in float32; compiled on CUDA, float32 dots run as TF32.
AGREEMENT_DB = 35 if DEVICE.type == "cuda" else 60


@pytest.mark.parametrize("model_type, preset", [("llama", "k4v2"), ("deepseek_v3", "k4v2"), ("qwen3", "k2v2"),
                                                ("deepseek_v3", "k4v2-r8")])
def test_triton_backend_generates_the_torch_backend_tokens(model_type, preset):
    model = build_model(model_type).to(DEVICE)
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # a left-padded row
    outputs = {}
    for backend in ("torch", "triton"):
        kvarn_mla.patch(model, preset, tile_size=64, sink_tokens=64, backend=backend)
        with torch.no_grad():
            outputs[backend] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                              output_logits=True, return_dict_in_generate=True)
    assert torch.equal(outputs["torch"].sequences, outputs["triton"].sequences)
    logits = [torch.stack(outputs[b].logits, 1) for b in ("torch", "triton")]
    assert sqnr(*logits) > AGREEMENT_DB
    torch_cache, triton_cache = outputs["torch"].cache, outputs["triton"].cache
    for a, b in zip(torch_cache.layers, triton_cache.layers):  # the store kernel wrote the same codes
        assert torch.equal(a.streams[0].tiles.codes, b.streams[0].tiles.codes)


def test_triton_backend_chunked_prefill_uses_the_multi_query_kernel():
    model = build_model("llama").to(DEVICE)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    steps = ids[:, :160]
    logits = {}
    for backend in ("torch", "triton"):
        kvarn_mla.patch(model, "k4v2", tile_size=64, sink_tokens=0, backend=backend)
        logits[backend] = teacher_forced_logits(model, steps, 150)  # one prefill, then teacher-forced steps
        with torch.no_grad():
            chunk = model(ids[:, :130]).cache
            logits[backend + "-chunk"] = model(ids[:, 130:], cache=chunk).logits  # 70 queries over a quantized cache
    assert sqnr(logits["torch"], logits["triton"]) > AGREEMENT_DB
    assert sqnr(logits["torch-chunk"], logits["triton-chunk"]) > AGREEMENT_DB


def test_auto_backend_and_explicit_choices():
    assert resolve_backend("auto", torch.device("cpu")).name == "torch"
    assert resolve_backend("torch", torch.device("cpu")).name == "torch"
    assert resolve_backend("auto", torch.device("cuda")).name == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", torch.device("cpu"))
    env = dict(os.environ, TRITON_INTERPRET="0")
    code = ("import torch\nfrom kvarn_mla.backends import resolve_backend\n"
            "resolve_backend('triton', torch.device('cpu'))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "set TRITON_INTERPRET=1" in run.stderr


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_patch_resolves_the_backend_once(monkeypatch, backend):
    """The backend `patch` resolved is the one every cache layer and attention binding uses; generating never
    resolves it again."""
    import kvarn_mla.cache
    from kvarn_mla.adapters.base import find_binding

    model = build_model("llama").to(DEVICE)
    kvarn_mla.patch(model, "k4v2", tile_size=64, sink_tokens=64, backend=backend)
    resolved = find_binding(model).backend
    assert resolved.name == backend

    def refuse(*args):
        raise AssertionError("the backend was resolved again")

    monkeypatch.setattr(kvarn_mla.cache, "resolve_backend", refuse)
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(0)).to(DEVICE)  # no pad id (0)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert all(layer.backend is resolved for layer in out.cache.layers)
    assert out.cache.layers[0].streams[0].num_tiles == 1
