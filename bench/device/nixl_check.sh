#!/usr/bin/env bash
# --transport nixl on one GPU, in one device call (the image has no NIXL: `python bench/device/nixl_wheel.py`
# first puts a cut-down nixl-cu13 wheel in .whl/, which env.sh installs into /tmp/site; carry [".whl"]):
#   0. the wheel: transfer/nixl.py's load_nixl() must give $NIXL_MODULE (nixl_cu13) from /tmp/site, and two
#      NIXL agents with the UCX backend WRITE 64 MiB between two GPU buffers (host buffers without a GPU),
#      bytes checked; UCX's protocol choice (UCX_PROTO_INFO) is kept in $OUT/wheel.log;
#   1. tests: tests/transfer/test_transfer_gpu.py (the CUDA paths, nixl's between two processes among them)
#      and tests/transfer/test_transfer_nixl.py (NIXL on host memory between real processes);
#   2. bench/micro/handoff.py: a 16k-token llama8b handoff (2 GiB, GPU memory, sender and receiver in two
#      processes on the one GPU) over tcp, ipc and nixl (UCX's cuda_ipc; into the receiver's arena, and in
#      place into shuffled blocks of its KV pool: nixl-in-place) against the raw socket and the device copy
#      of the same bytes, in the same run;
#   3. bench/micro/tcp_streams.py --device cuda --tokens 16384 for N = 1, 2, 4, 8 sockets.
# Logs under $OUT, a summary last ($OUT/summary.txt). Each step has its own limit in seconds (WHEEL_S 45,
# TESTS_S 120, NIXL_TESTS_S 100, HANDOFF_S 150, STREAMS_S 120: 535 in all, under a call's 600 with the
# wheels' install); SKIP_TESTS=1, SKIP_HANDOFF=1, SKIP_STREAMS=1 leave a step out.
# Without a GPU the GPU steps are skipped with a line saying so; TINY=1 runs steps 2 and 3 on the CPU with
# tiny sizes instead (a rehearsal: NIXL_MODULE=nixl_cu12 where that is the wheel installed).
#   bash bench/device/nixl_check.sh                       (carry .whl)
#   TINY=1 NIXL_MODULE=nixl_cu12 OUT=/tmp/nixl_tiny bash bench/device/nixl_check.sh
set -u
OUT=${OUT:-/tmp/nixl_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export NIXL_MODULE=${NIXL_MODULE:-nixl_cu13}
# UCX's choice for NIXL's one-sided writes (UCX_PROTO_INFO=y tables in a log): memory kinds and transports
ucx_writes() {
    awk 'function flush() { if (h != "" && !seen[h r]++) print "  ucx: " h ":" r; h = "" }
         /by ucp_/ { flush() }
         /remote memory write by/ { h = $0; sub(/^[^|]*\| */, "", h); sub(/ *\|$/, "", h); r = ""; next }
         h != "" && /\| +[0-9]+(\.\.[0-9a-z]+)? +\|/ { x = $0; sub(/^[^|]*\| */, "", x); sub(/ *\|$/, "", x)
                                                     gsub(/ *\| */, " ", x); r = r " [" x "]" }
         END { flush() }' "$1" | head -"${2:-6}" | cut -c1-220 | tee -a "$SUMMARY"
}
GPU=$($PY -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
if [ "$GPU" = 1 ]; then
    DEV=cuda TOKENS=16384 ARENA_MB=${NIXL_ARENA_MB:-2304} STREAMS=1,2,4,8
elif [ -n "${TINY:-}" ]; then
    DEV=cpu TOKENS=256 ARENA_MB=${NIXL_ARENA_MB:-64} STREAMS=1,2
    say "no GPU, TINY=1: the handoff and tcp_streams steps on the CPU, $TOKENS tokens"
else
    DEV=""
    say "no GPU: the GPU tests, the handoff and tcp_streams steps are skipped (TINY=1 runs the last two on the CPU)"
fi

# 0. the wheel
t0=$(date +%s)
UCX_PROTO_INFO=y timeout -k 5 "${WHEEL_S:-45}" $PY - > "$OUT/wheel.log" 2>&1 <<'PY'
import importlib.metadata, os, time
import torch
from transfer.nixl import load_nixl

api = load_nixl()
want = os.environ["NIXL_MODULE"]
dist = want.replace("_", "-")
print(f"load_nixl: {api.__name__} from {api.__file__} ({dist} {importlib.metadata.version(dist)})")
assert api.__name__ == f"{want}._api", f"load_nixl gave {api.__name__}, not {want}"
conf = lambda: api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
a, b = api.nixl_agent("A", conf()), api.nixl_agent("B", conf())
print("plugins:", a.get_plugin_list())
gpu = torch.cuda.is_available()
dev, mem = ("cuda", "VRAM") if gpu else ("cpu", "DRAM")
n = 64 << 20
src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
dst = torch.zeros(n, dtype=torch.uint8, device=dev)
a.register_memory([src])
reg = b.register_memory([dst])
a.add_remote_agent(b.get_partial_agent_metadata(reg, True, []))
dev_id = src.device.index or 0
h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.data_ptr(), n, dev_id)], mem),
                      a.get_xfer_descs([(dst.data_ptr(), n, dev_id)], mem), "B", b"done")
