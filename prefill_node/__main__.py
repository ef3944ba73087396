"""`python -m prefill_node`."""

from prefill_node.cli import main

if __name__ == "__main__":
    main()
