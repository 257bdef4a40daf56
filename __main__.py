"""``python -m ninfer_bench``: the ``ninfer-bench`` command line."""

from .cli import main

main(obj={})
