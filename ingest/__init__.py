"""uflash ingest side: from a dropped file to a reviewed document.

Stages, each importing only those below it: commands/ > review/, worker/ > outputs/, quality/ > reading/,
intake/ > pages/, ledger/ > the top modules every stage uses (config, errors, files, logs). Each stage's
``__init__`` says what it owns.
"""
