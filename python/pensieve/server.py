"""``python -m pensieve.server [FLAGS]`` (or ``pensieve-server``): the OpenAI-compatible server,
with the flags of ``pensieve-server --help``."""

import sys

from . import PensieveError, serve


def main() -> int:
    """Serves with the command line's flags until SIGINT or SIGTERM; returns the exit code."""
    try:
        serve(*sys.argv[1:])
    except ValueError as e:  # the command line refused, in clap's words
        print(e, file=sys.stderr)
        return 2
    except PensieveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the server drained on SIGINT before Python saw it
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
