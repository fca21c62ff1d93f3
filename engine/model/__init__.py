"""The network and its cache: its files found (files), loading (load), the batched forward (forward), the R-SWA
slot cache (kv_slots), the vision encoder (vision) and tiny random models for tests (tiny).

May import kernels/ and official."""
