"""The ``kvarn-mla`` command line and the byte arithmetic behind ``presets``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TINY_CONFIGS
from transformers import AutoConfig

from kvarn_mla import PRESETS, KVarNCache, __version__
from kvarn_mla.archs import ARCHITECTURES, load_config
from kvarn_mla.cli import main
from kvarn_mla.plan import expected_nbytes


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3", "deepseek_v32", "mistral"])
@pytest.mark.parametrize("preset, tokens", [("k4v2", 700), ("k2v2", 64), ("k4v2-r8", 129), ("k8v8", 0)])
def test_expected_nbytes_equals_what_the_cache_holds(model_type, preset, tokens):
    sliding = dict(sliding_window=48, layer_types=["full_attention", "sliding_attention"])
    overrides = sliding if model_type == "mistral" else {}
    model_config = AutoConfig.for_model(model_type, **dict(TINY_CONFIGS[model_type], **overrides))
    config = PRESETS[preset].replace(tile_size=64, sink_tokens=64)
    cache = KVarNCache(model_config, config)
    gen = torch.Generator().manual_seed(0)
    for index, layer in enumerate(cache.layers):
        specs = getattr(layer, "specs", None) or cache.layers[0].specs
        for step in (tokens // 2, tokens - tokens // 2):
            if step == 0:
                continue
            k, v = (
                torch.randn(3, s.num_heads, step, s.dim, generator=gen, dtype=torch.float32).bfloat16() for s in specs
            )
            layer.update(k, v)
            if hasattr(layer, "flush"):
                layer.flush()
            if hasattr(layer, "update_indexer"):
                layer.update_indexer(torch.randn(3, step, model_config.index_head_dim).bfloat16())
    assert cache.nbytes() == expected_nbytes(model_config, config, tokens, batch=3)


def test_version_and_presets_table(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"kvarn-mla {__version__}"
    assert main(["presets", "--model", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert "MLA attention" in out and "latent/rope" in out
    assert "k4v2          kvarn          4/16          128   128            402.0" in out
    assert "16-bit        -              16/16         128   128           1152.0" in out
    assert "kvarn-vn-k4v2 rotation/kvarn 4/16          128   128            402.0" in out
    for name in PRESETS:
        assert f"\n{name} " in out
    assert main(["presets", "--model", "llama-3-8b"]) == 0
    out = capsys.readouterr().out
    assert "GQA attention" in out and "key/value" in out
    assert "k4v2          kvarn          4/2           128   128            864.0" in out


def test_presets_reads_a_config_file(tmp_path, capsys):
    fields = dict(TINY_CONFIGS["qwen3"], model_type="qwen3")
    (tmp_path / "config.json").write_text(json.dumps(fields))
    assert main(["presets", "--model", str(tmp_path), "--context", "1000"]) == 0
    assert "at 1000 tokens" in capsys.readouterr().out


def test_cli_errors_name_the_value(capsys):
    assert main(["presets", "--model", "gpt-5"]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["presets", "--context", "0"])
    assert "--context must be a positive number of tokens, got 0" in capsys.readouterr().err


def test_bundled_architectures_are_valid_configs():
    for name in ARCHITECTURES:
        assert load_config(name).model_type == ARCHITECTURES[name][0]


def test_console_script_entry_point():
    command = [sys.executable, "-m", "kvarn_mla.cli", "--version"]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"kvarn-mla {__version__}"


def _run_cli(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvarn_mla.cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=600)


def test_help_and_version_import_neither_torch_nor_transformers():
    probe = ("import sys\nfrom kvarn_mla.cli import main\n"
             "for argv in (['--help'], ['--version'], ['eval', '--help']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print('imported:', sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules),"
             " file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=600)
    assert out.stderr.strip().splitlines()[-1] == "imported: []"
    assert "usage: kvarn-mla" in out.stdout and f"kvarn-mla {__version__}" in out.stdout


def test_a_reader_that_stops_early_ends_the_command_quietly():
    read, write = os.pipe()
    os.close(read)  # like `kvarn-mla presets | head` once head has gone: every write meets a closed pipe
    try:
        out = _run_cli("presets", "--model", "llama-3-8b", stdout=write)
    finally:
        os.close(write)
    assert out.stderr == "" and out.returncode == 141


def test_bench_needs_an_explicit_out_and_writes_only_there(tmp_path, monkeypatch, capsys):
    from kvarn_mla.evaluation import bench

    def run_bench(families, contexts, steps, out_dir, prefill_up_to):
        out_dir.mkdir(parents=True)
        (out_dir / "bench_cpu.json").write_text("[]")
        return []

    monkeypatch.setattr(bench, "run_bench", run_bench)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench"])  # the committed results were the default --out
    assert exit_info.value.code == 2 and "the following arguments are required: --out" in capsys.readouterr().err
    assert main(["bench", "--out", "fresh"]) == 0 and os.listdir(tmp_path) == ["fresh"]
