"""uflash job ledger: SQLAlchemy models, sessions and the chunk queue."""
