"""The node agent: a DaemonSet on every GPU node that tells the kubelet which GPUs it has.

Why a package of its own: it runs on the nodes, not beside the database. It discovers the node's
GPUs (through NVML, or from a simulated inventory file where no GPU exists), registers them with
the kubelet as a device plugin and reports them to Kubernetes.

Modules: ``inventory`` (the node's GPUs), ``devicefiles`` (CDI spec and env file per allocation),
``allocations`` (what the node holds and advertises), ``serving`` (the kubelet's gRPC servers),
``registering`` (Register, and again after a kubelet restart), ``podresources`` (which pods hold
devices), ``signing`` (the node key and signed reports), ``converging`` (the agent's core, with
ports to Kubernetes), ``metrics`` and ``running`` (everything the kubelet sees, wired in order).
For pools whose devices reach pods through DRA claims: ``draclaims`` (which claims may be
prepared, and those that were, kept in a checkpoint), ``draserving`` (the kubelet's DRA plugin
service, v1 and v1beta1) and ``draregistering`` (its plugin-watcher registration).
The Kubernetes side: ``kube.client`` (credentials and the API client), ``watching`` (the
node's DeviceAllocations: the converger's two ports, kept by a watch), ``publishing`` (the
node's GPUNode) and ``agent`` (the process, ``better-compute-deviceplugin``).

It must never import ``store``, ``service``, ``api``, ``cli``, ``dev``, ``sim`` or
``operator``, nor speak to PostgreSQL: it talks only to the Kubernetes API and the kubelet
(import-linter enforces this).
"""