t = time.perf_counter()
state = a.transfer(h)
while state == "PROC" and time.perf_counter() - t < 30:
    b.get_new_notifs()
    state = a.check_xfer_state(h)
ms = (time.perf_counter() - t) * 1e3
ok = state == "DONE" and torch.equal(src, dst)
print(f"in-process WRITE of {n >> 20} MiB {mem}->{mem}: {state} in {ms:.1f} ms (first, untimed warm-up"
      f" included), bytes {'equal' if ok else 'DIFFER'}")
h.release()
raise SystemExit(0 if ok else 1)
PY
say "wheel: rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^(load_nixl|plugins|in-process)|Error|error" "$OUT/wheel.log" | cut -c1-240 | head -8 | tee -a "$SUMMARY"
ucx_writes "$OUT/wheel.log"

# 1. the tests
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    if [ "$GPU" = 1 ]; then
        t0=$(date +%s)
        timeout -k 10 "${TESTS_S:-120}" $PY -m pytest -q -p no:cacheprovider --durations=6 \
            tests/transfer/test_transfer_gpu.py > "$OUT/tests_gpu.log" 2>&1
        say "gpu transfer tests: rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests_gpu.log")"
    else
        say "gpu transfer tests: skipped (no GPU)"
    fi
    t0=$(date +%s)
    timeout -k 10 "${NIXL_TESTS_S:-100}" $PY -m pytest -q -p no:cacheprovider --durations=6 \
        tests/transfer/test_transfer_nixl.py > "$OUT/tests_nixl.log" 2>&1
    say "nixl tests: rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests_nixl.log")"
    grep -hE "^(FAILED|ERROR) " "$OUT"/tests_*.log | cut -c1-240 | head -20 | tee -a "$SUMMARY"
fi

[ -z "$DEV" ] && exit 0

# 2. the handoff: tcp, ipc (on a GPU) and nixl against their ceilings, one run
if [ "${SKIP_HANDOFF:-0}" != 1 ]; then
    t0=$(date +%s)
    UCX_PROTO_INFO=y timeout -k 10 "${HANDOFF_S:-150}" $PY bench/micro/handoff.py --layout llama8b --tokens "$TOKENS" --repeats 3 \
        --device "$DEV" --nixl-arena-mb "$ARENA_MB" --json "$OUT/handoff.json" > "$OUT/handoff.log" 2>&1
    say "handoff llama8b $TOKENS tokens on $DEV: rc $? in $(( $(date +%s) - t0 )) s"
    grep -E "^# (llama8b|nixl|no CUDA)|^ +tokens|(raw tcp socket|d2d copy|[ ]handoff (tcp|ipc|nixl|nixl-in-place)|payload (ipc|nixl|nixl-in-place)) |^bar " \
        "$OUT/handoff.log" | cut -c1-200 | tee -a "$SUMMARY"
    ucx_writes "$OUT/handoff.log" 8
    grep -E "Error|error:" "$OUT/handoff.log" | sort | uniq -c | head -8 | tee -a "$SUMMARY"
fi

# 3. tcp striped over N sockets from and to GPU memory
if [ "${SKIP_STREAMS:-0}" != 1 ]; then
    t0=$(date +%s)
    timeout -k 10 "${STREAMS_S:-120}" $PY bench/micro/tcp_streams.py --device "$DEV" --tokens "$TOKENS" \
        --streams "$STREAMS" --json "$OUT/tcp_streams.json" > "$OUT/tcp_streams.log" 2>&1
    say "tcp_streams $DEV $TOKENS tokens, N = $STREAMS: rc $? in $(( $(date +%s) - t0 )) s"
    sed -n '/^tcp handoff of/,$p' "$OUT/tcp_streams.log" | tee -a "$SUMMARY"
    grep -E "Error|error:" "$OUT/tcp_streams.log" | sort | uniq -c | head -8 | tee -a "$SUMMARY"
fi
