"""`python -m decode_node`."""

from decode_node.cli import main

if __name__ == "__main__":
    main()
