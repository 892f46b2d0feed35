"""`kvarn-mla plan`: bytes per token, max context and max batch checked against hand computations."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_CONFIGS
from transformers import AutoConfig

from kvarn_mla.adapters import adapter_for
from kvarn_mla.archs import ARCHITECTURES, SOURCES, load_config
from kvarn_mla.cli import main
from kvarn_mla.config import PRESETS
from kvarn_mla.plan import UNQUANTIZED, expected_nbytes, format_bytes, parameter_count, parse_memory, plan, weight_bytes

GiB = 2**30
# T = sink (128) + 31 full tiles of 128 + a 64-token tail: 192 tokens stay 16-bit, 31 tiles are quantized.
T, TILES, FP_TOKENS = 4160, 31, 192


def channel_tile(dim: int, bits: int, tile: int = 128) -> int:
    # Codes packed along the channels, then fp16 scale and zero per channel and fp16 gamma per token.
    return tile * dim * bits // 8 + 2 * (2 * dim + tile)


def token_tile(dim: int, bits: int, tile: int = 128) -> int:
    # Codes, then fp16 scale and zero per token and fp16 gamma per channel.
    return tile * dim * bits // 8 + 2 * (2 * tile + dim)


def test_deepseek_v3_bytes_per_token_by_hand():
    rows = plan(load_config("deepseek-v3"), 10_000 * GiB, batch=1, context=T, presets=["k4v2"], dtype_bytes=1)
    assert [row.name for row in rows] == ["16-bit", "k4v2"]
    # 16-bit MLA caches the latent (512) and the RoPE key (64) per token per layer, 2 bytes each: 1152 B.
    assert rows[0].sequence_nbytes == 61 * 1152 * T and rows[0].bytes_per_token == 61 * 1152
    # k4v2: the RoPE key stays 16-bit; the latent keeps sink + tail in 16-bit and packs 31 tiles at 4 bits.
    per_layer = T * 64 * 2 + FP_TOKENS * 512 * 2 + TILES * channel_tile(512, 4)
    assert channel_tile(512, 4) == 35072
    assert rows[1].sequence_nbytes == 61 * per_layer == 110_795_520


def test_llama_3_8b_bytes_per_token_by_hand():
    rows = plan(load_config("llama-3-8b"), 80 * GiB, batch=1, context=T, presets=["k4v2"])
    # 16-bit GQA: 8 KV heads x 128 dims x (key + value) x 2 bytes = 4096 B per token per layer.
    assert rows[0].sequence_nbytes == 32 * 4096 * T
    # k4v2: 4-bit keys per channel, 2-bit values per token; sink + tail 16-bit.
    per_layer = FP_TOKENS * 4096 + TILES * 8 * (channel_tile(128, 4) + token_tile(128, 2))
    assert rows[1].sequence_nbytes == 32 * per_layer == 134_873_088


def test_max_context_and_max_batch_by_hand():
    memory = 80 * GiB
    rows = plan(load_config("llama-3-8b"), memory, batch=8, context=32768)
    free = memory - 8_030_261_248 * 2  # Llama-3-8B's parameters in bf16
    assert free == 69_838_823_424
    # 16-bit: 131072 B per token per sequence, exactly linear in T.
    assert rows[0].max_context == free // (8 * 131072) == 66_603
    assert rows[0].max_batch == free // (32768 * 131072) == 16
    # Every row is the largest value that fits: one more token (or sequence) would not.
    model_config = load_config("llama-3-8b")
    for row in rows:
        def used(tokens, batch=8, config=row.config):
            return memory - free + expected_nbytes(model_config, config, tokens, batch=batch)

        assert used(row.max_context) <= memory < used(row.max_context + 1), row.name
        assert used(32768, row.max_batch) <= memory < used(32768, row.max_batch + 1), row.name
    assert [row.name for row in rows] == ["16-bit", *PRESETS]


def test_deepseek_v3_fp8_weights_and_weights_that_do_not_fit(capsys):
    memory = parse_memory("1128GiB")  # 8 x H200
    model_config = load_config("deepseek-v3")
    rows = plan(model_config, memory, batch=8, context=32768, presets=["k4v2"], dtype_bytes=1)
    free = memory - 671_026_404_352
    assert rows[0].max_context == free // (8 * 61 * 1152)
    assert rows[0].max_batch == free // (32768 * 61 * 1152)
    # In bf16 the 671B parameters (1.22 TiB) exceed 1128 GiB: nothing fits, and the CLI says so.
    assert weight_bytes(model_config) > memory
    assert all(row.max_context == 0 and row.max_batch == 0 for row in plan(model_config, memory, 8, 32768))
    assert main(["plan", "--model", "deepseek-v3", "--memory", "1128GiB", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "the weights do NOT fit, 130,872,031,232 B (122 GiB) short" in out
    assert "--dtype-bytes 1" in out


def test_cli_table(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--memory", "80GiB", "--batch", "8", "--context", "4096",
                 "--preset", "k4v2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model    llama-3-8b: llama, GQA attention, 32 layers, max_position_embeddings 8192"
    assert lines[1] == "weights  8,030,261,248 parameters x 2 B = 16,060,522,496 B (15.0 GiB)"
    assert lines[2] == "memory   85,899,345,920 B (80.0 GiB): 69,838,823,424 B (65.0 GiB) left for the KV cache"
    assert lines[5].split() == ["16-bit", "16/16", "131072.0", "512", "MiB", "1.00x", "66,603*", "130"]
    assert lines[6].split()[:2] == ["k4v2", "4/2"] and len(lines) == 8  # and the footnote for '*'


@pytest.mark.parametrize("text, nbytes", [("80GiB", 80 * GiB), ("1.5TB", 1_500_000_000_000), ("512 MiB", 2**29),
                                          ("0.1GB", 10**8), ("100B", 100), (" 2TiB ", 2 * 2**40), (".5KiB", 512)])
def test_parse_memory(text, nbytes):
    assert parse_memory(text) == nbytes


@pytest.mark.parametrize("text", ["80", "eighty GiB", "-1GiB", "80 GiBs", "0GiB", "0.5B", "", "80gib", "1e3GB"])
def test_bad_memory_strings_name_the_value_and_the_accepted_forms(text, capsys):
    with pytest.raises(ValueError, match=f"invalid memory size {text!r}") as error:
        parse_memory(text)
    assert "KiB, MiB, GiB, TiB" in str(error.value) and "80GiB" in str(error.value)
    assert main(["plan", "--model", "llama-3-8b", f"--memory={text}"]) == 2  # '=': argparse reads "-1GiB" as a flag
    assert f"invalid memory size {text!r}" in capsys.readouterr().err


def test_unknown_model_names_the_value_and_lists_the_bundled_names(capsys):
    with pytest.raises(ValueError, match="unknown model 'gpt-5'") as error:
        load_config("gpt-5")
    assert str(sorted(ARCHITECTURES)) in str(error.value)
    assert main(["plan", "--model", "nobody/no-such-model", "--memory", "80GiB"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'nobody/no-such-model'" in err and "llama-3-70b" in err and "nothing is downloaded" in err
    with pytest.raises(ValueError, match="or use the bundled 'deepseek-v3'"):
        load_config("deepseek-ai/DeepSeek-V3", cache_dir="/nonexistent")


def test_unsupported_model_type_says_so(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=2)))
    with pytest.raises(NotImplementedError, match="does not support model_type='gpt2'"):
        plan(load_config(str(tmp_path)), 80 * GiB)
    assert main(["plan", "--model", str(tmp_path), "--memory", "80GiB"]) == 2
    assert "does not support model_type='gpt2'" in capsys.readouterr().err


def test_hub_names_resolve_from_the_local_cache_only(tmp_path):
    snapshot = tmp_path / "models--someorg--tiny-qwen" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (tmp_path / "models--someorg--tiny-qwen" / "refs").mkdir()
    (tmp_path / "models--someorg--tiny-qwen" / "refs" / "main").write_text("a" * 40)
    (snapshot / "config.json").write_text(json.dumps(dict(TINY_CONFIGS["qwen3"], model_type="qwen3")))
    assert load_config("someorg/tiny-qwen", cache_dir=tmp_path).head_dim == 16
    with pytest.raises(ValueError, match="unknown model 'someorg/other'"):
        load_config("someorg/other", cache_dir=tmp_path)
    # Kimi-K2's config.json says model_type "kimi_k2" (remote code): read as the DeepSeek-V3 architecture it is.
    (snapshot / "config.json").write_text(json.dumps(dict(TINY_CONFIGS["deepseek_v3"], model_type="kimi_k2")))
    assert adapter_for(load_config("someorg/tiny-qwen", cache_dir=tmp_path)).family == "mla"


def test_every_bundled_config_loads_and_is_supported():
    assert set(SOURCES) == set(ARCHITECTURES) and len(ARCHITECTURES) == 10
    for name, (model_type, _) in ARCHITECTURES.items():
        model_config = load_config(name.upper())  # names are case-insensitive
        assert model_config.model_type == model_type
        adapter_for(model_config)
        rows = plan(model_config, 10_000 * GiB, batch=1, context=1024, presets=["k4v2"])
        assert rows[1].sequence_nbytes < rows[0].sequence_nbytes, name
    # Mistral-7B is v0.3: no sliding window, every layer is cached in full.
    assert load_config("mistral-7b").sliding_window is None


@pytest.mark.parametrize("name, published", [("llama-3-8b", 8.03e9), ("deepseek-v3", 671e9), ("llama-3-70b", 70.6e9),
                                             ("qwen3-32b", 32.8e9), ("mistral-7b", 7.25e9),
                                             ("deepseek-v2-lite", 15.7e9)])
def test_parameter_counts_match_published_sizes(name, published):
    assert abs(parameter_count(load_config(name)) / published - 1) < 0.01


def test_weight_bytes_dtype_and_validation():
    model_config = load_config("llama-3-8b")
    assert weight_bytes(model_config, 0.5) == 8_030_261_248 // 2 and weight_bytes(model_config, 1) == 8_030_261_248
    for bad in (0, -1, float("nan"), "2"):
        with pytest.raises(ValueError, match="dtype_bytes must be a positive number"):
            weight_bytes(model_config, bad)
    with pytest.raises(ValueError, match="batch must be a positive integer, got 0"):
        plan(model_config, 80 * GiB, batch=0)
    with pytest.raises(ValueError, match="unknown preset 'k3v3'"):
        plan(model_config, 80 * GiB, presets=["k3v3"])


def test_a_cache_that_stops_growing_has_no_context_limit():
    # Every layer a 48-token sliding window: the cache keeps 47 tokens whatever the context.
    model_config = AutoConfig.for_model("mistral", **dict(TINY_CONFIGS["mistral"], sliding_window=48))
    rows = plan(model_config, GiB, batch=8, context=1000, presets=["k4v2"])
    kept = 2 * 47 * 2 * 16 * 2 * 2  # layers x kept tokens x kv heads x head_dim x (key + value) x 2 bytes
    assert rows[0].max_context is None and rows[0].sequence_nbytes == kept
    assert expected_nbytes(model_config, UNQUANTIZED, 10**6) == rows[0].sequence_nbytes


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 1536, 80 * GiB, 1_342_052_808_704)] == \
        ["512 B", "1.50 KiB", "80.0 GiB", "1.22 TiB"]


def test_tensor_parallel_plan_is_per_rank():
    """--tp N: a dense model's KV bytes per rank are 1/N (its kv heads are split), an MLA model's are unchanged
    (the latent is replicated); weights per rank follow the model's own TP plan."""
    from kvarn_mla.plan import tp_kv_heads

    llama, deepseek = load_config("llama-3-8b"), load_config("deepseek-v3")
    assert tp_kv_heads(llama, 4) == 2 and tp_kv_heads(deepseek, 8) is None and tp_kv_heads(llama, 1) is None
    for model_config, divisor in ((llama, 4), (deepseek, 1)):
        single, split = (plan(model_config, 2**40, context=8192, presets=["k4v2"], tp=tp) for tp in (1, 4))
        assert [r.sequence_nbytes for r in split] == [r.sequence_nbytes // divisor for r in single]
    sharded = parameter_count(llama, 8)
    assert parameter_count(llama) / 8 < sharded < parameter_count(llama) / 8 * 1.001  # only norms are replicated
    assert weight_bytes(deepseek, 1, 8) == parameter_count(deepseek, 8)
    with pytest.raises(ValueError, match="--tp 3 does not divide the 8 kv heads"):
        plan(llama, 2**40, tp=3)


def test_cli_plan_tp(capsys):
    assert main(["plan", "--model", "deepseek-v3", "--memory", "141GiB", "--tp", "8", "--dtype-bytes", "1",
                 "--preset", "k4v2"]) == 0
    out = capsys.readouterr().out
    assert "per rank of --tp 8" in out and "the MLA latent and RoPE key are replicated on every rank" in out
    assert main(["plan", "--model", "llama-3-70b", "--memory", "80GiB", "--tp", "8", "--preset", "k4v2"]) == 0
    assert "1 kv head per rank" in capsys.readouterr().out
