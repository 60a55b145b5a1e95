"""The `lvx` command line: one module per command, thin over importable work."""
