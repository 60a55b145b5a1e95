"""`python -m lvx_app.cli ...` is `lvx ...`."""

from lvx_app.cli.main import app

app()
