"""The ``sbp`` command groups, one module each: ``servers`` (server, pd, range-server),
``streams``, ``ranges``, ``produce``, ``tail``, ``health`` (cluster), ``bench`` and ``demo``.

Each module's ``add_parser(subparsers)`` declares its commands and their arguments and sets
``handler`` (``args -> exit status``) and ``command`` (the name error lines start with);
``common`` holds what they share. ``sbp_spark.cli`` builds the parser from them and runs the
chosen handler.
"""
