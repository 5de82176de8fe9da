"""SASS instructions per main-loop step of llm_core.nf4_mm, per loop form (no GPU needed).

    python -m bench.nf4_mm_sass [--m 8] [--n 4096] [--k 4096] [--tile 32x256/s1/w4/st2] [--decode asm]
                                [--variants base,even,even+xvec,scale16,even+xvec+asm_scale,all] [--fp32-absmax]
                                [--no-divisibility] [--full] [--sass-dir DIR] [--json OUT]

Compiles the kernel for sm_90 on this machine (Triton's bundled ptxas; nf4_mm.compile_without_device: the argument
types and 16-divisibility the wrapper's launch gives for that (M, N, K)), disassembles it (nvdisasm, through
Triton's `asm["sass"]`) and counts the instructions of the main loop, the longest span between a label and a
backward branch to it, by opcode. Prints one line per variant (total, then the largest opcodes) and, with --json,
writes them all. Variants are MMConfig's loop-form flags joined by '+': base (none), even, xvec, scale16,
asm_scale; 'all' is even+xvec+scale16 (asm_scale only matters without scale16).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
FLAGS = ("even", "xvec", "scale16", "asm_scale")
_OP = re.compile(r"^\S+\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_LABEL = re.compile(r"^\s*(\.?L\w+):\s*$")
_BRANCH = re.compile(r"\bBRA\s+(?:`\()?(\.?L\w+)")


def loop_ops(sass: str) -> collections.Counter[str]:
    """Full opcodes (with modifiers) of the longest loop: from a label to the last backward branch to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    best = (0, 0)
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    ops: collections.Counter[str] = collections.Counter()
    for line in lines[best[0] + 1:best[1] + 1]:
        m = _OP.match(line)
        if m:
            ops[m.group(1)] += 1
    return ops


def by_base(ops: collections.Counter[str]) -> collections.Counter[str]:
    out: collections.Counter[str] = collections.Counter()
    for op, c in ops.items():
        out[op.split(".")[0]] += c
    return out


def config_for(tile: str, variant: str) -> Any:
    """'BNxBK/s<split>/w<warps>/st<stages>' and 'even+xvec' -> MMConfig."""
    from llm_core.fast.kernels.nf4_mm import MMConfig

    size, split, warps, stages = tile.split("/")
    bn, bk = (int(v) for v in size.split("x"))
    names = {"even", "xvec", "scale16"} if variant == "all" else {f for f in variant.split("+") if f != "base"}
    unknown = names - set(FLAGS)
    if unknown:
        raise SystemExit(f"unknown loop forms {sorted(unknown)}; known: {FLAGS}")
    return MMConfig(bn, bk, int(split[1:]), int(warps[1:]), int(stages[2:]), True,
                    **{f: f in names for f in FLAGS})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--tile", default="32x256/s1/w4/st2", help="BNxBK/s<split>/w<warps>/st<stages>")
    ap.add_argument("--decode", default="asm", choices=("asm", "gather"))
    ap.add_argument("--variants", default="base,even,even+xvec,scale16,even+xvec+asm_scale,all")
    ap.add_argument("--fp32-absmax", action="store_true", help="absmax in fp32 instead of double quant")
    ap.add_argument("--no-divisibility", action="store_true",
                    help="compile without the launcher's 16-divisibility (how the first counts were taken)")
    ap.add_argument("--top", type=int, default=12, help="opcodes shown per line")
    ap.add_argument("--full", action="store_true", help="count opcodes with their modifiers (IMAD.MOV, ...)")
    ap.add_argument("--sass-dir", type=Path, help="write each variant's whole SASS here")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--frag", action="store_true",
                    help="llm_core.nf4_frag instead: its forms plain, table, table+pairs (FragConfig.table_regs, "
                         "scale_pairs) at --frag-ms rows, one K split, 4 warps; loop instructions a 64-block "
                         "(32 weights a thread) and the registers cuobjdump reports")
    ap.add_argument("--frag-ms", default="8,16,32")
    ap.add_argument("--frag-depths", default="1", help="FragConfig.depth values (blocks a warp takes an iteration)")
    ap.add_argument("--frag-early", action="store_true", help="also each form with FragConfig.early")
    args = ap.parse_args(argv)
    if args.frag:
        return frag_counts(args)

    from llm_core.fast.kernels.nf4_mm import compile_without_device

    records = []
    for variant in args.variants.split(","):
        cfg = config_for(args.tile, variant)
        kern = compile_without_device(args.m, args.n, args.k, 64, cfg, args.decode, NF4, not args.fp32_absmax,
                                      divisibility=not args.no_divisibility)
        sass = kern.asm["sass"]
        ops = loop_ops(sass)
        shown = ops if args.full else by_base(ops)
        total = sum(ops.values())
        rec = {"variant": variant, "config": cfg.as_list(), "loop_instructions": total,
               "n_regs": getattr(kern, "n_regs", None), "shared_bytes": getattr(kern.metadata, "shared", None),
               "ops": dict(shown.most_common())}
        records.append(rec)
        top = " ".join(f"{op} {c}" for op, c in shown.most_common(args.top))
        print(f"{variant:22s} {total:5d}  {top}", flush=True)
        if args.sass_dir:
            args.sass_dir.mkdir(parents=True, exist_ok=True)
            (args.sass_dir / f"{variant.replace('+', '_')}.sass").write_text(sass)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "m": args.m, "n": args.n, "k": args.k,
                                         "tile": args.tile, "decode": args.decode, "records": records}, indent=1))
    return 0


def cubin_registers(cubin: bytes) -> int | None:
    """Registers a thread, from `cuobjdump -res-usage` (Triton's bundled copy), or None where it is missing."""
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    return int(m.group(1)) if m else None


def frag_counts(args: argparse.Namespace) -> int:
    """--frag: nf4_frag's main loop per form and row count."""
    from llm_core.fast.kernels.nf4_frag import FragConfig, compile_without_device

    forms = {"plain": (False, False, False), "table": (True, False, False), "table+pairs": (True, True, False)}
    if args.frag_early:
        forms.update({f"{name}+early": (t, p, True) for name, (t, p, _) in list(forms.items())})
    records = []
    for m, depth in itertools.product((int(v) for v in args.frag_ms.split(",")),
                                      (int(v) for v in args.frag_depths.split(","))):
        for name, (table, pairs, early) in forms.items():
            cfg = FragConfig(4, 1, True, table, pairs, depth, early)
            kern = compile_without_device(m, args.n, args.k, 64, cfg, NF4, not args.fp32_absmax)
            ops = loop_ops(kern.asm["sass"])
            shown = ops if args.full else by_base(ops)
            total = sum(ops.values())
            rec = {"m": m, "form": name, "depth": depth, "loop_instructions": total,
                   "per_weight": round(total / (32 * depth), 2),
                   "registers": cubin_registers(kern.asm["cubin"]), "ops": dict(shown.most_common())}
            records.append(rec)
            top = " ".join(f"{op} {c}" for op, c in shown.most_common(args.top))
            print(f"M={m:2d} d{depth} {name:18s} {total:4d} ({rec['per_weight']} a weight, {rec['registers']} "
                  f"registers)  {top}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "n": args.n, "k": args.k,
                                         "kernel": "nf4_frag", "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
