"""Kubelet plugin-watcher registration API: our wire-compatible protos."""
