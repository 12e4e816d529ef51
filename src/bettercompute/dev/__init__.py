"""``better-compute dev``: the whole system on one machine, the composition root.

``config`` reads and checks the one YAML file (the shipped ``demo.yaml`` by default),
``applying`` writes it into the database, ``running`` starts the embedded PostgreSQL, the
reconciler, the simulated nodes' agents and the HTTP API; with ``--kube``, ``kubernetes``
starts a real Kubernetes control plane beside them (``controlplane``: the processes, their
certificates, the chart's install and kubelet-style Nodes, which the tests run too) and the
operator in it. The only package allowed to import every layer below the CLI; in the product
nothing imports it but the CLI's ``dev`` command, lazily (the tests and benchmarks use
``controlplane`` as well).
"""
