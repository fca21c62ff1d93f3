"""uflash engine: Unlimited-OCR loading and decoding. Knows nothing of the DB or config files."""

__version__ = "0.1.0"
