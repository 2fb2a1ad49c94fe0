"""`python -m runtime.serve`: placeholder until the OpenAI-compatible server lands (issue #6)."""

import sys

if __name__ == "__main__":
    print("runtime.serve: the HTTP server is not built yet (issue #6).", file=sys.stderr)
    sys.exit(0)
