"""The synthetic document generator: deterministic labelled documents (documents: pages, scans, labels, plain text;
doc: layout and drawing; text: words and pseudo-words; raster: rendering and scan effects) and the calibration
ladder (ladder) that `uflash calibrate` decodes. Training, tests and benchmarks (scripts/) draw from it too.

Imports no other stage: pymupdf, Pillow and numpy only."""
