"""`python -m quantspec.cli`: the `quantspec` command."""

from quantspec.cli import main

main()
