"""``better-compute dev``: the whole system on one machine, the composition root.

``config`` reads and checks the one YAML file (the shipped ``demo.yaml`` by default),
``applying`` writes it into the database, ``running`` starts the embedded PostgreSQL, the
reconciler, the simulated nodes' agents and the HTTP API. The only package allowed to import
every layer below the CLI; nothing imports it but the CLI's ``dev`` command, lazily.
"""
