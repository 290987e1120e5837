"""The ``coordinator`` subcommands: one module each (``runs`` holds status, runs and stop).

Every module has ``add_parser(sub)`` and ``run(args) -> int`` and imports only the standard
library at module level: ``coordinator --help`` builds every parser, and must stay torch-free.
"""
