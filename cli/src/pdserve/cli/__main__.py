"""`python -m pdserve.cli`: the `pdserve` command."""

from pdserve.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
