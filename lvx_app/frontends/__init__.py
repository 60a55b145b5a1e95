"""Frontends that drive an engine from a terminal: the chat REPL and the rank entry point that may
run it.

The browser frontend lives in `ui/`; the `lvx` commands in `lvx_app/cli.py` start these.
"""
