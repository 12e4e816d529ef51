"""Simulated GPU nodes for ``better-compute dev --sim N`` and the tests.

``inventories`` describes nodes as data (stable GPU UUIDs, NUMA nodes, NVLink domains, MIG
instances, time-slice slots, advertised capability labels); ``binding`` runs a node's agent,
which binds and releases allocations through the service exactly as a real node reports them;
``deviceplugin.devicefiles`` (the device plugin owns it) writes the CDI spec and env file a real
node would write.

``sim`` stands beside the HTTP API: it may use ``service``, ``core`` and
``deviceplugin.devicefiles``, never ``store`` (the composition root writes the inventory) and
never a door.
"""
