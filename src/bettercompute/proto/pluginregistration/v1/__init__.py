"""Registration API v1 (wire package ``pluginregistration``): ``api.proto``, generated modules."""
