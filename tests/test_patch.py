"""`patch` / `unpatch` / `patched`: instance-only, reversible, loud on bad input, nothing at import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import TINY_CONFIGS, build_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import kvarn_mla
from kvarn_mla import KVarNCache
from kvarn_mla.adapters import ADAPTERS, adapter_for, supported_model_types


def _snapshot(model):
    """Everything patching may touch: instance dicts, hooks, attention implementations, parameters."""
    modules = {
        name: (sorted(m.__dict__), len(m._forward_pre_hooks), len(m._forward_hooks))
        for name, m in model.named_modules()
    }
    configs = [(c, c._attn_implementation_internal) for c in (model.config, model.config.get_text_config(decoder=True))]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return modules, [(id(c), impl) for c, impl in configs], state


@torch.no_grad()
def _logits(model, ids):
    return model(ids, use_cache=True).logits


def test_registry_is_complete_and_every_type_has_a_test_model():
    assert set(ADAPTERS) == set(TINY_CONFIGS) == set(supported_model_types())
    for model_type in ADAPTERS:
        mapped = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type == "kimi_k25"
        assert mapped, f"{model_type} has no causal-LM class in transformers"


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3", "deepseek_v32", "kimi_k25"])
def test_unpatch_restores_the_model_exactly(model_type):
    model = build_model(model_type)
    ids = torch.randint(0, 128, (2, 150))
    before_logits, before = _logits(model, ids), _snapshot(model)
    kvarn_mla.patch(model, "k2v2", tile_size=64, sink_tokens=0)
    assert kvarn_mla.is_patched(model)
    assert model.config.get_text_config(decoder=True)._attn_implementation == "kvarn"
    patched_logits = model(ids[:, :130], use_cache=True)
    assert isinstance(patched_logits.cache, KVarNCache)
    kvarn_mla.unpatch(model)
    after = _snapshot(model)
    assert before[0] == after[0] and before[1] == after[1]
    assert all(torch.equal(before[2][k], after[2][k]) for k in before[2])
    assert torch.equal(_logits(model, ids), before_logits)  # bit-identical
    assert type(model(ids, use_cache=True).cache).__name__ == "DynamicCache"
    assert not kvarn_mla.is_patched(model)
    kvarn_mla.unpatch(model)  # unpatching an unpatched model is a no-op


def test_patched_modules_say_so_and_repatching_switches_config():
    model = build_model("deepseek_v3")
    kvarn_mla.patch(model)
    assert "kvarn(latent=4b, rope=16b, tile=128, sink=128, method=kvarn)" in repr(model)
    kvarn_mla.patch(model, "kivi-k2v2")
    assert "kvarn(latent=2b, rope=16b, tile=128, sink=128, method=rtn)" in repr(model)
    assert repr(model).count("kvarn(") == 2  # one per attention module, not stacked
    kvarn_mla.unpatch(model)
    assert "kvarn(" not in repr(model)
    dense = kvarn_mla.patch(build_model("llama"), "k8v8")
    assert "kvarn(key=8b, value=8b" in repr(dense)


def test_context_manager_unpatches_even_on_error():
    model = build_model("llama")
    with pytest.raises(RuntimeError, match="boom"):
        with kvarn_mla.patched(model, "k4v4"):
            assert kvarn_mla.is_patched(model)
            raise RuntimeError("boom")
    assert not kvarn_mla.is_patched(model)


def test_unsupported_models_are_refused_with_the_supported_list_and_left_alone():
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2))
    before = _snapshot(gpt2)
    with pytest.raises(NotImplementedError, match=r"model_type='gpt2'.*supported: \['deepseek_v2', "):
        kvarn_mla.patch(gpt2)
    assert _snapshot(gpt2)[:2] == before[:2]
    v4 = AutoConfig.for_model("deepseek_v4")
    with pytest.raises(NotImplementedError, match="deepseek_v4 is not latent MLA"):
        adapter_for(v4)


def test_bad_config_is_refused_before_anything_changes(monkeypatch):
    model = build_model("llama")
    before = _snapshot(model)
    with pytest.raises(ValueError, match="unknown preset 'k3v1'"):
        kvarn_mla.patch(model, "k3v1")
    with pytest.raises(ValueError, match="key_bits must be one of .* got 6"):
        kvarn_mla.patch(model, key_bits=6)
    with pytest.raises(ValueError, match="tile_size must be one of"):
        kvarn_mla.patch(model, tile_size=32)
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="need CUDA tensors .* set TRITON_INTERPRET=1"):
            kvarn_mla.patch(model, backend="triton")
    with pytest.raises(TypeError, match="PreTrainedModel"):
        kvarn_mla.patch(torch.nn.Linear(2, 2))
    assert _snapshot(model)[:2] == before[:2]


def test_kvarn_cache_requires_a_patched_model():
    model = build_model("llama")
    with pytest.raises(ValueError, match="patched with kvarn_mla.patch"):
        KVarNCache(model)
    kvarn_mla.patch(model, "k2v2")
    assert KVarNCache(model).config == kvarn_mla.PRESETS["k2v2"]


def test_nothing_happens_at_import():
    code = (
        "import kvarn_mla\n"
        "from transformers.modeling_utils import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "assert 'kvarn' not in AttentionInterface._global_mapping\n"
        "assert 'kvarn' not in AttentionMaskInterface._global_mapping\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_eager_models_keep_eager_for_full_precision_attention():
    model = build_model("llama", attn_implementation="eager")
    ids = torch.randint(0, 128, (2, 40))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    reference = model(ids, attention_mask=mask).logits
    kvarn_mla.patch(model)
    assert kvarn_mla.patch.__module__ == "kvarn_mla.patch"
    out = model(ids, attention_mask=mask).logits  # a prefill: full precision through the model's eager path
    assert torch.equal(out[0, 7:], reference[0, 7:]) and torch.equal(out[1], reference[1])
    kvarn_mla.unpatch(model)
    assert model.config._attn_implementation == "eager"


def test_generate_from_inputs_embeds():
    """`generate` inspects ``prepare_inputs_for_generation``'s signature for ``inputs_embeds``: the patched one keeps
    the model's."""
    model = build_model("llama")
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    embeds = model.get_input_embeddings()(ids)
    expected = model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False)
    kvarn_mla.patch(model, "k8v8")
    assert torch.equal(model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False), expected)


def test_padded_sdpa_is_sdpa_and_the_patched_prefill_attends_through_it():
    # MLA's value head (16) is narrower than its query head (24): `use_padded_sdpa` zero-pads it so SDPA can run its
    # fused kernel. Same logits as plain sdpa up to rounding; a patched prefill then attends through it bit for bit.
    model = build_model("deepseek_v3")
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        assert kvarn_mla.use_padded_sdpa(model)
        assert model.config._attn_implementation == "sdpa_pad_v"
        padded = model(ids).logits
        torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
        assert not torch.equal(padded, plain)  # the fused kernel did run (a different summation order)
        with kvarn_mla.patched(model, "k4v2"):
            assert torch.equal(model(ids).logits, padded)
    assert model.config._attn_implementation == "sdpa_pad_v"  # unpatch restores the choice
    assert not kvarn_mla.use_padded_sdpa(model)  # already selected
    assert not kvarn_mla.use_padded_sdpa(build_model("deepseek_v3", v_head_dim=24))  # as wide as the query
    assert not kvarn_mla.use_padded_sdpa(build_model("llama"))  # dense: one head width
    eager = build_model("deepseek_v3")
    eager.config._attn_implementation = "eager"
    assert not kvarn_mla.use_padded_sdpa(eager)  # an explicit choice other than sdpa is kept
