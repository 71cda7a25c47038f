"""What tests, benchmarks and the demo share, kept apart from the product: engine processes
(``engine_proc``/``engine_client``), the tiny test model, synthetic prompts and payloads, owner
processes for transfer tests (``peer_process``), striped pulls, and the in-memory index for fast
unit tests. Nothing in the serving path imports from here."""
