"""The ``tandem`` command line: the one package that imports every component.

``main`` wires the subcommands; each lives in its own module and imports its component
(router, workers, engine, tools) only when it runs, so ``tandem --help`` stays instant
and torch-free. ``launcher`` runs a whole cluster on one machine for ``tandem serve``
and the end-to-end tests.
"""
