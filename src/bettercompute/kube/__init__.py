"""The Kubernetes contract the operator and the node agent share.

Why one package: the operator writes DeviceAllocations and reads GPUNodes; the node agent reads
the first and writes the second. Their names, labels and shapes must be spelled once, or the two
programs drift apart. What it must never do: import kopf, the store or the service: the node
agent's image carries neither.
"""
