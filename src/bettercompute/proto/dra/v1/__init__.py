"""DRA plugin API v1 (kubelets 1.34 on): ``api.proto`` and its generated modules (never edit)."""
