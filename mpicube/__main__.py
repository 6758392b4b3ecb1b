"""``python -m mpicube``: the same as the ``mpicube`` console command."""

from .cli.main import main

if __name__ == "__main__":
    main()
