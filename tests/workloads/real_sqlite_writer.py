"""real_sqlite_writer.py WORKDIR MODE TARGET HOLD_TX

A write loop on a real SQLite database (WORKDIR/test.db) through python3's
sqlite3 module, for checkpoint/restore tests. MODE is the journal mode
("delete": rollback journal, or "wal": write-ahead log with its mmapped
-shm index and POSIX locks). Each transaction (BEGIN IMMEDIATE ... COMMIT)
inserts 20 numbered rows (id, id*id, padding); after each commit the
program prints `count N` (rows committed so far). It stops at TARGET rows.

HOLD_TX > 0: in transaction number HOLD_TX, after its rows are inserted but
before COMMIT (so the write lock is held and, in rollback mode, the -journal
file is live), the program creates WORKDIR/hold, prints
`HOLD committed=N pending=M` and waits until WORKDIR/hold is removed.

At the end it checks the database through its own connection
(integrity_check, rows 1..TARGET exactly once with the right values) and
prints `final N` and OK, or FAIL: reason (exit 1).
"""

import os
import sqlite3
import sys
import time

ROWS_PER_TX = 20
SELF_TIMEOUT = 120.0


def out(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    workdir, mode, target, hold_tx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    db = os.path.join(workdir, "test.db")
    hold = os.path.join(workdir, "hold")
    con = sqlite3.connect(db, isolation_level=None, timeout=10.0)
    got = con.execute("PRAGMA journal_mode=%s" % mode).fetchone()[0]
    out("journal %s" % got)
    if got != mode:
        out("FAIL: journal_mode is %s, wanted %s" % (got, mode))
        sys.exit(1)
    # No fsync per commit: the test is about the process, not the disk.
    con.execute("PRAGMA synchronous=OFF")
    con.execute(
        "CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, v INTEGER NOT NULL, pad TEXT NOT NULL)"
    )
    n = con.execute("SELECT coalesce(max(id), 0) FROM t").fetchone()[0]
    out("READY pid=%d" % os.getpid())
    start = time.monotonic()
    tx = 0
    while n < target:
        tx += 1
        con.execute("BEGIN IMMEDIATE")
        for i in range(n + 1, n + ROWS_PER_TX + 1):
            con.execute(
                "INSERT INTO t (id, v, pad) VALUES (?, ?, ?)",
                (i, i * i, "p%d-" % i + "x" * (40 + i % 61)),
            )
        if tx == hold_tx:
            with open(hold, "w"):
                pass
            out("HOLD committed=%d pending=%d" % (n, n + ROWS_PER_TX))
            while os.path.exists(hold):
                if time.monotonic() - start > SELF_TIMEOUT:
                    out("FAIL: timed out holding the transaction")
                    sys.exit(1)
                time.sleep(0.005)
        con.execute("COMMIT")
        n += ROWS_PER_TX
        out("count %d" % n)
        if time.monotonic() - start > SELF_TIMEOUT:
            out("FAIL: timed out writing")
            sys.exit(1)

    problems = []
    ic = [r[0] for r in con.execute("PRAGMA integrity_check").fetchall()]
    if ic != ["ok"]:
        problems.append("integrity_check: %r" % ic[:5])
    cnt, lo, hi, s = con.execute("SELECT count(*), min(id), max(id), sum(id) FROM t").fetchone()
    if (cnt, lo, hi, s) != (n, 1, n, n * (n + 1) // 2):
        problems.append("rows: count %s min %s max %s sum %s, wanted 1..%d" % (cnt, lo, hi, s, n))
    bad = con.execute(
        "SELECT count(*) FROM t WHERE v != id * id OR pad != 'p' || id || '-' || substr(?, 1, 40 + id % 61)",
        ("x" * 200,),
    ).fetchone()[0]
    if bad:
        problems.append("%d rows with wrong contents" % bad)
    con.close()
    out("final %d" % n)
    if problems:
        out("FAIL: " + "; ".join(problems))
        sys.exit(1)
    out("OK")


if __name__ == "__main__":
    main()
