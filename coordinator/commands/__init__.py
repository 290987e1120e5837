"""The ``coordinator`` subcommands: one module each (``runs`` holds status, runs and stop).

Every module has ``add_parser(sub)`` and ``run(args) -> int``. ``coordinator --help`` builds
every parser and must stay torch-free, so a module imports only the standard library and its
sibling option helpers at module level; everything else is imported inside ``run``.
"""
