"""uflash engine: Unlimited-OCR loading and decoding. Knows nothing of the DB or config files.

Stages, each importing only those below it: loading (the decoders the pipeline loads) > batch/ (the batched
decode loop), chunk_decode (one chunk through the official or the batched path) > chunk_output (a decode's pages),
drafters/ > ngram_rule (the official no-repeat rule) > model/ (the network and its cache) > official (the
reference path: transformers' generate), kernels/.
"""

__version__ = "0.1.0"
