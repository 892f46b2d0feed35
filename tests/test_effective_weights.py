"""MLA absorption uses the effective weight of whatever implements ``kv_b_proj``: LoRA (peft), FP8 block-quantized
(emulated on CPU), bitsandbytes. With a configuration that quantizes nothing, the patched model must then match the
unpatched model that runs the same module."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, build_wide, sqnr
from torch import nn
from transformers.integrations.finegrained_fp8 import FP8Linear

import kvarn_mla
from kvarn_mla.adapters.mla import ABSORBED_ATTR, effective_weight
from kvarn_mla.config import UNQUANTIZED

NOTHING_QUANTIZED = UNQUANTIZED.replace(tile_size=64, sink_tokens=64, backend="torch")


def _attention_modules(model) -> list[nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


@torch.no_grad()
def _greedy(model, ids, patch: bool):
    if patch:
        kvarn_mla.patch(model, NOTHING_QUANTIZED)
    try:
        out = model.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    finally:
        kvarn_mla.unpatch(model)
    return out.sequences, torch.stack(out.logits, 1)


def _assert_patched_matches_unpatched(model, ids):
    reference, reference_logits = _greedy(model, ids, patch=False)
    tokens, logits = _greedy(model, ids, patch=True)
    assert torch.equal(tokens, reference)
    assert sqnr(reference_logits, logits) > 60


def _ids(seed: int = 0, length: int = 100) -> torch.Tensor:
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def test_lora_adapted_kv_b_proj_and_refresh():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = build_model("deepseek_v3")
    ids = _ids()
    plain_tokens, plain_logits = _greedy(base, ids, patch=False)
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["kv_b_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, lora).base_model.model  # the transformers model, LoRA layers injected
    _, adapted_logits = _greedy(model, ids, patch=False)
    assert sqnr(plain_logits, adapted_logits) < 30  # the adapter matters: ignoring it would be visibly wrong
    _assert_patched_matches_unpatched(model, ids)

    # The absorbed weights follow the module: an in-place update of the adapter, and disabling it.
    kvarn_mla.patch(model, NOTHING_QUANTIZED)
    attention = _attention_modules(model)[0]
    before = attention.__dict__[ABSORBED_ATTR].w_uk.clone()
    with torch.no_grad():
        for module in _attention_modules(model):
            module.kv_b_proj.lora_B["default"].weight.mul_(3.0)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert not torch.equal(attention.__dict__[ABSORBED_ATTR].w_uk, before)
    kvarn_mla.unpatch(model)
    tripled_tokens, tripled_logits = _greedy(model, ids, patch=False)
    assert torch.equal(out.sequences, tripled_tokens) and sqnr(tripled_logits, torch.stack(out.logits, 1)) > 60
    for module in _attention_modules(model):
        module.kv_b_proj.enable_adapters(False)  # what peft's disable_adapter() context does to each layer
    _assert_patched_matches_unpatched(model, ids)
    assert torch.equal(_greedy(model, ids, patch=True)[0], plain_tokens)


class EmulatedFP8Linear(FP8Linear):
    """transformers' `FP8Linear` (``float8_e4m3fn`` weight, ``weight_scale_inv`` per 128 x 128 block) with a forward
    that dequantizes on the CPU, where its fused FP8 kernels do not run."""

    @classmethod
    def quantize(cls, linear: nn.Linear, block: int = 128) -> EmulatedFP8Linear:
        out_features, in_features = linear.weight.shape
        fp8 = cls(in_features, out_features, block_size=(block, block))
        weight = linear.weight.detach().float()
        blocks = weight.unflatten(0, (-1, block)).unflatten(-1, (-1, block))  # [out/b, b, in/b, b]
        scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max  # [out/b, in/b]
        quantized = blocks / scale[:, None, :, None]
        fp8.weight = nn.Parameter(quantized.flatten(2, 3).flatten(0, 1).to(torch.float8_e4m3fn), requires_grad=False)
        fp8.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        return fp8

    def dequantized(self) -> torch.Tensor:
        block = self.block_size[0]
        weight = self.weight.float().unflatten(0, (-1, block)).unflatten(-1, (-1, block))
        return (weight * self.weight_scale_inv[:, None, :, None]).flatten(2, 3).flatten(0, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(input, self.dequantized().to(input.dtype), self.bias)


def test_fp8_block_quantized_kv_b_proj():
    model = build_wide("mla-512+64")  # kv_b_proj 512 -> 2 x (128 + 128): 4 x 4 blocks of 128 x 128
    for attention in _attention_modules(model):
        attention.kv_b_proj = EmulatedFP8Linear.quantize(attention.kv_b_proj)
    _assert_patched_matches_unpatched(model, _ids(1))
    kvarn_mla.patch(model, NOTHING_QUANTIZED)
    attention = _attention_modules(model)[0]
    absorbed = attention.__dict__[ABSORBED_ATTR]
    assert absorbed.w_uk.dtype == torch.float32 and absorbed.w_uk.shape == (2, 128, 512)  # dense, compute dtype
    expected = attention.kv_b_proj.dequantized().view(2, 256, 512)
    assert torch.equal(absorbed.w_uk, expected[:, :128]) and torch.equal(absorbed.w_uv, expected[:, 128:])
    kvarn_mla.unpatch(model)
    assert ABSORBED_ATTR not in attention.__dict__


def test_bitsandbytes_kv_b_proj():
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    model = build_model("deepseek_v3")
    try:
        for attention in _attention_modules(model):
            linear = attention.kv_b_proj
            quantized = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=False,
                                            has_fp16_weights=False)
            quantized.weight = bnb.nn.Int8Params(linear.weight.data.clone(), requires_grad=False,
                                                 has_fp16_weights=False)
            attention.kv_b_proj = quantized.to("cpu")
        assert attention.kv_b_proj.weight.dtype == torch.int8
        attention.kv_b_proj(torch.zeros(1, linear.in_features))
    except (RuntimeError, NotImplementedError) as error:  # a build without CPU kernels
        pytest.skip(f"bitsandbytes cannot run an int8 layer on this CPU: {error}")
    _assert_patched_matches_unpatched(model, _ids(2))


def test_effective_weight_of_a_biased_linear_is_its_weight():
    linear = nn.Linear(24, 40, bias=True)
    assert torch.allclose(effective_weight(linear, 24, torch.float32), linear.weight, atol=1e-6)
