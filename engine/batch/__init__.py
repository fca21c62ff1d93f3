"""The batched decode loop: the engine (engine), its rows (rows), admission of new chunks (admission), the one
acceptance rule (acceptance), the width choice (step_width), requests and results (requests), memory sizing (memory).

May import drafters/, the official rule (ngram_rule), model/, kernels/ and official."""
