"""Small-M 4-bit matmul sweep: per linear of a Llama layer (qkv, o, gate_up, down), M = 1..32 activation rows,
time and achieved bandwidth of llm_core.nf4_mm (each launch config and decode), the older llm_core kernels
(nf4_gemv at M = 1, nf4_rows above), bitsandbytes' matmul_4bit, dequantize_4bit + matmul, and bf16 cuBLAS.

    python -m bench.small_m --out results.json [--archs llama-2-7b,llama-3-8b] [--ms 1,2,4,8,16,32] [--budget-s 420]
                            [--forms all] [--refine 3] [--overlap | --fused | --frag]

--frag (M <= 32): llm_core.nf4_frag over the weights repacked into mma fragment order (its default_config and, up
to 8 rows, a grid of warps x splits x forms) beside the engine's calls of today: nf4_mm's launch rule (PDL, the
weight's own counters) and, at M = 1, the one-token GEMV (PDL); the summary sums each per layer.

Loop forms (MMConfig.even / xvec / scale16): the grid runs with --forms (default all three), the library's rule
without them (ours-default: the library's rule keeps them off until timed) and with them (ours-default-all,
ours-default-even+xvec+asm_scale), and the best --refine configs again with each of base,
even+xvec, even+xvec+asm_scale (the older bits), scale16 and all; the summary's ours-<forms>_us is each form's best
per layer.

Weights: random bf16 of the real shape, quantized by bitsandbytes (NF4, blocksize 64, double quant), one tensor per
fused shape (the fused parts' separate offsets only change which offset a block reads: tests/test_nf4_mm.py checks
that layout). Clock: each variant is captured in one CUDA graph that calls it on `copies` independent weight sets
(together over 3x the L2, so no call finds its weights in the cache), replayed 30 times with events around each
replay; time per call = median replay / calls in the graph. Bandwidth = NF4 bytes (packed weights + 8-bit absmax +
second-level scales) / time; the copy bandwidth (1 GiB device-to-device copy, read + write bytes) is measured in the
same run. Each variant's output on the first weight set is checked against x @ dequantize_4bit(W).T in fp32
(relative L2 error recorded; the bound the tests use is 1e-2). Needs CUDA, bitsandbytes and Triton.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

LAYERS = {  # arch -> {linear: (N, K)}
    "llama-2-7b": {"qkv": (3 * 4096, 4096), "o": (4096, 4096), "gate_up": (2 * 11008, 4096), "down": (4096, 11008)},
    "llama-3-8b": {"qkv": (4096 + 2 * 1024, 4096), "o": (4096, 4096), "gate_up": (2 * 14336, 4096),
                   "down": (4096, 14336)},
}
# (BLOCK_N, BLOCK_K, warps) tiles for the tensor-core form, and for the CUDA-core form at M <= 4 (smaller: the
# broadcast product holds M x tile values)
DOT_TILES = [(16, 512, 4), (32, 256, 4), (64, 256, 8), (64, 128, 4), (128, 128, 8)]
FMA_TILES = [(16, 256, 4), (32, 128, 4), (8, 512, 4)]
SPLITS = (1, 2, 4, 8)
# --fused: the tiles and splits the in-launch split sum is timed over (its splits cost no second kernel, so more of
# them may pay)
FUSED_TILES = [(64, 128, 4), (32, 128, 4)]
FUSED_SPLITS = (2, 4, 8, 16)


def graph_us(calls: list[Any], replays: int = 30) -> float:
    """Median µs per call over `replays` replays of one graph that makes every call in `calls` once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del g
    return statistics.median(times) / len(calls)


def copy_bandwidth() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = graph_us([lambda: y.copy_(x)] * 4, replays=10)
    return 2 * 2**30 / (us * 1e-6)


