"""The kernels compile for real GPU targets on this CPU-only machine, with the ptxas the triton wheel bundles.

The launchers' own launches for sm_90 and sm_80 (`benchmarks/compile_report.py --quick`: MLA decode at 128 heads x
(512 + 64) with a 16- and an 8-bit RoPE key, one and two tiles per split; GQA decode at head_dim 128; the store
kernel at 8 bits), compiled in a subprocess because the suite runs Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``, under which nothing compiles). The full tables are ``benchmarks/results/compile_sm*.md``.
40 s on this 2-core machine (103 s while other jobs ran).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ptxas() -> tuple[str | None, str]:
    try:
        from triton import knobs

        path = knobs.nvidia.ptxas.path
    except Exception as error:  # noqa: BLE001 - triton raises when it finds no ptxas
        return None, f"{type(error).__name__}: {error}"
    if not path or not os.path.exists(path):
        return None, f"ptxas path {path!r} does not exist"
    return path, ""


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    path, why = _ptxas()
    if path is None:
        pytest.skip(f"no ptxas to compile with (the triton wheel bundles one; TRITON_PTXAS_PATH names another): {why}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    script = str(ROOT / "benchmarks" / "compile_report.py")
    command = [sys.executable, script, "--arch", "90", "80", "--quick", "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.stdout.strip(), f"compile_report printed nothing (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_variant_compiles(compiled):
    assert {r["arch"] for r in compiled} == {90, 80}
    failed = [f"sm_{r['arch']} {r['name']}: {r['error']}" for r in compiled if not r["ok"]]
    assert not failed, "\n".join(failed)


def test_no_register_spills(compiled):
    # The decode kernels run every step; the store kernel once a tile, but a spill there is local-memory traffic
    # in its float64 passes. Neither may spill.
    spilling = [
        f"sm_{r['arch']} {r['name']}: {r['registers']} registers, {r['spill_stores']}/{r['spill_loads']} B spilled"
        for r in compiled
        if r["ok"] and (r["spill_stores"] or r["spill_loads"])
    ]
    assert not spilling, "\n".join(spilling)


def test_shared_memory_within_each_targets_limit(compiled):
    over = [
        f"sm_{r['arch']} {r['name']}: {r['shared']:,} B > {r['shared_limit']:,} B"
        for r in compiled
        if r["ok"] and r["shared"] > r["shared_limit"]
    ]
    assert not over, "\n".join(over)
    # The MLA decode launch also fits the 99 KB of sm_86/sm_89, whose launcher picks the same blocks.
    mla = [r for r in compiled if r["ok"] and "MLA" in r["name"]]
    assert mla and max(r["shared"] for r in mla) <= 101_376
