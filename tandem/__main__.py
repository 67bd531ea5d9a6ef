"""``python -m tandem`` is the ``tandem`` command."""

from tandem.cli import app

app()
