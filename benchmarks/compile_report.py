"""Ahead-of-time compile report of the Triton kernels for NVIDIA targets, on a machine without a GPU.

Each variant is the launch the project's own launcher prepares (`plan_tiled_attention`, `plan_store_tiles`) for a
chosen compute capability, on CPU tensors of a realistic shape. The launch goes through Triton's own argument
specialization (pointer alignment, integer divisibility, constexprs) and ``triton.compile`` for
``GPUTarget("cuda", arch, 32)``; the PTX is assembled by the ``ptxas`` that the triton wheel bundles, whose ``-v``
log gives registers and spills. Nothing runs on a GPU.

Per variant: registers, spill stores/loads (bytes per thread), shared memory (Triton's allocation, checked against
the target's per-block limit), and float64 instruction counts (PTX and SASS).

    python benchmarks/compile_report.py --arch 90 80 86          # full tables -> benchmarks/results/compile_sm*.md
    python benchmarks/compile_report.py --arch 90 80 --quick --json  # what tests/test_compile.py runs

TRITON_INTERPRET must not be set (under the interpreter ``@triton.jit`` builds no compilable kernel): this script
unsets it before importing triton, so run it as its own process. FP fusion is Triton 3.9's default (on), stated
through ``TRITON_DEFAULT_FP_FUSION=1`` unless set otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TARGETS = {90: "H100/H200", 80: "A100", 86: "RTX 30xx/A10/A40", 89: "L4/L40/RTX 40xx"}


def ptxas_path() -> str | None:
    """The ``ptxas`` bundled with the triton wheel (or named by ``TRITON_PTXAS_PATH``), or None."""
    from triton import knobs

    try:
        path = knobs.nvidia.ptxas.path
    except Exception:  # noqa: BLE001 - triton raises when no ptxas can be found
        return None
    return path if path and os.path.exists(path) else None


# ------------------------------------------------------------------------------------------------------------------
# Compiling one prepared launch
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class CompileResult:
    """What ``ptxas -v`` and the compiled kernel say about one variant on one target."""

    name: str
    kernel: str
    arch: int
    ok: bool
    error: str = ""
    num_warps: int = 0
    num_stages: int = 0
    registers: int = -1
    spill_stores: int = -1  # bytes per thread
    spill_loads: int = -1
    stack: int = -1  # bytes per thread (spills and local arrays)
    shared: int = -1  # bytes per block: Triton's allocation (+ any static)
    shared_limit: int = 0
    ptx_fp64: int = -1  # PTX instructions with an .f64 type
    sass_fp64: int = -1  # SASS double-precision instructions (DADD/DMUL/DFMA/DSETP/DMNMX/MUFU.*64)
    seconds: float = 0.0


_PTXAS_USAGE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTX_F64 = re.compile(r"^\s*(?:@!?%p\d+\s+)?[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*\.f64\b", re.M)
_SASS_FP64 = re.compile(r"\b(?:DADD|DMUL|DFMA|DSETP|DMNMX|DSET|MUFU\.(?:RCP|RSQ)64H)\b")


def parse_ptxas_log(log: str) -> dict[str, int]:
    """Registers, stack, spill stores/loads and static shared memory of the entry function in a ``ptxas -v`` log."""
    entry = log.split("Compiling entry function", 1)[-1]
    usage = _PTXAS_USAGE.search(entry)
    registers = re.search(r"Used (\d+) registers", entry)
    static = re.search(r"(\d+) bytes smem", entry)
    if usage is None or registers is None:
        raise ValueError(f"no resource usage in the ptxas log:\n{log[-2000:]}")
    stack, stores, loads = map(int, usage.groups())
    return {
        "registers": int(registers.group(1)),
        "stack": stack,
        "spill_stores": stores,
        "spill_loads": loads,
        "static_shared": int(static.group(1)) if static else 0,
    }


def _sass_fp64(cubin: bytes) -> int:
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "kernel.cubin")
        path.write_bytes(cubin)
        command = [knobs.nvidia.cuobjdump.path, "-sass", str(path)]
        sass = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return len(_SASS_FP64.findall(sass))


def compile_launch(name: str, kind: str, launch, arch: int, *, sass: bool = True) -> CompileResult:
    """Compile a `KernelLaunch` for ``sm_<arch>`` with the bundled ptxas; never raises for a compile failure."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from kvarn_mla.kernels.common import shared_memory_limit

    started = time.perf_counter()
    result = CompileResult(name, kind, arch, ok=False, shared_limit=shared_memory_limit((arch // 10, arch % 10)))
    fn = launch.kernel
    try:
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        # Triton's own specialization of the arguments (what JITFunction.run does before compiling).
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        kwargs = dict(launch.kwargs, debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
        bound, specialization, options = binder(*launch.args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        result.num_warps, result.num_stages = options.num_warps, options.num_stages
        log = io.StringIO()
        with knobs.nvidia.scope(), knobs.compilation.scope():
            knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas's -v log to stdout
            knobs.compilation.always_compile = True  # a cache hit would skip ptxas, and its log with it
            with contextlib.redirect_stdout(log):
                source = ASTSource(fn, signature, constexprs, attrs)
                compiled = triton.compile(source, target=target, options=options.__dict__)
        usage = parse_ptxas_log(log.getvalue())
        result.registers, result.stack = usage["registers"], usage["stack"]
        result.spill_stores, result.spill_loads = usage["spill_stores"], usage["spill_loads"]
        result.shared = compiled.metadata.shared + usage["static_shared"]
        result.ptx_fp64 = len(_PTX_F64.findall(compiled.asm["ptx"]))
        if sass:
            result.sass_fp64 = _sass_fp64(compiled.asm["cubin"])
        result.ok = True
    except Exception as error:  # noqa: BLE001 - reported per variant
        lines = str(error).strip().splitlines()
        result.error = f"{type(error).__name__}: " + " / ".join(line for line in lines[:6] if line.strip())
    result.seconds = round(time.perf_counter() - started, 1)
    return result


# ------------------------------------------------------------------------------------------------------------------
# Variants: the launches the launchers prepare for a target
# ------------------------------------------------------------------------------------------------------------------
def variants(arch: int, quick: bool) -> list[tuple[str, str, Callable]]:
    """(name, kernel, build) for every variant; ``build()`` returns the `KernelLaunch` for compute capability
    ``arch``. ``quick``: the representative subset tests/test_compile.py compiles (MLA at DeepSeek widths with a
    16- and an 8-bit RoPE key, one and two tiles per split; GQA at head_dim 128; the store at 8 bits)."""
    import torch

    from kvarn_mla.kernels.decode import plan_tiled_attention
    from kvarn_mla.kernels.store import plan_store_tiles
    from kvarn_mla.quant import QuantizedTile, StreamView, packed_width
    from kvarn_mla.quant.scheme import TileScheme

    capability = (arch // 10, arch % 10)
    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

    def store(bits: int, axis: str, dim: int, dtype, *, mask: bool = False, iters: int = 8, hadamard: bool = True):
        def build():
            scheme = TileScheme(bits, axis, tile_size=128, varnorm_iters=iters, hadamard=hadamard)
            valid = torch.ones(2, 128, dtype=torch.bool) if mask else None
            x = torch.zeros(2, 128, dim, dtype=dtype)
            return plan_store_tiles(x, scheme, valid, capability=capability)[0]

        extra = (" mask" if mask else "") + ("" if iters else (" rotation-only" if hadamard else " kivi"))
        return f"store {'K' if axis == 'channel' else 'V'} d{dim} b{bits} {names[dtype]}{extra}", "store", build

    def view(bits: int, axis: str, heads: int, dim: int, dtype, tiles: int) -> StreamView:
        # 128 sink tokens, `tiles` tiles of 128 and 10 tail tokens, never filled (compiling needs shapes only).
        scheme = TileScheme(bits, axis)
        if not scheme.quantized:
            tokens = torch.zeros(2, heads, 138 + 128 * tiles, dim, dtype=dtype)
            return StreamView(scheme, dim, dtype, None, None, tokens)
        rows, cols = scheme.rows_cols(dim)
        codes = torch.zeros(2, heads, tiles, 128, packed_width(dim, bits), dtype=torch.uint8)
        meta = (torch.zeros(2, heads, tiles, n, dtype=torch.float16) for n in (rows, rows, cols))
        sink, tail = (torch.zeros(2, heads, n, dim, dtype=dtype) for n in (128, 10))
        return StreamView(scheme, dim, dtype, sink, QuantizedTile(codes, *meta), tail)

    def mask(q_len: int, tiles: int):
        return torch.ones(2, 1, q_len, 138 + 128 * tiles, dtype=torch.bool) if q_len > 1 else None

    def dense(kv_heads: int, group: int, dim: int, kbits: int, vbits: int, dtype, *, q_len: int = 1):
        def build():
            keys = view(kbits, "channel", kv_heads, dim, dtype, 4)
            values = view(vbits, "token", kv_heads, dim, dtype, 4)
            q = torch.zeros(2, kv_heads, group * q_len, dim)
            plan = plan_tiled_attention(
                q, [keys], values, dim**-0.5, q_len=q_len, mask=mask(q_len, 4), num_splits=2, capability=capability
            )
            return plan.launch

        family = "MHA" if group == 1 else f"GQA{group}"
        extra = f" qlen{q_len} mask" if q_len > 1 else ""
        return f"decode {family} hd{dim} k{kbits}v{vbits} {names[dtype]}{extra}", "decode", build

    def mla(heads: int, lbits: int, rbits: int, dtype, *, tiles_per_split: int = 2, q_len: int = 1):
        def build():
            latent = view(lbits, "channel", 1, 512, dtype, 2 * tiles_per_split)
            rope_key = view(rbits, "channel", 1, 64, dtype, 2 * tiles_per_split)
            q = torch.zeros(2, 1, heads * q_len, 576)
            plan = plan_tiled_attention(
                q,
                [latent, rope_key],
                None,
                192**-0.5,
                q_len=q_len,
                mask=mask(q_len, 2 * tiles_per_split),
                num_splits=2,
                capability=capability,
            )
            return plan.launch

        extra = f" qlen{q_len} mask" if q_len > 1 else ""
        name = f"decode MLA h{heads} L512b{lbits} R64b{rbits} {names[dtype]} {tiles_per_split} tile/split{extra}"
        return name, "decode", build

    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    quick_set = [
        mla(128, 4, 16, bf16, tiles_per_split=2),
        mla(128, 4, 8, f16, tiles_per_split=1),
        dense(8, 4, 128, 4, 2, bf16),
        store(8, "channel", 128, f16),
        store(8, "token", 128, f16),
    ]
    if quick:
        return quick_set
    out = [
        mla(128, 4, rbits, dtype, tiles_per_split=tps) for rbits in (16, 8) for dtype in (f16, bf16) for tps in (1, 2)
    ]
    out += [
        mla(128, 2, 16, bf16),
        mla(128, 8, 8, bf16),
        mla(16, 4, 16, bf16),
        mla(128, 4, 16, f32),
        mla(128, 4, 16, bf16, q_len=2),
    ]
    out += [dense(8, 4, dim, bits, bits, f16) for dim in (64, 128) for bits in (2, 3, 4, 8)]
    out += [
        dense(8, 4, 128, 4, 2, bf16),
        dense(32, 1, 128, 4, 2, bf16),
        dense(8, 8, 128, 4, 2, bf16),
        dense(8, 4, 128, 4, 2, f32),
        dense(8, 4, 128, 4, 2, f16, q_len=6),
    ]
    out += [store(bits, axis, 128, f16) for axis in ("channel", "token") for bits in (2, 3, 4, 8)]
    out += [store(bits, "channel", 512, bf16) for bits in (2, 4, 8)]
    out += [store(8, "channel", 64, bf16), store(4, "channel", 128, f16, mask=True), store(2, "token", 128, f32)]
    return out


_WORK: list[tuple[str, str, Callable, int]] = []  # what the forked workers compile, by index


def _compile_one(index: int) -> CompileResult:
    name, kind, build, arch = _WORK[index]
    try:
        launch = build()
    except Exception as error:  # noqa: BLE001 - a launcher that refuses the shape is a failure of this variant
        return CompileResult(name, kind, arch, ok=False, error=f"launcher: {type(error).__name__}: {error}")
    result = compile_launch(name, kind, launch, arch)
    print(f"  sm_{arch} {name}: {'ok' if result.ok else 'FAILED'} ({result.seconds} s)", file=sys.stderr, flush=True)
    return result


def run(archs: list[int], quick: bool, jobs: int, only: str = "") -> list[CompileResult]:
    """Compile every variant for each ``sm_<arch>`` (``jobs`` forked processes; ``only``: names containing it)."""
    _WORK[:] = [
        (name, kind, build, arch) for arch in archs for name, kind, build in variants(arch, quick) if only in name
    ]
    if jobs > 1 and len(_WORK) > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(jobs) as pool:
            return pool.map(_compile_one, range(len(_WORK)), chunksize=1)
    return [_compile_one(index) for index in range(len(_WORK))]


def markdown(arch: int, results: list[CompileResult], only: str = "") -> str:
    import triton

    limit = results[0].shared_limit if results else 0
    command = f"python benchmarks/compile_report.py --arch {arch}" + (f" --only {only}" if only else "")
    lines = [
        f"# Compile report, sm_{arch} ({TARGETS.get(arch, '')})",
        "",
        f"`{command}` with triton {triton.__version__} and its bundled ptxas "
        f"(FP fusion on); shared memory limit per block {limit:,} B. Spills and stack are bytes per thread; fp64 "
        "counts are instructions in the PTX and in the SASS. Each variant is the launch the launcher prepares for "
        "this target (block sizes, warps, stages as chosen there).",
        "",
        "| variant | ok | warps | stages | registers | spill st/ld B | stack B | shared B | PTX fp64 | SASS fp64 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        status = "yes" if r.ok else f"**no**: {r.error[:200]}"
        if r.ok and r.shared > r.shared_limit:
            status = "**over the shared memory limit**"
        lines.append(
            f"| {r.name} | {status} | {r.num_warps} | {r.num_stages} | {r.registers} | "
            f"{r.spill_stores}/{r.spill_loads} | {r.stack} | {r.shared:,} | {r.ptx_fp64} | {r.sass_fp64} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (90 80 86 89)")
    parser.add_argument("--quick", action="store_true", help="the representative subset tests/test_compile.py uses")
    parser.add_argument("--only", default="", help="only variants whose name contains this (e.g. decode, store)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel compiles")
    parser.add_argument("--json", action="store_true", help="print one JSON list of results (no files written)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of compile_sm<arch>.md (full runs)")
    args = parser.parse_args(argv)
    if ptxas_path() is None:
        print("no ptxas: the triton wheel bundles none here and TRITON_PTXAS_PATH is unset", file=sys.stderr)
        return 2
    results = run(args.arch, args.quick, args.jobs, args.only)
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    else:
        for arch in args.arch:
            text = markdown(arch, [r for r in results if r.arch == arch], args.only)
            print(text)
            if not args.quick:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"compile_sm{arch}.md").write_text(text)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
