#!/usr/bin/env bash
# One device call (<= 9.5 min): the paged KV pool's and the prefix cache's GPU tests (the kernel = the contiguous
# kernel; the engine on KV_LAYOUT=paged from its graphs = the batch of one, a repeated prompt cached; a later chunk's
# flash attention = the explicit mask), bench.prefix_attention (that attention's two forms timed), then
# bench.batched through ChatEngine twice on the same random Llama-2-7B checkpoint, NF4, 1 and 8 chats of 512 + 64:
# KV_LAYOUT=slots and KV_LAYOUT=paged (graphs, tokens/s, TTFT, peak, pauses). Run from the repo root; JSON under $OUT.
# Limits (s): TESTS_S (150), ATTN_S (75), SLOTS_S (170, writes the checkpoint), PAGED_S (120).
set -uo pipefail
source bench/h200_env.sh || exit 1
timeout -s INT -k 15 "${TESTS_S:-150}" python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/test_paged_kv.py tests/test_prefix_cache.py \
  > "$OUT/paged-gpu-tests.txt" 2>&1; echo "tests rc=$?"
grep -E "^(PASSED|FAILED|ERROR)|^E |passed|failed" "$OUT/paged-gpu-tests.txt" | cut -c1-400 | head -30
timeout "${ATTN_S:-75}" python3 -m bench.prefix_attention --out "$OUT/prefix-attention.json" 2>&1 | cut -c1-330; echo "prefix_attention rc=$?"
for layout in slots paged; do
  timeout "$([ "$layout" = slots ] && echo "${SLOTS_S:-170}" || echo "${PAGED_S:-120}")" python3 -m bench.batched --no-reference --chats 1,8 --new-tokens 64 --kv-layout "$layout" --profile \
    --ckpt /tmp/paged-check-ckpt --out "$OUT/batched-$layout.json" > "$OUT/batched-$layout.log" 2>&1
  echo "$layout rc=$?"
  grep -iE "not captured|graphs off|eager|Traceback|Error" "$OUT/batched-$layout.log" | cut -c1-300 | head -10
done
python3 - "$OUT" <<'P'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {}
for layout in ("slots", "paged"):
    path = out / f"batched-{layout}.json"
    if not path.exists():
        summary[layout] = "missing"
        continue
    records = json.loads(path.read_text())["records"]
    load = next((r for r in records if r.get("phase") == "load"), {})
    runs = {r["concurrent_chats"]: {k: r.get(k) for k in ("aggregate_decode_tokens_per_s", "ttft_p50_s", "ttft_p95_s",
                                                          "peak_vram_bytes", "completed", "step_profile")}
            for r in records if r.get("recipe") == "ours" and r.get("what") != "profile"}
    prof = next((r for r in records if r.get("what") == "profile"), {})
    summary[layout] = {"graphs": load.get("graphs"), "slot_tokens": load.get("slot_tokens"),
                       "reply_tokens": load.get("reply_tokens"), "notes": load.get("slot_notes"), "runs": runs,
                       "profile": {k: prof.get(k) for k in ("mean_step_s", "kernels_us_per_step", "device_kernels")}}
(out / "paged-vs-slots.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary)[:3000])
P
