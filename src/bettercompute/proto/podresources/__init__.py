"""Kubelet PodResources API: our wire-compatible protos (see ``bettercompute.proto``)."""
