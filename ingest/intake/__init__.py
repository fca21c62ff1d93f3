"""From a dropped file to queued chunks: the watcher (watch), taking a file exactly once (enqueue), reading what a
file is (probe) and splitting a document into chunks (chunk_plan); a failed document's original (failed) and a refused
file (refused) in failed/ and out of it again.

May import pages/, ledger/, the top modules, engine/ and db/."""
