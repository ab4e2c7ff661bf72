"""The domain: one module per memory mode, no FastAPI imports."""
