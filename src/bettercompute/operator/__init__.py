"""The Kubernetes operator (kopf): Reservations, GPUPools, GPUNodes and DeviceAllocations.

A door onto the service, like the HTTP API: handlers translate custom resources into service
calls and project the answers back into ``status``. Nothing here speaks SQL or decides
anything the core decides; the resources' contract is ``docs/kubernetes.md``.
"""
