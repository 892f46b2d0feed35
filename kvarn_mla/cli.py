"""The ``kvarn-mla`` command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .adapters import adapter_for
from .config import PRESETS, KVarNConfig


def _presets(args: argparse.Namespace) -> int:
    from .archs import load_config
    from .cache import expected_nbytes

    model_config = load_config(args.model)
    adapter = adapter_for(model_config)
    text_config = model_config.get_text_config(decoder=True)
    unquantized = KVarNConfig(key_bits=16, value_bits=16, latent_bits=16, rope_bits=16)
    dense = expected_nbytes(model_config, unquantized, args.context)
    print(f"{args.model}: {adapter.family} attention; KV bytes per token over all layers at {args.context} tokens "
          "(sink, tail and scales included), and per layer in a quantized tile (the long-context limit)")
    bits_header = "latent/rope" if adapter.family == "mla" else "key/value"
    print(f"{'preset':<11} {'method':<9} {bits_header:<12} {'tile':>4} {'sink':>5} {'tile B/tok/layer':>16} "
          f"{'B/token':>9} {'vs 16-bit':>9}")
    for name, config in [("16-bit", unquantized), *PRESETS.items()]:
        bits = (config.latent_bits, config.rope_bits) if adapter.family == "mla" else (config.key_bits, config.value_bits)
        per_layer = sum(
            s.num_heads * (s.tile_nbytes(config.tile_size) / config.tile_size if s.bits < 16 else 2 * s.dim)
            for s in adapter.stream_specs(text_config, config)
        )
        held = expected_nbytes(model_config, config, args.context)
        method = "-" if config is unquantized else config.method
        print(f"{name:<11} {method:<9} {'/'.join(map(str, bits)):<12} {config.tile_size:>4} {config.sink_tokens:>5} "
              f"{per_layer:>16.1f} {held / args.context:>9.1f} {dense / held:>8.3f}x")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvarn-mla", description="KVarN KV-cache quantization for transformers")
    parser.add_argument("--version", action="version", version=f"kvarn-mla {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    presets = commands.add_parser("presets", help="list the presets with their bits and bytes per token")
    presets.add_argument("--model", default="deepseek-v3",
                         help="bundled architecture name, config.json or model directory (default: deepseek-v3)")
    presets.add_argument("--context", type=int, default=4096, help="context length in tokens (default: 4096)")
    presets.set_defaults(run=_presets)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "context", 1) < 1:
        parser.error(f"--context must be a positive number of tokens, got {args.context}")
    try:
        return args.run(args)
    except (ValueError, NotImplementedError) as error:
        print(f"kvarn-mla: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
