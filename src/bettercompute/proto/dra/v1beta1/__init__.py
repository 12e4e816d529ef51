"""DRA plugin API v1beta1 (kubelets 1.32, 1.33): ``api.proto`` and generated modules."""
