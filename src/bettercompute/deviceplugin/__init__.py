"""The node agent: a DaemonSet on every GPU node that tells the kubelet which GPUs it has.

Why a package of its own: it runs on the nodes, not beside the database. It discovers the node's
GPUs (through NVML, or from a simulated inventory file where no GPU exists), registers them with
the kubelet as a device plugin and reports them to Kubernetes.

It must never import ``store``, ``service``, ``api``, ``cli``, ``dev`` or ``sim``, nor speak to
PostgreSQL: it talks only to the Kubernetes API and the kubelet (import-linter enforces this).
"""
