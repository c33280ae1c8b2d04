"""rsh_echo.py: checks cr_rsh from the inside (tests/tests/mpi.rs).

    python3 rsh_echo.py client CR_RSH HOST COUNT PACE_MS
    python3 rsh_echo.py server

The client runs `CR_RSH -x -q -o BatchMode=yes HOST python3 rsh_echo.py
server` (the same interpreter and script) and sends COUNT numbered lines,
one every PACE_MS, on its stdin. The server answers each on stdout
("echo N <hostname-free payload>") and every tenth on stderr ("tick N"),
and exits with status 7 once stdin ends. The client checks every answer
(in order, none missing or repeated), the stderr lines, and the exit
status, printing "progress N" as it goes and "OK" or "FAIL ..." at the end.
"""
import os
import subprocess
import sys
import threading
import time


def payload(n):
    return f"{n}:" + "x" * (n % 97)


def server():
    n = 0
    for line in sys.stdin:
        n += 1
        want = payload(n)
        if line.rstrip("\n") != want:
            print(f"server: line {n} is {line!r}, want {want!r}", file=sys.stderr, flush=True)
            sys.exit(3)
        print(f"echo {want}", flush=True)
        if n % 10 == 0:
            print(f"tick {n}", file=sys.stderr, flush=True)
    sys.exit(7)


def client(rsh, host, count, pace_ms):
    me = os.path.abspath(__file__)
    p = subprocess.Popen(
        [rsh, "-x", "-q", "-o", "BatchMode=yes", host, sys.executable, me, "server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    errors = []
    ticks = []

    def read_err():
        for line in p.stderr:
            ticks.append(line.rstrip("\n"))

    t = threading.Thread(target=read_err, daemon=True)
    t.start()
    for n in range(1, count + 1):
        p.stdin.write(payload(n) + "\n")
        p.stdin.flush()
        got = p.stdout.readline().rstrip("\n")
        want = f"echo {payload(n)}"
        if got != want:
            print(f"FAIL answer {n} is {got!r}, want {want!r}", flush=True)
            p.kill()
            sys.exit(1)
        print(f"progress {n}", flush=True)
        time.sleep(pace_ms / 1000)
    p.stdin.close()
    rest = p.stdout.read()
    rc = p.wait()
    t.join(10)
    want_ticks = [f"tick {n}" for n in range(10, count + 1, 10)]
    if rest:
        errors.append(f"output after the last answer: {rest!r}")
    if rc != 7:
        errors.append(f"exit status {rc}, want 7")
    if ticks != want_ticks:
        errors.append(f"stderr lines {ticks[:3]}...{ticks[-3:]} ({len(ticks)}), want {len(want_ticks)}")
    if errors:
        print("FAIL " + "; ".join(errors), flush=True)
        sys.exit(1)
    print("OK", flush=True)


if sys.argv[1] == "server":
    server()
else:
    client(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
