"""`uflash calibrate`: a model's grading thresholds chosen for it on the labelled ladder (ingest.synth.ladder). The
ladder decoded as the pipeline decodes (decode: resumable, cached), the pages graded and the thresholds chosen on the
labelled half and measured on the held-out half (fit), the command's job and the record it writes (calibrate; the file
itself is ingest.quality.calibration's); or fitted on the pages people corrected (corrections: `uflash calibrate
--from-corrections`).

May import worker/, quality/, reading/, pages/, synth/, the top modules, engine/ and db/; only the commands import
it."""
