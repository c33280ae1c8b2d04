#!/usr/bin/env bash
# Builds and installs the tools (cr_run, cr_checkpoint, cr_restart, cr_image,
# cr-agent, cr-coordinatord, crctl), then checkpoints a real program
# (python3 keeping state in memory) in the middle of its work, kills it,
# restores it with its PID, and lets it check itself; then does the same for
# a job of three python3 processes talking TCP across two "nodes" (network
# namespaces) with the cluster daemons, restarting it with the nodes swapped
# (tests/cluster-demo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "demo.sh: run as root (ptrace, clone3 set_tid)" >&2; exit 1; }
need=()
for pair in python3:python3 ip:iproute2 nft:nftables nsenter:util-linux; do
    command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

cargo build -j2 --release --workspace
install -m 755 target/release/cr_run target/release/cr_checkpoint target/release/cr_restart \
    target/release/cr_image target/release/cr-agent target/release/cr-coordinatord \
    target/release/crctl /usr/local/bin/

work=$(mktemp -d /var/tmp/cr-demo.XXXXXX)
trap 'rm -rf "$work"' EXIT
cat > "$work/demo.py" <<'PY'
import hashlib, sys, time
state = {i: hashlib.sha256(str(i).encode()).hexdigest() for i in range(100_000)}
h = hashlib.sha256()
for tick in range(1, 81):
    h.update(str(tick).encode())
    print("tick", tick, flush=True)
    time.sleep(0.05)
ok = all(state[i] == hashlib.sha256(str(i).encode()).hexdigest() for i in range(100_000))
ref = hashlib.sha256()
for tick in range(1, 81):
    ref.update(str(tick).encode())
ok = ok and ref.hexdigest() == h.hexdigest()
print("OK: state intact after restart" if ok else "FAIL: state damaged", flush=True)
sys.exit(0 if ok else 1)
PY
# Only stdin/out/err: an fd inherited from the calling shell (a pipe, say)
# would rightly be refused by cr_checkpoint.
(
    for fd in /proc/self/fd/*; do
        n=${fd##*/}
        [ "$n" -gt 2 ] && eval "exec $n>&-"
    done
    exec python3 "$work/demo.py"
) </dev/null >"$work/out.txt" 2>&1 &
pid=$!
for _ in $(seq 200); do grep -q '^tick 20$' "$work/out.txt" && break; sleep 0.05; done
echo "== python3 (pid $pid) is at: $(tail -1 "$work/out.txt")"
cr_checkpoint --dir "$work/image" --kill "$pid"
{ wait "$pid"; } 2>/dev/null || true
echo "== killed; the image:"
cr_image show "$work/image" | head -8
echo "== restoring pid $pid"
status=0
cr_restart "$work/image" || status=$?
echo "== restored process exited with status $status; its last lines:"
tail -3 "$work/out.txt"
grep -q '^OK' "$work/out.txt" && [ "$status" = 0 ] || { echo "demo: FAILED" >&2; exit 1; }

echo
echo "== a job on two nodes: coordinated checkpoint, restart elsewhere"
bash tests/cluster-demo.sh
