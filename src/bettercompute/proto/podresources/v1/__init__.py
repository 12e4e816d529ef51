"""PodResources API v1: ``api.proto`` and its generated modules; never hand-edit those."""
