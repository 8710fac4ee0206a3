"""Test harness beside the core: the reference scheduler (:mod:`.scheduler`) that drives traces in tests
and examples."""
