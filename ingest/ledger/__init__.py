"""The pipeline's use of the ledger: opening it (open), its health (health), who owns what (owners), leases and
their heartbeat (leases). Every read and write of the tables themselves lives in db/.

May import the top modules and db/."""
