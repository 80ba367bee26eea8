"""`python -m clover ...` is the `clover` command."""

from .cli import entry

entry()
