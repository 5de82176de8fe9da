"""llm_core.fast.kernels.nf4_frag: NF4 weights repacked into mma.sync fragment order, and the kernel over them (1-32
rows).

On CPU: the repack moves every code to the slot the module's docstring names and back; the PTX a thread runs for
one 64-wide block (the register-table decode, the block scales, four mma.sync) runs under a warp-wide emulator (the
32 lanes in lock step, mma.sync computed from the PTX ISA's fragment layout) on lane inputs gathered as the kernel
gathers them, and must give x @ W.T over the block; the kernel compiles for sm_90 with no shared memory in its
loop, decoding each word once whatever the row tiles. On a GPU (marked): the kernel against the reference form at
every M, shape, split and form.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace
from typing import Any

import pytest
import torch

from llm_core.fast.kernels import nf4_frag
from tests.test_nf4_gemv import NF4, _b2f, _f2b, ptx_op, ptx_value

MASK = 0xFFFFFFFF


def _codes_to_packed(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0-15 -> bitsandbytes' (N, K/2) uint8, the even k in the high nibble."""
    return (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8)


def test_repack_puts_each_code_in_its_fragment_slot_and_unpack_gives_the_bytes_back() -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 32, 192
    codes = torch.randint(0, 16, (n, k), generator=g)
    packed = _codes_to_packed(codes)
    frag = nf4_frag.repack(packed)
    assert frag.shape == (n // 16, k // 64, 32, 4) and frag.dtype == torch.int32
    assert torch.equal(nf4_frag.unpack(frag), packed)
    words = frag.view(torch.uint8).view(n // 16, k // 64, 32, 4, 4)  # byte p of word s of lane l
    for tile, b, lane, s, p in itertools.product(range(n // 16), range(k // 64), range(32), range(4), range(4)):
        gg, t, r, h = lane // 4, lane % 4, p % 2, p // 2
        row, kk = 16 * tile + gg + 8 * r, 64 * b + 16 * t + 4 * s + 2 * h
        assert int(words[tile, b, lane, s, p]) == int(codes[row, kk]) << 4 | int(codes[row, kk + 1])


def test_repack_refuses_shapes_without_whole_tiles() -> None:
    for shape in ((24, 64), (32, 48)):
        with pytest.raises(ValueError, match="multiple of 16"):
            nf4_frag.repack(torch.zeros(shape, dtype=torch.uint8))


# --- the PTX of one block under a warp-wide emulator --------------------------------------------------------------


def _bf16_of(bits16: int) -> float:
    return _b2f((bits16 & 0xFFFF) << 16)


def _mma(lanes: list[dict[str, int]], d: list[str], a: list[str], b: list[str], c: list[str]) -> None:
    """mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 over the 32 lanes, by the PTX ISA's fragments: lane
    4g + t holds A[g][2t, 2t+1], A[g+8][...], A[g][2t+8, 2t+9], A[g+8][...] in a0..a3 (low half the even
    column), B[2t, 2t+1][g] and B[2t+8, 2t+9][g] in b0, b1, C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]."""
    am = [[0.0] * 16 for _ in range(16)]
    bm = [[0.0] * 8 for _ in range(16)]
    cm = [[0.0] * 8 for _ in range(16)]
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for i, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            am[row][col], am[row][col + 1] = _bf16_of(regs[a[i]]), _bf16_of(regs[a[i]] >> 16)
        for i, k0 in enumerate((2 * t, 2 * t + 8)):
            bm[k0][g], bm[k0 + 1][g] = _bf16_of(regs[b[i]]), _bf16_of(regs[b[i]] >> 16)
        for i, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            cm[row][col] = _b2f(regs[c[i]])
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for i, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            regs[d[i]] = _f2b(sum(am[row][k] * bm[k][col] for k in range(16)) + cm[row][col])


def run_warp(asm: str, lanes: list[dict[str, int]]) -> None:
    """Execute nf4_frag.frag_asm's straight-line PTX on 32 lanes in lock step (register files in `lanes`)."""
    for stmt in (s.strip() for line in asm.splitlines() for s in line.split(";")):
        if not stmt or stmt in ("{", "}") or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op.startswith("mma.sync"):
            groups = [[r.strip() for r in grp.split(",")] for grp in re.findall(r"\{([^}]*)\}", rest)]
            _mma(lanes, *groups)
            continue
        dst, *srcs = [o.strip() for o in rest.split(",")]
        for regs in lanes:
            regs[dst] = ptx_op(op, [ptx_value(s, regs) for s in srcs]) & MASK


@pytest.mark.parametrize("seed,table_in,pairs", [(0, False, False), (1, False, False), (2, True, False),
                                                 (3, False, True), (4, True, True)])
def test_a_blocks_ptx_on_a_warp_adds_x_times_the_scaled_levels_to_the_accumulators(seed: int, table_in: bool,
                                                                                    pairs: bool) -> None:
    """One 16-row tile and one 64-wide block: each lane's words from repack, its rows' scales, its activation
    pairs as the kernel loads them (8t + u of row g, u = 2s + h -> b0 / b1 of step s) and accumulators already
    holding something; the warp's outputs must be C + x @ W.T with W = bf16(bf16 level x bf16 scale), the
    scale16 arithmetic of nf4_mm (nf4_mm_reference(..., scale16=True)). table_in: the level table's words come as
    operands $22..$29, as FragConfig.table_regs loads them from frag_table; pairs: the scales come as
    scale_pairs' bf16 pair in $8 (and $9)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (16, 64), generator=g)
    codes[0, :16] = torch.arange(16)  # every level at least once
    scale = torch.rand(16, generator=g) * 0.1 + 0.01
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    c0 = torch.randn(8, 16, generator=g).float()  # y rows x weight rows, as the accumulators hold them
    words = nf4_frag.repack(_codes_to_packed(codes))[0, 0]  # (32 lanes, 4 words)
    xp = (x.view(torch.int16).to(torch.int32) & 0xFFFF).view(8, 32, 2)
    x32 = (xp[..., 0] | xp[..., 1] << 16).tolist()  # row g's int32 pairs, as the kernel reads x
    lanes = []
    for lane in range(32):
        gg, t = lane // 4, lane % 4
        regs = {f"${4 + s}": int(words[lane, s]) & MASK for s in range(4)}
        if pairs:
            regs["$8"] = regs["$9"] = int(nf4_frag.scale_pairs(scale, 16, 64, 64)[0, 0, gg]) & MASK
        else:
            regs["$8"], regs["$9"] = _f2b(float(scale[gg])), _f2b(float(scale[gg + 8]))
        for u in range(8):  # $10 + 2s + h holds pair 8t + u of row g, u = 2s + h
            regs[f"${10 + u}"] = x32[gg][8 * t + u] & MASK
        for i, (row, col) in enumerate(((2 * t, gg), (2 * t + 1, gg), (2 * t, gg + 8), (2 * t + 1, gg + 8))):
            regs[f"${18 + i}"] = _f2b(float(c0[row, col]))
        if table_in:
            regs.update({f"${22 + i}": v & MASK for i, v in enumerate(nf4_frag.frag_table(NF4, "cpu")[:8].tolist())})
        lanes.append(regs)
    run_warp(nf4_frag.frag_asm(tuple(NF4), table_in, pairs), lanes)
    got = torch.zeros(8, 16)
    for lane, regs in enumerate(lanes):
        gg, t = lane // 4, lane % 4
        for i, (row, col) in enumerate(((2 * t, gg), (2 * t + 1, gg), (2 * t, gg + 8), (2 * t + 1, gg + 8))):
            got[row, col] = _b2f(regs[f"${i}"])
    levels = torch.tensor(NF4).to(torch.bfloat16).float()
    w = (levels[codes] * scale.to(torch.bfloat16).float()[:, None]).to(torch.bfloat16).double()
    want = c0.double() + x.double() @ w.T
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got.double(), c0.double(), atol=1e-3)  # the block added something


def test_the_block_ptx_reads_each_operand_it_names() -> None:
    for table_in, pairs in itertools.product((False, True), (False, True)):
        asm = nf4_frag.frag_asm(tuple(NF4), table_in, pairs)
        used = {int(m) for m in re.findall(r"\$(\d+)", asm)}
        operands = nf4_frag.frag_constraints(table_in, pairs).count(",") + 1
        assert operands == (30 if table_in else 22)
        assert used == set(range(operands)) - ({9} if pairs else set())  # pairs: $9 repeats $8, unread
        assert ("0x" + format(nf4_frag.table_bytes(NF4)[0][0], "08x") in asm) is not table_in
        assert asm.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 4


def test_scale_pairs_hold_the_bf16_scales_of_rows_g_and_g_plus_8() -> None:
    g = torch.Generator().manual_seed(3)
    n, k, bs = 32, 256, 128
    absmax = torch.rand(n * k // bs, generator=g)
    pairs = nf4_frag.scale_pairs(absmax, n, k, bs)
    assert pairs.shape == (n // 16, k // bs, 8) and pairs.dtype == torch.int32
    want = absmax.view(n, k // bs).to(torch.bfloat16)
    for tile, blk, gg in itertools.product(range(n // 16), range(k // bs), range(8)):
        word = int(pairs[tile, blk, gg]) & MASK
        assert _bf16_of(word) == float(want[16 * tile + gg, blk])
        assert _bf16_of(word >> 16) == float(want[16 * tile + gg + 8, blk])


# --- compiled for Hopper on this machine --------------------------------------------------------------------------

needs_triton = pytest.mark.skipif(nf4_frag.triton is None, reason="needs Triton")


def _loop(sass: str) -> list[str]:
    from bench.nf4_mm_sass import _BRANCH, _LABEL

    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    spans = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := _BRANCH.search(line)) and m.group(1) in labels and labels[m.group(1)] < i]
    start, end = max(spans, key=lambda s: s[1] - s[0])
    return lines[start:end + 1]


@needs_triton
@pytest.mark.parametrize("m,nested,bias,cfg,pdl", [
    (8, True, False, nf4_frag.FragConfig(4, 4, True), False), (3, False, True, nf4_frag.FragConfig(8, 1, False), True),
    (8, True, True, nf4_frag.FragConfig(2, 2, True, True), True),
    (8, True, False, nf4_frag.FragConfig(4, 4, True, True, True), False),
    (16, True, False, nf4_frag.FragConfig(4, 4, True, True, True), True),
    (32, False, True, nf4_frag.FragConfig(4, 1, True, True, False), False),
    (8, True, False, nf4_frag.FragConfig(8, 1, True, True, True, 2), True),
    (16, False, True, nf4_frag.FragConfig(4, 2, False, True, True, 4), False),
    (32, True, False, nf4_frag.FragConfig(4, 1, True, True, True, 2), True),
    (8, True, False, nf4_frag.FragConfig(8, 1, True, True, True, 2, True), True),
    (16, False, True, nf4_frag.FragConfig(4, 3, False, False, False, 1, True), False),
    (32, True, True, nf4_frag.FragConfig(4, 4, True, True, True, 2, True, True), True),
    (8, False, False, nf4_frag.FragConfig(8, 1, True, False, False, 1, False, True), False),
    (16, True, False, nf4_frag.FragConfig(4, 2, True, True, True, 2, True, True, True), True)])
def test_the_kernel_compiles_for_hopper_with_four_mma_a_row_tile_and_no_shared_memory_in_its_loop(
        m: int, nested: bool, bias: bool, cfg: nf4_frag.FragConfig, pdl: bool) -> None:
    """Per block of the loop (depth blocks an iteration): 4 HMMA a row tile, each word decoded once."""
    kern = nf4_frag.compile_without_device(m, 4096, 11008, 64, cfg, NF4, nested, bias, pdl=pdl)
    loop = "\n".join(_loop(kern.asm["sass"]))
    assert loop.count("HMMA.16816.F32.BF16") == 4 * nf4_frag.row_tiles(m) * cfg.depth
    assert loop.count("PRMT") <= 64 * cfg.depth  # words decoded once a block whatever the row tiles (ptxas shares)
    assert not re.search(r"\b(BAR|LDS|STS|STL|LDL)\b", loop)  # registers only: no layout trip through shared memory
    if cfg.stream:  # the words evict-first
        assert "LDG.E.EF.128" in loop
    if cfg.warp_tiles:  # each warp stores its own tile: no reduction across warps at all
        assert not re.search(r"\b(BAR|LDS|STS)\b", kern.asm["sass"])
    assert "LDG.E.128" in loop  # the words (and the activations) in 16-byte loads


def test_default_config_splits_k_only_where_the_grid_is_small() -> None:
    assert nf4_frag.default_config(4096, 4096).split == 4  # 256 tiles: 1,024 programs
    assert nf4_frag.default_config(12288, 4096).split == 1  # 768 tiles already
    assert nf4_frag.default_config(4096, 11008).split == 4
    # 8 warps for the wide weights up to 8 rows (the H100 sweep's best), else 4
    assert [nf4_frag.default_config(n, 4096, m=m).warps for n, m in ((12288, 8), (12288, 9), (4096, 1))] == [8, 4, 4]
    # up to 8 rows two blocks a warp an iteration, loaded early (the s8 sweep); above, one block as before
    assert [(c.depth, c.early) for c in (nf4_frag.default_config(12288, 4096, m=m) for m in (1, 8, 9, 32))] == [
        (2, True), (2, True), (1, False), (1, False)]
    with pytest.raises(ValueError, match="multiple of 16"):
        nf4_frag.check_shapes(4100, 4096, 64)


# --- in the engine: NF4_FRAG ---------------------------------------------------------------------------------------


def test_nf4_frag_setting_adds_the_fragment_order_copy_to_each_packed_nf4_linear_and_the_rows_dispatch_uses_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NF4_FRAG: off by default, on parsed, unknown refused, resolved off where there is no CUDA. With it on,
    pack_linears gives an NF4 linear (fused q/k/v too) its codes in fragment order, the level table and the scale
    pairs before the bias, counted in its bytes, in LinSpec's order (tensor_count, frag_of, bias_of); the rows
    dispatch hands exactly those to the nf4_frag op, and a linear without them takes nf4_mm."""
    from llm_core.config import Settings
    from llm_core.errors import GenerationError, SettingsError
    from llm_core.fast import rows
    from llm_core.fast.layer import tensor_count
    from llm_core.fast.options import FastDecodeOptions
    from llm_core.fast.pack import absmax_2d, bias_of, code_of, counters_of, frag_of, pack_linears
    from tests.test_fast_decode import nf4_linear

    assert Settings.from_env(environ={}, env_file=None).model.nf4_frag == "off"
    assert Settings.from_env(environ={"NF4_FRAG": "on"}, env_file=None).model.nf4_frag == "on"
    with pytest.raises(SettingsError, match="NF4_FRAG"):
        Settings.from_env(environ={"NF4_FRAG": "maybe"}, env_file=None)
    with pytest.raises(GenerationError, match="NF4_FRAG"):
        FastDecodeOptions(nf4_frag="maybe").resolved(torch.device("cpu"), 64)
    assert FastDecodeOptions(nf4_frag="on").resolved(torch.device("cpu"), 64).nf4_frag == "off"

    on = FastDecodeOptions(nf4_frag="on")
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(torch.ops.llm_core, "nf4_frag", lambda *a: calls.append(a) or "frag-out", raising=False)
    monkeypatch.setattr(torch.ops.llm_core, "nf4_mm", lambda *a: calls.append(a) or "mm-out", raising=False)
    for mods in ([nf4_linear(48, 128, 0, bias=True)], [nf4_linear(64, 256, 1), nf4_linear(32, 256, 2)]):
        plain, frag = pack_linears(mods, FastDecodeOptions(), "nf4"), pack_linears(mods, on, "nf4")
        s, ts = frag.spec, frag.tensors
        assert s.frag and not plain.spec.frag and tensor_count(s) == len(ts) == len(plain.tensors) + 3
        codes, table, pairs = frag_of(s, ts)
        assert torch.equal(codes, nf4_frag.repack(ts[0])) and torch.equal(nf4_frag.unpack(codes), ts[0])
        assert torch.equal(table, nf4_frag.frag_table(s.levels, "cpu"))
        assert torch.equal(pairs, nf4_frag.scale_pairs(absmax_2d(s, ts), s.n, s.k, s.blocksize))
        assert torch.equal(code_of(s, ts), code_of(plain.spec, plain.tensors))
        assert counters_of(s, ts).dtype == torch.int32
        assert (bias_of(s, ts) is None) == (bias_of(plain.spec, plain.tensors) is None)
        if s.bias:
            assert torch.equal(bias_of(s, ts), bias_of(plain.spec, plain.tensors))
        assert frag.nbytes == plain.nbytes + sum(t.numel() * t.element_size() for t in (codes, table, pairs))
        with pytest.raises(ValueError, match="fragment-order"):
            frag_of(plain.spec, plain.tensors)

        x = torch.randn(3, s.k).bfloat16()
        assert rows.nf4_rows_linear("frag", s, x, ts) == "frag-out"
        got = calls[-1]
        assert got[0] is x and got[1] is codes and got[2] is table and got[3] is pairs and got[5] == s.blocksize
        assert rows.nf4_rows_linear("frag", plain.spec, x, plain.tensors) == "mm-out"  # no copy: nf4_mm
    assert rows.pick_rows_plan({8: {"mm": 90.0, "frag": 45.0, "dequant": 400.0}}).kernel_for(5) == "frag"
    assert rows.pick_rows_plan({8: {"mm": 45.0, "frag": 45.0}}).kernel_for(8) == "mm"  # a tie keeps nf4_mm


def test_nf4_frag_auto_is_on_only_for_batched_nf4_where_the_copy_takes_little_of_the_kv_slots() -> None:
    """frag_copy_bytes is what pack_linears adds with NF4_FRAG=on (exactly, linear by linear), and NF4_FRAG=auto
    (llm_core.memory.plan.resolve_nf4_frag) turns it on for a Llama-2-7B-shaped NF4 model decoded in 8 slots where
    they keep their whole 4k context beside the copy (80 GB), and at 32k positions, where memory bounds the slots
    either way, while the copy takes at most AUTO_FRAG_POOL_SHARE of their tokens; off where it would take more
    (a 16 GiB card), for one reply at a time, and where nothing is tiled; on and off are kept."""
    from llm_core.config import Settings
    from llm_core.fast.options import FastDecodeOptions
    from llm_core.fast.pack import frag_copy_bytes, pack_linears
    from llm_core.memory.model import GiB, ModelMemoryFacts, human_bytes, static_kv_bytes
    from llm_core.memory.plan import AUTO_FRAG_POOL_SHARE, longest_slot_tokens, resolve_nf4_frag
    from tests.test_fast_decode import nf4_linear

    assert Settings.from_env(environ={"NF4_FRAG": "auto"}, env_file=None).model.nf4_frag == "auto"
    assert FastDecodeOptions(nf4_frag="auto").resolved(torch.device("cpu"), 64).nf4_frag == "off"
    on = FastDecodeOptions(nf4_frag="on")
    mods = [nf4_linear(48, 128, 0, bias=True), nf4_linear(64, 256, 1), nf4_linear(40, 256, 2)]  # 40: not tiled
    added = sum(pack_linears([m], on, "nf4").nbytes - pack_linears([m], FastDecodeOptions(), "nf4").nbytes
                for m in mods)
    assert frag_copy_bytes(torch.nn.ModuleList(mods)) == added == 48 * 128 // 2 + 48 * 2 * 2 + 64 + 64 * 128 + \
        64 * 4 * 2 + 64

    def facts(context: int) -> ModelMemoryFacts:
        return ModelMemoryFacts(num_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                num_kv_heads=32, head_dim=128, vocab_size=32000, layer_windows=(None,) * 32,
                                weights_bytes=int(3.6 * GiB), context_length=context, fast_prefill=True)

    copy = 6_476_005_376 // 2 + 6_476_005_376 // 32  # Llama-2-7B's linears: the codes and the scale pairs
    kw: dict[str, Any] = dict(max_new_tokens=512, prefill_chunk_tokens=2048, kv_cache="bf16")

    def slot_tokens(f: ModelMemoryFacts, budget: int, extra: int) -> int:
        return longest_slot_tokens(f, budget, slots=8, per_token=static_kv_bytes(f, 1, "bf16"), extra_bytes=extra,
                                   **kw)

    mode, why = resolve_nf4_frag("auto", facts(4096), 78 * GiB, copy_bytes=copy, slots=8, **kw)
    assert mode == "on" and "8 KV slots no context" in why and human_bytes(copy) in why
    long = facts(32768)  # 8 x 32k bf16 tokens need 128 GiB: the slots are bounded on 80 GB with or without it
    without, with_copy = slot_tokens(long, 78 * GiB, 0), slot_tokens(long, 78 * GiB, copy)
    assert with_copy < without < 32768 and with_copy >= (1 - AUTO_FRAG_POOL_SHARE) * without
    mode, why = resolve_nf4_frag("auto", long, 78 * GiB, copy_bytes=copy, slots=8, **kw)
    assert mode == "on" and f"{with_copy:,} of {without:,} tokens a slot" in why
    small = int(15.5 * GiB)  # a 16 GiB card: the copy would take > 10% of the slots' tokens
    without, with_copy = slot_tokens(facts(4096), small, 0), slot_tokens(facts(4096), small, copy)
    assert 0 < with_copy < (1 - AUTO_FRAG_POOL_SHARE) * without
    mode, why = resolve_nf4_frag("auto", facts(4096), small, copy_bytes=copy, slots=8, **kw)
    assert mode == "off" and f"from {without:,} to {with_copy:,} tokens" in why
    assert resolve_nf4_frag("auto", facts(4096), 78 * GiB, copy_bytes=copy, slots=1, **kw)[0] == "off"
    assert resolve_nf4_frag("auto", facts(4096), 78 * GiB, copy_bytes=0, slots=8, **kw) == ("off", "")
    assert resolve_nf4_frag("on", facts(4096), small, copy_bytes=copy, slots=8, **kw) == ("on", "")
    assert resolve_nf4_frag("off", facts(4096), 78 * GiB, copy_bytes=copy, slots=8, **kw) == ("off", "")


# --- GPU ----------------------------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and nf4_frag.triton is not None),
                               reason="needs a CUDA GPU with Triton")


def _gpu_case(n: int, k: int, nested: bool) -> tuple[Any, ...]:
    """A random bitsandbytes NF4 weight: its repacked codes, the kernel's scale arguments, the scale16 weight the
    kernel multiplies by (bf16 level x bf16 absmax, rounded to bf16: nf4_mm_reference(..., scale16=True)'s) and
    bitsandbytes' own dequantized weight, both fp32."""
    import bitsandbytes.functional as bf

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, qs = bf.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
    packed = packed.view(n, k // 2)
    scales: dict[str, Any] = ({"nested": (qs.absmax.view(-1), qs.state2.absmax.float(),
                                          qs.offset.float().reshape(()).repeat(qs.state2.absmax.numel()),
                                          qs.state2.code.float())} if nested else {"absmax": qs.absmax.float()})
    idx = torch.stack(((packed >> 4) & 0xF, packed & 0xF), dim=-1).reshape(n, k).long()
    levels = torch.tensor(NF4, device="cuda").bfloat16().float()
    absmax = absmax_of(scales).view(n, k // 64).bfloat16().float()
    w16 = (levels[idx].view(n, k // 64, 64) * absmax[..., None]).bfloat16().float().view(n, k)
    return nf4_frag.repack(packed), scales, w16, bf.dequantize_4bit(packed.view(-1, 1), qs).float()


def absmax_of(scales: dict[str, Any]) -> torch.Tensor:
    """The fp32 absmax per block from nf4_frag's scale arguments (decoded where double-quantized)."""
    if "absmax" in scales:
        return scales["absmax"]
    from llm_core.fast.pack import nested_absmax_fp32

    return nested_absmax_fp32(*scales["nested"])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("shape,every_config", [((4096, 4096), True), ((1040, 704), True), ((12288, 4096), False),
                                                ((4096, 11008), False)])
def test_gpu_kernel_matches_the_scale16_reference_at_every_m_split_and_form(
        nested: bool, shape: tuple[int, int], every_config: bool) -> None:
    """Two shapes (one ragged in splits and warps) through every config, two Llama shapes through the default and
    the engine's form (each config is a compile per row tiles: a few seconds)."""
    n, k = shape
    frag, scales, w16, ref_w = _gpu_case(n, k, nested)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    configs = [None, nf4_frag.FragConfig(4, 1, False), nf4_frag.FragConfig(8, 3, True),
               nf4_frag.FragConfig(2, 16, True, True), nf4_frag.FragConfig(1, 5, False),
               nf4_frag.FragConfig(4, 2, True, True, True), nf4_frag.FragConfig(8, 1, True, False, True),
               nf4_frag.FragConfig(4, 2, True, True, True, 2), nf4_frag.FragConfig(2, 3, False, False, False, 4),
               nf4_frag.FragConfig(8, 1, True, True, True, 4), nf4_frag.FragConfig(4, 2, True, True, True, 1, True),
               nf4_frag.FragConfig(2, 3, True, False, False, 2, True), nf4_frag.FragConfig(8, 1, False, True, True, 4,
                                                                                           True),
               nf4_frag.FragConfig(4, 2, True, True, True, 2, True, True),  # warp tiles: N / 16 not a multiple of 4
               nf4_frag.FragConfig(8, 3, False, False, False, 1, False, True),
               nf4_frag.FragConfig(4, 2, True, True, True, 2, True, False, True)]
    if not every_config:
        configs = [None, replace(nf4_frag.default_config(n, k), table_regs=True, scale_pairs=True)]
    table = nf4_frag.frag_table(NF4, "cuda")
    pairs = nf4_frag.scale_pairs(absmax_of(scales), n, k, 64)
    for m, cfg, with_bias in itertools.product((1, 3, 8, 9, 16, 17, 32), configs, (False, True)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = bias.float() if with_bias else 0
        got = nf4_frag.nf4_frag(x, frag, 64, NF4, bias=bias if with_bias else None, config=cfg, table=table,
                                pairs=pairs, **scales).float()
        want = (x.float() @ w16.T + b).bfloat16().float()
        close = ((got - want).abs() <= want.abs() * 2.0**-7 + 1e-3).all()
        assert close, (m, cfg, with_bias, float((got - want).abs().max()))
        plain = x.float() @ ref_w.T + b
        assert float((got - plain).norm() / plain.norm()) < 1e-2, (m, cfg)


@pytest.mark.gpu
@needs_gpu
def test_gpu_kernel_in_a_cuda_graph_with_pdl_matches_eager() -> None:
    frag, scales, _, _ = _gpu_case(4096, 4096, True)
    x = torch.randn(24, 4096, device="cuda", dtype=torch.bfloat16)
    eager = nf4_frag.nf4_frag(x, frag, 64, NF4, **scales)
    assert torch.equal(nf4_frag.nf4_frag(x, frag, 64, NF4, pdl=True, **scales), eager)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nf4_frag.nf4_frag(x, frag, 64, NF4, pdl=True, **scales)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
