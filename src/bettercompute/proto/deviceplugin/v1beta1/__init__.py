"""Device-plugin API v1beta1: ``api.proto`` and its generated modules; never hand-edit those."""
