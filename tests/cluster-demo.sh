#!/usr/bin/env bash
# A two-node cluster on this machine: two network namespaces ("nodes" n1
# and n2, 10.98.0.1 and .2) joined by a bridge in a third one that also
# runs the coordinator (10.98.0.254). All three are created here and
# removed at the end; no traffic leaves them.
#
# A job of three python3 processes in a ring (n1, n2, n1), each sending
# numbered messages to the next over TCP and checking that it receives
# every number from the previous once and in order, is checkpointed as one
# (crctl checkpoint --kill), then restarted with the nodes swapped: the
# processes of n1 now run on n2 and the other way round, their sockets
# rewritten. Every process ends by printing OK (or FAIL) about its stream.
#
# Uses the binaries installed by tests/demo.sh (or CR_BIN=target/release).
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "cluster-demo.sh: run as root" >&2; exit 1; }
bin=${CR_BIN:-/usr/local/bin}
# Only stdin/out/err: an fd inherited from the caller (a pipe, say) would
# rightly be refused by the checkpoint, as the job's processes inherit it.
for fd in /proc/$$/fd/*; do
    n=${fd##*/}
    [ "$n" -gt 2 ] && eval "exec $n>&-" 2>/dev/null || true
done
work=$(mktemp -d /var/tmp/cr-cluster-demo.XXXXXX)
tag=crdemo$$
hub=$tag-hub
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    for ns in "$hub" "$tag-n1" "$tag-n2"; do ip netns del "$ns" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# --- the network: a bridge in the hub, one veth per node
ip netns add "$hub"
ip -n "$hub" link set lo up
ip -n "$hub" link add br0 type bridge
ip -n "$hub" addr add 10.98.0.254/24 dev br0
ip -n "$hub" link set br0 up
for k in 1 2; do
    ns=$tag-n$k
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$hub" link add "v$k" type veth peer name eth0 netns "$ns"
    ip -n "$hub" link set "v$k" master br0 up
    ip -n "$ns" addr add "10.98.0.$k/24" dev eth0
    ip -n "$ns" link set eth0 up
done
# nsenter execs the program: in the background, $! is its PID.
in_ns() { local ns=$1; shift; nsenter --net=/run/netns/"$ns" -- "$@"; }

# --- certificates of a fresh cluster CA
pki=$work/pki
"$bin/crctl" pki init --dir "$pki" >/dev/null
"$bin/crctl" pki issue --dir "$pki" --name cr-coordinatord --ip 10.98.0.254 >/dev/null
"$bin/crctl" pki issue --dir "$pki" --name admin --admin >/dev/null
for k in 1 2; do "$bin/crctl" pki issue --dir "$pki" --name "n$k" --ip "10.98.0.$k" >/dev/null; done
tls() { echo --ca "$pki/ca.crt" --cert "$pki/$1.crt" --key "$pki/$1.key"; }

# --- the daemons
nsenter --net=/run/netns/"$hub" -- "$bin/cr-coordinatord" --listen 10.98.0.254:7170 \
    --db "$work/coord.redb" $(tls cr-coordinatord) >/dev/null 2>"$work/coordinator.log" &
pids+=($!)
for k in 1 2; do
    nsenter --net=/run/netns/"$tag-n$k" -- "$bin/cr-agent" --node "n$k" --listen "10.98.0.$k:7171" \
        --socket "$work/n$k.sock" --coordinator 10.98.0.254:7170 --images "$work/images" \
        --state-dir "$work/state-n$k" $(tls "n$k") >/dev/null 2>"$work/agent-n$k.log" &
    pids+=($!)
done
crctl() { in_ns "$hub" "$bin/crctl" --coordinator 10.98.0.254:7170 $(tls admin) "$@"; }
for _ in $(seq 100); do
    [ "$(crctl nodes 2>/dev/null | grep -c ' up')" = 2 ] && break
    sleep 0.1
done
echo "== the cluster"
crctl nodes

# --- the job: a ring of three python3 processes
cat >"$work/ring.py" <<'PY'
import selectors, socket, struct, sys, time
idx, listen, nxt, total = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
def addr(s):
    h, p = s.rsplit(":", 1)
    return h, int(p)
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(addr(listen))
ls.listen(1)
while True:
    try:
        out = socket.create_connection(addr(nxt), timeout=1)
        break
    except OSError:
        time.sleep(0.1)
inp, _ = ls.accept()
ls.close()
out.setblocking(False)
inp.setblocking(False)
sent = got = 0
pending = b""
buf = b""
sel = selectors.DefaultSelector()
sel.register(inp, selectors.EVENT_READ)
last_send = 0.0
while got < total or sent < total or pending:
    if not sel.get_map():
        time.sleep(0.002)
    for _key, _ev in (sel.select(0.005) if sel.get_map() else []):
        data = inp.recv(65536)
        if not data:
            if got < total:
                print(f"FAIL member {idx}: stream ended after {got}", flush=True)
                sys.exit(1)
            sel.unregister(inp)  # the previous member is done
            continue
        buf += data
        while len(buf) >= 16:
            n, check = struct.unpack(">QQ", buf[:16])
            buf = buf[16:]
            if n != got + 1 or check != (n * 2654435761) % (1 << 64):
                print(f"FAIL member {idx}: got message {n} after {got}", flush=True)
                sys.exit(1)
            got = n
            if got % 500 == 0:
                print(f"member {idx}: received {got}", flush=True)
    now = time.monotonic()
    if sent < total and now - last_send >= 0.002:
        last_send = now
        sent += 1
        pending += struct.pack(">QQ", sent, (sent * 2654435761) % (1 << 64))
    if pending:
        try:
            pending = pending[out.send(pending):]
        except BlockingIOError:
            pass
print(f"OK member {idx}: sent {sent} and received {got} messages, every one once and in order", flush=True)
PY
total=3000
place=(1 2 1)
for i in 0 1 2; do
    k=${place[$i]}
    next=$(( (i + 1) % 3 ))
    CR_AGENT_SOCKET="$work/n$k.sock" nsenter --net=/run/netns/"$tag-n$k" -- "$bin/cr_run" --job ring -- \
        python3 "$work/ring.py" "$i" "10.98.0.$k:$((7300 + i))" \
        "10.98.0.${place[$next]}:$((7300 + next))" "$total" </dev/null >"$work/member$i.txt" 2>&1 &
    pids+=($!)
done
for _ in $(seq 300); do
    [ "$(cat "$work"/member*.txt 2>/dev/null | grep -c 'received 1000')" = 3 ] && break
    sleep 0.05
done
echo "== job ring is running"
crctl jobs

echo "== coordinated checkpoint of the whole job, then kill it"
crctl checkpoint ring --kill
echo "== restart with the nodes swapped (n1 -> n2, n2 -> n1)"
crctl restart ring --on n2 --on n1
crctl jobs
for _ in $(seq 600); do
    [ "$(cat "$work"/member*.txt | grep -c '^OK\|^FAIL')" = 3 ] && break
    sleep 0.05
done
echo "== what every member says at the end"
grep -h '^OK\|^FAIL' "$work"/member*.txt || true
[ "$(cat "$work"/member*.txt | grep -c '^OK')" = 3 ]
