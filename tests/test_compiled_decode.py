"""A patched decode step is one graph: no host sync, no graph break, and compiled it gives what eager gives.

The flush that quantizes a full tile is not part of the step: eager forwards run it after the pass, compiled ones
leave the tile in the tail and `generate` flushes it before the next step (outside the graph).
"""

import pytest
import torch
from conftest import build_model
from transformers import CompileConfig

import kvarn_mla

# MHA, GQA (4 heads over 2), MLA; one layer keeps the compile cheap.
FAMILIES = [("llama", dict(num_key_value_heads=4)), ("qwen3", {}), ("deepseek_v3", {})]
LAYOUT = dict(tile_size=64, sink_tokens=64, backend="torch")


def _patched(model_type: str, overrides: dict):
    model = build_model(model_type, num_hidden_layers=1, **overrides)
    return kvarn_mla.patch(model, "k4v2", **LAYOUT)


def _padded_prompt(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 128, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in the second row
    return ids, mask


@pytest.mark.parametrize("model_type,overrides", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_decode_step_is_one_graph(model_type, overrides):
    model = _patched(model_type, overrides)
    ids, mask = _padded_prompt(150)
    with torch.no_grad():
        cache = model(ids, attention_mask=mask).cache
        assert cache.layers[0].streams[0].num_tiles == 1  # the step reads a quantized tile, the sink and the tail
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(
            lambda step: model(step, attention_mask=step_mask, cache=cache, use_cache=True).logits
        )(ids[:, -1:])
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("model_type,overrides", FAMILIES[1:], ids=[f[0] for f in FAMILIES[1:]])
def test_compiled_steps_match_eager_across_a_flush(model_type, overrides):
    model = _patched(model_type, overrides)
    ids = torch.randint(1, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(lambda step, cache: model(step, cache=cache, use_cache=True).logits, fullgraph=True,
                             backend="aot_eager")
    torch._dynamo.reset()
    with torch.no_grad():
        eager_cache, compiled_cache = model(ids).cache, model(ids).cache
        step = ids[:, -1:]
        for _ in range(12):  # the tail fills its first tile (64 tokens past the sink) after 8 steps
            expected = model(step, cache=eager_cache, use_cache=True).logits
            if compiled_cache.has_pending_tiles():  # what generate does between compiled steps
                compiled_cache.flush()
            got = compiled(step, compiled_cache)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            step = expected.argmax(-1)
    compiled_cache.flush()
    assert compiled_cache.layers[0].streams[0].num_tiles == eager_cache.layers[0].streams[0].num_tiles == 1
    for mine, theirs in zip(compiled_cache.layers[0].streams, eager_cache.layers[0].streams):
        torch.testing.assert_close(mine.dequantized(), theirs.dequantized(), rtol=0, atol=0)


def test_generate_compiles_with_a_compile_config_and_flushes_between_steps():
    model = _patched("llama", {})
    ids, mask = _padded_prompt(100)
    kwargs = dict(attention_mask=mask, max_new_tokens=36, do_sample=False, return_dict_in_generate=True,
                  output_logits=True, pad_token_id=0)
    eager = model.generate(ids, **kwargs)
    assert not eager.cache.is_compileable and not hasattr(model, "_compiled_call")  # eager unless asked
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode="default")
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    compiled = model.generate(ids, compile_config=config, **kwargs)
    assert hasattr(model, "_compiled_call")
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), rtol=0, atol=1e-5)
    # the 36 tokens took the tail (36 past the 64-token sink) past a tile: quantized by the between-step flush
    assert [s.num_tiles for s in compiled.cache.layers[0].streams] == [1, 1]
