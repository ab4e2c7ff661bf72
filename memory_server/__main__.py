"""`python -m memory_server` runs the CLI."""

from memory_server.cli import main

main()
