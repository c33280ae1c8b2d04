"""python3 with several threads sharing state under a lock, checked after restore.

Usage: py_threads.py WORKDIR. Prints READY, then `total N` lines until
WORKDIR/go exists; then stops and joins the threads and prints OK if the
per-thread counts add up to the shared total and every thread made progress.
"""
import os
import sys
import threading
import time

workdir = sys.argv[1]
N = 6
lock = threading.Lock()
shared = {"total": 0}
per = [0] * N
stop = threading.Event()


def work(i):
    while not stop.is_set():
        with lock:
            per[i] += 1
            shared["total"] += 1
        time.sleep(0.005)


threads = [threading.Thread(target=work, args=(i,)) for i in range(N)]
for t in threads:
    t.start()
while not all(per):
    time.sleep(0.01)
print("READY", flush=True)
while not os.path.exists(os.path.join(workdir, "go")):
    with lock:
        total = shared["total"]
    print("total", total, flush=True)
    stop.wait(0.1)
stop.set()
for t in threads:
    t.join()
ok = sum(per) == shared["total"] and all(per)
print("OK" if ok else "FAIL: per %r total %d" % (per, shared["total"]), flush=True)
sys.exit(0 if ok else 1)
