"""Project scripts (benchmarks, training, data generation). A package so that tests can import them."""
