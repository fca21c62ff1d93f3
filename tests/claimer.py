"""A bare queue worker for the multi-process tests: claims chunks from a real SQLite file.

usage: python -m tests.claimer DB_URL OWNER OUT_FILE {drain|hold} LEASE_SECONDS [IDLE_SECONDS [GO_FILE]]
- drain: claim, note the chunk id in OUT_FILE, complete; stop after IDLE_SECONDS with nothing to claim.
- hold: claim one chunk, note it, renew its lease with a heartbeat (every LEASE_SECONDS / 12: a beat can be late
  by most of the lease before the lease runs out), and wait forever (to be killed).
Each notes ``ready`` first; given GO_FILE, it then waits for that file to exist before its first claim (so that
processes started one after the other on a busy machine begin together).
"""

import os
import sys
import threading
import time

from db.chunks import complete_chunk
from db.queue import claim, heartbeat
from db.session import Database


def main() -> None:
    url, owner, out, mode, lease = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
    idle = float(sys.argv[6]) if len(sys.argv) > 6 else 2.0
    go = sys.argv[7] if len(sys.argv) > 7 else None
    db = Database(url)
    with open(out, "a", buffering=1) as f:
        f.write(f"ready {time.time()}\n")
        while go is not None and not os.path.exists(go):
            time.sleep(0.01)
        last = time.monotonic()
        while True:
            c = claim(db, owner, lease_seconds=lease, max_attempts=5)
            if c is None:
                if mode == "drain" and time.monotonic() - last > idle:
                    return
                time.sleep(0.05)
                continue
            last = time.monotonic()
            f.write(f"claimed {c.chunk_id} {c.attempts} {time.time()}\n")
            if mode == "hold":
                while True:
                    threading.Event().wait(lease / 12)
                    heartbeat(db, c, lease)
            time.sleep(0.01)  # "work": the other process gets its turn
            assert complete_chunk(db, c)
            f.write(f"done {c.chunk_id}\n")


if __name__ == "__main__":
    main()
