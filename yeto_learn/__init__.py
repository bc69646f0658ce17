"""yeto_learn: the learner side of YETO v4 and the ``yeto`` command.

Importing this package is cheap: it pulls in no torch. Modules that need torch import it
themselves, and the command line imports them only for the subcommand that runs.
"""
