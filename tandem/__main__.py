"""``python -m tandem`` is the ``tandem`` command."""

from tandem.apps.cli import app

app()
