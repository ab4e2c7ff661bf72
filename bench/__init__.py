"""Benchmarks for memory-server: mem0 side by side, HTTP under load, LoCoMo retrieval quality."""
