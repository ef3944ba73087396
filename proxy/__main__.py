"""`python -m proxy`: the `pd-proxy` command."""

from proxy.cli import main

if __name__ == "__main__":
    main()
