"""py_state.py WORKDIR

A Python workload for checkpoint/restore: keeps state in interpreter memory
(dicts, lists, a live generator, a Random instance, a running SHA-256, a big
bytearray), advances it step by step printing `step N`, prints READY after 20
steps, and once WORKDIR/go exists recomputes the whole run from the seed and
compares: prints OK or FAIL: reason (exit 0 / 1).
"""

import hashlib
import os
import random
import sys
import time

SELF_TIMEOUT = 240.0


def primes():
    """An infinite generator: its frame (locals, position) lives in memory."""
    found = []
    n = 2
    while True:
        if all(n % p for p in found if p * p <= n):
            found.append(n)
            yield n
        n += 1


class State:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.table = {}
        self.seq = []
        self.words = {}
        self.hash = hashlib.sha256()
        self.gen = primes()
        self.steps = 0

    def step(self):
        self.steps += 1
        p = next(self.gen)
        r = self.rng.getrandbits(64)
        self.table[self.steps] = (p, r)
        self.seq.append((p * r) % 1000003)
        key = "w%d" % (r % 97)
        self.words[key] = self.words.get(key, 0) + p
        self.hash.update(("%d:%d:%d;" % (self.steps, p, r)).encode())

    def summary(self):
        return (
            self.steps,
            self.table,
            self.seq,
            self.words,
            self.hash.hexdigest(),
        )


def blob(seed, size):
    return bytearray(random.Random(seed ^ 0x5A5A).randbytes(size))


def out(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    workdir = sys.argv[1]
    go = os.path.join(workdir, "go")
    pid = os.getpid()
    seed = (pid << 32) ^ time.time_ns()
    state = State(seed)
    big = blob(seed, 16 << 20)
    big_digest = hashlib.sha256(big).hexdigest()
    start = time.monotonic()
    while True:
        state.step()
        out("step %d" % state.steps)
        if state.steps == 20:
            out("READY")
        if state.steps >= 20 and os.path.exists(go):
            break
        if time.monotonic() - start > SELF_TIMEOUT:
            out("FAIL: timed out waiting for go")
            sys.exit(1)
        time.sleep(0.01)

    problems = []
    if os.getpid() != pid:
        problems.append("pid is %d, was %d" % (os.getpid(), pid))
    fresh = State(seed)
    for _ in range(state.steps):
        fresh.step()
    names = ["steps", "table", "seq", "words", "hash"]
    for name, a, b in zip(names, state.summary(), fresh.summary()):
        if a != b:
            problems.append("%s differs from the recomputation" % name)
    if next(state.gen) != next(fresh.gen):
        problems.append("generator resumed at the wrong place")
    if state.rng.random() != fresh.rng.random():
        problems.append("Random state differs")
    if hashlib.sha256(big).hexdigest() != big_digest or big != blob(seed, 16 << 20):
        problems.append("16 MiB bytearray changed")
    out("steps %d" % state.steps)
    if problems:
        out("FAIL: " + "; ".join(problems))
        sys.exit(1)
    out("OK")


if __name__ == "__main__":
    main()