class WeightSet:
    """One random NF4 weight (N, K) in every form the variants read."""

    def __init__(self, n: int, k: int, seed: int) -> None:
        import bitsandbytes.functional as bf

        from llm_core.fast.kernels.nf4_gemv import words_view

        g = torch.Generator(device="cuda").manual_seed(seed)
        self.w = (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
        self.q, self.st = bf.quantize_4bit(self.w, blocksize=64, quant_type="nf4", compress_statistics=True)
        st = self.st
        self.packed = self.q.view(torch.uint8).reshape(n, k // 2)
        words = words_view(self.packed)
        assert words is not None
        self.words = words
        self.q8 = st.absmax.view(-1)
        self.absmax2 = st.state2.absmax.float()
        self.offsets = st.offset.float().reshape(()).repeat(self.absmax2.numel())
        self.code2 = st.state2.code.float()
        self.code = st.code.float()
        self.levels = [float(v) for v in st.code.float().tolist()]
        self.nf4_bytes = self.packed.numel() + self.q8.numel() + 4 * (self.absmax2.numel() + self.offsets.numel())
        from llm_core.fast.kernels.nf4_mm import mm_counters

        self.counters = mm_counters(n, "cuda")
        self._frag: torch.Tensor | None = None

    @property
    def frag(self) -> torch.Tensor:
        """The codes in nf4_frag's fragment order (repacked on first use: --frag), with frag_table and scale_pairs
        beside them."""
        if self._frag is None:
            from llm_core.fast.kernels import nf4_frag

            self._frag = nf4_frag.repack(self.packed)
            self.frag_table = nf4_frag.frag_table(self.levels, "cuda")
            from llm_core.fast.pack import nested_absmax_fp32

            absmax = nested_absmax_fp32(*self.nested())
            self.scale_pairs = nf4_frag.scale_pairs(absmax, self.packed.shape[0], 2 * self.packed.shape[1], 64)
        return self._frag

    def nested(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q8, self.absmax2, self.offsets, self.code2


def cases(archs: list[str], ms: list[int], l2: int, budget_s: float, t_start: float, doc: dict[str, Any],
          save: Any) -> Any:
    """Per arch, linear and M: (arch, linear, N, K, M, weight sets, one x per set, the fp32 reference of the first
    set's x @ dequantize_4bit(W).T). The sets together hold 3x the L2 (none is read from the cache by the next);
    a linear is not started past budget_s (the document says so, saved). Frees each linear's sets after it."""
    import bitsandbytes.functional as bf

    for arch in archs:
        for lin, (n, k) in LAYERS[arch].items():
            if time.perf_counter() - t_start > budget_s:
                doc["meta"]["stopped_early"] = f"budget {budget_s} s reached before {arch} {lin}"
                save()
                return
            first = WeightSet(n, k, seed=1)
            copies = max(2, math.ceil(3 * l2 / first.nf4_bytes))
            sets = [first] + [WeightSet(n, k, seed=2 + i) for i in range(copies - 1)]
            deq_ref = bf.dequantize_4bit(first.q, first.st).float()
            for m in ms:
                xs = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _ in sets]
                yield arch, lin, n, k, m, sets, xs, xs[0].float() @ deq_ref.T
            sets.clear()
            del first, deq_ref
            torch.cuda.empty_cache()


# MMConfig's loop forms (bench/nf4_mm_sass.py counts their instructions), and the combinations --refine re-times
# the best configs with
FORM_FLAGS = ("even", "xvec", "scale16", "asm_scale")
FORMS = ("base", "even+xvec", "even+xvec+asm_scale", "scale16", "all")


def with_forms(cfg: Any, forms: str) -> Any:
    """cfg with the loop forms 'base' (none), 'all' (even+xvec+scale16), or flags joined by '+' (even+xvec) on and
    the others off."""
    names = {"even", "xvec", "scale16"} if forms == "all" else {f for f in forms.split("+") if f != "base"}
    if names - set(FORM_FLAGS):
        raise ValueError(f"unknown loop forms {sorted(names - set(FORM_FLAGS))}; known: {FORM_FLAGS}")
    return cfg.replace(**{f: f in names for f in FORM_FLAGS})


def key_of(cfg: Any, decode: str, forms: str) -> str:
    return (f"ours:{decode}:{cfg.block_n}x{cfg.block_k}/s{cfg.split}/w{cfg.warps}/st{cfg.stages}/"
            f"{'dot' if cfg.dot else 'fma'}/{forms}")


def variants(m: int, n: int, k: int, sms: int, forms: str = "all") -> list[tuple[str, dict[str, Any]]]:
    """The library's launch rule (default_config: no loop form until timed), the same tile with every form
    ('-all') and with the bit-identical ones ('-even+xvec+asm_scale'), then the tile x split grid with `forms`."""
    from llm_core.fast.kernels.nf4_mm import MMConfig, default_config

    default = default_config(m, n, k, sms)
    out: list[tuple[str, dict[str, Any]]] = [("ours-default:asm", {"config": default, "decode": "asm"}),
                                             ("ours-default-all:asm", {"config": with_forms(default, "all"),
                                                                       "decode": "asm"}),
                                             ("ours-default-even+xvec+asm_scale:asm", {
                                                 "config": with_forms(default, "even+xvec+asm_scale"),
                                                 "decode": "asm"})]
    tiles = [(t, True) for t in DOT_TILES] + ([(t, False) for t in FMA_TILES] if m <= 4 else [])
    for (bn, bk, warps), dot in tiles:
        for split in SPLITS:
            programs = -(-n // bn) * split
            if not sms <= programs <= 12 * sms or k // (bk * split) < 2:
                continue
            cfg = with_forms(MMConfig(bn, bk, split, warps, 3, dot), forms)
            out.append((key_of(cfg, "asm", forms), {"config": cfg, "decode": "asm"}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--archs", default="llama-2-7b,llama-3-8b")
    ap.add_argument("--ms", default="1,2,4,8,16,32")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new shapes after this long")
    ap.add_argument("--refine", type=int, default=3,
                    help="re-time the best N configs with other stages / decodes / loop forms")
    ap.add_argument("--forms", default="all", help=f"loop forms of the swept grid: one of {FORMS} or flags "
                    f"joined by '+' ({'/'.join(FORM_FLAGS)}); --refine re-times the best with the others")
    ap.add_argument("--fused", action="store_true",
                    help="only the split sum: the launch rule with its splits summed by a second kernel and inside "
                         "the launch (MMConfig.fuse_splits, a counters buffer per weight set), then the in-launch "
                         "sum over FUSED_TILES x FUSED_SPLITS, all as programmatic dependent launches (the engine's "
                         "LAUNCH_OVERLAP=auto on sm_90); no grid")
    ap.add_argument("--frag", action="store_true",
                    help="only M <= 32: nf4_frag (fragment-order weights) over a grid, beside nf4_mm's rule and the "
                         "GEMV as the engine calls them; no nf4_mm grid")
    ap.add_argument("--frag-grid", default="all", choices=("all", "ahead"),
                    help="--frag's configs: all, or ahead: the default (both forms) and the loads-ahead forms only "
                         "(depth, early loads, warp tiles)")
    ap.add_argument("--overlap", action="store_true",
                    help="only the launch rule, one launch after the other and as programmatic dependent launches "
                         "(with and without the early weight prefetch): LAUNCH_OVERLAP per linear; no grid")
    args = ap.parse_args()

    import bitsandbytes as bnb
    import bitsandbytes.functional as bf
    import triton

    from llm_core.fast.kernels import nf4_gemv
    from llm_core.fast.kernels.nf4_mm import MMConfig, default_config, nf4_mm

    t_start = time.perf_counter()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    doc: dict[str, Any] = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "triton": triton.__version__, "bitsandbytes": bnb.__version__, "sms": sms,
                                    "l2_bytes": l2, "clock": __doc__.split("Clock: ")[1].split(" Bandwidth")[0]},
                           "records": []}
    bw = copy_bandwidth()
    doc["meta"]["copy_bytes_per_s"] = bw
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    ms = [int(v) for v in args.ms.split(",")]
    if args.frag:
        ms = [m for m in ms if m <= 32]

    def save() -> None:
        args.out.write_text(json.dumps(doc, indent=1))

    for case in cases(args.archs.split(","), ms, l2, args.budget_s, t_start, doc, save):
        arch, lin, n, k, m, sets, xs, ref = case
        first, copies = sets[0], len(sets)
        rec: dict[str, Any] = {"arch": arch, "linear": lin, "n": n, "k": k, "m": m, "copies": copies,
                               "nf4_bytes": first.nf4_bytes, "ideal_us": first.nf4_bytes / bw * 1e6,
                               "us": {}, "rel_err": {}, "errors": {}}

        def timed(name: str, make: Any, rec: dict[str, Any] = rec, xs: list[torch.Tensor] = xs,
                  ref: torch.Tensor = ref, sets: list[WeightSet] = sets) -> None:
            try:
                out = make(sets[0], xs[0])()
                rec["rel_err"][name] = round(float((out.float() - ref).norm() / ref.norm()), 5)
                rec["us"][name] = round(graph_us([make(s, x) for s, x in zip(sets, xs, strict=True)]), 2)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run is recorded, not fatal
                rec["errors"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"

        def ours(cfg: MMConfig, decode: str, **launch: bool) -> Any:
            return lambda s, x: (lambda: nf4_mm(x, s.words, 64, s.code, nested=s.nested(), config=cfg,
                                                decode=decode, levels=s.levels, **launch))

        def fused(cfg: MMConfig) -> Any:  # the engine's call: the weight's own counters, a PDL launch
            return lambda s, x: (lambda: nf4_mm(x, s.words, 64, s.code, nested=s.nested(), config=cfg,
                                                decode="asm", levels=s.levels, pdl=True, counters=s.counters))

        if args.frag:
            frag_variants(timed, fused, m, n, k, sms, args.frag_grid)
            doc["records"].append(rec)
            save()
            print(arch, lin, m, {key: v for key, v in sorted(rec["us"].items(), key=lambda kv: kv[1])[:4]},
                  {key: rec["us"].get(key) for key in ("frag-default", "mm-rule-pdl", "gemv-pdl")}, flush=True)
            continue

        if args.fused:
            rule = default_config(m, n, k, sms)
            timed("ours-default-pdl:asm", ours(rule.replace(fuse_splits=False), "asm", pdl=True))
            timed("ours-default-fused-pdl:asm", fused(rule))
            for bn, bk, warps in FUSED_TILES:
                for split in FUSED_SPLITS:
                    if k // (bk * split) >= 2:
                        cfg = rule.replace(block_n=bn, block_k=bk, warps=warps, split=split)
                        timed(key_of(cfg, "asm", "all") + "/fused-pdl", fused(cfg))
            doc["records"].append(rec)
            save()
            print(arch, lin, m, {key: v for key, v in sorted(rec["us"].items(), key=lambda kv: kv[1])[:4]},
                  flush=True)
            continue

        if args.overlap:  # LAUNCH_OVERLAP per linear: the rule one launch after the other, then as PDL launches
            rule = default_config(m, n, k, sms)
            timed("ours-default:asm", ours(rule, "asm"))
            timed("ours-default-pdl:asm", ours(rule, "asm", pdl=True))
            timed("ours-default-pdl-early:asm", ours(rule, "asm", pdl=True, early=True))
        for name, kw in [] if args.overlap else variants(m, n, k, sms, args.forms):
            timed(name, ours(kw["config"], kw["decode"]))
        ranked = sorted((v, key) for key, v in rec["us"].items() if key.startswith("ours:"))
        for _, key in ranked[:0 if args.overlap else args.refine]:
            cfg, _, forms = config_of(key)
            for stages in (2, 4):
                staged = cfg.replace(stages=stages)
                timed(key_of(staged, "asm", forms), ours(staged, "asm"))
            timed(key_of(cfg, "gather", forms), ours(cfg, "gather"))
            for other in FORMS:
                if other != forms:
                    timed(key_of(with_forms(cfg, other), "asm", other), ours(with_forms(cfg, other), "asm"))
        if m == 1:
            timed("nf4_gemv", lambda s, x: (lambda: nf4_gemv.nf4_gemv(x, s.words, 64, s.levels,
                                                                       nested=s.nested())))
        else:
            timed("nf4_rows", lambda s, x: (lambda: nf4_gemv.nf4_rows(x, s.words, 64, s.levels,
                                                                       nested=s.nested())))
        with torch.inference_mode():
            timed("bnb.matmul_4bit", lambda s, x: (lambda: bnb.matmul_4bit(x, s.q.t(), quant_state=s.st)))
        timed("dequant+matmul", lambda s, x: (lambda: x @ bf.dequantize_4bit(s.q, s.st).t()))
        timed("bf16_cublas", lambda s, x: (lambda: x @ s.w.t()))
        best = min(((v, key) for key, v in rec["us"].items() if key.startswith("ours")), default=None)
        if best is not None:
            rec["best_ours"] = best[1]
            rec["best_ours_us"] = best[0]
            rec["best_ours_fraction_of_copy_bw"] = round(first.nf4_bytes / (best[0] * 1e-6) / bw, 3)
        if best is not None and best[1].startswith("ours:"):
            rec["best_compile"] = compile_info(best[1], sets[0], xs[0])
        rec["max_rel_err_ours"] = max((v for key, v in rec["rel_err"].items() if key.startswith("ours")),
                                      default=None)
        doc["records"].append(rec)
        save()
        others = {key: rec["us"].get(key) for key in ("nf4_gemv", "nf4_rows", "bnb.matmul_4bit",
                                                      "dequant+matmul", "bf16_cublas") if key in rec["us"]}
        print(f"{arch} {lin:8s} M={m:2d} best {rec.get('best_ours')} {rec.get('best_ours_us')} µs "
              f"({rec.get('best_ours_fraction_of_copy_bw')} of copy bw) err {rec['max_rel_err_ours']} "
              f"{others} errors={len(rec['errors'])}", flush=True)
    if args.frag:
        doc["summary"] = summarize_frag(doc)
        save()
        print(json.dumps(doc["summary"], indent=1))
        return
    if args.fused:
        doc["summary"] = summarize_fused(doc)
        save()
        print(json.dumps(doc["summary"], indent=1))
        return
    doc["summary"] = summarize(doc)
    save()
    print_table(doc)


FRAG_FORMS = ((False, False), (True, False), (True, True))  # FragConfig (table_regs, scale_pairs)


def frag_grid(n: int, k: int, sms: int, m: int = 8, grid: str = "all") -> list[Any]:
    """--frag's configs of one shape: its default_config, that without prefetch, and 4 or 8 warps x the default's
    K split halved, kept and doubled x FRAG_FORMS, and x depth 2 and 4 with both forms, and x depth 1, 2 and 4
    with both forms and early loads, and with a weight tile a warp (warp_tiles, depth 2, early loads; 4 or 8 warps;
    K split to ~32 warps an SM and half that); above 8 rows (other compiles: more row tiles) only the default in
    each of FRAG_FORMS, at depth 2 and 4 with both forms, at depth 1 and 2 with early loads and the warp tiles."""
    from llm_core.fast.kernels.nf4_frag import FragConfig
    from llm_core.fast.kernels.nf4_frag import default_config as frag_default

    base = frag_default(n, k, sms, m)
    both = dataclasses.replace(base, table_regs=True, scale_pairs=True)
    deeper = [dataclasses.replace(both, depth=d) for d in (2, 4)]  # more loads in flight a warp
    # and each block's scale pair and activations loaded an iteration ahead with its words
    deeper += [dataclasses.replace(both, depth=d, early=True) for d in ((1, 2) if m > 8 else (1, 2, 4))]
    # each warp its own weight tile (the warps at the same blocks share the activations' loads), K split to about
    # 32 warps an SM while each warp keeps 4 blocks to walk, and half that split
    tiles, blocks = n // 16, k // 64
    for warps in (4, 8):
        split = 1
        while tiles * split < 32 * sms and blocks // (split * 2) >= 4:
            split *= 2
        deeper += [FragConfig(warps, s, True, True, True, 2, True, True) for s in sorted({max(1, split // 2), split})]
    # and with the words read evict-first (the activations stay in L1 and L2)
    deeper += [dataclasses.replace(c, stream=True) for c in deeper
               if c.depth == 2 and c.early and (not c.warp_tiles or c == deeper[-1])]
    if grid == "ahead":  # the default first (the engine's form: both), then the loads-ahead forms
        return list(dict.fromkeys([both, *deeper, *(dataclasses.replace(c, warps=12 - c.warps) for c in deeper
                                                    if not c.warp_tiles and m <= 8)]))
    if m > 8:
        return [dataclasses.replace(base, table_regs=table, scale_pairs=pairs) for table, pairs in FRAG_FORMS] + deeper
    grid = [base, dataclasses.replace(base, prefetch=False)]
    for warps in (4, 8):
        for split in sorted({max(1, base.split // 2), base.split, base.split * 2}):
            for table, pairs in FRAG_FORMS:
                grid.append(FragConfig(warps, split, True, table, pairs))
        grid += [dataclasses.replace(c, warps=warps) for c in deeper]
    return list(dict.fromkeys(grid))


def frag_variants(timed: Any, fused: Any, m: int, n: int, k: int, sms: int, grid: str = "all") -> None:
    """--frag's timings of one linear and M: nf4_frag over frag_grid (the default first), nf4_mm's rule as the
    engine calls it, and the GEMV at M = 1, all as programmatic dependent launches."""
    from llm_core.fast.kernels import nf4_gemv
    from llm_core.fast.kernels.nf4_frag import FragConfig, nf4_frag
    from llm_core.fast.kernels.nf4_mm import default_config

    def frag(cfg: FragConfig) -> Any:
        def make(s: WeightSet, x: torch.Tensor) -> Any:
            w, table, pairs = s.frag, s.frag_table, s.scale_pairs  # repacked here, before any graph capture
            return lambda: nf4_frag(x, w, 64, s.levels, nested=s.nested(), config=cfg, pdl=True, table=table,
                                    pairs=pairs)

        return make

    timed("mm-rule-pdl", fused(default_config(m, n, k, sms)))
    if m == 1:
        timed("gemv-pdl", lambda s, x: (lambda: nf4_gemv.nf4_gemv(x, s.words, 64, s.levels, nested=s.nested(),
                                                                   pdl=True)))
    for i, cfg in enumerate(frag_grid(n, k, sms, m, grid)):
        name = (f"frag-w{cfg.warps}-s{cfg.split}-p{int(cfg.prefetch)}-t{int(cfg.table_regs)}"
                f"-sp{int(cfg.scale_pairs)}" + (f"-d{cfg.depth}" if cfg.depth > 1 else "")
                + ("-e" if cfg.early else "") + ("-wt" if cfg.warp_tiles else "") + ("-st" if cfg.stream else ""))
        timed("frag-default" if i == 0 else name, frag(cfg))


def summarize_frag(doc: dict[str, Any]) -> dict[str, Any]:
    """Per arch and M, µs per layer (the four linears): nf4_frag's default, its best config per linear, nf4_mm's
    rule and the GEMV (M = 1), with nf4_frag's largest error."""
    out: dict[str, Any] = {}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in doc["records"]:
        groups.setdefault((r["arch"], r["m"]), []).append(r)
    for (arch, m), recs in sorted(groups.items()):
        def total(pick: Any, recs: list[dict[str, Any]] = recs) -> float | None:
            vals = [pick(r) for r in recs]
            return round(sum(vals), 2) if vals and all(v is not None for v in vals) else None

        frags = [{key: v for key, v in r["us"].items() if key.startswith("frag")} for r in recs]
        out[f"{arch} M={m}"] = {
            "linears": len(recs),
            "frag_default_us": total(lambda r: r["us"].get("frag-default")),
            "frag_best_us": round(sum(min(f.values()) for f in frags), 2) if all(frags) else None,
            "frag_best": [min(f, key=lambda key, f=f: f[key]) for f in frags if f],
            "mm_rule_us": total(lambda r: r["us"].get("mm-rule-pdl")),
            "gemv_us": total(lambda r: r["us"].get("gemv-pdl")),
            "frag_max_rel_err": max((v for r in recs for key, v in r["rel_err"].items() if key.startswith("frag")),
                                    default=None),
            "errors": sorted({e for r in recs for e in r["errors"].values()})[:3],
        }
    return out


def summarize_fused(doc: dict[str, Any]) -> dict[str, Any]:
    """--fused: per arch and M, µs per layer (qkv + o + gate_up + down) of the rule with its splits summed by a
    second kernel, the rule summed in the launch, and each linear's best in-launch config; their ratio; the best
    keys per linear."""
    out: dict[str, Any] = {}
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in doc["records"]:
        by.setdefault((r["arch"], r["m"]), []).append(r)
    for (arch, m), recs in sorted(by.items()):
        if len(recs) != len(LAYERS[arch]):
            continue

        def total(pick: Any, recs: list[dict[str, Any]] = recs) -> float | None:
            vals = [pick(r["us"]) for r in recs]
            return round(sum(vals), 2) if all(v is not None for v in vals) else None

        kernel = total(lambda us: us.get("ours-default-pdl:asm"))
        fused = total(lambda us: us.get("ours-default-fused-pdl:asm"))
        best = total(lambda us: min((v for key, v in us.items() if "fused" in key), default=None))
        out[f"{arch}/M={m}"] = {
            "rule_sum_kernel_us": kernel, "rule_fused_us": fused, "best_fused_us": best,
            "fused_over_kernel": round(fused / kernel, 3) if fused and kernel else None,
            "best": {r["linear"]: min((key for key in r["us"] if "fused" in key), key=r["us"].__getitem__,
                                      default=None) for r in recs}}
    return out


def config_of(key: str) -> tuple[Any, str, str]:
    """'ours:<decode>:<BN>x<BK>/s<split>/w<warps>/st<stages>/<dot|fma>[/<forms>]' -> (MMConfig, decode, forms);
    keys without forms (earlier records) are the older loop ('base')."""
    from llm_core.fast.kernels.nf4_mm import MMConfig

    _, decode, rest = key.split(":")
    tile, split, warps, stages, form, *forms = rest.split("/")
    bn, bk = (int(v) for v in tile.split("x"))
    cfg = MMConfig(bn, bk, int(split[1:]), int(warps[1:]), int(stages[2:]), form == "dot")
    return with_forms(cfg, forms[0] if forms else "base"), decode, forms[0] if forms else "base"


def compile_info(key: str, s: WeightSet, x: torch.Tensor) -> dict[str, Any]:
    """Registers, spills and shared memory of a config's compiled kernel (Triton's compile metadata)."""
    from llm_core.fast.kernels.nf4_mm import nf4_mm

    cfg, decode, _ = config_of(key)
    got: list[Any] = []
    nf4_mm(x, s.words, 64, s.code, nested=s.nested(), config=cfg, decode=decode, levels=s.levels, compiled=got)
    kern = got[0]
    return {"n_regs": getattr(kern, "n_regs", None), "n_spills": getattr(kern, "n_spills", None),
            "shared_bytes": getattr(getattr(kern, "metadata", None), "shared", None)}


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Per arch and M: the layer's four linears summed, for each family's best entry."""
    out: dict[str, Any] = {}
    bw = doc["meta"]["copy_bytes_per_s"]
    fams = {"ours": lambda key: key.startswith("ours"), "ours-default": lambda key: key == "ours-default:asm",
            "ours-default-all": lambda key: key == "ours-default-all:asm",
            "ours-default-even+xvec+asm_scale": lambda key: key == "ours-default-even+xvec+asm_scale:asm",
            **{f"ours-{forms}": (lambda key, forms=forms: key.startswith("ours:") and key.endswith("/" + forms))
               for forms in FORMS},
            "llm_core-old": lambda key: key in ("nf4_gemv", "nf4_rows"),
            "bnb": lambda key: key == "bnb.matmul_4bit", "dequant+matmul": lambda key: key == "dequant+matmul",
            "bf16": lambda key: key == "bf16_cublas"}
    for r in doc["records"]:
        row = out.setdefault(r["arch"], {}).setdefault(str(r["m"]), {"linears": [], "nf4_bytes": 0})
        row["linears"].append(r["linear"])
        row["nf4_bytes"] += r["nf4_bytes"]
        for fam, pick in fams.items():
            vals = [v for key, v in r["us"].items() if pick(key)]
            if vals:
                row[fam + "_us"] = round(row.get(fam + "_us", 0.0) + min(vals), 2)
    for rows in out.values():
        for row in rows.values():
            if "ours_us" in row:
                row["ours_fraction_of_copy_bw"] = round(row["nf4_bytes"] / (row["ours_us"] * 1e-6) / bw, 3)
                for other in ("bnb", "dequant+matmul", "bf16", "llm_core-old"):
                    if other + "_us" in row:
                        row[f"{other}_over_ours"] = round(row[other + "_us"] / row["ours_us"], 2)
        if "1" in rows and "ours_us" in rows["1"]:
            for row in rows.values():
                if "ours_us" in row:
                    row["ours_over_m1"] = round(row["ours_us"] / rows["1"]["ours_us"], 2)
    return out


def print_table(doc: dict[str, Any]) -> None:
    print(f"copy {doc['meta']['copy_bytes_per_s'] / 1e12:.3f} TB/s; per layer (4 linears), µs:")
    print("arch        M  ours  frac  xM1  default  old   bnb  deq+mm  bf16")
    for arch, rows in doc.get("summary", {}).items():
        for m, r in rows.items():
            print(f"{arch:10s} {m:>2s} {r.get('ours_us', 0):6.1f} {r.get('ours_fraction_of_copy_bw', 0):5.2f} "
                  f"{r.get('ours_over_m1', 0):4.2f} {r.get('ours-default_us', 0):7.1f} "
                  f"{r.get('llm_core-old_us', 0):6.1f} {r.get('bnb_us', 0):6.1f} {r.get('dequant+matmul_us', 0):6.1f} "
                  f"{r.get('bf16_us', 0):6.1f}  {len(r['linears'])} linears")
    print("loop forms, per layer µs (default rule: without forms / all / bit-identical ones; best config per form):")
    for arch, rows in doc.get("summary", {}).items():
        for m, r in rows.items():
            best = " ".join(f"{forms} {r.get(f'ours-{forms}_us', 0):6.1f}" for forms in FORMS)
            print(f"{arch:10s} {m:>2s} default {r.get('ours-default_us', 0):6.1f} / "
                  f"{r.get('ours-default-all_us', 0):6.1f} / {r.get('ours-default-even+xvec+asm_scale_us', 0):6.1f}  "
                  f"{best}")


if __name__ == "__main__":
    main()
