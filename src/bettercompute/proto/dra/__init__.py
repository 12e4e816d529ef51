"""Kubelet DRA plugin API: our wire-compatible protos (see ``bettercompute.proto``)."""
